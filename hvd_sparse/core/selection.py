"""Exact, deterministic selection on any backend: top-k of |acc| and the intersection of sorted index lists.

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


def intersect_sorted(xp, a, b):
    """The elements of the sorted unique int ``a`` that occur in the sorted unique ``b`` (exact, ascending).

    ``xp.intersect``: numpy and CPU torch int64 arrays take the native merge kernel when it is built, else merge
    the two runs with one stable sort (O(|a| + |b|)); other backends binary-search ``a`` in ``b``."""
    return xp.intersect(a, b)
