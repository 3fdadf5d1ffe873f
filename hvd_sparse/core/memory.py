"""Error feedback: the residual each rank carries between steps (spec oktopk.md §2.3).

Per step, on every rank:  1. acc = residual + grad          (float32, in the residual's own buffer)
                          2. the reducer returns the included set I (S, or S ∩ G for Ok-Topk and gTopk)
                          3. residual = acc with residual[I] = 0

Invariant (oracle O10, not gTopk): P·Σ updates + Σ residuals over ranks == Σ grads, exact on integer data.
The residual stays float32 whatever the gradient dtype, and is per rank: never broadcast, never averaged.
"""

from __future__ import annotations

import numpy as np

from .reducers.base import ALL


class ErrorFeedback:
    """The residual of one sparsification unit on one rank ("gradient mode": raw gradients, no lr)."""

    __slots__ = ("residual",)

    def __init__(self):
        self.residual = None

    def compensate(self, xp, grad32):
        """Return ``acc = residual + grad``. ``acc`` *is* the residual buffer: read it, do not keep it."""
        if self.residual is None:
            self.residual = xp.copy(grad32)
        else:
            if type(self.residual) is not type(grad32):     # restored from a checkpoint (numpy)
                self.residual = xp.asarray(np.array(self.residual, copy=True), xp.float32, like=grad32)
            self.residual += grad32
        return self.residual

    def update(self, xp, acc, included):
        """``residual = acc`` with the ``included`` entries zeroed (``acc`` is the buffer of ``compensate``)."""
        if included is ALL:
            self.residual = None
        else:
            self.residual = xp.put_(acc, included, 0.0)

    def norm(self, xp):
        """L2 norm of the residual (0.0 before the first step)."""
        if self.residual is None:
            return 0.0
        r = xp.to_numpy(self.residual).astype("float64")
        return float((r * r).sum() ** 0.5)
