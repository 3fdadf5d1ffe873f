"""ExDyna exchange (docs/algorithms.md#exdyna): a global sparse allreduce on the jointly chosen support.

Per step, on every rank r (``acc`` = V_r = residual + gradient, I_r its selection inside its exclusive
partition, chosen by :class:`hvd_sparse.core.sparsifiers.exdyna.ExDyna` in its capacity c, padded with index n):

    5.7  1. S, ks = allgather(I_r)                       # the step's opening (core/comm.py): c int32 indices per
                                                         #   rank, its count k_r in the header; P·c of them,
                                                         #   rank order, the padding n included
         2. vals = allreduce_sum(V_r[S])                 # phase "values": EVERY rank's own V at ALL of S; the
                                                         #   padding reads the zero at index n
         3. u = zeros(n); u[S] = vals                    # the sum; the engine divides by P
    5.8  included = S                                    # every rank zeroes its residual on the whole union

On a device S is the P·c indices as they came, padding included. On the host, where the counts cost no read, S is
the K = sum(ks) real ones, the ranks' runs in the order of their partitions (ascending), padded with n to the
smallest size of a ladder P·c, ⌈7/8 of it⌉, ... that holds them (``size_bucket``), and the sum returns on its
support (no buffer of n). Two collectives per step: the opening has one shape every step; the values' allreduce
one shape on a device, and on the host one of a few, each under its own name (``values.<rung>``), so Horovod's
response cache serves both after the first step of each size.
info = {"counts": ks, "K": sum(ks)}. When every rank selected nothing (K = 0, known to all ranks from step 1)
step 2 is skipped.

Cost per rank (logical words, the padding included): indices c(P-1) sent and received; values 2m(P-1)/P each way
(ring allreduce of m values: P·c on a device; on the host m < 8K/7, or m <= 7). With c = ratio·k/P
(``ExDyna.capacity_ratio``) that is at most 3·ratio·k(P-1)/P. With a sparsifier whose selections overlap (not
ExDyna) S may hold duplicates: u is still the exact sum (every copy carries the same all-reduced value), only
bandwidth is wasted.
"""

from __future__ import annotations

import numpy as np

from ..comm import SUM
from .base import Reducer, SparseSum, size_bucket, wire_index_dtype


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
        info = {"counts": ks, "K": sum(ks)}
        if info["K"] == 0:
            return xp.zeros(n, xp.float32, like=acc), idx, info
        if not xp.on_device(acc):
            return self._on_host(xp, rows, ks, comm, ctx, n) + (info,)
        S = rows                                                      # (P, c): rank order, the padding n
        # 5.7 step 2: every rank's own values at the whole union (the padding: 0)
        vals = xp.take(ctx.padded, S)
        if comm.size > 1:
            vals = comm.allreduce(vals, SUM, "values")
        # 5.7 step 3 / 5.8: u[S] = summed values; the residual is cleared on all of S
        return xp.put_(xp.zeros(n + 1, xp.float32, like=acc), S, vals)[:n], S, info

    @staticmethod
    def _on_host(xp, rows, ks, comm, ctx, n):
        """Steps 2 and 3 on the host, where the counts cost no read: ``(u, S)``. S holds the union's K real
        indexes, the ranks' runs in the order of their partitions (disjoint ranges, so S ascends), padded with n to
        the smallest size of the ladder from P·c (``size_bucket``) that holds them: the values' allreduce carries
        about K values instead of P·c, in one of a few sizes, each under a name of its own (Horovod's cache serves
        each after its first step). The sum returns on its support; under a sparsifier whose selections overlap
        (not ExDyna: S does not ascend), as a dense buffer."""
        K, P = sum(ks), len(ks)
        rung, size = size_bucket(P * xp.numel(rows[0]), K)
        first = xp.to_numpy(rows[:, 0])
        order = sorted((r for r in range(P) if ks[r]), key=lambda r: int(first[r]))
        S = xp.concat([xp.astype(rows[r, :ks[r]], xp.index_dtype) for r in order]
                      + [xp.full(size - K, n, xp.index_dtype, like=rows)], like=rows)
        vals = xp.take(ctx.padded, S)
        if comm.size > 1:
            vals = comm.allreduce(vals, SUM, "values", bucket=rung)
        support = xp.to_numpy(S[:K])
        if bool(np.all(support[1:] > support[:-1])):
            return SparseSum(S[:K], vals[:K]), S
        return xp.put_(xp.zeros(n + 1, xp.float32, like=vals), S, vals)[:n], S
