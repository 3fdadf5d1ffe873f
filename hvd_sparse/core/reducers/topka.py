"""TopkA: allgather of every rank's local selection (docs/algorithms.md#topka; Li & Hoefler Table 1 row "TopkA").
Also the exchange of Gaussiank and of DCT-DP (docs/algorithms.md#gaussiank, docs/algorithms.md#dct).

Per step, on every rank r (``acc`` = residual + gradient, S^r its selection, chosen by the sparsifier in its
capacity c: exactly k for an exact-k sparsifier (TopK), the sparsifier's capacity otherwise, padded with index n):

    1. send [S^r, bits(acc[S^r])]      # one int32 message of 2c words, in the step's opening (core/comm.py):
                                       #   the agreement's header rides in front, the padding's values are 0
    2. allgather                       # the same shape every step: Horovod's response cache serves it
    3. u = 0;  for s in 0..P-1: u.index_add_(idx_s, val_s)        # rank order: bit-identical everywhere;
                                                                   # the padding adds 0 into a spare slot n
                                       # (on the host: the same additions on the support only, one merge
                                       #  pass of the real pairs -- no buffer of n)
    4. included I^r = S^r              # every sent value reaches u

One collective per step. Every rank receives exactly 2c(P-1) words (2k(P-1) with exact top-k, Table 1) plus the
header. Output support <= min(n, Pc) (fill-in; no global top-k).
"""

from __future__ import annotations

from .base import (Reducer, SparseSum, pair_blocks, real_runs, sum_sparse_in_rank_order, unpack_pair_rows,
                   wire_index_dtype)


def allgather_selection(xp, acc, idx, ctx):
    """Every rank's padded selection and its values in the step's opening: ``(all_idx, all_vals, counts)``, the
    (P, c) indices (the wire dtype: int32 while n allows) and values, and every rank's count of real entries."""
    n, c = xp.numel(acc), xp.numel(idx)
    packed = pair_blocks(xp, idx, xp.take(ctx.padded, idx), wire_index_dtype(xp, n))
    rows, counts, _ = ctx.open(packed, (("indices", c), ("values", c)))
    all_idx, all_vals = unpack_pair_rows(xp, rows)
    return all_idx, all_vals, counts


class TopkA(Reducer):
    name = "topka"
    opens = True
    sparse_result = "host"

    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        n = xp.numel(acc)
        all_idx, all_vals, counts = allgather_selection(xp, acc, idx, ctx)
        info = {} if ctx.exact_k else {"counts": counts}
        if not xp.on_device(acc):                           # the support where reading it is free
            real_idx, real_vals = real_runs(xp, all_idx, all_vals, counts)
            return SparseSum(*sum_sparse_in_rank_order(xp, real_idx, real_vals, counts, acc)), idx, info
        u = xp.zeros(n + 1, xp.float32, like=acc)          # slot n takes the padding
        for i, v in zip(xp.unbind(all_idx), xp.unbind(all_vals)):      # rank order: bit-identical everywhere
            u = xp.add_unique_(u, i, v)
        return u[:n], idx, info
