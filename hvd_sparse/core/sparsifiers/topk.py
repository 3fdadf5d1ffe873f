"""Exact top-k (docs/algorithms.md#exact-top-k): the k entries of largest ``|acc|``.

    S = the min(k, nnz(acc)) indices of largest |acc_j|, ties at the k-th magnitude broken by lower index

This is the sparsifier of TopkA, TopkDSA and gTopk (paper §5: "an exact torch.topk every step", their
sparsification overhead). It never selects zeros, so with density 1 it selects every nonzero entry and
the sparse reducers equal the dense allreduce.
"""

from __future__ import annotations

from .base import Sparsifier


class TopK(Sparsifier):
    """Exact, deterministic top-k by magnitude. Stateless."""

    name = "topk"
    exact_k = True

    def select(self, xp, acc, k, state, ctx):
        idx, th, count = xp.topk_padded(acc, k)        # exactly k slots, the index n after fewer nonzeros
        state["threshold"] = th
        return idx, count
