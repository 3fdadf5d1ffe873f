"""Operations every backend offers, written once on the backends' elementary operations.

The numpy and torch backends override them with the C kernels when those are built
(:mod:`hvd_sparse.core.xp.kernels`); the TensorFlow backend (and CUDA tensors) run these. Both give the same
bits.
"""

from __future__ import annotations

import numpy as np

from .fixed import FixedOps


def f32(x):
    """``x`` rounded to float32, as a Python float: what thresholds are compared with."""
    return float(np.float32(x))


def rule_mask(xp, mag, th, rule):
    """Boolean mask of the entries ``rule`` selects from the magnitudes ``mag`` at threshold ``th``.

    ``ge_nonzero``: ``mag >= th and mag != 0``; ``gt``: ``mag > th``; ``ge``: ``mag >= th``. ``th`` is compared
    in float32 (rounded to nearest).
    """
    if rule == "ge":
        return xp.ge(mag, th)
    t = f32(th)
    if rule == "gt":
        return xp.gt(mag, t)
    if rule != "ge_nonzero":
        raise ValueError(f"hvd_sparse: rule must be one of ('ge_nonzero', 'gt', 'ge'), got {rule!r}")
    if t > 0.0:
        return xp.ge(mag, t)          # mag >= t > 0 implies nonzero
    return xp.gt(mag, 0.0)


class Scan:
    """Counts and selections of one array by a thresholding rule on ``|x|`` (``xp.scan(x)``).

    Rules (``hvd_sparse.core.native.RULES``): ``ge_nonzero`` (|x| >= t and x != 0; t <= 0: |x| > 0), ``gt``
    (|x| > t), ``ge`` (|x| >= t); NaN is never selected. This generic scan computes ``|x|`` once, on first use,
    and masks it per call; the numpy and CPU torch backends scan float32 buffers with the fused kernel instead
    (one read pass per call, no copy, no mask), with the same results.
    """

    __slots__ = ("xp", "x", "_mag")

    def __init__(self, xp, x):
        self.xp, self.x, self._mag = xp, x, None

    def _magnitudes(self):
        if self._mag is None:
            self._mag = self.xp.abs(self.x)
        return self._mag

    def count(self, th, rule):
        """How many entries ``rule`` selects at threshold ``th``."""
        return self.xp.sum_int(rule_mask(self.xp, self._magnitudes(), th, rule))

    def count_array(self, ths, rule):
        """The counts at every threshold of ``ths`` as one int64 array on ``x``'s device (nothing is read)."""
        mag = self._magnitudes()
        return self.xp.count_true([rule_mask(self.xp, mag, th, rule) for th in ths])

    def counts(self, ths, rule, until=None):
        """``[count(th, rule) for th in ths]``, read by the host at once (one wait on a GPU). With ``until``, the
        list may end at the first count ``c`` with ``until(c)`` true (the kernel scan stops there; this one counts
        every threshold: one read either way)."""
        return [int(c) for c in self.xp.to_numpy(self.count_array(ths, rule))]

    def select(self, th, rule, *, base=0, values=False, expect=0):
        """``(indices, values or None)``: the ascending int64 indices (plus ``base``) of the entries ``rule``
        selects at ``th``, and with ``values`` their values (signed). ``expect``: the count the caller expects
        (sizes the kernel's output; unused here)."""
        xp = self.xp
        idx = xp.nonzero(rule_mask(xp, self._magnitudes(), th, rule))
        vals = xp.take(self.x, idx) if values else None
        if base and xp.numel(idx):
            idx = xp.add(idx, base)
        return idx, vals


class GenericOps(FixedOps):
    """The generic path of the operations the C kernels speed up, and the fixed-size selections
    (:mod:`~hvd_sparse.core.xp.fixed`); mixed into every backend."""

    #: the simulator may share one read-only result between its ranks (:meth:`freeze` makes it read-only)
    freezable = False

    def freeze(self, x):
        """``x``, made read-only where the array type allows it (numpy)."""
        return x

    def _dtypes_of(self, framework):
        """Take ``float32``, ``index_dtype`` (int64) and ``int32`` from a framework module that names its dtypes
        as numpy does (torch, tensorflow)."""
        self.float32, self.index_dtype, self.int32 = framework.float32, framework.int64, framework.int32

    def scan(self, x):
        """A :class:`Scan` of the 1-D ``x``: ``count(th, rule)`` and ``select(th, rule, ...)`` on ``|x|``."""
        return Scan(self, x)

    def topk(self, acc, k):
        """Exact top-k of ``|acc|`` (:func:`hvd_sparse.core.selection.topk_indices`): ``(sorted int64 indexes,
        threshold)``; everything above the k-th largest magnitude, ties by the lower index, never a zero."""
        n = self.numel(acc)
        if 0 < k < n:
            fast = self._topk_fast(acc, k)
            if fast is not None:
                return fast
        mag = self.abs(acc)
        if k >= n:
            return self.nonzero(self.gt(mag, 0)), 0.0
        th = self.kth_largest(mag, k)
        th_f = float(th)
        if th_f == 0.0:                          # fewer than k nonzeros: take them all
            return self.nonzero(self.gt(mag, 0)), 0.0
        above = self.nonzero(self.gt(mag, th))
        need = k - self.numel(above)
        if need == 0:
            return above, th_f
        tied = self.nonzero(self.eq(mag, th))[:need]  # ascending index: lower index wins
        idx = self.concat([above, tied], like=acc)
        return self.sort(idx), th_f

    def _topk_fast(self, acc, k):
        """:meth:`topk` by a faster path with the same result (the kernels), or None: the generic one."""
        return None

    def add_runs_(self, dst, idx, vals, counts):
        """``dst[idx_s] += vals_s`` for the sources s = 0..P-1 in turn (``counts[s]`` pairs each, indexes unique
        within a source): the sums are the same on every rank whatever the order of the pairs within a source."""
        off = 0
        for c in counts:
            if c:
                dst = self.add_unique_(dst, idx[off:off + c], vals[off:off + c])
            off += c
        return dst

    def merge_add(self, idx, vals, counts, like=None):
        """``(sorted unique indexes, sums)`` of P runs of (index, value) pairs (``counts[s]`` pairs for source s,
        indexes unique within a source): every sum is ``0 + v_0 + v_1 + ...`` over the sources in rank order,
        the very additions of ``dst = 0; dst[idx_s] += vals_s for s = 0..P-1``, bit for bit. O(m log m) in the
        m pairs: the indexes are mapped to slots of their sorted distinct values (``like``: device)."""
        support, slot = self.unique_inverse(idx)
        zeros = self.zeros(self.numel(support), self.float32, like=like)
        return support, self.add_runs_(zeros, slot, vals, counts)

    def intersect(self, a, b):
        """The elements of the sorted unique int ``a`` that occur in the sorted unique ``b`` (exact, ascending)."""
        if self.numel(a) == 0 or self.numel(b) == 0:
            return a[:0]
        return self._intersect(a, b)

    def _intersect(self, a, b):
        """Binary search of ``a`` in ``b`` (both non-empty)."""
        pos = self.clamp_max(self.searchsorted(b, a), self.numel(b) - 1)
        return self.take(a, self.nonzero(self.eq(self.take(b, pos), a)))
