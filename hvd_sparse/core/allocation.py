"""One budget over several units: each bucket's share of the entries, from where the whole model's top-k falls.

The torch optimizer's ``overlap`` (:mod:`hvd_sparse.torch.buckets`) selects in each bucket apart, so that a bucket
can go while backward still runs. Split by size (k_b = d·n_b), the buckets of small layers starve: the whole model's
top-k, which one unit would send, puts 13-30 times more of its entries in a CNN's convolutions than their size does
(docs/algorithms.md, "Buckets"). Its split moves slowly, so the buckets follow the split of a recent step:

1. **Tally** (every :data:`EVERY` exchanges, from the first): each sparse bucket's step counts the entries of its
   accumulator ``|residual + gradient|`` in bins of magnitude, four an octave over float32's whole range
   (``Engine.tally``; ``xp.magnitude_counts``: one pass, by the float's exponent and first mantissa bits): what
   whole-model selection would choose from, before this bucket selects.
2. **Count** (:func:`local_counts`): after the exchange, this rank's whole-model threshold is the lower bound of
   the highest bin from which up the buckets together hold at least k entries (k: the entries the buckets selected
   together this step, Σ k_b); c_b: bucket b's entries from that bin up.
3. **Agree** (:func:`rebalance`): one allreduce of the c_b (integers, summed over the ranks; ``<unit>.budget``), so
   that every rank derives the same shares from the same numbers.
4. **Share** (:func:`shares`): bucket b's factor on the density is its part of the counts over its part of the
   entries, s_b = (C_b / Σ C) / (n_b / Σ n), so that Σ s_b·d·n_b = d·Σ n: the same budget, placed where the whole
   model's top-k was (at least :data:`FLOOR`, so that no bucket stops selecting; at most the :func:`ceiling` at which
   its sparse message would cost what the dense rule refuses -- the budget a bucket cannot use is not sent). A
   factor within a quarter octave of the current one is kept (:func:`settled`): a new one starts the bucket's scheme
   afresh (thresholds, partitions), and the count's grid is no finer.

The new factors hold from the next exchange on (``Engine.set_share``): a bucket selects before the later buckets'
gradients exist, so the split can only come from a step already taken. A step skipped for a non-finite gradient
tallies nothing and keeps the shares; dense buckets (``min_compression_rate``) are outside the split. Each factor is
in its engine's checkpoint.
"""

from __future__ import annotations

import math

import numpy as np

from . import budget
from .comm import SUM
from .xp import backend_of

#: exchanges between two tallies
EVERY = 10
#: a new factor replaces the current one when they differ by more than this ratio (a quarter octave: about a bin)
KEEP = 2.0 ** 0.25
#: the smallest factor: a bucket where none of the top-k fell still selects 1/64 of its size's share
FLOOR = 2.0 ** -6


def due(clock):
    """Whether the exchange numbered ``clock`` (0, 1, ... since the job began) tallies."""
    return clock % EVERY == 0


def local_counts(tallies, k):
    """c_b of this rank: the entries of each bucket from the highest bin up where the buckets' tallies (``tallies[b]
    [j]``: bucket b's entries in bin j, bins ascending) add up to at least ``k``; from the lowest bin if none does."""
    above = np.cumsum(np.stack([np.asarray(t, np.float64) for t in tallies])[:, ::-1], axis=1)[:, ::-1]
    reached = np.flatnonzero(above.sum(axis=0) >= k)
    return above[:, reached[-1] if reached.size else 0]


def shares(counts, numels):
    """The factors s_b = (C_b / Σ C) / (n_b / Σ n) of the summed counts ``counts``, at least :data:`FLOOR`; None when
    every count is 0."""
    total, n = float(np.sum(counts)), float(sum(numels))
    if total <= 0.0:
        return None
    return [max(FLOOR, float(c) / total * n / m) for c, m in zip(counts, numels)]


def settled(current, new):
    """The factor a bucket keeps: ``new`` unless it is within a factor :data:`KEEP` of ``current``."""
    if current > 0.0 and new > 0.0 and abs(math.log(new / current)) <= math.log(KEEP) * (1 + 1e-12):
        return current
    return new


def across(size, local_size=1):
    """The ranks a bucket's preset runs over: ``size``, or on two levels (``local_size`` L > 1 ranks a host) the
    size / L hosts (:mod:`hvd_sparse.core.hierarchy`: the preset runs on a host's shard among the hosts)."""
    return size // local_size if local_size > 1 else size


def ceiling(compression, size, min_rate, local_size=1):
    """The largest factor at which a bucket's sparse message stays ``min_rate`` times smaller than a dense
    allreduce's over ``size`` ranks (:mod:`hvd_sparse.core.budget`'s model of the preset's bytes), as the dense rule
    asks of a sparse bucket; on two levels (``local_size`` L > 1) of the shard's exchange among the hosts."""
    size = across(size, local_size)
    if size <= 1 or compression.sparsifier is None:
        return math.inf
    most = budget.density_for(1.0 / min_rate, compression.sparsifier, compression.reducer, size)
    return most / compression.density_for(size)


def rebalance(buckets, comm):
    """Steps 2-4 after an exchange in which the sparse buckets tallied. ``buckets``: ``[(engine, numel, most)]`` of
    the sparse buckets in order (each engine's ``last`` from this exchange; ``numel``: the bucket's entries, the same
    on every rank; ``most``: its :func:`ceiling`); ``comm``: every rank's, for one allreduce (phase ``budget``). A
    bucket that tallied nothing (no entry to select: all frozen) stays out; with fewer than two left there is nothing
    to split. Sets each engine's share, the same on every rank; returns the factors, or None (no split, or no count
    anywhere: shares unchanged)."""
    buckets = [bucket for bucket in buckets if "tally" in bucket[0].last]
    if len(buckets) < 2:
        return None
    like = buckets[0][0].last["tally"]
    xp = backend_of(like)
    tallies = xp.read(*[engine.last["tally"] for engine, _, _ in buckets])
    counts = local_counts(tallies, sum(int(engine.last["k"]) for engine, _, _ in buckets))
    summed = comm.allreduce(xp.asarray(counts.astype(np.int64), xp.index_dtype, like=like), SUM, "budget")
    factors = shares(xp.to_numpy(summed), [numel for _, numel, _ in buckets])
    if factors is None:
        return None
    factors = [min(factor, most) for factor, (_, _, most) in zip(factors, buckets)]
    for (engine, _, _), factor in zip(buckets, factors):
        engine.set_share(settled(engine.share, factor))
    return factors
