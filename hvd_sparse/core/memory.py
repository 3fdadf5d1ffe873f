"""Error feedback: the residual each rank carries between steps (docs/algorithms.md#error-feedback).

Per step, on every rank:  1. acc = residual + grad          (float32, in a spare buffer of the same size)
                          2. the reducer returns the included set I (S, or S ∩ G for Ok-Topk and gTopk)
                          3. residual = acc with residual[I] = 0

Invariant (mass conservation, not gTopk): P·Σ updates + Σ residuals over ranks == Σ grads, exact on integer data.
The residual stays float32 whatever the gradient dtype, and is per rank: never broadcast, never averaged.

Momentum correction (Deep Gradient Compression, Lin et al., ICLR 2018), when the compression asks for it
(``momentum_correction = m > 0``): the optimizer's momentum moves into error feedback, so that what is
accumulated and selected is the velocity, not the raw gradient --

    0. u = m·u + grad                             (the velocity, float32, per rank; then acc = residual + u)
    3'. u[I] = 0  on sparse steps                 (momentum factor masking: an entry that was sent restarts
                                                   its velocity, as its residual does)

Without it, a sent entry's stale momentum keeps pushing it with the optimizer's velocity while the residual of
the other entries lags behind. Dense steps (the warm-up) do not mask: their result is the exact average of the
velocities, i.e. plain momentum SGD. The invariant becomes P·Σ updates + Σ residuals == Σ u (the velocities fed).
"""

from __future__ import annotations

import numpy as np

from .reducers.base import ALL


class ErrorFeedback:
    """The residual of one sparsification unit on one rank ("gradient mode": raw gradients, no lr).

    Two float32 buffers of n values, reused across steps on numpy and torch (no allocation, no page faults
    after the first steps): ``residual`` and a spare that receives ``acc = residual + grad``. The residual is
    not touched until :meth:`update`, so a step that is abandoned after :meth:`compensate` (a non-finite
    gradient somewhere) leaves it exactly as it was; :meth:`update` zeroes the included entries of ``acc``
    and swaps the two buffers. TensorFlow tensors are immutable: there each step makes new ones.
    """

    __slots__ = ("residual", "velocity", "_spare", "_found")

    def __init__(self):
        self.residual = None
        self.velocity = None    # momentum correction's u (None: off, or before the first step)
        self._spare = None
        self._found = ()        # entries the last add pass selected, per piece (sizes the next one's output)

    def next_velocity(self, xp, pieces, momentum):
        """``[momentum·u + concat(pieces)]`` (float32, a new array), the input of :meth:`compensate` in place of
        the gradient pieces; ``u`` itself changes only in :meth:`commit_velocity` (a skipped step leaves it)."""
        flat = xp.astype(pieces[0] if len(pieces) == 1 else xp.concat(pieces), xp.float32)
        u = self.velocity
        if u is not None and type(u) is not type(flat):     # restored from a checkpoint (numpy)
            u = xp.asarray(np.array(u, copy=True), xp.float32, like=flat)
        return [xp.copy(flat) if u is None else xp.add(xp.mul(u, momentum), flat)]

    def commit_velocity(self, xp, velocity, included):
        """``u = velocity`` with momentum factor masking: ``u[included] = 0``, except when every entry was sent
        (``included`` is ALL: a dense step)."""
        self.velocity = velocity if included is ALL else xp.put_(velocity, included, 0.0)

    def compensate(self, xp, pieces, zero_pieces=False, select=None):
        """``acc = residual + concat(pieces)`` (float32; the pieces are 1-D, of any float dtype, read once and
        not modified, unless ``zero_pieces``: then they are zeroed in the same pass -- for a caller whose output
        goes into them and is sparse). ``acc`` is a buffer of this object: read it, do not keep it past the step.

        ``select``: None, or ``(threshold, rule, expect)`` (rule one of ``native.RULES``, expect the count the
        caller expects): then the same pass also collects the entries of ``acc`` that the rule selects
        (the backend's ``accumulate_``), when the fused CPU kernel runs for every piece. The output
        room of each piece follows the larger of its share of ``expect`` and what the last such pass found in it (a
        threshold that trails a growing accumulator finds a few times k, unevenly across the layers: ThresholdReuse's
        guard then raises it on the candidates).

        Returns ``(acc, finite, selected)``: ``finite`` is whether every entry of ``acc`` is finite when the pass
        could tell on the way (the fused CPU kernel, float32 pieces), else None; ``selected`` is ``(indices,
        values)`` (numpy int64 ascending, float32: exactly ``xp.scan(acc).select(threshold, rule, values=True)``)
        or None (not asked for, or not every piece took the kernel)."""
        n = sum(xp.numel(p) for p in pieces)
        like = pieces[0]
        r = self.residual
        if r is not None and type(r) is not type(like):     # restored from a checkpoint (numpy)
            r = self.residual = xp.asarray(np.array(r, copy=True), xp.float32, like=like)
        if not xp.mutable:
            flat = xp.astype(pieces[0] if len(pieces) == 1 else xp.concat(pieces), xp.float32)
            return (xp.copy(flat) if r is None else xp.add(r, flat)), None, None
        acc = self._spare
        if acc is None or type(acc) is not type(like) or xp.numel(acc) != n or acc is r:
            acc = self._spare = xp.stream_buffer(n, like)
        sel = None
        if select is not None:                          # each piece's output room
            th, rule, expect = select
            last = self._found if len(self._found) == len(pieces) else (0,) * len(pieces)
            sel = (th, rule, [max(int(expect) * xp.numel(p) // max(n, 1), last[j] + last[j] // 4)
                              for j, p in enumerate(pieces)])
        finite, found = xp.accumulate_(r, pieces, acc, zero_g=zero_pieces, select=sel)
        selected = None
        if found is not None:
            selected = found[0] if len(found) == 1 else (np.concatenate([i for i, _ in found]),
                                                          np.concatenate([v for _, v in found]))
            self._found = tuple(int(i.size) for i, _ in found)
        return acc, finite, selected

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
