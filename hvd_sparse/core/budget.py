"""Byte budgets: the density at which a sparse preset sends a given fraction of a dense allreduce's bytes.

``Compression.<preset>(byte_budget=b)`` runs the preset at the density at which each rank sends, per step on average
over ranks and steps, at most the fraction b in (0, 1] of what a ring allreduce of the same float32 gradient sends
(:func:`dense_bytes`, 2·n·(P−1)/P words of 4 bytes), as far as the model below predicts it. Bytes are counted as the volume meter counts them
(``hvd_sparse/core/comm.py``: what a rank *sends*; the agreement's 28-byte control vector apart).

The model. One step of a preset sends about

    4 · f(P) · s(d) · n · (P−1)/P  bytes per rank,

with s(d) the fraction of the n entries one rank selects at density d (:func:`selected_fraction`; d itself for an
exact top-k) and f(P) the 4-byte words its reducer sends per selected entry, in units of (P−1)/P
(:func:`words_per_entry`). Equal to b · 8·n·(P−1)/P, it gives

    s(d) = 2·b / f(P):

n cancels, so the density depends on b and P only (:func:`density_for`): every rank derives the same density from the
number of ranks, and a new process set derives it again. The density is clipped to (0, 1]; at P = 1 (nothing is
sent) it is the limit of the formula.

=========  =====================  ==============================================================================
reducer    f(P)                   what a rank sends per step (k = max(1, ⌊d·n⌋), |S| its selection)
=========  =====================  ==============================================================================
topka      2P                     its |S| (index, value) pairs to P−1 ranks (allgather): 2|S|(P−1)
topk_dsa   TOPK_DSA_WORDS         2k(P−1)/P in the reduce-scatter, then its share of the reduced union N, 2N/P
                                  pairs to P−1 ranks: N grows from k to Pk as the selections overlap less
gtopk      4                      every rank but rank 0 sends its k pairs once and rank 0 broadcasts k pairs:
                                  4k(P−1)/P on average over the ranks (rank 0 alone sends 2k(P−1))
oktopk     7                      the paper's bound 6k(P−1)/P, plus k(P−1)/P for the per-step control words (load
                                  histogram of 2P int64 counts, ladder, counts: about 10(P−1) 4-byte words)
exdyna     3P                     per entry it selects in its partition (about k/P of them): the index to P−1
                                  ranks and the allreduce of the values at the union of the P partitions
spardl     (4(Q−1) + 2(g−1))/Q    g = groups teams of Q = P/g ranks: 2⌊k/Q⌋ words per hop of the reduce-scatter and
           · P/(P−1)              of the all-gather, at most as many per other team (4k(P−1)/P for g = 1)
=========  =====================  ==============================================================================

s(d) per sparsifier: TopK selects k, and so does Ok-Topk's ThresholdReuse, whose controllers keep the count near k
(Ok-Topk's K as well); ExDyna's ranks select 1.5·k/P each (:data:`SELECTED_RATIO`: its threshold starts from one
top-k, selects 2-3.5k for the first steps and settles near 1.1-1.2k); Gaussiank's and DCT's counts follow the density
loosely (:data:`SELECTED`), since their thresholds are statistical (μ + zσ of a heavy-tailed accumulator: 10-20k
at d = 1e-4) or stale (DCT's is recomputed once per ``lifespan``, and error feedback pushes the count between
recomputations to 15k at d = 0.01, and to 2% of n at any d ≤ 1e-5, where every tensor selects one entry).

Calibration: ``hvd_sparse.testing.simulate`` of every preset (defaults) at the density the model derives, on
``SyntheticGradients(100000, P, seed=0)`` (16 layers), 40 steps (the start-up steps included); the mean sent bytes per
rank and step over ``byte_budget`` x :func:`dense_bytes`, for b = 0.05:

=========  ======  ======  ======  ======  ========================================================================
preset     P = 4   P = 8   P = 64  P = 256 why below 1
=========  ======  ======  ======  ======  ========================================================================
topka      1.00    1.00    0.998   0.973   exact (k = ⌊d·n⌋ rounds down)
topk_dsa   0.915   0.908   0.883   0.825   N varies with the data (table: 40-step means of b = 0.01-0.2, ~8% margin)
gtopk      1.00    1.00    1.00    1.00    exact
oktopk     0.526   0.543   0.651   0.861   measures 3.7-4.5k(P−1)/P; at P = 256 the control words are a quarter
exdyna     0.827   0.839   0.854   0.893   the count varies around k (1.2-1.25k over 40 steps, model 1.5k)
spardl     1.00    0.998   0.998   0.922   exact but for ⌊k/Q⌋ per block
gaussiank  0.897   0.895   1.21*   4.83*   the count varies with the data (seed 7: 0.76 and 0.67 at P = 4, 8)
dct        1.49*   2.96*   23.4*   93.6*   the count does not follow the density
=========  ======  ======  ======  ======  ========================================================================

Starred: out of the model's reach (:func:`fraction` at the smallest density exceeds b): the preset runs at that density
(Gaussiank 1e-6, DCT 1e-5) with a ``RuntimeWarning`` and sends more than the budget. At b = 0.2 (P = 4, 8, 64) the
ratios are 0.83-0.86 (topk_dsa), 0.58-0.61 (oktopk), 0.77-0.79 (exdyna), 0.89-0.92 (gaussiank), 0.93 (dct, P = 4);
at b = 0.01, 0.90-0.91, 0.52-0.91, 0.86-0.95 and 0.91 (gaussiank, P = 4, 8).

The selected fraction of Gaussiank and DCT (lifespan 1000) per rank, mean over 40 steps at P = 2, the larger of
seeds 0 and 7, times 1.1, interpolated log-log (:data:`SELECTED`): Gaussiank 0.00103 at d = 1e-6, 0.00462 at 1e-3,
0.0145 at 1e-2; DCT 0.027 at d ≤ 1e-5, 0.0806 at 1e-3, 0.164 at 1e-2. With TopkA's allgather (2|S|(P−1) words) DCT
therefore sends at least 0.027·P of the dense bytes on this data: 0.11 at P = 4, more than the dense allreduce from
P = 38; Gaussiank reaches b = 0.05 up to P = 48.

Budgets out of reach. For an exact top-k the density has no floor, but k = max(1, ⌊d·n⌋) is at least 1: when
d·n < 1 the preset sends one entry per rank, f(P)·(P−1)/P words, more than the budget (n below about P/b for
TopkA), without a warning: n is not known when the density is derived. For the table-based sparsifiers the smallest
density is the table's first; below it the model's bytes stop falling.

Limits of the model: the per-step control words (counts, Ok-Topk's histogram) do not scale with k, so where k/P is
small they add to the volume (Ok-Topk at P = 256: 0.86 of the budget at k = 5.6P, more below); int64 indices (n > 2^31 − 2) make a pair 12 bytes, not 8;
Gaussiank's count settles lower after its first 10-20 steps (long runs use less of the budget) while DCT's grows with
the steps since its last recomputation (over 200 steps 1.1-1.5 times the 40-step mean: a long
``lifespan`` exceeds the budget); the model is the library's Ok-Topk variant: "paper" and "ref_*", without its count
controllers, select several k for tens of steps (docs/algorithms.md) and exceed the budget (P = 8: 5.4 and 1.7 times
it for "paper" and "ref_vgg") unless ``max_select_ratio`` caps the counts (1.2: 0.68 of it for both). SparDL with
``groups`` > 1 stays below its bound (P = 64, groups = 4: 0.64 of the budget; P = 8, groups = 2: 0.88, and 1.00 with
``sag="recursive"``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings

#: bytes of one word on the wire: a float32 value or an int32 index
WORD_BYTES = 4
#: the density a byte-budget preset's sparsifier is built with, before ``SparseCompression`` sets the one for P = 1
TEMPLATE_DENSITY = 1.0

#: (P, f(P)) of TopkDSA: the largest measured mean of the words per entry on SyntheticGradients(100000) (40 steps,
#: b = 0.01-0.2), plus ~8%; linear in log2 P between the points, with the last slope beyond 256, never above 2 + 2P
#: (disjoint selections)
TOPK_DSA_WORDS = ((1, 4.0), (2, 6.1), (4, 9.2), (8, 13.8), (16, 19.3), (32, 25.3), (64, 31.8), (256, 45.0))

#: words per selected entry, in units of (P−1)/P, by reducer name: ``f(reducer, P)`` (module docstring)
WORDS = {
    "topka": lambda reducer, P: 2.0 * P,
    "topk_dsa": lambda reducer, P: _dsa_words(P),
    "gtopk": lambda reducer, P: 4.0,
    "oktopk": lambda reducer, P: 7.0,
    "exdyna": lambda reducer, P: 3.0 * P,
    "spardl": lambda reducer, P: _spardl_words(reducer.groups, P),
}

#: (density, selected fraction per rank) of the sparsifiers whose count follows the density loosely: 40-step means
#: on SyntheticGradients(100000), the larger of seeds 0 and 7, times 1.1 (the module docstring's calibration)
SELECTED = {
    "gaussiank": ((1e-6, 0.00103), (3e-6, 0.00123), (1e-5, 0.00151), (3e-5, 0.00185), (1e-4, 0.00242),
                  (3e-4, 0.00318), (1e-3, 0.00462), (3e-3, 0.0071), (1e-2, 0.0145), (3e-2, 0.0349),
                  (0.1, 0.0994), (0.3, 0.28), (1.0, 1.0)),
    "dct": ((1e-5, 0.027), (3e-5, 0.0278), (1e-4, 0.0357), (3e-4, 0.0562), (1e-3, 0.0806), (3e-3, 0.111),
            (1e-2, 0.164), (3e-2, 0.226), (0.1, 0.322), (0.3, 0.481), (1.0, 1.0)),
}

#: count / k of the sparsifiers that select about a constant multiple of k (all ranks together); others: 1
SELECTED_RATIO = {"exdyna": 1.5}


def dense_bytes(numel, size):
    """Bytes each rank sends in a ring allreduce of ``numel`` float32 values over ``size`` ranks: 8·n·(P−1)/P."""
    return 2 * WORD_BYTES * numel * (size - 1) / size


def check_byte_budget(value, api, reducer=None):
    """``value`` (None passes) as a float in (0, 1], or a ValueError/TypeError naming ``byte_budget``; with
    ``reducer``, a ValueError unless it is sparse and has a cost model (:data:`WORDS`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{api}: byte_budget must be a number in (0, 1] (the fraction of a dense ring allreduce's "
                        f"bytes each rank may send), got {value!r} ({type(value).__name__})")
    b = float(value)
    if not math.isfinite(b) or not 0.0 < b <= 1.0:
        raise ValueError(f"{api}: byte_budget must be in (0, 1] (the fraction of a dense ring allreduce's bytes "
                         f"each rank may send), got {value!r}")
    if reducer is not None and (getattr(reducer, "name", None) not in WORDS or not reducer.sparse):
        raise ValueError(f"{api}: byte_budget needs a cost model of the reducer, and {reducer!r} has none "
                         f"(models: {', '.join(sorted(WORDS))}); pass density instead")
    return b


def template_density(density, byte_budget, api):
    """The density a preset's sparsifier is built with: ``density``, or :data:`TEMPLATE_DENSITY` when the
    (checked) ``byte_budget`` is given instead; a ValueError naming both unless exactly one of them is given."""
    if (density is None) == (byte_budget is None):
        got = "neither" if density is None else f"density={density!r} and byte_budget={byte_budget!r}"
        raise ValueError(f"{api}: give exactly one of density (the fraction of entries each rank selects) and "
                         f"byte_budget (the fraction of a dense allreduce's bytes each rank sends), got {got}")
    if density is None:
        check_byte_budget(byte_budget, api)
        return TEMPLATE_DENSITY
    return density


def sparsifier_for(byte_budget, sparsifier, reducer, size, who):
    """``sparsifier`` with the density :func:`density_for` ``size`` ranks. Warns (``RuntimeWarning``, naming
    ``who``) when ``size`` > 1 and the model's bytes exceed the budget even at the smallest density it allows."""
    twin = dataclasses.replace(sparsifier, density=density_for(byte_budget, sparsifier, reducer, size))
    reached = fraction(twin, reducer, twin.density, size)
    if size > 1 and reached > byte_budget * (1 + 1e-9):
        warnings.warn(f"{who}: at P = {size} ranks the cost model expects {reached:.3g} of the dense bytes even at "
                      f"the smallest density it allows ({twin.density:g}); running there, above the budget "
                      "(see hvd_sparse.core.budget)", RuntimeWarning, stacklevel=4)
    return twin


def words_per_entry(reducer, size):
    """f(P): 4-byte words a rank of ``reducer`` sends per entry it selects, in units of (P−1)/P."""
    return WORDS[reducer.name](reducer, max(1, int(size)))


def selected_fraction(sparsifier, reducer, density, size):
    """s(d): the fraction of the entries one rank selects at ``density`` over ``size`` ranks (the model's)."""
    if not reducer.uses_selection:                   # the exchange picks k entries itself (SparDL)
        return density
    name = getattr(sparsifier, "name", None)
    if name in SELECTED:
        return _loglog(SELECTED[name], density)
    share = size if getattr(sparsifier, "partitioned", False) else 1
    return SELECTED_RATIO.get(name, 1.0) * density / share


def fraction(sparsifier, reducer, density, size):
    """The model's sent bytes at ``density`` as a fraction of :func:`dense_bytes` (P = 1: the limit P -> 1)."""
    return words_per_entry(reducer, size) * selected_fraction(sparsifier, reducer, density, size) / 2.0


def density_for(byte_budget, sparsifier, reducer, size):
    """The density at which the model's sent bytes are ``byte_budget`` x :func:`dense_bytes` over ``size`` ranks,
    in (0, 1]; the smallest density of the sparsifier's table when even that sends more (see :func:`fraction`)."""
    target = 2.0 * float(byte_budget) / words_per_entry(reducer, size)     # s(d) to reach
    name = getattr(sparsifier, "name", None)
    if reducer.uses_selection and name in SELECTED:
        return _loglog(SELECTED[name], target, inverse=True)
    return min(1.0, target / (selected_fraction(sparsifier, reducer, 1.0, size)))


def _dsa_words(P):
    pts = TOPK_DSA_WORDS
    if P >= pts[-1][0]:
        (p0, f0), (p1, f1) = pts[-2], pts[-1]
        slope = (f1 - f0) / math.log2(p1 / p0)
        return min(2.0 + 2.0 * P, f1 + slope * math.log2(P / p1))
    for (p0, f0), (p1, f1) in zip(pts, pts[1:]):
        if p0 <= P <= p1:
            return f0 + (f1 - f0) * math.log2(P / p0) / math.log2(p1 / p0)
    return pts[0][1]


def _spardl_words(groups, P):
    if P == 1:
        return 4.0
    g = groups if P % groups == 0 else 1
    Q = P // g
    return (4.0 * (Q - 1) + 2.0 * (g - 1)) / Q * P / (P - 1)


def _loglog(table, x, inverse=False):
    """Piecewise log-log interpolation of ``table`` ((d, s) points, both increasing) at d = ``x`` (s = ``x`` with
    ``inverse``), clamped to the table's ends."""
    pts = [(s, d) for d, s in table] if inverse else list(table)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + t * math.log(y1 / y0))
    return pts[-1][1]
