"""Runs under `horovodrun -np P --gloo`: hvd_sparse's optimizer with ``overlap=True`` (buckets launched from the
gradient hooks); each rank writes <outdir>/<scenario>.rank<r>.npz for tests/torch/test_overlap_horovod.py.

Scenarios:
  buckets   TopkA, Ok-Topk and ExDyna (and TopkA over two backward passes a step, ExDyna with the budget split
            by size) with small buckets, one of them dense, and a layer that only rank 0 uses on even steps: raw
            and reduced gradients, final parameters and residuals, the plan, how many buckets the hooks launched,
            the buckets' shares of the density, a checkpoint's resume
  frozen    a layer frozen after 4 steps, another unfrozen after 8: final parameters, the frozen layer's drift
  resume    a checkpoint written without overlap loaded with it: the error on every rank
  amp       hvd_sparse's GradScaler (an Inf on rank 1 at step 3) and torch's; torch.compile around the model; the
            job and its thread gone with the optimizer
"""

import gc
import json
import threading
import time
import weakref

import horovod.torch as hvd
import numpy as np
import torch

import hvd_sparse.torch as hvds

from worker_helpers import run_scenarios

STEPS = 12
DENSITY = 0.05
#: the largest bucket (MB, 52 entries): a tensor a bucket, the last layer's bias (4 entries) alone in the first
CAP_MB = 0.0002
#: the dense rule's rate: a bucket of under ~6 entries goes dense at P = 2 (TopkA sends 2k words to each other rank)
MIN_RATE = 3.0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(16, 4)     # registered first: the last bucket, so it blocks no other
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x, use_extra):
        y = torch.tanh(self.b(torch.tanh(self.a(x))))
        out = self.c(y)
        return out + self.extra(y) if use_extra else out


def setup(seed):
    torch.manual_seed(seed)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


def flat_grads(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for _, p in sorted(model.named_parameters())]).numpy().copy()


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for _, p in sorted(model.named_parameters())]).numpy().copy()


def batch(t, i=0):
    g = torch.Generator().manual_seed(1000 * t + 10 * i + hvd.rank())
    return torch.randn(8, 12, generator=g)


def train(model, opt, passes=1, steps=range(STEPS)):
    raw, red, hooks = [], [], []
    for t in steps:
        opt.zero_grad()
        for i in range(passes):
            model(batch(t, i), use_extra=hvd.rank() == 0 and t % 2 == 0).pow(2).mean().backward()
        raw.append(flat_grads(model))
        hooks.append(opt._hvds.overlap.launched_by_hooks)
        opt.step()
        red.append(flat_grads(model))
    return np.array(raw), np.array(red), np.array(hooks)


def scenario_buckets(out):
    res = {}
    for tag, preset, passes, budget in (("topka", "topka", 1, None), ("oktopk", "oktopk", 1, None),
                                        ("exdyna", "exdyna", 1, None), ("topka_passes2", "topka", 2, None),
                                        ("exdyna_size", "exdyna", 1, "size")):
        model = setup(seed=3)
        opt = bucketed(model, preset, passes, budget, MIN_RATE)
        raw, red, hooks = train(model, opt, passes, range(STEPS - 3))
        state = opt.sparse_state_dict()                       # 3 steps after the last split: resumed below
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}
        raw2, red2, hooks2 = train(model, opt, passes, range(STEPS - 3, STEPS))
        plan = [{"names": [n for n, _ in b.params], "dense": b.dense} for b in opt._hvds.overlap.buckets]
        res.update({f"{tag}.raw": np.concatenate([raw, raw2]), f"{tag}.red": np.concatenate([red, red2]),
                    f"{tag}.params": flat_params(model), f"{tag}.hooks": np.concatenate([hooks, hooks2]),
                    f"{tag}.plan": np.array(json.dumps(plan)), f"{tag}.residual": residuals(opt),
                    f"{tag}.shares": np.array([e.share for e in opt._hvds.engines()])})
        model = setup(seed=3)                                 # a new model and optimizer resume the checkpoint
        model.load_state_dict(saved["model"])
        opt = bucketed(model, preset, passes, budget, MIN_RATE)
        opt.load_state_dict(saved["opt"])
        opt.load_sparse_state_dict(state)
        train(model, opt, passes, range(STEPS - 3, STEPS))
        res[f"{tag}.resumed"] = flat_params(model)
    res["layout"] = np.array(json.dumps([(n, p.numel()) for n, p in sorted(model.named_parameters())]))
    np.savez(out, **res)


