"""The compatibility shims with Horovod's and PyTorch's recipes that leave no public way to do what they need: the
one module of hvd_sparse that reads the interpreter's frames or sets what Horovod reads. Each behaviour it relies on
is pinned by ``tests/torch/test_recipes.py``, which fails when Horovod or PyTorch changes it.

* ``horovod.torch.broadcast_optimizer_state`` (and ``hvd.elastic.TorchState``'s sync) steps ranks that have no
  optimizer state yet, on zero gradients, to create it. The other ranks are not stepping, so an exchange there would
  deadlock (resume, a joining elastic worker) or, when every rank steps (a fresh start), run a sparse exchange of
  zeros that moves thresholds and trajectories (DCT, ExDyna). Horovod steps only the wrapped class
  (``super(optimizer.__class__, optimizer).step()``) of an optimizer whose ``__module__`` is Horovod's optimizer
  module: :func:`step_inner_under_broadcast` makes hvd_sparse's optimizer say so (an attribute of the instance; its
  class keeps its own module), so Horovod runs only the inner optimizer. No frame is read: a steady step asks
  nothing.
* ``horovod.torch.DistributedOptimizer(compression=<preset>)`` calls ``compress(p.grad)`` without the parameter,
  its name, ``op`` or process set: :func:`compressing_optimizer` finds the Horovod optimizer (and the parameter)
  that is calling, from its frame.
* ``torch.amp.GradScaler.step`` calls ``step()`` on every rank when the optimizer declares
  ``_step_supports_amp_scaling`` (overflow or not), with ``grad_scale`` / ``found_inf`` set (the optimizer asks only
  then): :func:`grad_scaler` finds that scaler from its frame, so the optimizer can unscale locally, let the
  exchange decide the skip for every rank and write that decision into the scaler's record (its ``update()`` then
  changes the scale alike on every rank). Only a step under a GradScaler reads a frame.
"""

from __future__ import annotations

import sys

import torch
import torch._dynamo.eval_frame
from horovod.torch.optimizer import DistributedOptimizer as _HorovodDistributedOptimizer

#: files whose frames stand between ``step()`` and its caller: torch's step hooks / profiling wrapper, and the
#: wrapper of ``torch.compiler.disable`` (which keeps the exchange out of torch.compile's graphs)
_WRAPPER_FILES = frozenset({sys.modules[torch.optim.Optimizer.__module__].__file__,
                            torch._dynamo.eval_frame.__file__})


def caller(depth=2):
    """The frame that called ``step()`` (``depth`` frames up from here), past torch's wrappers."""
    frame = sys._getframe(depth)
    while frame.f_code.co_filename in _WRAPPER_FILES:
        frame = frame.f_back
    return frame


def step_inner_under_broadcast(optimizer):
    """Make Horovod's ``broadcast_optimizer_state`` step only ``optimizer``'s wrapped class, as it does for its own
    optimizers (it compares ``optimizer.__module__`` with its ``DistributedOptimizer``'s)."""
    optimizer.__module__ = _HorovodDistributedOptimizer.__module__


def grad_scaler(optimizer, api):
    """The ``torch.amp.GradScaler`` whose ``step()`` is calling ``optimizer.step()`` (which calls this while
    ``grad_scale``/``found_inf`` are set). Raises when they were set by something else: the agreed skip could not be
    recorded."""
    scaler = caller(depth=3).f_locals.get("self")
    if isinstance(scaler, torch.amp.GradScaler) and id(optimizer) in scaler._per_optimizer_states:
        return scaler
    raise RuntimeError(f"{api}: step() was called with grad_scale/found_inf set by something other than "
                       "torch.amp.GradScaler.step(); use scaler.step(optimizer), or Horovod's recipe: "
                       "optimizer.synchronize(); scaler.unscale_(optimizer); with optimizer.skip_synchronize(): "
                       "scaler.step(optimizer)")


def record_skip(scaler, optimizer, skipped):
    """Write the skip every rank agreed on into ``scaler``'s found-inf record of ``optimizer``."""
    for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        found.fill_(1.0 if skipped else 0.0)


def compressing_optimizer(compression, tensor):
    """``(optimizer, parameter)``: the Horovod optimizer up the stack whose ``_compression`` is ``compression`` (the
    ``self`` of its ``_allreduce_grad_async``), and its parameter whose gradient is ``tensor`` (that frame's ``p``, or
    found in ``_parameter_names``; None if none). ``(None, None)`` when no such optimizer is calling."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and getattr(owner, "_compression", None) is compression \
                and hasattr(owner, "_parameter_names"):
            p = frame.f_locals.get("p")
            if p is None or p.grad is not tensor:
                p = next((q for q in owner._parameter_names if q.grad is tensor), None)
            return owner, p
        frame = frame.f_back
    return None, None
