"""Runs under `horovodrun -np P --gloo`: reliability scenarios of hvd_sparse.torch.

    reliability_worker.py <scenario> <outdir> [preset]

Scenarios (``all`` runs skip, amp, raise and consistency in one job; each rank writes <outdir>/<scenario>.rank<r>.npz unless it is meant to die):
  skip         NaN in rank 1's gradient at step 3 (nonfinite="skip"): parameters after every step, skipped count
  amp          the Horovod AMP recipe with torch.amp.GradScaler: Inf on rank 1 at step 3; scales and parameters
  raise        nonfinite="raise": NaN on rank 1 at step 2; the error message every rank caught
  consistency  consistency_check_every=2; rank 1 nudges one parameter after step 3; the error every rank caught
  inputs       the bad-input rows of docs/reliability.md that need real ranks: fp16/bf16 models, an int tensor,
               torch.sparse gradients (Horovod's path and sparse_as_dense), a layer frozen and unfrozen between steps,
               a parameter unused on rank 1 only, a model without trainable parameters, step() without backward()
  kill <p>     preset <p>; rank 1 SIGKILLs itself as it enters step 3's exchange (its first collective, which the
               other ranks then wait in), after writing the time to <outdir>/killed.time
  fail <p>     the same, but rank 1 raises RuntimeError there
"""

import os
import signal
import sys
import time
import warnings

import horovod.torch as hvd
import numpy as np
import torch

import hvd_sparse
import hvd_sparse.torch as hvds
from hvd_sparse.bench import presets

from worker_helpers import data, flat, mlp, save, wrap

STEPS = 6


def build(seed=0, **kw):
    compression = kw.pop("compression", None) or hvds.Compression.oktopk(0.1, threshold_period=2)
    model = mlp(seed)
    return model, wrap(model, compression, **kw)


def poison(model, step, at, rank, value):
    if step == at and hvd.rank() == rank:
        next(model.parameters()).grad.view(-1)[5] = value


