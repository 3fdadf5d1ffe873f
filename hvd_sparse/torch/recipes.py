"""Who is calling ``optimizer.step()``: Horovod's and PyTorch's recipes that step an optimizer from outside.

* ``horovod.torch.broadcast_optimizer_state`` steps ranks that have no optimizer state yet, on zero gradients, to
  create it; it skips that only for Horovod's own optimizer classes. The other ranks are not stepping, so an
  exchange there would deadlock (resume, a joining elastic worker) or, when every rank steps (a fresh start), run a
  sparse exchange of zeros that moves thresholds and trajectories (DCT, ExDyna). :func:`caller` lets the optimizer
  recognise the call and run only its inner optimizer.
* ``torch.amp.GradScaler.step`` calls ``step()`` on every rank when the optimizer declares
  ``_step_supports_amp_scaling`` (overflow or not), with ``grad_scale`` / ``found_inf`` set: :func:`grad_scaler`
  finds that scaler, so the optimizer can unscale locally, let the exchange decide the skip for every rank and write
  that decision into the scaler's record (its ``update()`` then changes the scale alike on every rank).
"""

from __future__ import annotations

import sys

import torch
from horovod.torch.functions import broadcast_optimizer_state

_TORCH_OPTIMIZER_FILE = sys.modules[torch.optim.Optimizer.__module__].__file__


def caller(depth=2):
    """The frame that called ``step()`` (``depth`` frames up from here), past torch's step hooks / profiling
    wrapper."""
    frame = sys._getframe(depth)
    while frame.f_code.co_filename == _TORCH_OPTIMIZER_FILE:
        frame = frame.f_back
    return frame


def is_broadcast_optimizer_state(frame):
    return frame.f_code is broadcast_optimizer_state.__code__


def grad_scaler(optimizer, frame, api):
    """The ``torch.amp.GradScaler`` whose ``step()`` (``frame``) is calling ``optimizer.step()``, or None. Raises
    when ``grad_scale``/``found_inf`` were set by something else: the agreed skip could not be recorded."""
    if not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf"):
        return None
    scaler = frame.f_locals.get("self")
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
