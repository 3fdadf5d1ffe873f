"""Runs under `horovodrun -np 2 --gloo`: what real training scripts do with a wrapped optimizer (docs/reliability.md,
"Misuse and Horovod's recipes"). Each scenario writes <outdir>/<scenario>.rank<r>.npz when it is done, so a test can
tell a scenario that hung (no file) from one that failed.

    misuse_worker.py <job> <outdir>        job: "agree" (ranks that disagree: an error on every rank), "train",
                                           or one scenario

agree:  compression (oktopk vs topka, topka vs gtopk, oktopk periods), density (topka, oktopk), allreduce_shapes
        (sparse_allreduce with other shapes per rank), two_optimizers (stepped in another order per rank, then in
        the same order)
train:  add_param_group, unfreeze, embedding (nn.Embedding(sparse=True) without a gradient in some steps, also on one
        rank in the first step),
        grad_scaler (the plain GradScaler pattern, Inf on rank 1 in step 3), wrap_twice, tied (named_parameters(
        remove_duplicate=False)), state_checks (load_sparse_state_dict of another rank / preset / density),
        broadcast_resume (broadcast_optimizer_state when only rank 0 has optimizer state), broadcast_fresh (the same
        call on a fresh start, DCT and ExDyna: the run equals the run without it), after_an_error (going on after
        a RankDisagreementError; sparse_allreduce names built at run time), compiled (torch.compile(opt.step)),
        refused (a preset's factory not called, as DistributedOptimizer's compression= and sparse_allreduce's;
        momentum_correction beside SGD's momentum; options of the sparse path with Compression.fp16; a preset as
        sparse_allreduce's second positional argument, Horovod's average: the error each rank got)
"""

import sys
import time

import horovod.torch as hvd
import numpy as np
import torch

import hvd_sparse.torch as hvds

from worker_helpers import data, flat, mlp, save, wrap

STEPS = 6


def train_step(model, opt, t):
    opt.zero_grad()
    model(data(t)).pow(2).mean().backward()
    opt.step()


def caught(fn):
    """(message, seconds) of the error ``fn`` raised (a RankDisagreementError is a ValueError), or ("", seconds)."""
    start = time.time()
    try:
        fn()
    except (ValueError, TypeError, RuntimeError, IndexError) as e:
        return f"{type(e).__name__}: {e}", time.time() - start
    return "", time.time() - start


# -- agree: ranks that disagree get the same error on every rank, at once -------------------------------------
def compression(outdir):
    pairs = {"oktopk_topka": (hvds.Compression.oktopk(0.1), hvds.Compression.topka(0.1)),
             "topka_gtopk": (hvds.Compression.topka(0.1), hvds.Compression.gtopk(0.1)),
             "threshold_period": (hvds.Compression.oktopk(0.1), hvds.Compression.oktopk(0.1, threshold_period=4)),
             "repartition_period": (hvds.Compression.oktopk(0.1),
                                    hvds.Compression.oktopk(0.1, repartition_period=4))}
    out = {}
    for key, pair in pairs.items():
        model = mlp()
        opt = wrap(model, pair[hvd.rank()])
        out[key], out[key + ".seconds"] = caught(lambda: [train_step(model, opt, t) for t in range(3)])
    save(outdir, "compression", **out)


def density(outdir):
    out = {}
    for key, make in {"topka": hvds.Compression.topka, "oktopk": hvds.Compression.oktopk}.items():
        model = mlp()
        opt = wrap(model, make(0.1 if hvd.rank() == 0 else 0.3))
        out[key], _ = caught(lambda: [train_step(model, opt, t) for t in range(3)])
    save(outdir, "density", **out)


