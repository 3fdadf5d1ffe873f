"""``hvd_sparse.torch.GradScaler``: ``torch.amp.GradScaler`` that tells hvd_sparse's optimizer it is stepping it.

    scaler = hvds.GradScaler("cuda")              # the arguments of torch.amp.GradScaler
    scaler.scale(loss).backward()
    scaler.step(optimizer)                        # the skip of a non-finite step agreed by every rank
    scaler.update()                               # so the scale changes alike on every rank

Under a GradScaler, hvd_sparse's optimizer unscales the local gradients before error feedback sees them, lets the
exchange decide for every rank whether a NaN or Inf skips the step, and writes that decision into the scaler's
record of the step (``update()`` reads it). This scaler hands itself to the optimizer for the length of its
``step()``; torch's own ``torch.amp.GradScaler`` works too, found from the interpreter's frame
(:mod:`hvd_sparse.torch.recipes`, pinned by ``tests/torch/test_recipes.py``). With any other optimizer it is
torch's.

With ``overlap=True`` the gradients must be unscaled before a bucket's error feedback sees them, and only the scaler
knows the scale: once this scaler has scaled a loss, the buckets are launched after backward, when the optimizer's
step has unscaled them (:func:`scaling`); torch's own GradScaler cannot tell the hooks, and the optimizer refuses it
under overlap.
"""

from __future__ import annotations

import weakref

import torch

_SCALING = weakref.WeakSet()        # the enabled hvd_sparse GradScalers that have scaled a loss


def scaling():
    """Whether an enabled :class:`GradScaler` has scaled a loss: the gradients of this backward are scaled."""
    return any(scaler.is_enabled() for scaler in list(_SCALING))


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose :meth:`step` tells an hvd_sparse optimizer which scaler steps it, and whose
    :meth:`scale` tells an overlapping optimizer's hooks to wait for unscaling."""

    def scale(self, outputs):
        _SCALING.add(self)
        return super().scale(outputs)

    def step(self, optimizer, *args, **kwargs):
        job = getattr(optimizer, "_hvds", None)
        if job is None:
            return super().step(optimizer, *args, **kwargs)
        job.scaler = self
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            job.scaler = None
