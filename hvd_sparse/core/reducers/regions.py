"""Ok-Topk's region boundaries from data every rank holds identically (no communication, O(P)).

Ok-Topk's owner r reduces what the ranks selected in its region [o_r, o_{r+1}) of the index space; the
split phase's volume is balanced only while every region receives about the same number of pairs. The
paper recomputes the boundaries every τ steps with one allreduce and the selection drifts in between. The
functions here place the boundaries from what every rank holds identically: after a step, the global result G
(``result_boundaries``) or the loads the owners report in the step's count collective (``load_boundaries``,
``smoothed_load_boundaries``: an exponential average of the load CDFs); before the split, the step's own load,
counted in bins and summed by one allreduce (``measure_load``, ``measured_boundaries``). All are pure functions
of identical inputs: identical boundaries on every rank. ``repartition`` is the paper's own rule (one allreduce).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..comm import SUM


def repartition(xp, idx, n, comm):
    """The paper's repartition (one allreduce, phase ``boundaries``): each rank proposes the boundaries that split
    its sorted selection ``idx`` evenly, and o_j is the mean of the proposals. Returns [0, o_1, ..., o_{P-1}, n]."""
    P = comm.size
    if P == 1:
        return [0, n]
    c = xp.numel(idx) // P
    if c >= 1:       # this rank's balanced boundaries
        prop = xp.take(idx, xp.asarray([j * c for j in range(1, P)], xp.index_dtype, like=idx))
    else:            # library fallback (ref: c = 0 -> idx[0]; m = 0 -> crash)
        prop = xp.asarray([(j * n) // P for j in range(1, P)], xp.index_dtype, like=idx)
    total = comm.allreduce(prop, SUM, "boundaries")            # int64: no overflow
    return [0] + [int(b) // P for b in xp.to_numpy(total)] + [n]


def region_split(xp, idx, offsets):
    """Split the sorted global indexes ``idx`` by regions ``offsets`` (o_0..o_P, non-decreasing).

    Returns ``(splits, rel)``: ``splits[j] = |idx ∩ [o_j, o_{j+1})|`` (Python ints) and the region-relative
    indexes ``rel = idx - o_{region(idx)}`` (int64), in the order of ``idx`` (= grouped by region)."""
    P = len(offsets) - 1
    bounds = xp.asarray(offsets, xp.index_dtype, like=idx)
    pos = [int(p) for p in xp.to_numpy(xp.searchsorted(idx, bounds))]
    splits = [pos[j + 1] - pos[j] for j in range(P)]
    if xp.numel(idx) == 0:
        return splits, idx
    region = xp.searchsorted(bounds[1:P], idx, right=True)     # j with o_j <= x < o_{j+1}
    return splits, idx - xp.take(bounds, region)


def _non_decreasing(out, n):
    """``out`` (boundaries 0 = o_0 .. o_last = n) made non-decreasing inside [0, n], in place; returns it."""
    for i in range(1, len(out) - 1):
        out[i] = min(n, max(out[i - 1], out[i]))
    return out


def _positions(xp, g_idx, offsets):
    """Where each boundary of ``offsets`` falls in the sorted global result ``g_idx`` (Python ints)."""
    return [int(p) for p in xp.to_numpy(xp.searchsorted(g_idx, xp.asarray(offsets, xp.index_dtype, like=g_idx)))]


def result_boundaries(xp, g_idx, P, n):
    """Region boundaries o_0..o_P that split the sorted global result ``g_idx`` into P equal parts:
    ``o_j = g_idx[floor(j·m/P)]`` (m = |G|), or None when m < P (too few points to place P-1 boundaries).

    Every rank holds the same G after a step, so these boundaries cost no communication and are identical on
    all ranks. O(P): P-1 reads of G."""
    m = xp.numel(g_idx)
    if P == 1 or m < P:
        return None
    pos = xp.asarray([(j * m) // P for j in range(1, P)], xp.index_dtype, like=g_idx)
    return [0] + [int(b) for b in xp.to_numpy(xp.take(g_idx, pos))] + [n]


def load_boundaries(offsets, loads, g_pos=None, g_at=None):
    """Region boundaries that split the measured load evenly. Region j = [o_j, o_{j+1}) received
    ``loads[j]`` pairs; the new o_i is where the cumulative load reaches i·W/P (W = sum of the loads).
    Inside a region the load is taken as spread like the global result G (``g_pos[j]``: index in G of the
    first point of region j, ``g_at(list of positions)``: those points of G), or uniformly over the region
    when G has no point in it. Integer arithmetic on values every rank holds: identical everywhere, O(P).
    Returns None when nothing was received (W = 0)."""
    P = len(loads)
    W = sum(loads)
    if P == 1 or W == 0:
        return None
    out, j, cum = [0], 0, 0                 # cum = load of regions 0..j-1
    picks = {}                              # boundary i -> position in G
    for i in range(1, P):
        q = i * W                           # target cumulative load, scaled by P
        while j < P - 1 and (cum + loads[j]) * P <= q:
            cum += loads[j]
            j += 1
        lo, hi = offsets[j], offsets[j + 1]
        num, den = q - cum * P, max(1, loads[j] * P)
        cnt = 0 if g_pos is None else g_pos[j + 1] - g_pos[j]
        if cnt:
            picks[i] = g_pos[j] + min(cnt - 1, (num * cnt) // den)
            out.append(None)
        else:
            out.append(lo + (num * (hi - lo)) // den)
    if picks:
        vals = g_at(list(picks.values()))
        for i, v in zip(picks, vals):
            out[i] = v
    out.append(offsets[-1])
    return _non_decreasing(out, offsets[-1])


#: The smoothed load CDF reads at most this many points of G per region on average (every s-th point of G
#: beyond): its cost per step is O(P), whatever k is, and below it (k <= 1024·P) every point is used.
CDF_POINTS_PER_REGION = 1024


def load_cdf(offsets, loads, g):
    """This step's load CDF (points xs, values Fs, float64 arrays normalized to 1), piecewise linear: region j's
    load spread like the global result G (``g``, sorted integers) inside it: F(g_m) = C_j + L_j·m/c_j at its
    c_j points of G (m = 0..c_j-1), uniform over the region when it holds no point of G. O(P + |G|)."""
    g = np.asarray(g, dtype=np.int64)
    off = np.asarray(offsets, dtype=np.int64)
    L = np.asarray(loads, dtype=np.int64)
    P, W = len(L), int(L.sum())
    pos = np.searchsorted(g, off, side="left")
    cum = np.concatenate(([0], np.cumsum(L)))                   # load of regions 0..j-1
    counts = np.diff(pos)
    r = np.repeat(np.arange(P), counts)                         # region of each point of G
    i = np.arange(len(g))
    m, c = i - pos[r], counts[r]
    xs = np.empty(1 + len(g) + P, np.float64)
    Fs = np.empty_like(xs)
    xs[0], Fs[0] = float(off[0]), 0.0
    at = 1 + i + r                                              # each region: its points, then its end
    xs[at] = g
    Fs[at] = (cum[r] + (L[r] * m) / c) / W
    ends = 1 + pos[1:] + np.arange(P)
    xs[ends] = off[1:]
    Fs[ends] = cum[1:] / W
    return xs, Fs


def _cdf(xs, Fs, x):
    """The piecewise-linear CDF (xs, Fs) at every point of ``x``."""
    j = np.searchsorted(xs, x, side="right") - 1
    out = np.where(j < 0, 0.0, Fs[-1])
    mid = (j >= 0) & (j < len(xs) - 1)
    jm, xm = j[mid], x[mid]
    out[mid] = Fs[jm] + (Fs[jm + 1] - Fs[jm]) * (xm - xs[jm]) / (xs[jm + 1] - xs[jm])
    return out


def _inverse(xs, Fs, y):
    """Where the non-decreasing piecewise-linear CDF (xs, Fs) reaches every level of ``y``."""
    j = np.searchsorted(Fs, y, side="left")
    out = np.where(j <= 0, xs[0], xs[-1])
    mid = (j > 0) & (j < len(Fs))
    jm, ym = j[mid], y[mid]
    d = Fs[jm] - Fs[jm - 1]
    frac = np.divide(ym - Fs[jm - 1], d, out=np.ones_like(d), where=d > 0)
    out[mid] = xs[jm - 1] + (xs[jm] - xs[jm - 1]) * frac
    return out


def smoothed_load_boundaries(offsets, loads, g, prev, beta, M):
    """Region boundaries from an exponential average of the measured load CDFs over steps: ``prev`` (the
    average so far, as M+1 points x_0..x_M with CDF j/M, or None) is blended as beta·prev + (1-beta)·this
    step's CDF (``load_cdf``; G thinned to every s-th point beyond ``CDF_POINTS_PER_REGION``·P points) and
    resampled at M+1 quantiles; boundary i is the average's quantile i/P. Returns (boundaries, new state), or
    (None, prev) when nothing was received. Elementwise float64 operations on identical inputs: identical on
    every rank. O(P) numpy work per step (O((M + |G|) log) below the thinning)."""
    P, W = len(loads), sum(loads)
    if P == 1 or W == 0:
        return None, prev
    g = np.asarray(g, dtype=np.int64)
    cap = CDF_POINTS_PER_REGION * P
    if len(g) > cap:
        g = g[::-(-len(g) // cap)]
    xs, Fs = load_cdf(offsets, loads, g)
    if prev is not None:
        pv = np.asarray(prev, np.float64)
        grid = np.sort(np.concatenate((xs, pv)), kind="stable")
        grid = grid[np.append(True, grid[1:] != grid[:-1])]
        H = beta * _cdf(pv, np.arange(M + 1) / M, grid) + (1 - beta) * _cdf(xs, Fs, grid)
        xs, Fs = grid, np.maximum.accumulate(H)
    state = _inverse(xs, Fs, np.arange(M + 1) / M).tolist()
    n = offsets[-1]
    out = [0] + [int(round(state[(i * M) // P])) for i in range(1, P)] + [n]
    return _non_decreasing(out, n), state


#: ``measured`` boundaries: histogram bins per region (the forecast keeps 2 points per bin)
BINS_PER_REGION = 2


def histogram_edges(forecast, P, n):
    """The bins of the step's load histogram: every second point of the forecast (the ``CDF`` quantiles the
    smoothed average keeps, 2·``BINS_PER_REGION``·P + 1 of them), rounded to integers, non-decreasing inside
    [0, n]; equal-width bins when there is no forecast yet. Returns ``BINS_PER_REGION``·P + 1 integers."""
    M = BINS_PER_REGION * P
    if forecast is None or len(forecast) != 2 * M + 1:
        return [(b * n) // M for b in range(M + 1)]
    return _non_decreasing([0] + [int(round(x)) for x in forecast[2:2 * M:2]] + [n], n)


def measure_load(xp, idx, forecast, n, comm, like):
    """This step's load before the split, the one collective of ``measured`` boundaries: every rank counts
    its selection (sorted global indexes ``idx``) in the bins of ``histogram_edges`` and an allreduce
    (phase ``histogram``, ``BINS_PER_REGION``·P int64) sums the counts. Returns (edges, summed counts)."""
    edges = histogram_edges(forecast, comm.size, n)
    pos = xp.searchsorted(idx, xp.asarray(edges, xp.index_dtype, like=idx))     # on the device: no read
    mine = xp.astype(pos[1:] - pos[:-1], xp.index_dtype)
    return edges, [int(h) for h in xp.to_numpy(comm.allreduce(mine, SUM, "histogram"))]


#: ``refine_load`` counts again the bins that hold more than 1/REFINE_ABOVE of a region's share of the load, in
#: sub-bins of about 1/REFINE_SUB of a share (a boundary inside a bin misplaces at most that bin's load)
REFINE_ABOVE, REFINE_SUB = 1, 4


def refine_load(xp, idx, edges, hist, comm, like):
    """Where the step's histogram is too coarse, count again. A bin that holds more than a region's share of the
    load (W/P, W: the total) says the forecast that placed the bins was wrong, as on the step after a
    repartition, and a boundary inside it can misplace up to that bin's load h. Each such bin is cut into
    ceil(4·P·h/W) equal sub-bins of about a quarter share, and one more allreduce (phase ``refine``, one int64
    per sub-bin: fewer than 4P + P of them, since fewer than P bins can each hold more than W/P) sums the ranks'
    counts of their selection (sorted global indexes ``idx``) in them. No bin that heavy: no collective (decided
    on the summed histogram, the same on every rank). Returns the refined (edges, counts), the other bins as they
    were."""
    P, W = comm.size, sum(hist)
    cuts = {}
    for b, h in enumerate(hist):
        lo, hi = edges[b], edges[b + 1]
        if h * P * REFINE_ABOVE > W and hi - lo > 1:
            s = min(hi - lo, -(-REFINE_SUB * P * h // W))
            cuts[b] = [lo + (j * (hi - lo)) // s for j in range(s + 1)]
    if not cuts:
        return edges, hist
    pos, mine, at = _positions(xp, idx, [e for c in cuts.values() for e in c]), [], 0
    for c in cuts.values():
        mine += np.diff(pos[at:at + len(c)]).tolist()
        at += len(c)
    sums = iter(int(v) for v in xp.to_numpy(comm.allreduce(xp.asarray(mine, xp.index_dtype, like=like), SUM,
                                                            "refine")))
    out_e, out_h = [], []
    for b, h in enumerate(hist):
        c = cuts.get(b, edges[b:b + 2])
        out_e += c[:-1]
        out_h += [next(sums) for _ in c[1:]] if b in cuts else [h]
    return out_e + [edges[-1]], out_h


def measured_boundaries(edges, hist, forecast, n, P=None):
    """Region boundaries that split this step's measured load evenly: bin b = [edges[b], edges[b+1]) holds
    ``hist[b]`` selected entries summed over the ranks (allreduced before the split, so exact at the edges);
    inside a bin the load is taken as spread like the forecast, whose middle point halves it. ``P``: the number of
    regions (by default the bins' count / ``BINS_PER_REGION``; ``refine_load``'s bins are more). Float64
    elementwise work on identical inputs: identical on every rank, O(P). None when nothing was selected."""
    P = P or (len(edges) - 1) // BINS_PER_REGION
    if P == 1 or sum(hist) == 0:
        return None
    shape = np.asarray(edges if forecast is None else np.rint(np.asarray(forecast, np.float64)), np.int64)
    xs, Fs = load_cdf(edges, hist, np.unique(shape[(shape >= 0) & (shape < n)]))
    return _non_decreasing([0] + [int(round(x)) for x in _inverse(xs, Fs, np.arange(1, P) / P)] + [n], n)


def next_boundaries(policy, xp, g_idx, offsets, loads, n, state, tolerance, beta, measured=None):
    """The boundaries of Ok-Topk's next step under ``policy``, or None to keep ``offsets``: from this step's
    result G (``result``) or from the split loads every owner reported (``load``, and ``measured`` on steps
    without a histogram); only when the step's imbalance exceeded ``tolerance``. ``measured`` (the step's
    histogram: edges, counts) only updates the forecast (``state["cdf"]``, average β = ``beta``) that bins
    the next histogram. Identical inputs on every rank: identical boundaries. O(P log k)."""
    P = len(offsets) - 1
    if measured is not None:
        state["cdf"] = smoothed_load_boundaries(measured[0], measured[1], xp.to_numpy(g_idx), state.get("cdf"),
                                                beta, 2 * BINS_PER_REGION * P)[1]
        return None
    if policy in ("load", "measured"):
        if loads is None or max(loads) * P <= tolerance * sum(loads):
            return None
        if beta:                                                    # O(P) numpy work, the average in state
            out, state["cdf"] = smoothed_load_boundaries(offsets, loads, xp.to_numpy(g_idx), state.get("cdf"),
                                                         beta, 2 * BINS_PER_REGION * P)
            return out
        return load_boundaries(offsets, loads, _positions(xp, g_idx, offsets), lambda pos: [int(v) for v in xp.to_numpy(
            xp.take(g_idx, xp.asarray(pos, xp.index_dtype, like=g_idx)))])
    m = xp.numel(g_idx)
    if m:
        pos = _positions(xp, g_idx, offsets)
        if max(pos[j + 1] - pos[j] for j in range(P)) * P <= tolerance * m:
            return None
    return result_boundaries(xp, g_idx, P, n)


@dataclasses.dataclass(frozen=True)
class Regions:
    """Ok-Topk's region policy, built from :class:`~hvd_sparse.core.reducers.oktopk.OkTopk`'s options: ``rule`` its
    ``boundaries``, ``period`` its ``repartition_period``, ``tolerance`` its ``boundary_tolerance``, ``smoothing``
    its ``load_smoothing``. The rules:

    * ``"periodic"`` (the paper): the allreduce repartition every ``period`` steps only; the selection drifts in
      between (a region received 2.3x its share at P = 256 within 40 steps).
    * ``"result"``: the P quantiles of the step's global result G (no communication; G is more concentrated than
      the selections, so the split stays uneven).
    * ``"load"``: the pairs each region received ride in the step's count collective (+1 word per owner in the
      allgather, +P per rank in the ladder's allreduce) and the next boundaries split this load evenly.
    * ``"measured"`` (the ``Compression.oktopk`` preset): before the split, one allreduce (phase ``histogram``, 2P
      int64) sums the ranks' counts in 2 bins per region and the step's boundaries split this, its own load, evenly
      (a forecast is poor at ~10 entries per region: a step clears the entries that carried the last one's load).

    ``result`` and ``load`` recompute when the last step's imbalance exceeds ``tolerance``; ``load`` and
    ``measured``'s bins follow an exponential average of the load CDFs (``smoothing`` = β,
    :func:`smoothed_load_boundaries`: the hot entries a step clears move the load elsewhere, and the last step alone
    forecasts the next poorly). With all three the allreduce repartition runs only on the first step (and after a
    change of P or n).

    Two calls per step, on a step record ``s`` (P, n, t, the few-collectives flag; the regions and what follows
    them are written into it): :meth:`plan` before the split, :meth:`follow` once the result G is known."""

    rule: str
    period: int
    tolerance: float
    smoothing: float

    def plan(self, xp, acc, idx, comm, state, s):
        """The regions of this step (``s.offsets``): the paper's repartition (one allreduce) every ``period`` steps
        (``periodic``) or, for the others, to start; with ``measured``, the step's own load counted before the split
        (histogram, and the refine of its heavy bins) and split evenly. ``s.with_load``: whether the owners' split
        loads ride in the step's count collective (``load``, and ``measured`` without a histogram)."""
        s.repart = s.offsets is None or (self.rule == "periodic" and s.t % self.period == 0)
        if s.repart:
            s.offsets = repartition(xp, idx, s.n, comm)
        elif self.rule == "measured" and not s.few and s.P > 1:
            s.edges, s.hist = refine_load(xp, idx, *measure_load(xp, idx, state.get("cdf"), s.n, comm, acc), comm,
                                          acc)
            s.offsets = measured_boundaries(s.edges, s.hist, state.get("cdf"), s.n, s.P) or s.offsets
        s.with_load = s.P > 1 and s.hist is None and self.rule in ("load", "measured")

    def follow(self, xp, state, s):
        """The next step's boundaries from this step's (:func:`next_boundaries`), or None to keep ``s.offsets``
        (``periodic``, P = 1, or an imbalance within ``tolerance``)."""
        if self.rule == "periodic" or s.P == 1:
            return None
        return next_boundaries(self.rule, xp, s.g_idx, s.offsets, s.loads, s.n, state, self.tolerance,
                               self.smoothing, s.hist and (s.edges, s.hist))