def allreduce_shapes(outdir):
    out = {}
    for key, make in {"topka": hvds.Compression.topka, "oktopk": hvds.Compression.oktopk}.items():
        comp = make(0.2)
        sizes = torch.randn(10 if hvd.rank() == 0 else 12)
        out[f"{key}.sizes"], _ = caught(lambda: hvds.sparse_allreduce(sizes, compression=comp, name=f"{key}.sizes"))
        shaped = torch.randn((3, 4) if hvd.rank() == 0 else (4, 3))
        out[f"{key}.shapes"], _ = caught(lambda: hvds.sparse_allreduce(shaped, compression=comp, name=f"{key}.shapes"))
        same = hvds.sparse_allreduce(data(0, n=12), compression=comp, name=f"{key}.same")       # still works afterwards
        out[f"{key}.same"] = same.numpy()
    save(outdir, "allreduce_shapes", **out)


def two_optimizers(outdir):
    a, b = mlp(1), mlp(2)
    opt_a, opt_b = wrap(a, hvds.Compression.topka(0.2)), wrap(b, hvds.Compression.topka(0.2))
    for m in (a, b):
        m(data(0)).pow(2).mean().backward()
    order = [opt_a, opt_b] if hvd.rank() == 0 else [opt_b, opt_a]
    msg, seconds = caught(lambda: [o.step() for o in order])
    a, b = mlp(1), mlp(2)
    opt_a, opt_b = wrap(a, hvds.Compression.topka(0.2)), wrap(b, hvds.Compression.topka(0.2))
    for t in range(1, 4):              # the same order on every rank: trains, each with its own collectives
        for m, o in ((a, opt_a), (b, opt_b)):
            train_step(m, o, t)
    save(outdir, "two_optimizers", msg=msg, seconds=seconds, a=flat(a), b=flat(b))


# -- train: recipes that must train with bit-identical parameters on every rank ------------------------------
def add_param_group(outdir):
    model = mlp()
    opt = wrap(model, hvds.Compression.oktopk(0.2, threshold_period=2), params=model[0].parameters(),
               consistency_check_every=1)
    head = [flat(model)[-68:]]
    for t in range(STEPS):
        if t == 2:                       # a new head joins the training
            opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.05})
        train_step(model, opt, t)
        head.append(flat(model)[-68:])
    opt.check_consistency()
    save(outdir, "add_param_group", params=flat(model), head=np.stack(head))


def unfreeze(outdir):
    model = mlp()
    for p in model[0].parameters():      # fine-tuning: freeze the backbone, wrap, unfreeze later
        p.requires_grad_(False)
    opt = wrap(model, hvds.Compression.topka(0.2), consistency_check_every=1)
    backbone = [flat(model)[:336]]
    for t in range(STEPS):
        if t == 2:
            for p in model[0].parameters():
                p.requires_grad_(True)
        train_step(model, opt, t)
        backbone.append(flat(model)[:336])
    opt.check_consistency()
    save(outdir, "unfreeze", params=flat(model), backbone=np.stack(backbone))


class EmbNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, ids, use_emb):
        x = self.emb(ids) if use_emb else torch.ones(len(ids), 4)
        return self.lin(x)


def embedding(outdir):
    out = {}
    # used by both ranks, by neither (both None), by rank 0 only (None on rank 1), by both; and from the first step
    # by rank 0 only (rank 1 cannot tell that its missing gradient would be sparse: every rank says what it saw)
    for run, uses in {"later": [(True, True), (False, False), (True, False), (True, True)],
                      "first": [(True, False), (False, True), (True, True)]}.items():
        torch.manual_seed(0)
        model = EmbNet()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=hvds.Compression.topka(0.5))
        start = flat(model)
        for t, use in enumerate(uses):
            opt.zero_grad(set_to_none=True)
            ids = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(t * 10 + hvd.rank()))
            model(ids, use[hvd.rank()]).pow(2).mean().backward()
            opt.step()
        out[f"{run}.params"] = flat(model)
        out[f"{run}.moved"] = np.array(bool((out[f"{run}.params"] != start).any()))
    save(outdir, "embedding", **out)


