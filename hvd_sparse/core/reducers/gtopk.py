"""gTopk: global top-k through a binary reduction tree (docs/algorithms.md#gtopk; Shi et al.; Li & Hoefler Table 1
row "gTopk").

Per step, on every rank r (``acc`` = a = residual + gradient, S^r its selection, chosen by the sparsifier):

    1. list l^r = (S, a[S]), at most k pairs (a larger selection is first cut to its own top-k)
    0. fold-in (P not a power of two, library extension): m = 2^floor(log2 P);
       ranks r >= m send l^r to r - m, which merges                         # phase "fold"
    2. rounds i = 0 .. log2(m)-1: active ranks are the multiples of 2^i below m;
       rank r with (r / 2^i) odd sends its list to r - 2^i, which merges    # phase "round<i>"
       merge(l, l') = union of the indexes, values of common indexes summed,
                      then the k largest |value| (all of them if the union has <= k entries),
                      ties by the lower index; no duplicate index survives
    3. rank 0 broadcasts its final list G, padded to k pairs (index n, value 0)   # phase "broadcast"
    4. u[G.idx] = G.val;  K = |G|
    5. included I^r = S^r ∩ G.idx  (S^r \\ G stays in the residual)

Every round is ONE alltoall called by all P ranks; its splits carry the sender's pairs to the partner
and 0 elsewhere (the receiver learns the size from the returned splits). Pairs travel as two int32
words (index, float32 value bits; int64 words only for n >= 2^31), so each rank moves at most 2k words
per round up and receives 2k words from the broadcast: 4k·log2 P in total (Table 1).

Not mass-conserving: a value of j in G can miss the contributions of a
subtree where j was pruned, yet those ranks clear eps[j] because j is in G.
"""

from __future__ import annotations

from ..selection import topk_indices
from .base import Reducer, pack_pairs, unpack_pairs, wire_index_dtype


def top_k_list(xp, idx, vals, k):
    """The k entries of largest |vals| of a list sorted by index (ties by lower index), still sorted.

    Entries whose value is 0 rank last but are kept when fewer than k nonzero entries exist (the reference
    "keep all if the union is < k"); with <= k entries the list is returned unchanged.
    """
    m = xp.numel(idx)
    if m <= k:
        return idx, vals
    pos, _ = topk_indices(xp, vals, k)            # <= k nonzero positions, ascending
    need = k - xp.numel(pos)
    if need > 0:
        zeros = xp.nonzero(xp.eq(vals, 0))[:need]
        pos = xp.sort(xp.concat([pos, zeros], like=vals))
    return xp.take(idx, pos), xp.take(vals, pos)


def merge(xp, ia, va, ib, vb, k):
    """Union of two index-sorted lists with unique indexes, values summed on common indexes, then the
    top-k (:func:`top_k_list`). Deterministic: every index appears at most twice and a + b == b + a."""
    idx = xp.concat([ia, ib], like=va)
    val = xp.concat([va, vb], like=va)
    m = xp.numel(idx)
    if m == 0:
        return idx, val
    order = xp.argsort_stable(idx)
    idx = xp.take(idx, order)
    val = xp.take(val, order)
    dup = xp.nonzero(idx[1:] == idx[:-1])         # position p: idx[p] == idx[p + 1]
    if xp.numel(dup):
        val = xp.copy(val)
        val = xp.scatter_add_(val, dup, xp.take(val, dup + 1))
        drop = xp.put_(xp.zeros(m, xp.int32, like=va), dup + 1, 1)
        keep = xp.nonzero(xp.eq(drop, 0))
        idx = xp.take(idx, keep)
        val = xp.take(val, keep)
    return top_k_list(xp, idx, val, k)


class GTopk(Reducer):
    """gTopk (Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for
    Low Bandwidth Networks", ICDCS'19; baseline of Li & Hoefler, PPoPP'22, §5; docs/algorithms.md#gtopk):
    pairwise merges of the local top-k lists along a binary tree, each keeping only the top-k of the
    partial sum, then a broadcast of the global list from rank 0. Any P (non-powers of two use a fold-in
    pre-round). The included set is S ∩ G, so values pruned on the way stay in the residual.

    No knobs. ``info``: ``K`` (the number of global entries |G| <= k).
    """

    name = "gtopk"

    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        n = xp.numel(acc)
        P = comm.size
        r = comm.rank
        # 1. local list (at most k pairs; an exact-k sparsifier already respects that)
        vals = xp.take(acc, idx)
        if xp.numel(idx) > k:
            idx, vals = top_k_list(xp, idx, vals, k)
        if P == 1:                              # no collective: G = the local list
            u = xp.zeros(n, xp.float32, like=acc)
            u = xp.put_(u, idx, vals)
            return u, idx, {"K": xp.numel(idx)}
        wire = wire_index_dtype(xp, n)
        empty = xp.zeros(0, wire, like=acc)
        my_idx, my_val = idx, vals

        # 0. fold-in pre-round for P not a power of two
        m = 1 << (P.bit_length() - 1)
        if m != P:
            splits = [0] * P
            x = empty
            if r >= m:
                x = pack_pairs(xp, my_idx, my_val, wire, acc)
                splits[r - m] = xp.numel(x)
            recv, _ = comm.alltoall(x, splits, "fold")
            if r + m < P:
                ri, rv = unpack_pairs(xp, recv)
                my_idx, my_val = merge(xp, my_idx, my_val, ri, rv, k)
        # 2. tree rounds on ranks < m
        i, step = 0, 1
        while step < m:
            splits = [0] * P
            x = empty
            if r < m and r % (2 * step) == step:          # sender, becomes inactive
                x = pack_pairs(xp, my_idx, my_val, wire, acc)
                splits[r - step] = xp.numel(x)
            recv, _ = comm.alltoall(x, splits, f"round{i}")
            if r < m and r % (2 * step) == 0:             # receiver: merge the partner's list
                ri, rv = unpack_pairs(xp, recv)
                my_idx, my_val = merge(xp, my_idx, my_val, ri, rv, k)
            i, step = i + 1, 2 * step
        # 3. broadcast rank 0's list, padded to k pairs (index n, value 0)
        if r == 0:
            K0 = xp.numel(my_idx)
            pad = k - K0
            b_idx = xp.concat([my_idx, xp.full(pad, n, xp.index_dtype, like=acc)], like=acc)
            b_val = xp.concat([my_val, xp.zeros(pad, xp.float32, like=acc)], like=acc)
            buf = pack_pairs(xp, b_idx, b_val, wire, acc)
        else:
            buf = xp.zeros(2 * k, wire, like=acc)
        g_idx, g_val = unpack_pairs(xp, comm.broadcast(buf, 0, "broadcast"))
        K = k - xp.sum_int(xp.eq(g_idx, n))
        g_idx, g_val = g_idx[:K], g_val[:K]
        # 4. u[G] = G.val
        u = xp.zeros(n, xp.float32, like=acc)
        u = xp.put_(u, g_idx, g_val)
        # 5. included = S ∩ G
        return u, xp.intersect(idx, g_idx), {"K": K}
