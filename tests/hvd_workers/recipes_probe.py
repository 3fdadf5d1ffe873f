"""Run with plain ``python`` (one process, ``hvd.init()`` at size 1): the Horovod and PyTorch behaviours that
hvd_sparse.torch.recipes reads from the interpreter's frames, each exercised end to end. Prints one JSON object."""

import json
import os
import sys

import horovod.torch as hvd
import torch

import hvd_sparse
import hvd_sparse.torch as hvds
from hvd_sparse.torch import recipes


def model_and_opt(compression, factory=None, **options):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = (factory or hvds.DistributedOptimizer)(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                                 named_parameters=model.named_parameters(), compression=compression,
                                                 **options)
    return model, opt


def broadcast_optimizer_state():
    """Horovod's own broadcast_optimizer_state steps an optimizer without state: recognised, no exchange."""
    comp = hvds.Compression.topka(0.5)
    model, opt = model_and_opt(comp)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return {"state_created": bool(opt.state_dict()["state"]), "exchanges": opt._hvds.exchanges,
            "engine": opt._hvds.states.get("model") is not None,
            "own_attributes": sorted(a for a in vars(opt) if a.startswith("_hvds"))}


def grad_scaler(kind=torch.amp.GradScaler, reads=None, **options):
    """The plain GradScaler pattern: torch's GradScaler.step is found as the caller (hvd_sparse's says so), its
    found-inf record written. ``reads``: a list that :func:`counting_frames` fills, emptied before each step (and
    each backward: the hooks of ``overlap=True`` count)."""
    model, opt = model_and_opt(hvds.Compression.topka(0.5), **options)
    scaler = kind("cpu", init_scale=2.0 ** 8)
    scales, frames = [], []
    for t in range(3):
        opt.zero_grad()
        if reads is not None:
            del reads[:]
        scaler.scale(model(torch.ones(2, 6)).pow(2).mean()).backward()
        if t == 1:
            model.weight.grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        frames.append(None if reads is None else len(reads))
        scaler.update()
        scales.append(scaler.get_scale())
    return {"scales": scales, "skipped": opt.skipped_steps(), "frames": frames}


def counting_frames(fn):
    """``fn(reads)`` with every ``sys._getframe`` call made from hvd_sparse's package appended to ``reads``."""
    real, reads = sys._getframe, []
    package = os.path.dirname(os.path.abspath(hvd_sparse.__file__)) + os.sep     # hvd_sparse/, not the tests

    def counted(depth=0):
        caller = real(1)
        if os.path.abspath(caller.f_code.co_filename).startswith(package):
            reads.append(caller.f_code.co_name)
        return real(depth + 1)

    sys._getframe = counted
    try:
        return fn(reads)
    finally:
        sys._getframe = real


def frames_read():
    """A step of hvd_sparse's optimizer reads no interpreter frame (``sys._getframe``, counted through the whole
    step), with state or without; Horovod's broadcast_optimizer_state steps nothing once the optimizer has state."""
    real, reads = sys._getframe, []
    sys._getframe = lambda depth=0: reads.append(1) or real(depth + 1)
    try:
        out = {}
        for name, momentum in (("stateless", 0.0), ("stateful", 0.9)):
            torch.manual_seed(0)
            model = torch.nn.Linear(6, 3)
            opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                            named_parameters=model.named_parameters(),
                                            compression=hvds.Compression.topka(0.5))
            per_step = []
            for _ in range(3):
                opt.zero_grad()
                model(torch.ones(2, 6)).sum().backward()
                del reads[:]
                opt.step()
                per_step.append(len(reads))
            out[name] = per_step
    finally:
        sys._getframe = real
    before = [p.detach().clone() for p in model.parameters()]
    exchanges = opt._hvds.exchanges
    hvd.broadcast_optimizer_state(opt, root_rank=0)      # an optimizer with state, gradients still set
    stepped = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    out["broadcast_with_state"] = {"stepped": stepped, "exchanges": opt._hvds.exchanges - exchanges}
    return out


def compressing_optimizer():
    """Horovod's optimizer hands compress() p.grad only: its frame gives the optimizer and the parameter."""
    comp = hvds.Compression.topka(0.5)
    model, opt = model_and_opt(comp, factory=hvd.DistributedOptimizer)
    model(torch.ones(2, 6)).sum().backward()
    found, p = recipes.compressing_optimizer(comp, model.bias.grad)
    outside = recipes.compressing_optimizer(comp, model.bias.grad)
    handle = opt._allreduce_grad_async(model.bias)        # what Horovod's hook calls: compress(p.grad) inside
    hvd.synchronize(handle[0] if isinstance(handle, tuple) else handle)
    stashed = sorted(opt._hvds_stash.stash)
    return {"outside": [x is None for x in outside], "stashed": stashed, "direct": [found is None, p is None]}


if __name__ == "__main__":
    hvd.init()
    print("RESULT " + json.dumps({"broadcast_optimizer_state": broadcast_optimizer_state(),
                                  "grad_scaler": grad_scaler(),
                                  "hvds_grad_scaler": counting_frames(lambda r: grad_scaler(hvds.GradScaler, r)),
                                  "hvds_grad_scaler_overlap": counting_frames(
                                      lambda r: grad_scaler(hvds.GradScaler, r, overlap=True)),
                                  "torch_grad_scaler": counting_frames(lambda r: grad_scaler(reads=r)),
                                  "frames_read": frames_read(),
                                  "compressing_optimizer": compressing_optimizer()}))
