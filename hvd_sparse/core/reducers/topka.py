"""TopkA: allgather of every rank's local selection (docs/algorithms.md#topka; Li & Hoefler Table 1 row "TopkA").
Also the exchange of Gaussiank and of DCT-DP (docs/algorithms.md#gaussiank, docs/algorithms.md#dct).

Per step, on every rank r (``acc`` = residual + gradient, S^r its selection, chosen by the sparsifier):

    1. send (S^r, acc[S^r])
         exact-k sparsifier (TopK): padded to exactly k pairs     # pad: index n (a dummy slot), value 0
         otherwise (Gaussiank, DCT): counts = allgather(|S^r|)   # variable sizes (allgatherv)
    2. allgather indices, allgather values                        # concatenated in rank order
    3. u = 0;  for s in 0..P-1: u.index_add_(idx_s, val_s)        # rank order: bit-identical everywhere
    4. included I^r = S^r                                         # every sent value reaches u

With an exact-k sparsifier every message has the same size, so no count exchange is needed and each
rank receives exactly 2k(P-1) words. Output support <= min(n, Pk) (fill-in; no global top-k).
"""

from __future__ import annotations

from .base import Reducer, sum_in_rank_order, wire_index_dtype


def allgather_selection(xp, acc, idx, comm, pad_to=None):
    """Allgather every rank's (indices, acc[indices]); returns (all_idx, all_vals, counts).

    ``all_idx`` is in the wire dtype (int32 while n <= 2^31 - 2, else int64). One negotiated collective: the
    indices (phase ``indices``) and values (``values``) travel in one grouped allgather, and so does the count of
    each rank (``count``) unless ``pad_to`` is given (a size every rank respects: messages are padded with index
    ``n``/value 0 and no count is exchanged).
    """
    n = xp.numel(acc)
    wire = wire_index_dtype(xp, n)
    vals = xp.take(acc, idx)
    send_idx = xp.astype(idx, wire)
    m = xp.numel(idx)
    if pad_to is not None:
        if m > pad_to:
            raise ValueError(f"{comm.rank}: the sparsifier selected {m} > k={pad_to} entries although it "
                             "declares exact_k")
        pad = pad_to - m
        if pad:
            send_idx = xp.concat([send_idx, xp.full(pad, n, wire, like=acc)], like=acc)
            vals = xp.concat([vals, xp.zeros(pad, xp.float32, like=acc)], like=acc)
        # indices stay in their wire dtype (int32 while n allows): index_add_/fancy indexing take them as they
        # are, and no rank makes its own int64 copy of the P·k gathered indices
        all_idx, all_vals = comm.grouped_allgather([send_idx, vals], ["indices", "values"])
        return all_idx, all_vals, [pad_to] * comm.size
    count = xp.asarray([m], xp.index_dtype, like=acc)
    counts, all_idx, all_vals = comm.grouped_allgather([count, send_idx, vals], ["count", "indices", "values"])
    return all_idx, all_vals, [int(c) for c in xp.to_numpy(counts)]


class TopkA(Reducer):
    name = "topka"

    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        n = xp.numel(acc)
        if comm.size == 1:
            u = xp.zeros(n, xp.float32, like=acc)
            return xp.put_(u, idx, xp.take(acc, idx)), idx, {"counts": [xp.numel(idx)]}
        all_idx, all_vals, counts = allgather_selection(xp, acc, idx, comm, pad_to=k if ctx.exact_k else None)
        u = sum_in_rank_order(xp, n, all_idx, all_vals, counts, acc)
        info = {} if ctx.exact_k else {"counts": counts}
        return u, idx, info
