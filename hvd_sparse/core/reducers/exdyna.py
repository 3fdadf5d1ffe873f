"""ExDyna exchange (docs/algorithms.md#exdyna): a global sparse allreduce on the jointly chosen support.

Per step, on every rank r (``acc`` = V_r = residual + gradient, I_r its selection inside its exclusive
partition, chosen by :class:`hvd_sparse.core.sparsifiers.exdyna.ExDyna` in its capacity c, padded with index n):

    5.7  1. S, ks = allgather(I_r)                       # the step's opening (core/comm.py): c int32 indices per
                                                         #   rank, its count k_r in the header; P·c of them,
                                                         #   rank order, the padding n included
         2. vals = allreduce_sum(V_r[S])                 # phase "values": EVERY rank's own V at ALL of S; the
                                                         #   padding reads the zero at index n
         3. u = zeros(n); u[S] = vals                    # the sum; the engine divides by P (on the host: the
                                                         #   real pairs alone, rows in the order of their
                                                         #   partitions, ascending -- no buffer of n)
    5.8  included = S                                    # every rank zeroes its residual on the whole union

Two collectives per step, each of the same shape every step (Horovod's response cache serves both).
info = {"counts": ks, "K": sum(ks)}. When every rank selected nothing (K = 0, known to all ranks from step 1)
step 2 is skipped.

Cost per rank (logical words, the padding included): indices c(P-1) sent and received; values 2Pc(P-1)/P each
way (ring allreduce). With c = ratio·k/P (``ExDyna.capacity_ratio``) that is 3·ratio·k(P-1)/P. With a sparsifier
whose selections overlap (not ExDyna) S may hold duplicates: u is still the exact sum (every copy carries the
same all-reduced value), only bandwidth is wasted.
"""

from __future__ import annotations

import numpy as np

from ..comm import SUM
from .base import Reducer, SparseSum, real_runs, wire_index_dtype


class ExDynaReducer(Reducer):
    """The exchange of ExDyna (Yoon & Oh, CCGrid 2024; docs/algorithms.md#exdyna): allgather every rank's indices
    (the step's opening, with its count), then allreduce (SUM) every rank's accumulated values over the union S;
    every rank's residual is cleared on all of S. No knobs.
    """

    name = "exdyna"
    opens = True
    sparse_result = "host"

    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        n = xp.numel(acc)
        c = xp.numel(idx)
        # 5.7 step 1: S = the concatenation of every rank's indices in rank order, and the counts
        rows, ks, _ = ctx.open(xp.astype(idx, wire_index_dtype(xp, n)), (("indices", c),))
        K = sum(ks)
        if K == 0:
            return xp.zeros(n, xp.float32, like=acc), idx, {"counts": ks, "K": 0}
        S = rows                                                      # (P, c): rank order, the padding n
        if not xp.on_device(acc):                                     # flat int64: the host's quick gathers
            S = xp.astype(xp.reshape(rows, (-1,)), xp.index_dtype)
        # 5.7 step 2: every rank's own values at the whole union (the padding: 0)
        vals = xp.take(ctx.padded, S)
        if comm.size > 1:
            vals = comm.allreduce(vals, SUM, "values")
        # 5.7 step 3 / 5.8: u[S] = summed values; the residual is cleared on all of S
        info = {"counts": ks, "K": K}
        if not xp.on_device(acc):
            found = self._support(xp, rows, xp.reshape(vals, (comm.size, c)), ks)
            if found is not None:
                return found, S, info
        return xp.put_(xp.zeros(n + 1, xp.float32, like=acc), S, vals)[:n], S, info

    @staticmethod
    def _support(xp, rows, vals, ks):
        """The sum as a :class:`SparseSum`: the ranks' real indices, rows ordered by their first index (ExDyna's
        partitions are disjoint ranges, so the concatenation ascends), with their summed values; None when it does
        not ascend (a sparsifier whose selections overlap)."""
        first = xp.to_numpy(rows[:, 0])
        order = sorted((r for r in range(len(ks)) if ks[r]), key=lambda r: int(first[r]))
        idx, val = real_runs(xp, rows, vals, ks, order)
        host = xp.to_numpy(idx)
        return SparseSum(idx, val) if bool(np.all(host[1:] > host[:-1])) else None
