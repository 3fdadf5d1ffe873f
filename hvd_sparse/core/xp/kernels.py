"""The C kernels behind backend methods, for the numpy and torch backends.

Each method takes the kernel (:mod:`hvd_sparse.core.native`) when its buffers are numpy arrays or CPU torch
tensors of the kernel's dtype, 1-D and contiguous, and the kernel is built (``HVD_SPARSE_NATIVE`` not 0); else
the generic path of :class:`~hvd_sparse.core.xp.generic.GenericOps`. The results are the same bits either way
(``tests/core/test_native_select.py`` runs both).
"""

from __future__ import annotations

import numpy as np

from .. import native
from .fixed import compress, largest
from .generic import GenericOps, Scan

#: the most runs one kernel merge takes (:meth:`KernelOps.merge_add` merges more in chunks)
MERGE_RUNS = 256
#: :meth:`KernelOps.topk` takes the kernel from this many values on (below, a full selection is as quick)
TOPK_KERNEL_MIN = 1 << 16
#: values sampled (evenly strided) to place the kernel path's candidate threshold
TOPK_SAMPLE = 1 << 18


def first_within(count, limit, lo, hi):
    """The first rung j in [lo, hi] with ``count(j) <= limit``, else hi, for counts that do not rise with j:
    galloping from lo (lo, lo+1, lo+3, lo+7, ...), then halving the last step; few calls of ``count``."""
    if count(lo) <= limit or lo >= hi:
        return lo
    step, below = 1, lo                                 # count(below) > limit
    while below + step < hi and count(below + step) > limit:
        below, step = below + step, step * 2
    above = min(below + step, hi)                       # count(above) <= limit, or above == hi
    while above - below > 1:
        mid = (below + above) // 2
        below, above = (mid, above) if count(mid) > limit else (below, mid)
    return above


class KernelScan:
    """A :class:`~hvd_sparse.core.xp.generic.Scan` by the fused kernel: one read pass per call over the float32
    buffer, |x| compared on the fly (no copy, no mask)."""

    __slots__ = ("xp", "view")

    def __init__(self, xp, view):
        self.xp, self.view = xp, view

    def count(self, th, rule):
        return native.count(self.view, th, rule)

    def count_array(self, ths, rule):
        return self.xp.from_numpy(np.array(self.counts(ths, rule), np.int64))

    def counts(self, ths, rule, until=None):
        out = []
        for th in ths:                  # one read pass each: stop as soon as the caller knows enough
            out.append(native.count(self.view, th, rule))
            if until is not None and until(out[-1]):
                break
        return out

    def select(self, th, rule, *, base=0, values=False, expect=0):
        idx, vals = native.select(self.view, th, rule, base=base, values=values, expect=expect)
        return self.xp.from_numpy(idx), (None if vals is None else self.xp.from_numpy(vals))


