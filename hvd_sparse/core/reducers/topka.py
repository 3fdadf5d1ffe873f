"""TopkA: allgather of every rank's local top-k (spec oktopk.md §3.2; paper Table 1 row "TopkA").

Per step, on every rank r (``acc`` = residual + gradient, S^r its top-k, chosen by the sparsifier):

    1. send (S^r, acc[S^r]) padded to exactly k pairs     # pad: index n (a dummy slot), value 0
    2. allgather indices, allgather values                # rank order; k pairs from each rank
    3. u = 0;  for s in 0..P-1: u.index_add_(idx_s, val_s) # rank order: bit-identical on every rank
    4. included I^r = S^r                                  # every sent value reaches u

Padding to k keeps every rank's message the same size, so no count exchange is needed and each rank
receives exactly 2k(P-1) words (oracle O2). Output support <= min(n, Pk) (fill-in; no global top-k).
"""

from __future__ import annotations

from .base import Reducer, wire_index_dtype


class TopkA(Reducer):
    name = "topka"

    def reduce(self, xp, acc, idx, k, comm, state):
        n = xp.numel(acc)
        vals = xp.take(acc, idx)
        P = comm.size
        if P == 1:
            u = xp.zeros(n, xp.float32, like=acc)
            return xp.put_(u, idx, vals), idx
        m = xp.numel(idx)
        if m > k:
            raise ValueError(f"topka: the sparsifier selected {m} > k={k} entries; TopkA needs at most k "
                             "(pair it with TopK)")
        wire = wire_index_dtype(xp, n)
        pad = k - m
        send_idx = xp.astype(idx, wire)
        if pad:
            send_idx = xp.concat([send_idx, xp.full(pad, n, wire, like=acc)], like=acc)
            vals = xp.concat([vals, xp.zeros(pad, xp.float32, like=acc)], like=acc)
        all_idx = xp.astype(comm.allgather(send_idx, "indices"), xp.index_dtype)
        all_vals = comm.allgather(vals, "values")
        u = xp.zeros(n + 1, xp.float32, like=acc)
        for s in range(P):
            xp.scatter_add_(u, all_idx[s * k:(s + 1) * k], all_vals[s * k:(s + 1) * k])
        return u[:n], idx
