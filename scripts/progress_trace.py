"""Per-step progress of a preset in training, on the simulator: MNIST-1D's WideNet1D trained by P virtual ranks in
one process (no Horovod, no network), each rank's gradient through the engine over a ``SimulatedWorld``, and every
``--every`` steps what error feedback holds back and what the step applied:

    python scripts/progress_trace.py oktopk+d0.02373 topka+d0.01 --workers 4 --epochs 8 --json trace.json

    res        |mean over ranks of the residuals| / |mean gradient|: the mass error feedback still holds (the sum of
               the updates so far differs from the sum of the mean gradients by exactly the mean residual)
    cos        cosine of the applied update and the step's mean gradient
    applied    entries of the update / n (K / n for Ok-Topk; up to P·k / n for TopkA)
    K/k        Ok-Topk: the global count against k (and "filled" when global_fill acted)

Configurations as in ``bench train`` (``dense``: the exact mean, no engine; ``<preset>+d<density>``, ``+fill``
for Ok-Topk's ``global_fill``, ``+mc``, ``+w<steps>``); the training is the one of ``bench train --task mnist1d``
(SGD, momentum 0.9, cosine learning rate, the same data order), so its accuracies are those of a run on a
network, without the time. Reported per configuration: the final test accuracy, the curve (every 40 steps) and
the trace's means over four phases of the run.
"""

import argparse
import json
import threading

import numpy as np
import torch
import torch.nn.functional as F

from hvd_sparse.bench._train_worker import parse_config, sparse_compression
from hvd_sparse.bench.loop import correct, epoch_order
from hvd_sparse.bench.mnist1d_torch import WideNet1D, load_data
from hvd_sparse.core.sim import SimulatedWorld


def compression_of(name, density):
    """The compression of a configuration name (None for ``dense``)."""
    return None if name == "dense" else sparse_compression(parse_config(name), density, 0.9)


def trace_row(step, grads, update, engines):
    """What error feedback holds and what the step applied, from every rank's gradient and engine."""
    mean = np.mean(grads, 0)
    norm = float(np.linalg.norm(mean)) or 1.0
    residual = np.mean([np.zeros_like(update) if e.memory.residual is None else np.asarray(e.memory.residual)
                        for e in engines], 0)       # (no residual yet in dense warm-up steps)
    info = engines[0].last["info"]
    return {"step": step, "res": float(np.linalg.norm(residual)) / norm,
            "cos": float(update @ mean) / (float(np.linalg.norm(update)) * norm or 1.0),
            "applied": int(np.count_nonzero(update)) / update.size, "K": info.get("K"),
            "k": engines[0].last["k"], "filled": info.get("filled")}


def train(name, args):
    """One configuration: ``{"config", "final", "curve", "trace"}``."""
    (x_tr, y_tr), test = load_data(args.seed, args.train_samples, 10_000)
    P, comp = args.workers, compression_of(name, args.density)
    world = SimulatedWorld(P)
    comms = world.communicators()
    engines = [comp.new_engine(c) for c in comms] if comp is not None else None
    torch.manual_seed(args.seed)
    models = [WideNet1D(args.hidden) for _ in range(P)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    momentum = 0.0 if comp is not None and comp.momentum_correction else 0.9
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=momentum) for m in models]
    spe = len(range(0, len(x_tr), P)) // args.batch_size
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=spe * args.epochs) for o in opts]
    grads, barrier, curve, trace = [None] * P, threading.Barrier(P), [], []

    def rank_loop(comm):
        r, m = comm.rank, models[comm.rank]
        for epoch in range(1, args.epochs + 1):
            order = epoch_order(len(x_tr), r, P, args.seed, epoch)
            for s in range(spe):
                idx = order[s * args.batch_size:(s + 1) * args.batch_size]
                opts[r].zero_grad()
                F.cross_entropy(m(x_tr[idx]), y_tr[idx]).backward()
                grads[r] = torch.cat([q.grad.reshape(-1) for q in m.parameters()]).numpy().copy()
                barrier.wait()
                u = np.mean(grads, 0) if engines is None else np.asarray(engines[r].step(grads[r]))
                step = (epoch - 1) * spe + s + 1
                if r == 0 and engines is not None and step % args.every == 0:
                    trace.append(trace_row(step, grads, u, engines))
                barrier.wait()
                flat, offset = torch.tensor(u), 0               # a copy: the simulator's ranks may share u
                for q in m.parameters():
                    q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
                    offset += q.numel()
                opts[r].step()
                scheds[r].step()
                if r == 0 and (step % 40 == 0 or step == spe * args.epochs):
                    with torch.no_grad():
                        curve.append((step, correct(m, test) / len(test[1])))

    def guarded(comm):                  # a rank that fails breaks the barrier: the others raise, none hangs
        try:
            rank_loop(comm)
        except BaseException:
            barrier.abort()
            raise

    world.run(guarded, comms)
    return {"config": name, "final": curve[-1][1], "curve": curve, "trace": trace}


def phases(trace, parts=4):
    """The trace's means over ``parts`` equal phases of the run."""
    out = []
    for chunk in np.array_split(np.arange(len(trace)), min(parts, len(trace))):
        rows = [trace[i] for i in chunk]
        mean = {k: float(np.mean([r[k] for r in rows])) for k in ("res", "cos", "applied")}
        ks = [r["K"] / r["k"] for r in rows if r["K"] is not None]
        out.append(dict(mean, steps=f"{rows[0]['step']}-{rows[-1]['step']}", K_over_k=float(np.mean(ks)) if ks
                        else None))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="+")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--train-samples", type=int, default=10_000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--every", type=int, default=8, help="steps between two trace rows")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = []
    for name in args.configs:
        run = train(name, args)
        run["phases"] = phases(run["trace"]) if run["trace"] else []
        out.append(run)
        print(f"{name}: final test accuracy {run['final'] * 100:.2f}%")
        for ph in run["phases"]:
            k = f"  K/k {ph['K_over_k']:.2f}" if ph["K_over_k"] is not None else ""
            print(f"  steps {ph['steps']:>9}: res {ph['res']:.2f}  cos {ph['cos']:.3f}  applied {ph['applied']:.4f}{k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
