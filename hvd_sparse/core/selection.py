"""Exact, deterministic selection on any backend: top-k of |acc| (the intersection of sorted index lists that the
reducers take is the backend method ``xp.intersect`` itself).

Both are backend methods (``xp.topk``, ``xp.intersect``): the numpy and torch backends run the C kernels
(:mod:`hvd_sparse.core.native`) on CPU float32/int64 buffers when they are built, the others their generic
operations (:mod:`hvd_sparse.core.xp.generic`); the results are the same bits either way.
"""

from __future__ import annotations


def topk_indices(xp, acc, k):
    """Exact top-k of ``|acc|``: sorted int64 indices of the min(k, nnz) largest magnitudes.

    Deterministic: ties at the k-th magnitude are broken by the lower index, zeros are never selected
    (docs/algorithms.md#exact-top-k). Returns ``(indices, threshold)`` where ``threshold`` is the k-th largest |acc|
    as a Python float (0.0 when fewer than k entries are nonzero).
    """
    return xp.topk(acc, k)
