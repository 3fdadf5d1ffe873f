"""Exact, deterministic selection on any backend: top-k of |acc| and of gathered candidates (the intersection of
sorted index lists that the reducers take is the backend method ``xp.intersect`` itself).

Top-k and the intersection are backend methods (``xp.topk``, ``xp.intersect``): the numpy and torch backends run
the C kernels (:mod:`hvd_sparse.core.native`) on CPU float32/int64 buffers when they are built, the others their
generic operations (:mod:`hvd_sparse.core.xp.generic`); the results are the same bits either way.
"""

from __future__ import annotations

import math


def topk_indices(xp, acc, k):
    """Exact top-k of ``|acc|``: sorted int64 indices of the min(k, nnz) largest magnitudes.

    Deterministic: ties at the k-th magnitude are broken by the lower index, zeros are never selected
    (docs/algorithms.md#exact-top-k). Returns ``(indices, threshold)`` where ``threshold`` is the k-th largest |acc|
    as a Python float (0.0 when fewer than k entries are nonzero).
    """
    return xp.topk(acc, k)


def global_topk(xp, c_idx, c_val, k):
    """Deterministic top-min(k, |C|) of candidates sorted by global index (ties: ascending index).

    Returns ``(G.idx, G.val, Γ)`` with Γ the K-th largest |value| (``inf`` when C is empty)."""
    m = xp.numel(c_val)
    if m == 0:
        return c_idx, c_val, math.inf
    if m > k:
        pos, th = topk_indices(xp, c_val, k)
        return xp.take(c_idx, pos), xp.take(c_val, pos), th
    return c_idx, c_val, float(xp.kth_largest(xp.abs(c_val), m))
