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
"""

from __future__ import annotations

import torch


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose :meth:`step` tells an hvd_sparse optimizer which scaler steps it."""

    def step(self, optimizer, *args, **kwargs):
        job = getattr(optimizer, "_hvds", None)
        if job is None:
            return super().step(optimizer, *args, **kwargs)
        job.scaler = self
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            job.scaler = None
