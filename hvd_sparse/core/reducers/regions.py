"""Ok-Topk's region boundaries from data every rank holds identically (no communication, O(P)).

Ok-Topk's owner r reduces what the ranks selected in its region [o_r, o_{r+1}) of the index space; the
split phase's volume is balanced only while every region receives about the same number of pairs. The
paper recomputes the boundaries every τ steps with one allreduce and the selection drifts in between. The two
functions here derive the next step's boundaries from what every rank already holds after a step: the global
result G (``result_boundaries``), or the loads the owners report in the step's count allgather
(``load_boundaries``). Both are pure functions of identical inputs: identical boundaries on every rank.
"""

from __future__ import annotations

import bisect


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
    for i in range(1, P):                   # non-decreasing, inside [0, n]
        out[i] = min(offsets[-1], max(out[i - 1], out[i]))
    return out


def _cdf(xs, Fs, x):
    j = bisect.bisect_right(xs, x) - 1
    if j < 0:
        return 0.0
    if j >= len(xs) - 1:
        return Fs[-1]
    return Fs[j] + (Fs[j + 1] - Fs[j]) * (x - xs[j]) / (xs[j + 1] - xs[j])


def _inverse(xs, Fs, y):
    j = bisect.bisect_left(Fs, y)
    if j <= 0:
        return xs[0]
    if j >= len(Fs):
        return xs[-1]
    d = Fs[j] - Fs[j - 1]
    return xs[j - 1] + (xs[j] - xs[j - 1]) * ((y - Fs[j - 1]) / d if d > 0 else 1.0)


def load_cdf(offsets, loads, g):
    """This step's load CDF (points xs, values Fs, normalized to 1), piecewise linear: region j's load
    spread like the global result G (``g``, sorted ints) inside it: F(g_m) = C_j + L_j·m/c_j at its c_j points
    of G (m = 0..c_j-1), uniform over the region when it holds no point of G. O(P + |G|)."""
    W = sum(loads)
    xs, Fs, cum = [float(offsets[0])], [0.0], 0
    pos = [bisect.bisect_left(g, o) for o in offsets]
    for j, L in enumerate(loads):
        c = pos[j + 1] - pos[j]
        for m in range(c):
            xs.append(float(g[pos[j] + m]))
            Fs.append((cum + L * m / c) / W)
        cum += L
        xs.append(float(offsets[j + 1]))
        Fs.append(cum / W)
    return xs, Fs


def smoothed_load_boundaries(offsets, loads, g, prev, beta, M):
    """Region boundaries from an exponential average of the measured load CDFs over steps: ``prev`` (the
    average so far, as M+1 points x_0..x_M with CDF j/M, or None) is blended as beta·prev + (1-beta)·this
    step's CDF (``load_cdf``) and resampled at M+1 quantiles; boundary i is the average's quantile i/P.
    Returns (boundaries, new state), or (None, prev) when nothing was received. Python floats, the same
    operations on identical inputs: identical on every rank. O((M + |G|) log(M + |G|))."""
    P, W = len(loads), sum(loads)
    if P == 1 or W == 0:
        return None, prev
    xs, Fs = load_cdf(offsets, loads, g)
    if prev is not None:
        pF = [j / M for j in range(M + 1)]
        grid = sorted(set(xs) | set(prev))
        H = [beta * _cdf(prev, pF, x) + (1 - beta) * _cdf(xs, Fs, x) for x in grid]
        for i in range(1, len(H)):
            H[i] = max(H[i], H[i - 1])
        xs, Fs = grid, H
    state = [_inverse(xs, Fs, j / M) for j in range(M + 1)]
    n = offsets[-1]
    out = [0] + [int(round(state[(i * M) // P])) for i in range(1, P)] + [n]
    for i in range(1, P):
        out[i] = min(n, max(out[i - 1], out[i]))
    return out, state