def after_an_error(outdir):
    """Scripts that catch a RankDisagreementError and go on with the same optimizers (zero_grad, then steps in the
    same order on every rank), and sparse_allreduce under names built at run time (equal, not the same object)."""
    a, b = mlp(1), mlp(2)
    opt_a, opt_b = wrap(a, hvds.Compression.topka(0.2)), wrap(b, hvds.Compression.topka(0.2))
    model, opt = (a, opt_a) if hvd.rank() == 0 else (b, opt_b)      # another optimizer on each rank: an error
    model(data(0)).pow(2).mean().backward()
    msg, _ = caught(opt.step)
    for t in range(1, 4):
        for m, o in ((a, opt_a), (b, opt_b)):
            train_step(m, o, t)          # zero_grad() first: the failed step's backward passes no longer count
    comp, outs = hvds.Compression.topka(0.3), []
    for t in range(3):
        for i in range(2):
            outs.append(hvds.sparse_allreduce(data(t, n=12)[i], compression=comp, name="grad." + str(i)).numpy())
    save(outdir, "after_an_error", msg=msg, a=flat(a), b=flat(b), allreduced=np.stack(outs))


def compiled(outdir):
    """torch.compile around optimizer.step(): the exchange runs outside the graph, as without it."""
    runs = {}
    for how in ("plain", "compiled"):
        model = mlp(3)
        opt = wrap(model, hvds.Compression.oktopk(0.2, threshold_period=2))
        step = torch.compile(opt.step, backend="eager") if how == "compiled" else opt.step
        for t in range(STEPS):
            opt.zero_grad()
            model(data(t)).pow(2).mean().backward()
            step()
        runs[how] = flat(model)
    save(outdir, "compiled", **runs)


def grad_scaler(outdir):
    model = mlp()
    opt = wrap(model, hvds.Compression.oktopk(0.1, threshold_period=2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    params, scales = [flat(model)], []
    for t in range(STEPS):               # the plain pattern of the PyTorch AMP docs
        opt.zero_grad()
        scaler.scale(model(data(t)).pow(2).mean()).backward()
        if t == 3 and hvd.rank() == 1:
            next(model.parameters()).grad.view(-1)[5] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        params.append(flat(model))
    save(outdir, "grad_scaler", params=np.stack(params), scales=np.array(scales), skipped=opt.skipped_steps())


def wrap_twice(outdir):
    model = mlp()
    opt = wrap(model, hvds.Compression.topka(0.1))
    msg, _ = caught(lambda: hvds.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                      compression=hvds.Compression.topka(0.1)))
    horovods = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    msg2, _ = caught(lambda: hvds.DistributedOptimizer(horovods, named_parameters=model.named_parameters(),
                                                       compression=hvds.Compression.topka(0.1)))
    save(outdir, "wrap_twice", msg=msg, msg2=msg2)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(6, 6)
        self.dec = torch.nn.Linear(6, 6)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(torch.tanh(self.enc(x)))


def tied(outdir):
    torch.manual_seed(0)
    model = Tied()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=list(model.named_parameters(remove_duplicate=False)),
                                    compression=hvds.Compression.topka(0.3))
    for t in range(4):
        opt.zero_grad()
        model(data(t, n=6)).pow(2).mean().backward()
        opt.step()
    save(outdir, "tied", params=flat(model))


def state_checks(outdir):
    model = mlp()
    opt = wrap(model, hvds.Compression.oktopk(0.1))
    train_step(model, opt, 0)
    mine = opt.sparse_state_dict()
    other = hvd.allgather_object(mine)[1 - hvd.rank()]      # the other rank's file
    out = {}

    def load_into(make, state):
        return caught(lambda: wrap(mlp(), make()).load_sparse_state_dict(state))[0]

    out["other_rank"] = load_into(lambda: hvds.Compression.oktopk(0.1), other)
    out["other_size"] = load_into(lambda: hvds.Compression.oktopk(0.1), dict(mine, size=3))
    out["other_preset"] = load_into(lambda: hvds.Compression.topka(0.1), mine)
    out["other_density"] = load_into(lambda: hvds.Compression.oktopk(0.2), mine)
    out["other_period"] = load_into(lambda: hvds.Compression.oktopk(0.1, repartition_period=8), mine)
    out["own"] = load_into(lambda: hvds.Compression.oktopk(0.1), mine)
    save(outdir, "state_checks", **out)