def residuals(opt):
    """This rank's residual in sorted-name order (zeros where a bucket has none)."""
    names = sorted(n for b in opt._hvds.overlap.buckets for n, _ in b.params)
    flat = {}
    for b in opt._hvds.overlap.buckets:
        r, at = opt._hvds.engine(b).memory.residual, 0
        for n, p in b.params:
            flat[n] = np.zeros(p.numel(), np.float32) if r is None else np.asarray(r[at:at + p.numel()])
            at += p.numel()
    return np.concatenate([flat[n] for n in names])


def scenario_frozen(out):
    model = setup(seed=4)
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.oktopk(DENSITY), overlap=True, bucket_cap_mb=CAP_MB)
    model.extra.requires_grad_(False)
    for t in range(STEPS):
        if t == 4:
            model.a.requires_grad_(False)
            frozen = model.a.weight.detach().clone()
        if t == 8:
            model.extra.requires_grad_(True)
        opt.zero_grad()
        model(batch(t), use_extra=True).pow(2).mean().backward()
        opt.step()
    np.savez(out, params=flat_params(model), frozen_drift=float((model.a.weight - frozen).abs().max()),
             residual=opt.residual_norm())


def scenario_resume(out):
    model = setup(seed=5)
    plain = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                      named_parameters=model.named_parameters(),
                                      compression=hvds.Compression.topka(DENSITY))
    model(batch(0), use_extra=True).pow(2).mean().backward()
    plain.step()
    state = plain.sparse_state_dict()
    bucketed = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters(),
                                         compression=hvds.Compression.topka(DENSITY), overlap=True)
    try:
        bucketed.load_sparse_state_dict(state)
        message = ""
    except ValueError as e:
        message = str(e)
    np.savez(out, message=np.array(message))


def bucketed(model, preset="oktopk", passes=1, budget=None, min_rate=None):
    return hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters(),
                                     compression=getattr(hvds.Compression, preset)(DENSITY), overlap=True,
                                     bucket_cap_mb=CAP_MB, min_compression_rate=min_rate,
                                     backward_passes_per_step=passes, bucket_budget=budget)


def scenario_amp(out):
    model = setup(seed=6)
    opt = bucketed(model)
    scaler = hvds.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    params, scales, hooks = [flat_params(model)], [], []
    for t in range(6):
        opt.zero_grad()
        scaler.scale(model(batch(t), use_extra=True).pow(2).mean()).backward()
        if t == 3 and hvd.rank() == 1:
            model.a.weight.grad.view(-1)[5] = float("inf")
        hooks.append(opt._hvds.overlap.launched_by_hooks)
        scaler.step(opt)
        scaler.update()
        params.append(flat_params(model))
        scales.append(scaler.get_scale())
    del scaler
    model = setup(seed=6)
    opt = bucketed(model)
    plain = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    plain.scale(model(batch(0), use_extra=True).pow(2).mean()).backward()
    try:
        plain.step(opt)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    runs = {}
    for how in ("eager", "compiled"):
        model = setup(seed=7)
        opt = bucketed(model)
        run = torch.compile(model, backend="eager") if how == "compiled" else model
        for t in range(4):
            opt.zero_grad()
            run(batch(t), use_extra=True).pow(2).mean().backward()
            opt.step()
        runs[how] = flat_params(model)
    skipped = opt.skipped_steps()
    job = weakref.ref(opt._hvds)                # the optimizer's thread must not keep its job alive
    del opt, run
    gc.collect()
    time.sleep(0.05)
    np.savez(out, params=np.array(params), scales=np.array(scales), hooks=np.array(hooks), skipped=skipped,
             refused=np.array(refused), freed=job() is None,
             threads=np.array([t.name for t in threading.enumerate() if t.name.startswith("hvd_sparse")]), **runs)


if __name__ == "__main__":
    run_scenarios(hvd, "", globals())
