"""Ok-Topk's region boundaries from data every rank holds identically (no collective of their own, O(P)).

Ok-Topk's owner r reduces what the ranks selected in its region [o_r, o_{r+1}) of the index space; the
split phase's volume is balanced only while every region receives about the same number of pairs. The
paper recomputes the boundaries every τ steps with one allreduce of the ranks' proposals and the selection drifts
in between. Here the proposals (``proposals``, ``repartition``) ride in the step's opening, and the functions place
the boundaries from what every rank holds identically: after a step, the global result G (``result_boundaries``)
or the loads the owners report in the gather's header (``load_boundaries``, ``smoothed_load_boundaries``: an
exponential average of the load CDFs); before the split, the step's own load, counted in bins in the opening
(``histogram``, ``measured_boundaries``). All are pure functions of identical inputs: identical boundaries on
every rank.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..xp.fixed import compress


def proposals(xp, idx, count, n, P):
    """This rank's proposal for the paper's repartition: the P-1 boundaries that split its selection evenly,
    ``idx[j·c]`` for c = count // P (``idx``: sorted global indexes, ``count`` real ones, padded), else floor(j·n/P)
    (the library's fallback for a selection of fewer than P; ref: c = 0 -> idx[0]; m = 0 -> crash). On the device
    (``count`` a device value): no read. The boundaries are the floor of the proposals' mean (:func:`repartition`)."""
    fallback = xp.asarray([(j * n) // P for j in range(1, P)], xp.index_dtype, like=idx)
    if P == 1:
        return fallback
    c = count // P
    mine = xp.take(idx, xp.mul(xp.arange(P - 1, xp.index_dtype, like=idx) + 1, c))
    return xp.choose(c >= 1, mine, fallback)


def repartition(rows, n):
    """The paper's repartition from every rank's :func:`proposals` (rows of P-1 ints, gathered):
    [0, o_1, ..., o_{P-1}, n] with o_j the floor of their mean, exact in int64 (each proposal split into its
    quotient and remainder by P before the sums: no overflow), one numpy pass (P = 1024: 19 ms, not 75)."""
    P = len(rows)
    q, r = np.divmod(np.asarray(rows, np.int64).reshape(P, P - 1), P)
    return [0] + (q.sum(axis=0) + r.sum(axis=0) // P).tolist() + [n]


def region_split(xp, idx, offsets):
    """``splits[j] = |idx ∩ [o_j, o_{j+1})|`` (Python ints, read on the host) of the sorted global indexes ``idx``
    (padded with n: the padding lies past o_P = n) for the regions ``offsets`` (o_0..o_P, non-decreasing)."""
    pos = [int(p) for p in xp.to_numpy(xp.searchsorted(idx, xp.asarray(offsets, xp.index_dtype, like=idx)))]
    return [pos[j + 1] - pos[j] for j in range(len(offsets) - 1)]


def _non_decreasing(out, n):
    """``out`` (boundaries 0 = o_0 .. o_last = n) made non-decreasing inside [0, n], in place; returns it."""
    for i in range(1, len(out) - 1):
        out[i] = min(n, max(out[i - 1], out[i]))
    return out


def result_boundaries(g, P, n):
    """Region boundaries o_0..o_P that split the sorted global result ``g`` (numpy) into P equal parts:
    ``o_j = g[floor(j·m/P)]`` (m = |G|), or None when m < P (too few points to place P-1 boundaries).

    Every rank holds the same G after a step, so these boundaries cost no communication and are identical on
    all ranks. O(P)."""
    m = len(g)
    if P == 1 or m < P:
        return None
    return [0] + [int(g[(j * m) // P]) for j in range(1, P)] + [n]


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


def histogram(xp, idx, edges):
    """This rank's load in the bins of ``edges`` (:func:`histogram_edges`): how many of its selected indexes
    (sorted, padded with n) fall in each bin, on the device (no read). Summed over the ranks (they ride in the step's
    opening), it is the step's load before the split."""
    pos = xp.searchsorted(idx, xp.asarray(edges, xp.index_dtype, like=idx))
    return xp.astype(pos[1:] - pos[:-1], xp.index_dtype)


def measured_boundaries(edges, hist, forecast, n, P):
    """Region boundaries that split this step's measured load evenly: bin b = [edges[b], edges[b+1]) holds
    ``hist[b]`` selected entries summed over the ranks (gathered before the split, so exact at the edges);
    inside a bin the load is taken as spread like the forecast, whose middle point halves it. Float64
    elementwise work on identical inputs: identical on every rank, O(P). None when nothing was selected."""
    if P == 1 or sum(hist) == 0:
        return None
    shape = np.asarray(edges if forecast is None else np.rint(np.asarray(forecast, np.float64)), np.int64)
    xs, Fs = load_cdf(edges, hist, np.unique(shape[(shape >= 0) & (shape < n)]))
    return _non_decreasing([0] + [int(round(x)) for x in _inverse(xs, Fs, np.arange(1, P) / P)] + [n], n)


def next_boundaries(policy, g, offsets, loads, n, state, tolerance, beta, measured=None):
    """The boundaries of Ok-Topk's next step under ``policy``, or None to keep ``offsets``: from this step's
    result G (``g``: its sorted indexes, numpy; ``result``) or from the split loads every owner reported (``load``,
    and ``measured`` on steps without a histogram); only when the step's imbalance exceeded ``tolerance``.
    ``measured`` (the step's histogram: edges, counts) only updates the forecast (``state["cdf"]``, average β =
    ``beta``) that bins the next histogram. Identical inputs on every rank: identical boundaries. O(P log k)."""
    P = len(offsets) - 1
    if measured is not None:
        state["cdf"] = smoothed_load_boundaries(measured[0], measured[1], g, state.get("cdf"), beta,
                                                2 * BINS_PER_REGION * P)[1]
        return None
    pos = np.searchsorted(g, offsets).tolist()
    if policy in ("load", "measured"):
        if loads is None or max(loads) * P <= tolerance * sum(loads):
            return None
        if beta:                                                    # O(P) numpy work, the average in state
            out, state["cdf"] = smoothed_load_boundaries(offsets, loads, g, state.get("cdf"), beta,
                                                         2 * BINS_PER_REGION * P)
            return out
        return load_boundaries(offsets, loads, pos, lambda at: [int(g[i]) for i in at])
    if len(g) and max(pos[j + 1] - pos[j] for j in range(P)) * P <= tolerance * len(g):
        return None
    return result_boundaries(g, P, n)


@dataclasses.dataclass(frozen=True)
class Regions:
    """Ok-Topk's region policy, built from :class:`~hvd_sparse.core.oktopk.exchange.OkTopk`'s options: ``rule`` its
    ``boundaries``, ``period`` its ``repartition_period``, ``tolerance`` its ``boundary_tolerance``, ``smoothing``
    its ``load_smoothing``. The rules:

    * ``"periodic"`` (the paper): the repartition (the mean of the ranks' proposals) every ``period`` steps only;
      the selection drifts in between, and a region can receive well over its share before the next repartition
      (measured: docs/benchmarks.md, "Measured choices in the code").
    * ``"result"``: the P quantiles of the step's global result G (G is more concentrated than the selections,
      so the split stays uneven).
    * ``"load"``: the pairs each region received (in the gather's header) and the next boundaries split this load
      evenly.
    * ``"measured"`` (the ``Compression.oktopk`` preset): before the split, the ranks' counts in 2 bins per region
      ride in the opening (phase ``histogram``, 2P words) and the step's boundaries split their sum, its own load,
      evenly (a forecast is poor at ~10 entries per region: a step clears the entries that carried the last one's
      load). At many entries per region (``few_collectives_from``) it follows the load instead.

    ``result`` and ``load`` recompute when the last step's imbalance exceeds ``tolerance``; ``load`` and
    ``measured``'s bins follow an exponential average of the load CDFs (``smoothing`` = β,
    :func:`smoothed_load_boundaries`: the hot entries a step clears move the load elsewhere, and the last step alone
    forecasts the next poorly). With all three the repartition runs only on the first step (and after a change of
    P or n).

    Three calls per step: :meth:`opening` for the opening's words, :meth:`plan` for the step's regions before the
    split, :meth:`follow` for the next step's once the result G is known (G read on the host). What they need of the
    step comes in arguments (``step``: P, n, t and the few-collectives flag), what they find goes out in return
    values."""

    rule: str
    period: int
    tolerance: float
    smoothing: float

    @property
    def follows_load(self):
        """Whether the owners report the pairs their region received (the gather's header): ``load``, and
        ``measured`` on steps without a histogram."""
        return self.rule in ("load", "measured")

    def repartitions(self, step, offsets):
        """Whether this step places its regions from the ranks' proposals: the first step (no ``offsets`` yet) and,
        for ``periodic``, every ``period`` steps."""
        return offsets is None or (self.rule == "periodic" and step.t % self.period == 0)

    def opening(self, xp, idx, count, state, step, repart):
        """``(words, parts, edges)``: what this rank's regions put in the step's opening, their meter phases, and the
        histogram's bins (None without one). With ``measured`` regions that count a histogram (``step.few`` false),
        its :func:`histogram` in the bins of the forecast (2P words, every step: the opening keeps one shape); else
        on repartition steps (``repart``: :meth:`repartitions`) its :func:`proposals` (P-1 words: the opening changes
        shape on those steps only), nothing on the others."""
        if self.rule == "measured" and not step.few and step.P > 1:
            edges = histogram_edges(state.get("cdf"), step.P, step.n)
            return histogram(xp, idx, edges), [("histogram", len(edges) - 1)], edges
        if repart and step.P > 1:
            return proposals(xp, idx, count, step.n, step.P), [("boundaries", step.P - 1)], None
        return xp.zeros(0, xp.index_dtype, like=idx), [], None

    def plan(self, rows, state, step, offsets, repart, edges):
        """``(offsets, hist)``: the regions of this step from every rank's opening words (``rows``: host lists) --
        the even split of the summed histogram ``hist`` (``measured``; on its first step in even bins), else on
        repartition steps the mean of the proposals (``periodic`` every ``period`` steps; ``result`` and ``load``
        to start), else the last step's ``offsets``. ``hist`` is None without a histogram."""
        P, n = step.P, step.n
        if edges is not None:
            hist = [sum(col) for col in zip(*rows)]
            return (measured_boundaries(edges, hist, state.get("cdf"), n, P) or offsets or
                    [(j * n) // P for j in range(P)] + [n]), hist
        if repart:
            return (repartition(rows, n) if P > 1 else [0, n]), None
        return offsets, None

    def follow(self, xp, state, step, offsets, loads, g_idx, measured):
        """The next step's boundaries from this step's (:func:`next_boundaries`; ``g_idx``: G's indexes, read on the
        host; ``loads``: what every owner received; ``measured``: ``(edges, hist)`` or None), or None to keep
        ``offsets`` (``periodic``, P = 1, or an imbalance within ``tolerance``)."""
        if self.rule == "periodic" or step.P == 1:
            return None
        g = xp.to_numpy(g_idx)
        g, = compress(g < step.n, g)
        return next_boundaries(self.rule, g, offsets, loads, step.n, state, self.tolerance, self.smoothing, measured)