class KernelOps(GenericOps):
    """Kernel-backed operations of the numpy and torch backends (``host(x)``: the numpy array of a CPU buffer,
    or None; ``from_numpy(a)``: a numpy result as the backend's array)."""

    def scan(self, x):
        """A scan by the fused kernel for a float32 CPU buffer, else the generic one."""
        view = native.f32_view(self, x)
        return Scan(self, x) if view is None else KernelScan(self, view)

    def _topk_fast(self, acc, k):
        """:meth:`GenericOps.topk` in one read pass of the fused kernel, for float32 CPU buffers (else None).

        1. a threshold ``lo`` a little below the k-th largest ``|acc|``, placed from an evenly strided sample (so
        that about 1.25k values reach it); 2. one pass selects the candidates ``|acc| >= lo`` with their values
        (ascending indexes); 3. the exact k-th largest magnitude of the candidates is the k-th largest of ``acc``,
        and the same rule as the generic path (everything above it, ties by the lower index) picks the result from
        them. A sample that places ``lo`` too high (fewer than k candidates) lowers it and selects again. Returns
        exactly what the generic path returns (indexes and threshold), or None when it cannot tell cheaply: a NaN
        anywhere (the candidates' pass collects the NaNs too), fewer than k nonzeros, small inputs. Many times
        faster than ``torch.topk`` on the CPU (measured: docs/benchmarks.md, "Measured choices in the code")."""
        n = self.numel(acc)
        if n < TOPK_KERNEL_MIN:
            return None
        view = native.f32_view(self, acc)
        if view is None:
            return None
        stride = max(1, n // TOPK_SAMPLE)
        sample = np.abs(view[::stride])
        s = sample.size
        expect = k * s / n
        want = min(s, int(1.25 * expect + 3.0 * expect ** 0.5 + 16))
        lo = float(np.partition(sample, s - want)[s - want])
        for _ in range(4):
            if not lo > 0.0:
                return None                                     # (nearly) all zeros: the generic path decides
            cand, vals = native.select(view, lo, "ge", values=True, expect=int(1.25 * k), nan=True)
            if np.isnan(vals).any():
                return None                                     # the generic path's order of NaNs
            if cand.size >= k:
                break
            lo /= 4.0
        else:
            return None
        mag = np.abs(vals)
        th = mag[np.argpartition(mag, mag.size - k)[mag.size - k]]
        if not th > 0:
            return None                                         # fewer than k nonzeros
        keep = mag > th
        need = k - int(np.count_nonzero(keep))
        if need:
            keep[np.flatnonzero(mag == th)[:need]] = True       # ties: the lower indexes
        return self.from_numpy(compress(keep, cand)[0]), float(th)

    def select_capped(self, x, ths, rule, cap, fill, *, base=0, guard=None, counts=0, tally=True, start=0):
        """:meth:`FixedOps.select_capped` by the fused kernel for a float32 CPU buffer: a rung's count is one read
        pass; the climb to the first rung that fits gallops (1, 2, 4, ... rungs, then halves), since the counts fall
        as the threshold rises; then one selecting pass (else the host implementation). ``counts``: those rungs
        are counted first, one pass each."""
        view = native.f32_view(self, x)
        if view is None:
            return super().select_capped(x, ths, rule, cap, fill, base=base, guard=guard, counts=counts, tally=tally,
                                         start=start)
        ths = [float(t) for t in self._np(ths)]
        seen = {j: native.count(view, ths[j], rule) for j in range(min(counts, len(ths)))}

        def count(j):
            if j not in seen:
                seen[j] = native.count(view, ths[j], rule)
            return seen[j]

        j = start
        if guard is not None and count(0) > guard[0]:       # the guard's climb: at least one rung, to its limit
            j = first_within(count, guard[1], 1, guard[2])
        j = first_within(count, cap, j, len(ths) - 1)        # then the capacity's
        if j > start and count(j) == 0:                     # ties: not to a rung that passes none
            j -= 1
        if count(j) > cap:                                  # past the ladder's top: the cap largest stay
            idx, vals = native.select(view, ths[j], rule, base=base, values=True, expect=count(j))
            idx = idx[largest(np.abs(vals), cap)]
        else:
            idx = native.select(view, ths[j], rule, base=base, expect=cap)[0]
        out = np.full(cap, fill, np.int64)
        out[:idx.size] = idx
        found = self.from_numpy(out), int(idx.size), j
        return (found + (self.asarray([seen[i] for i in range(min(counts, len(ths)))], self.index_dtype, like=x),)
                if counts else found)

    def accumulate_(self, r, pieces, out, *, zero_g=False, select=None):
        """``out[:] = r + concat(pieces)`` (``r`` None: ``out[:] = concat(pieces)``), cast to float32 (``out``), in
        one pass per piece; with ``zero_g`` the pieces are zeroed in the same pass (``out`` is none of them).

        ``select``: None, or ``(threshold, rule, expects)``: the same pass also collects the entries of ``out``
        that ``rule`` selects, piece by piece (``expects[j]``: the count expected in piece j, which sizes its
        output room).

        Returns ``(finite, found)``: ``finite`` is False when a sum is not finite, True when every piece took the
        kernel and all are, else None (the generic path cannot tell on the way); ``found`` the list of
        ``(indices, values)`` per piece (global int64 indices ascending, float32 values; numpy arrays), exactly
        ``scan(out).select(threshold, rule, values=True)`` of each piece, or None (not asked for, or a piece took
        the generic path)."""
        ov = native.f32_view(self, out)
        rv = None if r is None or ov is None else native.f32_view(self, r)
        bad, known, off = 0, True, 0
        found = [] if select is not None else None
        for j, p in enumerate(pieces):
            m = self.numel(p)
            pv = None if ov is None or (r is not None and rv is None) else native.f32_view(self, p)
            rp = None if rv is None else rv[off:off + m]
            if pv is not None and found is not None:    # one pass: the sum, its non-finite count and selection
                th, rule, expects = select
                b, idx, vals = native.add_select(rp, pv, ov[off:off + m], th, rule, base=off, expect=expects[j],
                                                 zero_g=zero_g)
                bad += b
                found.append((idx, vals))
            elif pv is not None:                        # one pass: the sum and its non-finite count
                bad += native.add(rp, pv, ov[off:off + m], zero_g=zero_g)
            else:                                       # the generic path
                whole = len(pieces) == 1                # (no views of one piece: a device pays for each)
                self.add_into(None if r is None else r if whole else r[off:off + m], p,
                              out if whole else out[off:off + m])
                if zero_g:
                    self.fill_(p, 0.0)
                known, found = False, None
            off += m
        return (False if bad else (True if known else None)), found

    def merge_add(self, idx, vals, counts, like=None):
        """:meth:`GenericOps.merge_add` in one merge pass when every source's indexes are ascending (as the
        reducers send them); beyond ``MERGE_RUNS`` sources the runs are merged in chunks, each starting from the
        sums so far as its first run (``0.0 + s`` is ``s`` bit for bit: a rank-order sum is never -0.0), so
        every sum is still ``0 + v_0 + v_1 + ...`` in rank order."""
        counts = list(counts)
        if len(counts) <= MERGE_RUNS:
            return self._merge_runs(idx, vals, counts, like)
        head = sum(counts[:MERGE_RUNS])
        where, sums = self._merge_runs(idx[:head], vals[:head], counts[:MERGE_RUNS], like)
        for s in range(MERGE_RUNS, len(counts), MERGE_RUNS - 1):
            part = counts[s:s + MERGE_RUNS - 1]
            end = head + sum(part)
            where, sums = self._merge_runs(self.concat([where, idx[head:end]], like=like),
                                           self.concat([sums, vals[head:end]], like=like),
                                           [self.numel(where)] + list(part), like)
            head = end
        return where, sums

    def _merge_runs(self, idx, vals, counts, like):
        iv, vv = native.i64_view(self, idx), native.f32_view(self, vals)
        if iv is not None and vv is not None:
            merged = native.merge_add(iv, vv, counts)
            if merged is not None:
                return self.from_numpy(merged[0]), self.from_numpy(merged[1])
        return GenericOps.merge_add(self, idx, vals, counts, like)

    def members(self, a, b, fill):
        """:meth:`FixedOps.members` by the merge kernel when ``a`` and ``b`` are on the host and ``b`` is ascending
        (Ok-Topk's gathered sums are: owners in rank order, each ascending, the padding last): one pass, no sort;
        else the host's sort and search."""
        av = native.i64_view(self, a)
        bn = self.host(b) if av is not None else None
        if bn is not None:
            kept = native.members(av, np.ascontiguousarray(np.ravel(bn), np.int64), fill)
            if kept is not None:
                return self.from_numpy(kept)
        return super().members(a, b, fill)

    def _intersect(self, a, b):
        """The merge kernel on int64 buffers; else one stable sort of the two runs on the host (O(|a| + |b|));
        else (CUDA) the binary search."""
        av, bv = native.i64_view(self, a), native.i64_view(self, b)
        if av is not None and bv is not None:
            both = native.intersect(av, bv)
            if both is not None:
                return self.from_numpy(both)
        an, bn = self.host(a), self.host(b)
        if an is None or bn is None:
            return GenericOps._intersect(self, a, b)
        c = np.concatenate([an, bn.astype(an.dtype, copy=False)])
        c.sort(kind="stable")
        return self.from_numpy(c[:-1][c[1:] == c[:-1]])
