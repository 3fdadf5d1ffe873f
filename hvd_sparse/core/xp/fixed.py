"""Selections of a fixed size: what a step puts into a message whose shape does not depend on the data.

A fixed-shape message (docs/algorithms.md#the-wire) carries a selection of at most ``size`` entries as exactly
``size`` indexes: the entries in ascending order, then a *sentinel* (``fill``, e.g. n, one past the last index) in
the unused slots. Computing such a selection needs no count on the host, so on a GPU nothing waits for the
device before the message goes out. The operations here all return padded arrays of a size the caller chose:

* :meth:`FixedOps.compact` -- the positions of a mask's True entries, padded (``torch.nonzero_static``);
* :meth:`FixedOps.topk_padded` -- the exact top-k of ``|x|`` (ties by the lower index, zeros never), padded;
* :meth:`FixedOps.ladder_counts` -- how many entries a thresholding rule selects at each rung of a ladder of
  thresholds, one read pass;
* :meth:`FixedOps.magnitude_counts` -- how many entries fall in each of a fixed set of bins of magnitude (four an
  octave), one read pass without a search;
* :meth:`FixedOps.select_capped` -- a thresholding rule's selection capped at a capacity: when more entries pass
  than fit, the threshold climbs a ladder until they fit, and past its top the largest magnitudes are kept;
* :meth:`FixedOps.members` -- the entries of one padded index set that occur in another, in place;
* :meth:`FixedOps.region_sums` -- the rank-order sums of P sources' (index, value) runs in a region.

The methods of this class are the *host* implementations (numpy arithmetic on the arrays' host copies; the numpy
and TensorFlow backends, CPU torch tensors); the torch backend overrides them for device tensors with operations
whose output sizes are known in advance (no host read), with the same bits (``tests/core/test_fixed.py``).

Thresholds. A rule (``ge``, ``gt``, ``ge_nonzero``, see :func:`~hvd_sparse.core.xp.generic.rule_mask`) compares
``|x|`` in float32 with a float64 threshold rounded to float32; :func:`lower_bounds` turns every (threshold, rule)
into one float32 bound ``u`` with "the rule selects ``|x|``" == ``|x| >= u`` (for every non-NaN ``|x|``), so that
one comparison, one sorted search and one count serve every rule.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

#: the bins of :meth:`FixedOps.magnitude_counts`: a float32's bits less the sign, shifted right by
#: :data:`MAGNITUDE_SHIFT` (its exponent and the first two bits of its mantissa)
MAGNITUDE_BINS = 1 << 10
MAGNITUDE_SHIFT = 21
#: the entries :meth:`FixedOps.norm_f64` squares at a time (float64: 512 KiB)
NORM_RUN = 1 << 16
#: the smallest positive float32: ``|x| > 0`` is ``|x| >= TINY``
TINY = float(np.nextafter(np.float32(0), np.float32(1)))


def lower_bounds(ths, rule):
    """float32 bounds ``u`` (numpy) with ``rule`` selects ``|x|`` at ``th`` == ``|x| >= u``, for each ``th``. Besides
    the thresholding rules, ``"above"``: ``|x| > th`` compared exactly (th a float64; Gaussiank's rule)."""
    t = np.asarray(ths, np.float64).astype(np.float32)
    if rule == "above":
        return np.where(t > np.asarray(ths, np.float64), t, np.nextafter(t, np.float32(np.inf)))
    if rule == "ge":
        return t
    if rule == "gt":
        return np.nextafter(t, np.float32(np.inf))
    if rule == "ge_nonzero":
        return np.where(t > 0, t, np.float32(TINY)).astype(np.float32)
    raise ValueError(f"hvd_sparse: rule must be one of ('ge_nonzero', 'gt', 'ge'), got {rule!r}")


def rung_counts(mag, bounds):
    """``[#(mag >= u) for u in bounds]`` (``bounds`` non-decreasing) in one sorted search: numpy int64."""
    rungs = np.searchsorted(bounds, mag, side="right")          # how many bounds each |x| reaches
    hist = np.bincount(rungs, minlength=len(bounds) + 1)
    return np.ascontiguousarray(np.cumsum(hist[::-1])[::-1][1:])


def run_rung_counts(mag, bounds, lengths):
    """:func:`rung_counts` of each run of ``mag`` (consecutive runs of ``lengths``): a (runs, bounds) int64 table in
    one sorted search."""
    runs, B = len(lengths), len(bounds)
    reached = np.searchsorted(bounds, mag, side="right") + (B + 1) * np.repeat(np.arange(runs), lengths)
    hist = np.bincount(reached, minlength=runs * (B + 1)).reshape(runs, B + 1)
    return np.cumsum(hist[:, ::-1], axis=1)[:, ::-1][:, 1:]


def compress(mask, *arrays):
    """``tuple(a[mask] for a in arrays)`` (numpy, 1-D) by positions: ``np.flatnonzero`` once, then a ``take`` per
    array. numpy's boolean indexing branches on every entry, and on a mask without long runs (a threshold's
    selection) it costs 3-5x as much: 2.7 ms per array against 0.6 ms once plus 0.3-0.6 ms per array for 330,000
    entries, about half of them kept (measured on one x86 core)."""
    pos = np.flatnonzero(mask)
    return tuple(a.take(pos) for a in arrays)


def largest(mag, cap):
    """Positions (ascending) of the ``cap`` largest entries of the magnitudes ``mag`` (numpy, non-negative; NaN and 0
    never), ties by the lower position: the exact top-``cap`` as :meth:`~GenericOps.topk` chooses it. How a
    selection that still exceeds its capacity is cut (:meth:`FixedOps.select_capped`): by magnitude, so an entry
    left out grows in the residual until it is among the largest, where a cut by position would leave out the
    same high positions step after step."""
    if mag.size <= cap:
        return np.flatnonzero(mag > 0)
    th = np.partition(mag, mag.size - cap)[mag.size - cap]      # the cap-th largest
    if not th > 0:
        return np.flatnonzero(mag > 0)                          # fewer than cap nonzero: all of them
    keep = mag > th
    need = cap - int(np.count_nonzero(keep))
    if need:
        keep[np.flatnonzero(mag == th)[:need]] = True           # ties: the lower positions
    return np.flatnonzero(keep)


def first_fit(counts, cap):
    """The first rung whose count is at most ``cap``, else the last one."""
    fit = np.flatnonzero(np.asarray(counts) <= cap)
    return int(fit[0]) if fit.size else len(counts) - 1


class FixedOps:
    """Fixed-size selections on the host (numpy arithmetic); mixed into every backend (module docstring)."""

    def _np(self, x):
        return np.asarray(x if isinstance(x, (list, tuple)) else self.to_numpy(x))

    @staticmethod
    def on_device(x):
        """Whether reading ``x`` on the host makes the host wait for a device (never, here)."""
        return False

    def norm_f64(self, pieces):
        """The L2 norm of the float32 values of ``pieces`` (1-D arrays) together, in float64: a Python float here.
        numpy's pairwise sums over runs of :data:`NORM_RUN` entries, added in order: the same bits on every backend
        of the host, whatever its threads."""
        total = 0.0
        for p in pieces:
            a = self.to_numpy(self.astype(p, self.float32)).reshape(-1)
            for lo in range(0, a.size, NORM_RUN):
                run = a[lo:lo + NORM_RUN].astype(np.float64)
                total += float(np.square(run, out=run).sum())
        return math.sqrt(total)

    def item(self, x):
        """``x`` as a Python number (a host read on a device)."""
        return x if isinstance(x, (bool, int, float)) else np.asarray(self.to_numpy(x)).item()

    def nonfinite(self, x):
        """Whether ``x`` holds a NaN or Inf: a host bool here; on a device a device word that the opening's header
        carries (``core/comm.py``), where a read would wait."""
        return not self.all_finite(x)

    def stack(self, xs, axis=0):
        """The arrays ``xs`` (of one shape) stacked along a new ``axis``."""
        return self.asarray(np.stack([self._np(x) for x in xs], axis=axis), self.dtype_of(xs[0]), like=xs[0])

    def transpose(self, x):
        """The 2-D ``x`` transposed."""
        return self.asarray(self._np(x).T, self.dtype_of(x), like=x)

    def count_below(self, x, bound):
        """How many entries of ``x`` are below ``bound`` (the real entries of a padded selection)."""
        return int(np.count_nonzero(self._np(x) < bound))

    @staticmethod
    def choose(cond, a, b):
        """``a`` where ``cond`` else ``b``, for scalars that may live on a device (there: without a read)."""
        return a if cond else b

    def first_fit(self, counts, cap, start=0):
        """The first position from ``start`` on whose count is at most ``cap``, else the last (an int here, a
        device value on a device)."""
        return start + first_fit(self._np(counts)[start:], cap)

    def pick(self, values, j):
        """``values[j]`` for a position that may live on a device."""
        return values[int(j)] if isinstance(values, (list, tuple)) else self._np(values)[int(j)]

    def first_unless(self, idx, fill, value):
        """``(idx, empty)``: ``idx`` (a selection padded with ``fill``) with ``value`` as its first entry when it is
        empty (its first entry is ``fill``), and whether it was."""
        out = self._np(idx)
        if out.size and out[0] == fill:
            out = out.copy()
            out[0] = value
            return self.asarray(out, self.index_dtype, like=idx), True
        return idx, False

    @staticmethod
    def at_least_one(count):
        """``max(count, 1)`` of a count that may live on a device."""
        return max(int(count), 1)

    def to_list(self, x):
        """``x`` as (nested) Python lists: a host read."""
        return self._np(x).tolist()

    @staticmethod
    def unbind(rows):
        """The rows of a 2-D array, in order."""
        return list(rows)

    @staticmethod
    def columns(rows, start, length):
        """``rows[:, start:start + length]`` (a view where the array type has them)."""
        return rows[:, start:start + length]

    def choose_each(self, cond, a, b):
        """``a`` where ``cond`` else ``b``, elementwise (``a`` or ``b`` may be scalars)."""
        return self.asarray(np.where(self._np(cond), a if np.isscalar(a) else self._np(a),
                                     b if np.isscalar(b) else self._np(b)), self.index_dtype, like=cond)

    def masked(self, x, mask):
        """``x`` where ``mask``, else 0."""
        return self.asarray(np.where(self._np(mask), self._np(x), 0), self.dtype_of(x), like=x)

    def smallest_magnitude(self, x):
        """The smallest nonzero ``|x|`` (inf when every entry is 0)."""
        mag = np.abs(self._np(x))
        mag = mag[mag > 0]
        return float(mag.min()) if mag.size else float("inf")

    def div(self, x, y):
        """``x / y`` elementwise (float32; a zero in ``y`` gives inf or NaN, as IEEE says)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.asarray(self._np(x) / self._np(y), self.float32, like=x)

    def repeat(self, values, counts, total):
        """``values[j]`` repeated ``counts[j]`` times (host ints summing to ``total``), on ``values``' device."""
        return self.asarray(np.repeat(self._np(values), counts), self.dtype_of(values), like=values)

    def segment_counts(self, bounds):
        """How many entries lie between consecutive ``bounds`` (positions from a sorted search): a list of ints
        here, a device array on a device."""
        return np.diff(self._np(bounds)).tolist()

    def compact(self, mask, size, fill):
        """int64 positions of the True entries of the 1-D ``mask``, ascending, the first ``size`` of them, padded
        with ``fill`` to exactly ``size`` entries."""
        pos = np.flatnonzero(self._np(mask))[:size]
        out = np.full(size, fill, np.int64)
        out[:pos.size] = pos
        return self.asarray(out, self.index_dtype, like=mask)

    def largest_in_runs(self, x, lengths, caps, fill):
        """Positions (ascending) of the entries of ``x`` each run keeps, padded with ``fill`` to the length of ``x``:
        run j (``lengths[j]`` consecutive entries, host ints) keeps its ``caps[j]`` largest magnitudes, ties by the
        lower position (a stable sort by run, then by descending magnitude)."""
        mag, lengths = np.abs(self._np(x)), np.asarray(lengths, np.int64)
        order = np.lexsort((-mag, np.repeat(np.arange(lengths.size), lengths)))     # by run, the largest first
        rank = np.arange(mag.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)    # the place in its run
        keep = np.zeros(mag.size, bool)
        keep[order] = rank < np.repeat(np.asarray(caps, np.int64), lengths)
        out = np.full(mag.size, fill, np.int64)
        kept = np.flatnonzero(keep)
        out[:kept.size] = kept
        return self.asarray(out, self.index_dtype, like=x)

    def topk_padded(self, x, k):
        """``(indexes, threshold, count)``: :meth:`topk`'s exact top-k of ``|x|`` (ascending, ties by the lower
        index, zeros never; fewer than k when fewer are nonzero) padded with ``numel(x)`` to exactly k entries, the
        k-th largest magnitude (0.0 when fewer than k are nonzero) and how many indexes are real."""
        n = self.numel(x)
        idx, th = self.topk(x, min(k, n)) if n else (self.zeros(0, self.index_dtype, like=x), 0.0)
        count = self.numel(idx)
        if k > count:
            idx = self.concat([idx, self.full(k - count, n, self.index_dtype, like=x)], like=x)
        return idx, th, count

    def floor32(self, ths):
        """The largest float32 at most each threshold of ``ths`` (>= 0), as float64: ``|x| > floor32(t)`` is
        ``|x| > t`` exactly for float32 ``x``."""
        t = np.maximum(np.asarray(self._np(ths), np.float64), 0.0)
        f = t.astype(np.float32)
        return np.where(f > t, np.nextafter(f, np.float32(-np.inf)), f).astype(np.float64).tolist()

    def mean_std_values(self, x):
        """:meth:`mean_std` (float64 mean and unbiased std) as values that may stay on a device."""
        return self.mean_std(x)

    def clamp_min(self, x, low):
        """``max(x, low)`` elementwise (a list of floats here, an array on a device)."""
        return [max(float(v), low) for v in self._np(x)]

    def read(self, *values):
        """Host copies (numpy float64) of ``values`` (numbers, 0-d or 1-d arrays), in one transfer on a device:
        counts and thresholds that a controller needs on the host, read together."""
        return [np.atleast_1d(np.asarray(self._np(v) if not isinstance(v, (int, float)) else v, np.float64))
                for v in values]

    def ladder(self, th, factors, like):
        """The thresholds ``th·f`` for the ``factors`` (float64): a list of floats for a host ``th``, an array on
        ``like``'s device for a device one."""
        return [float(th) * f for f in factors]

    def ladder_counts(self, x, ths, rule):
        """How many entries ``rule`` selects from ``|x|`` at each threshold of the ascending ``ths`` (non-negative;
        :meth:`ladder`): an int64 array of the backend, on ``x``'s device."""
        bounds = lower_bounds(self._np(ths), rule)
        return self.asarray(rung_counts(np.abs(self._np(x)), bounds), self.index_dtype, like=x)

    def magnitude_counts(self, x):
        """How many entries of the float32 ``x`` fall in each of the :data:`MAGNITUDE_BINS` bins of ``|x|``: bin j
        holds the magnitudes whose float32 bits, less the sign, shifted right by :data:`MAGNITUDE_SHIFT`, are j -- from
        2^e·(1 + m/4) up to the next such value, four bins an octave, ascending (NaN and Inf in the last bins). An
        int64 array of the backend, on ``x``'s device: one pass, no search (a sorted search over as many rungs costs
        twenty times more on the CPU)."""
        bits = np.ascontiguousarray(self._np(x), np.float32).view(np.uint32)
        keys = (bits & np.uint32(0x7FFFFFFF)) >> np.uint32(MAGNITUDE_SHIFT)
        return self.asarray(np.bincount(keys, minlength=MAGNITUDE_BINS), self.index_dtype, like=x)

    def select_capped(self, x, ths, rule, cap, fill, *, base=0, guard=None, counts=0, tally=True, start=0):
        """``(indexes, count, rung)``: the entries ``rule`` selects from ``|x|`` at the first threshold of the
        ascending ``ths`` (:meth:`ladder`) from rung ``start`` on, at most ``cap`` of them. When more pass, the
        threshold climbs the ladder until at most ``cap`` pass; past its last rung, or where the next rung would pass
        none (ties), the ``cap`` largest magnitudes of the last rung from ``start`` that passes any (:func:`largest`;
        ``count`` then says how many were kept). Either way the largest magnitudes stay. ``guard``: None, or
        ``(trigger, limit, most)``: when more than ``trigger`` pass at the first rung,
        the threshold first climbs to the first rung from 1 on (at most rung ``most``) where at most ``limit`` pass
        (ThresholdReuse's guard). ``indexes``: ascending, plus ``base``, padded with ``fill`` to exactly ``cap``;
        ``count``: how many are real; ``rung``: the position in ``ths`` of the threshold used (:meth:`pick` it).
        ``counts``: also return how many pass at each of the first ``counts`` rungs (a fourth value). ``tally``:
        False when the caller does not need ``count`` (a device then spares its operations; it may be None)."""
        mag = np.abs(self._np(x))
        ths = [float(t) for t in self._np(ths)]
        bounds = lower_bounds(ths, rule)
        passing = rung_counts(mag, bounds) if len(ths) > 1 else [int(np.count_nonzero(mag >= bounds[0]))]
        j = max(start, first_fit(passing, cap))
        if guard is not None and passing[0] > guard[0]:
            j = max(j, min(guard[2], 1 + first_fit(passing[1:guard[2] + 1], guard[1])))
        j = min(j, max(start, int(np.count_nonzero(np.asarray(passing) > 0)) - 1))    # not past the last nonempty
        pos = np.flatnonzero(mag >= bounds[j])
        if pos.size > cap:                                      # still too many: the cap largest stay
            pos = pos[largest(mag[pos], cap)]
        out = np.full(cap, fill, np.int64)
        out[:pos.size] = pos + base
        found = self.asarray(out, self.index_dtype, like=x), int(pos.size), j
        return found + (self.asarray(passing[:counts], self.index_dtype, like=x),) if counts else found

    def select_at(self, x, th, rule, cap, fill, count):
        """The entries (ascending) ``rule`` selects from ``|x|`` at the host threshold ``th``, padded with ``fill``,
        the ``cap`` largest of them when more pass: :meth:`select_capped` at one rung, for a caller that knows
        ``count``, how many pass (a device then cuts only where they exceed ``cap``)."""
        return self.select_capped(x, [th], rule, cap, fill, tally=False)[0]

    def keep(self, idx, vals, th, rule, fill):
        """``(indexes, values)``: the pairs whose value ``rule`` selects at ``th``, in their order, then the padding
        (``fill``, 0.0), as long as ``idx`` (1-D here: compacted, by the backend's scan, so one kernel pass on a
        float32 CPU buffer; on a device the others are replaced where they are, in the shape of ``idx``, and
        nothing is compacted)."""
        m = self.numel(idx)
        pos, kept_v = self.scan(self.reshape(vals, (m,))).select(th, rule, values=True)
        kept_i = self.astype(self.take(self.reshape(idx, (m,)), pos), self.index_dtype)
        pad = m - self.numel(pos)
        return (self.concat([kept_i, self.full(pad, fill, self.index_dtype, like=kept_i)], like=kept_i),
                self.concat([kept_v, self.zeros(pad, self.float32, like=kept_v)], like=kept_v))

    def members(self, a, b, fill):
        """``a`` (ascending indexes, ``fill`` in its unused slots) with the entries that are not in ``b`` (indexes,
        in any order and shape, with ``fill`` for padding: :meth:`keep`'s) replaced by ``fill``: the same length
        as ``a``."""
        an, bn = self._np(a), np.sort(self._np(b).ravel())
        if bn.size == 0:
            hit = np.zeros(an.size, bool)
        else:
            pos = np.minimum(np.searchsorted(bn, an), bn.size - 1)
            hit = (bn[pos] == an) & (an != fill)
        return self.asarray(np.where(hit, an, fill), self.index_dtype, like=a)

    def region_sums(self, idx, vals, pieces, lo, hi, fill):
        """The sums over sources of (index, value) pairs in a region [lo, hi), as a :class:`RegionSums`. ``idx`` and
        ``vals`` are runs, one after the other: ``pieces`` gives each run's length and whether it is real (a source's
        pairs, ascending, unique) or padding (skipped); the sources are added in rank order (``0 + v_0 + v_1 + ...``,
        :meth:`merge_add`'s additions). Here the sums are on the support (the distinct indexes); a device keeps a dense
        buffer of the region instead (no sort, no count of the support), with the same selections from it."""
        iv, vv = self._np(idx), self._np(vals)
        ends = np.cumsum([m for m, _ in pieces], dtype=np.int64).tolist()
        runs = [slice(end - m, end) for end, (m, real) in zip(ends, pieces) if real]    # slices: no mask to read
        iv, vv = (np.concatenate([a[run] for run in runs]) if runs else a[:0] for a in (iv, vv))
        support, sums = self.merge_add(self.asarray(iv, self.index_dtype, like=idx),
                                       self.asarray(vv, self.float32, like=vals),
                                       [m for m, real in pieces if real], like=vals)
        return RegionSums(sums, support, lo, fill, None)


class RegionSums(NamedTuple):
    """A region's sums (:meth:`FixedOps.region_sums`): ``values`` to select from by position, and the global index
    of each position: ``index[pos]`` (the support), or with ``index`` None ``lo + pos`` (a dense region, whose
    ``padded`` buffer holds ``values`` and a zero after them)."""

    values: object
    index: object
    lo: int
    fill: int
    padded: object

    def pairs(self, xp, pos):
        """The (global index, value) pairs at the positions ``pos`` (padded with ``numel(values)``: index ``fill``,
        value 0)."""
        m = xp.numel(self.values)
        if self.index is None:
            return xp.choose_each(xp.eq(pos, m), self.fill, xp.add(pos, self.lo)), xp.take(self.padded, pos)
        vals = xp.take(xp.concat([self.values, xp.zeros(1, xp.float32, like=self.values)], like=self.values), pos)
        idx = xp.take(xp.concat([xp.astype(self.index, xp.index_dtype),
                                 xp.full(1, self.fill, xp.index_dtype, like=pos)], like=pos), pos)
        return idx, vals
