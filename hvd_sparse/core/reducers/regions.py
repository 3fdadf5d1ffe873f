"""Ok-Topk's region boundaries from data every rank holds identically (no communication, O(P)).

Ok-Topk's owner r reduces what the ranks selected in its region [o_r, o_{r+1}) of the index space; the
split phase's volume is balanced only while every region receives about the same number of pairs. The
paper recomputes the boundaries every τ steps with one allreduce and the selection drifts in between. The two
functions here derive the next step's boundaries from what every rank already holds after a step: the global
result G (``result_boundaries``), or the loads the owners report in the step's count allgather
(``load_boundaries``). Both are pure functions of identical inputs: identical boundaries on every rank.
"""

from __future__ import annotations


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