def skip(outdir):
    model, opt = build()
    params = [flat(model)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(STEPS):
            opt.zero_grad()
            model(data(t)).pow(2).mean().backward()
            poison(model, t, 3, 1, float("nan"))
            opt.step()
            params.append(flat(model))
    msgs = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    save(outdir, "skip", params=np.stack(params), skipped=opt.skipped_steps(), warnings=np.array(msgs))


def amp(outdir):
    model, opt = build()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    params, scales = [flat(model)], []
    for t in range(STEPS):
        opt.zero_grad()
        scaler.scale(model(data(t)).pow(2).mean()).backward()
        poison(model, t, 3, 1, float("inf"))
        opt.synchronize()                 # Horovod's AMP recipe: reduce, unscale, step without a second exchange
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        params.append(flat(model))
    save(outdir, "amp", params=np.stack(params), scales=np.array(scales))


def raise_(outdir):
    model, opt = build(nonfinite="raise")
    msg, at = "", -1
    for t in range(STEPS):
        opt.zero_grad()
        model(data(t)).pow(2).mean().backward()
        poison(model, t, 2, 1, float("nan"))
        try:
            opt.step()
        except hvd_sparse.NonFiniteGradientError as e:
            msg, at = str(e), t
            break
    save(outdir, "raise", msg=np.array(msg), at=at, params=flat(model))


def consistency(outdir):
    model, opt = build(consistency_check_every=2)
    msg, at = "", -1
    for t in range(STEPS):
        opt.zero_grad()
        model(data(t)).pow(2).mean().backward()
        try:
            opt.step()
        except hvd_sparse.ReplicaDivergenceError as e:
            msg, at = str(e), t
            break
        if t == 2 and hvd.rank() == 1:
            with torch.no_grad():
                model[2].weight[1, 2] += 1e-3
    save(outdir, "consistency", msg=np.array(msg), at=at)


def inputs(outdir):
    rec = {}

    def train(model, opt, steps=3, before=None):
        for t in range(steps):
            if before:
                before(t)
            opt.zero_grad()
            x = data(t).to(next(model.parameters()).dtype)
            model(x).float().pow(2).mean().backward()
            opt.step()

    for dtype in (torch.float16, torch.bfloat16):
        model, opt = build()
        model.to(dtype)
        start = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        train(model, opt)
        end = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        key = str(dtype).split(".")[1]
        rec[f"{key}_params"] = end.numpy()
        rec[f"{key}_moved"] = bool((end != start).any())
        rec[f"{key}_dtypes"] = np.array(sorted({str(p.dtype) for p in model.parameters()}))
    try:
        hvds.sparse_allreduce(torch.arange(4), compression=hvds.Compression.topka(0.5), name="ints")
    except TypeError as e:
        rec["int_error"] = str(e)

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 6, sparse=True)
            self.out = torch.nn.Linear(6, 1)

        def forward(self, ids):
            return self.out(self.emb(ids).mean(1))

    for as_dense in (False, True):
        torch.manual_seed(0)
        model = Bag()
        opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=hvds.Compression.topka(0.2), sparse_as_dense=as_dense)
        for t in range(3):
            g = torch.Generator().manual_seed(10 * t + hvd.rank())
            opt.zero_grad()
            model(torch.randint(0, 50, (4, 3), generator=g)).pow(2).mean().backward()
            opt.step()
        rec[f"sparse_grads_{as_dense}"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    model, opt = build()
    first = model[0]
    snaps = []

    def toggle(t):
        for p in first.parameters():
            p.requires_grad_(not 2 <= t < 4)          # frozen at steps 2 and 3
        snaps.append(torch.cat([p.detach().reshape(-1) for p in first.parameters()]).numpy().copy())

    train(model, opt, steps=6, before=toggle)
    snaps.append(torch.cat([p.detach().reshape(-1) for p in first.parameters()]).numpy().copy())
    rec["frozen_snaps"] = np.stack(snaps)
    rec["frozen_params"] = flat(model)

    torch.manual_seed(0)
    heads = torch.nn.ModuleDict({"a": torch.nn.Linear(20, 1), "b": torch.nn.Linear(20, 1)})
    opt = hvds.DistributedOptimizer(torch.optim.SGD(heads.parameters(), lr=0.1),
                                    named_parameters=heads.named_parameters(),
                                    compression=hvds.Compression.oktopk(0.2))
    for t in range(3):
        opt.zero_grad()
        x = data(t)
        y = heads["a"](x) if hvd.rank() == 1 else heads["a"](x) + heads["b"](x)     # b unused on rank 1
        y.pow(2).mean().backward()
        opt.step()
    rec["unused_params"] = torch.cat([p.detach().reshape(-1) for p in heads.parameters()]).numpy()

    frozen_model = torch.nn.Linear(3, 1)
    for p in frozen_model.parameters():
        p.requires_grad_(False)
    opt = hvds.DistributedOptimizer(torch.optim.SGD(frozen_model.parameters(), lr=0.1),
                                    named_parameters=frozen_model.named_parameters(),
                                    compression=hvds.Compression.topka(0.5))
    opt.step()
    rec["empty_stats"] = len(opt.sparse_stats())

    model, opt = build()
    opt.zero_grad()
    opt.step()                                        # no backward(): zero gradients, as in Horovod
    rec["no_backward_params"] = flat(model)
    save(outdir, "inputs", **rec)


class _DieMidStep:
    """Delegates to the engine's communicator; on rank 1 at step 3 dies as it enters the step's first collective (the
    opening, which carries TopkA's pairs): the other ranks are then inside the exchange, waiting for it."""

    def __init__(self, comm, engine, outdir, how):
        self._comm, self._engine, self._outdir, self._how, self._calls = comm, engine, outdir, how, 0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _maybe_die(self):
        if self._engine.steps == 3 and self._comm.rank == 1:
            self._calls += 1
            if self._calls == 1:
                with open(os.path.join(self._outdir, "killed.time"), "w") as f:
                    f.write(repr(time.time()))
                if self._how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected failure on rank 1 in the middle of step 3")

    def allreduce(self, *a, **kw):
        self._maybe_die()
        return self._comm.allreduce(*a, **kw)

    def allgather(self, *a, **kw):
        self._maybe_die()
        return self._comm.allgather(*a, **kw)

    def grouped_allgather(self, *a, **kw):
        self._maybe_die()
        return self._comm.grouped_allgather(*a, **kw)

    def alltoall(self, *a, **kw):
        self._maybe_die()
        return self._comm.alltoall(*a, **kw)

    def broadcast(self, *a):
        self._maybe_die()
        return self._comm.broadcast(*a)


def die(outdir, preset, how):
    model, opt = build(compression=presets.make(preset, 0.1))
    for t in range(STEPS + 4):
        opt.zero_grad()
        model(data(t)).pow(2).mean().backward()
        opt.step()
        if t == 0:
            engine = opt._hvds.engine()
            engine.comm = _DieMidStep(engine.comm, engine, outdir, how)
    save(outdir, f"{how}-{preset}", params=flat(model))       # not reached: the job must end first


if __name__ == "__main__":
    hvd.init()
    scenario, outdir = sys.argv[1], sys.argv[2]
    if scenario in ("kill", "fail"):
        die(outdir, sys.argv[3], scenario)
    else:
        table = {"skip": skip, "amp": amp, "raise": raise_, "consistency": consistency, "inputs": inputs}
        for name in (table if scenario == "all" else [scenario]):
            table[name](outdir)
