"""Error feedback: the residual each rank carries between steps (spec oktopk.md §2.3).

Per step, on every rank:  1. acc = residual + grad          (float32, in a spare buffer of the same size)
                          2. the reducer returns the included set I (S, or S ∩ G for Ok-Topk and gTopk)
                          3. residual = acc with residual[I] = 0

Invariant (oracle O10, not gTopk): P·Σ updates + Σ residuals over ranks == Σ grads, exact on integer data.
The residual stays float32 whatever the gradient dtype, and is per rank: never broadcast, never averaged.
"""

from __future__ import annotations

import numpy as np

from . import native
from .reducers.base import ALL


class ErrorFeedback:
    """The residual of one sparsification unit on one rank ("gradient mode": raw gradients, no lr).

    Two float32 buffers of n values, reused across steps on numpy and torch (no allocation, no page faults
    after the first steps): ``residual`` and a spare that receives ``acc = residual + grad``. The residual is
    not touched until :meth:`update`, so a step that is abandoned after :meth:`compensate` (a non-finite
    gradient somewhere) leaves it exactly as it was; :meth:`update` zeroes the included entries of ``acc``
    and swaps the two buffers. TensorFlow tensors are immutable: there each step makes new ones.
    """

    __slots__ = ("residual", "_spare")

    def __init__(self):
        self.residual = None
        self._spare = None

    def compensate(self, xp, pieces, zero_pieces=False):
        """``acc = residual + concat(pieces)`` (float32; the pieces are 1-D, of any float dtype, read once and
        not modified, unless ``zero_pieces``: then they are zeroed in the same pass -- for a caller whose output
        goes into them and is sparse). ``acc`` is a buffer of this object: read it, do not keep it past the step.

        Returns ``(acc, finite)``: ``finite`` is whether every entry of ``acc`` is finite when the pass could
        tell on the way (the fused CPU kernel of :mod:`hvd_sparse.core.native`, float32 pieces), else None."""
        n = sum(xp.numel(p) for p in pieces)
        like = pieces[0]
        r = self.residual
        if r is not None and type(r) is not type(like):     # restored from a checkpoint (numpy)
            r = self.residual = xp.asarray(np.array(r, copy=True), xp.float32, like=like)
        if not xp.mutable:
            flat = xp.astype(pieces[0] if len(pieces) == 1 else xp.concat(pieces), xp.float32)
            return (xp.copy(flat) if r is None else xp.add(r, flat)), None
        acc = self._spare
        if acc is None or type(acc) is not type(like) or xp.numel(acc) != n or acc is r:
            acc = self._spare = xp.empty(n, xp.float32, like=like)
        out = native.f32_view(xp, acc)
        rv = None if r is None or out is None else native.f32_view(xp, r)
        bad, known, off = 0, True, 0
        for p in pieces:
            m = xp.numel(p)
            pv = None if out is None or (r is not None and rv is None) else native.f32_view(xp, p)
            if pv is not None:                       # one pass: the sum and its non-finite count
                bad += native.add(None if rv is None else rv[off:off + m], pv, out[off:off + m],
                                  zero_g=zero_pieces)
            else:
                xp.add_into(None if r is None else r[off:off + m], p, acc[off:off + m])
                if zero_pieces:
                    xp.fill_(p, 0.0)
                known = False
            off += m
        return acc, (False if bad else (True if known else None))

    def update(self, xp, acc, included):
        """``residual = acc`` with the ``included`` entries zeroed (``acc`` from :meth:`compensate`)."""
        if included is ALL:
            self.residual = None
        else:
            self._spare, self.residual = self.residual, xp.put_(acc, included, 0.0)

    def replace(self, residual):
        """Take ``residual`` (a reducer's own, e.g. SparDL's global residual collection) as the residual."""
        self._spare = None
        self.residual = residual

    def norm(self, xp):
        """L2 norm of the residual (0.0 before the first step)."""
        if self.residual is None:
            return 0.0
        r = xp.to_numpy(self.residual).astype("float64")
        return float((r * r).sum() ** 0.5)
