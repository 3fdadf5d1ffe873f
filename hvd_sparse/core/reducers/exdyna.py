"""ExDyna exchange (docs/algorithms.md#exdyna): a global sparse allreduce on the jointly chosen support.

Per step, on every rank r (``acc`` = V_r = residual + gradient, I_r its selection inside its exclusive
partition, chosen by :class:`hvd_sparse.core.sparsifiers.exdyna.ExDyna`):

    5.7  1. ks   = allgather([k_r])                       # phase "count": P ints, rank order
         2. S    = allgather(I_r)                         # phase "indices": allgatherv, int32 on the wire
                                                          #   while n allows; concatenated in rank order
         3. vals = allreduce_sum(V_r[S])                  # phase "values": EVERY rank's own V at ALL of S
         4. u = zeros(n); u[S] = vals                     # the sum; the engine divides by P
    5.8  included = S                                     # every rank zeroes its residual on the whole union

info = {"counts": ks, "K": |S|}. P = 1: no collective (S = I_0). When every rank selected nothing (K = 0,
known to all ranks from step 1) steps 2-3 are skipped.

Cost per rank (logical words): counts (P-1) sent; indices k_r(P-1) sent, |S| - k_r received; values
2|S|(P-1)/P each way (ring allreduce). With a sparsifier whose selections overlap (not ExDyna) S may hold
duplicates: u is still the exact sum (every copy carries the same all-reduced value), only bandwidth is
wasted.
"""

from __future__ import annotations

from ..comm import SUM
from .base import Reducer, wire_index_dtype


class ExDynaReducer(Reducer):
    """The exchange of ExDyna (Yoon & Oh, CCGrid 2024; docs/algorithms.md#exdyna): allgather the per-rank counts
    and indices (one grouped allgather), then allreduce (SUM) every rank's accumulated values over the union S;
    every rank's residual is cleared on all of S. No knobs (indices travel unpadded, via allgatherv).
    """

    name = "exdyna"

    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        n = xp.numel(acc)
        m = xp.numel(idx)
        u = xp.zeros(n, xp.float32, like=acc)
        if comm.size == 1:
            u = xp.put_(u, idx, xp.take(acc, idx))
            return u, idx, {"counts": [m], "K": m}
        # 5.7 steps 1-2: the counts and S = the concatenation of every rank's indices in rank order, in one
        # negotiated collective (a grouped allgather)
        wire = wire_index_dtype(xp, n)
        counts, S = comm.grouped_allgather([xp.asarray([m], xp.index_dtype, like=acc), xp.astype(idx, wire)],
                                           ["count", "indices"])
        ks = [int(c) for c in xp.to_numpy(counts)]
        K = sum(ks)
        if K == 0:
            return u, idx, {"counts": ks, "K": 0}
        S = xp.astype(S, xp.index_dtype)
        # 5.7 step 3: every rank's own values at the whole union
        vals = comm.allreduce(xp.take(acc, S), SUM, "values")
        # 5.7 step 4 / 5.8: u[S] = summed values; the residual is cleared on all of S
        u = xp.put_(u, S, vals)
        return u, S, {"counts": ks, "K": K}
