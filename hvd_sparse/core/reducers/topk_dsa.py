"""TopkDSA: sparse reduce-scatter over equal regions + allgatherv with a dense switch (docs/algorithms.md#topk_dsa;
SparCML's dynamic sparse allreduce as benchmarked by ref ``topkSA``; paper Table 1 row "TopkDSA").

Per step, on every rank r (``acc`` = a = residual + gradient, S^r its selection, chosen by the sparsifier):

    1. S = the sparsifier's selection (exact top-k with TopK); included I^r = S^r   # eps[S] = 0 (engine)
    2. equal regions: q = floor(n/P), R_j = [jq, (j+1)q) for j < P-1, R_{P-1} = [(P-1)q, n)
    3. reduce-scatter: send (x - jq, a[x]) for x in S ∩ R_j to rank j       # ONE alltoall, phase "scatter"
       owner r: rho^r = zeros(|R_r|); for s in 0..P-1: rho^r.index_add_(rel_s, val_s)
    4. U_r = nnz(rho^r); counts = allgather(U_r); N = sum_r U_r             # phase "count"
    5. switch: if N < n/3: allgatherv (global idx, value) of the nonzeros   # phase "sparse"
                            u[idx] = val
               else:        allgatherv of the region buffers rho^j         # phase "dense"
                            u = concat_j rho^j

Result: u = sum_r TopK(a^r) -- the same u as TopkA, bit for bit (both add the sources in rank order
starting from +0), and the same residual. The dense switch is taken iff 3N >= n.

Wire format (words = 4-byte elements): every (index, value) pair travels as two words of one
int32 array, the index followed by the float32 value bit-cast to int32 (int64 words with the value bits
in the low half only when an index does not fit int32). One collective per exchange; each pair is
metered as 2 words. Volume received by rank r:
    scatter: 2·sum_{s != r} |S^s ∩ R_r|;  count: P-1;  sparse: 2(N - U_r)  or  dense: n - |R_r|.
"""

from __future__ import annotations

from .base import Reducer, pack_pairs, sum_in_rank_order, unpack_pairs, wire_index_dtype


def regions(n, P):
    """Equal region offsets o_0..o_P (step 2): q = n // P, the last region takes the rest."""
    q = n // P
    return [j * q for j in range(P)] + [n]


class TopkDSA(Reducer):
    """TopkDSA (Renggli et al., SparCML, SC'19, dynamic sparse allreduce; baseline of Li & Hoefler,
    PPoPP'22, §5; docs/algorithms.md#topk_dsa): direct-exchange sparse reduce-scatter over P equal regions, then
    an allgatherv of the reduced regions, sparse (COO) while the global fill-in N stays below n/3 and
    dense (the region buffers) otherwise. Same result as TopkA; costs between 4k(P-1)/P and
    (2k+n)(P-1)/P words per rank instead of 2k(P-1).

    No knobs (the dense-switch ratio 1/3 is fixed, as in ref). ``info``: ``N`` (global nonzeros of the
    reduced sum) and ``dense_switch`` (True when the dense allgather was used).
    """

    name = "topk_dsa"

    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        n = xp.numel(acc)
        P = comm.size
        if P == 1:                              # no collective; same semantics (the one region is R_0)
            u = xp.zeros(n, xp.float32, like=acc)
            u = xp.put_(u, idx, xp.take(acc, idx))
            N = n - xp.sum_int(xp.eq(u, 0))
            return u, idx, {"N": N, "dense_switch": 3 * N >= n}
        r = comm.rank
        # 2. equal regions
        off = regions(n, P)
        q = n // P
        lo, hi = off[r], off[r + 1]
        # 3. reduce-scatter: S ∩ R_j is a contiguous slice of the sorted selection
        bounds = xp.asarray(off[1:P], xp.index_dtype, like=acc)
        cut = [0] + [int(c) for c in xp.to_numpy(xp.searchsorted(idx, bounds))] + [xp.numel(idx)]
        pairs = [cut[j + 1] - cut[j] for j in range(P)]
        rel = idx if q == 0 else idx - xp.clamp_max(idx // q, P - 1) * q
        wire = wire_index_dtype(xp, n - (P - 1) * q)          # the largest region is the last one
        sent = pack_pairs(xp, rel, xp.take(acc, idx), wire, acc)
        recv, recv_words = comm.alltoall(sent, [2 * c for c in pairs], "scatter")
        rel_in, val_in = unpack_pairs(xp, recv)
        rho = sum_in_rank_order(xp, hi - lo, rel_in, val_in, [w // 2 for w in recv_words], acc)
        # 4. global fill-in
        nz = xp.nonzero(rho != 0)
        U = xp.numel(nz)
        counts = [int(c) for c in xp.to_numpy(comm.allgather(xp.asarray([U], xp.index_dtype, like=acc),
                                                             "count"))]
        N = sum(counts)
        # 5. switch (decided from the allgathered counts: identical on every rank)
        if 3 * N < n:
            g_wire = wire_index_dtype(xp, n)
            flat = comm.allgather(pack_pairs(xp, nz + lo, xp.take(rho, nz), g_wire, acc), "sparse")
            g_idx, g_val = unpack_pairs(xp, flat)
            u = xp.zeros(n, xp.float32, like=acc)
            u = xp.put_(u, g_idx, g_val)                   # regions are disjoint: no duplicate index
            dense = False
        else:
            u = comm.allgather(rho, "dense")
            dense = True
        return u, idx, {"N": N, "dense_switch": dense}