def broadcast_resume(outdir):
    model = mlp()
    opt = wrap(model, hvds.Compression.oktopk(0.1, threshold_period=2))
    if hvd.rank() == 0:                  # rank 0 resumed its optimizer state from a checkpoint, rank 1 did not
        opt.load_state_dict(_sgd_state_with_momentum(model))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    engine_before = opt._hvds.has_engine()
    for t in range(STEPS):
        train_step(model, opt, t)
    bufs = np.concatenate([opt.state[p]["momentum_buffer"].reshape(-1).numpy() for p in model.parameters()])
    save(outdir, "broadcast_resume", params=flat(model), bufs=bufs, engine_before=engine_before)


def _sgd_state_with_momentum(model):
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    plain.step()
    with torch.no_grad():                # undo the update: only the state matters
        for p in model.parameters():
            p.add_(plain.state[p]["momentum_buffer"], alpha=0.1)
            p.grad = None
    return plain.state_dict()


def broadcast_fresh(outdir):
    out = {}
    for preset in ("dct", "exdyna"):
        runs = []
        for call in (False, True):
            model = mlp()
            comp = hvds.Compression.dct(0.1, lifespan=3) if preset == "dct" else hvds.Compression.exdyna(0.1)
            opt = wrap(model, comp)
            if call:
                hvd.broadcast_optimizer_state(opt, root_rank=0)      # Horovod's fresh-start recipe
            for t in range(STEPS):
                train_step(model, opt, t)
            runs.append(flat(model))
            out[f"{preset}.density.{call}"] = opt.sparse_stats()["density"]
        out[f"{preset}.without"], out[f"{preset}.with"] = runs
    save(outdir, "broadcast_fresh", **out)


def refused(outdir):
    model = mlp()

    def sgd(momentum):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)

    out = {"factory": caught(lambda: hvds.DistributedOptimizer(sgd(0.0), named_parameters=model.named_parameters(),
                                                               compression=hvds.Compression.topka))[0],
           "allreduce_factory": caught(lambda: hvds.sparse_allreduce(torch.ones(8),
                                                                     compression=hvds.Compression.oktopk))[0],
           "allreduce_positional": caught(lambda: hvds.sparse_allreduce(torch.ones(8),       # the old signature
                                                                        hvds.Compression.topka(0.5)))[0],
           "momentum_twice": caught(lambda: hvds.DistributedOptimizer(
               sgd(0.9), named_parameters=model.named_parameters(),
               compression=hvds.Compression.topka(0.1, momentum_correction=0.9)))[0]}
    for option in ({"nonfinite": "raise"}, {"elastic_residuals": "drop"}, {"consistency_check_every": 5}):
        (name, value), = option.items()
        out[f"dense.{name}"] = caught(lambda: hvds.DistributedOptimizer(
            sgd(0.9), named_parameters=model.named_parameters(), compression=hvds.Compression.fp16, **option))[0]
    opt = hvds.DistributedOptimizer(sgd(0.0), named_parameters=model.named_parameters(),       # the fixed call
                                    compression=hvds.Compression.topka(0.1, momentum_correction=0.9))
    train_step(model, opt, 0)
    save(outdir, "refused", params=flat(model), **out)


JOBS = {"agree": [compression, density, allreduce_shapes, two_optimizers],
        "train": [add_param_group, unfreeze, embedding, grad_scaler, wrap_twice, tied, state_checks,
                  broadcast_resume, broadcast_fresh, after_an_error, compiled, refused]}

if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    job, outdir = sys.argv[1], sys.argv[2]
    for scenario in JOBS.get(job) or [globals()[job]]:      # a job, or one scenario by name
        scenario(outdir)
        print(f"rank {hvd.rank()}: {scenario.__name__} done", flush=True)
