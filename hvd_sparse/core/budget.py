"""Byte budgets: the density at which a sparse preset sends a given fraction of a dense allreduce's bytes.

``Compression.<preset>(byte_budget=b)`` runs the preset at the density at which each rank sends, per step on average
over ranks and steps, at most the fraction b in (0, 1] of what a ring allreduce of the same float32 gradient sends
(:func:`dense_bytes`, 2·n·(P−1)/P words of 4 bytes), as far as the model below predicts it. Bytes are counted as the volume meter counts them
(``hvd_sparse/core/comm.py``: what a rank *sends*, the padding of a fixed-size message included; the agreement's
header apart).

The model. One step of a preset sends about

    4 · f(P) · s(d) · n · (P−1)/P  bytes per rank,

with s(d) the fraction of the n entries one rank puts on the wire at density d (:func:`wire_fraction`) and f(P) the
4-byte words its reducer sends per such entry, in units of (P−1)/P (:func:`words_per_entry`). Equal to
b · 8·n·(P−1)/P, it gives

    s(d) = 2·b / f(P):

n cancels, so the density depends on b and P only (:func:`density_for`): every rank derives the same density from the
number of ranks, and a new process set derives it again. The density is clipped to (0, 1]; at P = 1 (nothing is
sent) it is the limit of the formula.

s(d): the selection travels in a message of a fixed size (docs/algorithms.md#the-wire), its capacity: k for an exact
top-k (TopK), ``capacity_ratio``·k for the others (Gaussiank, DCT: 2; ThresholdReuse: 1.25; ExDyna: 2·k/P per rank),
whatever they select; so s(d) = ratio·d (ExDyna: ratio·d/P). Ok-Topk's split sends its selection's real entries
(about k: its controllers keep the count near k), so s(d) = d there.

=========  =====================  ==============================================================================
reducer    f(P)                   what a rank sends per step (c its selection's capacity)
=========  =====================  ==============================================================================
topka      2P                     its c (index, value) slots to P−1 ranks (allgather): 2c(P−1)
topk_dsa   TOPK_DSA_WORDS         2k(P−1)/P in the reduce-scatter, then its share of the reduced union N, 2N/P
                                  pairs to P−1 ranks: N grows from k to Pk as the selections overlap less
gtopk      4                      every rank but rank 0 sends its k pairs once and rank 0 broadcasts k pairs:
                                  4k(P−1)/P on average over the ranks (rank 0 alone sends 2k(P−1))
oktopk     3 + 2·g                its |S| ≈ k pairs in the split (2k(P−1)/P), g·k/P pairs to P−1 ranks in the
                                  gather (g = ``gather_capacity``, 1.25 in the library preset; None: 2P²; on the
                                  host only the owners' real pairs, fewer), and about k(P−1)/P of control words
                                  (the histogram, proposals and the gather's header)
exdyna     3P                     per slot of its capacity (c = 2·k/P): the index to P−1 ranks and the allreduce
                                  of the values at all P·c slots (on the host at the union's real entries, about
                                  k, in one of a ladder of sizes: fewer)
spardl     (4(Q−1) + 2(g−1))/Q    g = groups teams of Q = P/g ranks: 2⌊k/Q⌋ words per hop of the reduce-scatter and
           · P/(P−1)              of the all-gather, at most as many per other team (4k(P−1)/P for g = 1)
=========  =====================  ==============================================================================

Calibration: ``hvd_sparse.testing.simulate`` of every preset (defaults) at the density the model derives, on
``SyntheticGradients(100000, P, seed=0)`` (16 layers), 40 steps (the start-up steps included); the mean sent bytes per
rank and step over ``byte_budget`` x :func:`dense_bytes`, for b = 0.05:

=========  ======  ======  ======  ======  ========================================================================
preset     P = 4   P = 8   P = 64  P = 256 why not 1
=========  ======  ======  ======  ======  ========================================================================
topka      1.00    1.00    0.998   0.973   exact (k = ⌊d·n⌋ rounds down)
topk_dsa   0.915   0.908   0.883   0.825   N varies with the data (table: 40-step means of b = 0.01-0.2, ~8% margin)
gtopk      1.00    1.00    1.00    1.00    exact
oktopk     0.790   0.802   0.817   0.996   the split carries |S| ≈ 0.9k; the gather its owners' c = ⌈1.25k/P⌉
                                           largest sums on every step (the exact global selection; a device's
                                           at P = 4: 0.794; with the global threshold reused the host's gather
                                           carried fewer, 0.686-0.895, a device's 0.798-1.23); at P = 256
                                           (k/P = 7.1) the gather's header exceeds the model's allowance
exdyna     0.775   0.765   0.748   0.749   its indices' capacity is sent whatever it selects; the host's values at
                                           the union's real entries (a device's at all P·c slots: 1.00, 0.998,
                                           0.999, 0.999)
spardl     1.00    0.998   0.998   0.922   exact but for ⌊k/Q⌋ per block
gaussiank  1.00    0.998   0.998   0.922   its capacity is sent (k = ⌊d·n⌋ rounds down)
dct        1.00    0.998   0.998   0.922   its capacity is sent
=========  ======  ======  ======  ======  ========================================================================

Budgets out of reach. The density has no floor, but k = max(1, ⌊d·n⌋) is at least 1: when d·n < 1 the preset
sends one entry per rank, f(P)·(P−1)/P words, more than the budget (n below about P/b for TopkA), without a warning:
n is not known when the density is derived.

Limits of the model: the per-step control words (Ok-Topk's histogram, the gather's header) do not scale with k, so
where k/P is small they add to the volume (Ok-Topk at k/P = 7.1: 0.996 of the budget on the host; 1.23 on a device,
measured with the global threshold reused); int64 indices (n > 2^31 − 2) make a pair 12 bytes, not 8; the model is
the library's Ok-Topk variant: "paper" and "ref_*", without its count controllers, select more than k for tens of
steps (their capacity, 1.25k, bounds them). SparDL with ``groups`` > 1 stays below its bound (P = 64, groups = 4:
0.64 of the budget; P = 8, groups = 2: 0.88, and 1.00 with ``sag="recursive"``).
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

#: words per entry on the wire, in units of (P−1)/P, by reducer name: ``f(reducer, P)`` (module docstring)
WORDS = {
    "topka": lambda reducer, P: 2.0 * P,
    "topk_dsa": lambda reducer, P: _dsa_words(P),
    "gtopk": lambda reducer, P: 4.0,
    "oktopk": lambda reducer, P: 3.0 + 2.0 * (2 * P * P if reducer.gather_capacity is None else
                                              reducer.gather_capacity),
    "exdyna": lambda reducer, P: 3.0 * P,
    "spardl": lambda reducer, P: _spardl_words(reducer.groups, P),
}


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
    """f(P): 4-byte words a rank of ``reducer`` sends per entry it puts on the wire, in units of (P−1)/P."""
    return WORDS[reducer.name](reducer, max(1, int(size)))


def wire_fraction(sparsifier, reducer, density, size):
    """s(d): the fraction of the entries one rank puts on the wire at ``density`` over ``size`` ranks: its
    selection's capacity (module docstring)."""
    if not reducer.uses_selection or reducer.name == "oktopk" or sparsifier.exact_k:   # k itself (SparDL: its own)
        return density
    share = size if getattr(sparsifier, "partitioned", False) else 1
    return sparsifier.capacity_ratio * density / share


def fraction(sparsifier, reducer, density, size):
    """The model's sent bytes at ``density`` as a fraction of :func:`dense_bytes` (P = 1: the limit P -> 1)."""
    return words_per_entry(reducer, size) * wire_fraction(sparsifier, reducer, density, size) / 2.0


def density_for(byte_budget, sparsifier, reducer, size):
    """The density at which the model's sent bytes are ``byte_budget`` x :func:`dense_bytes` over ``size`` ranks,
    in (0, 1]."""
    target = 2.0 * float(byte_budget) / words_per_entry(reducer, size)     # s(d) to reach
    return min(1.0, target / wire_fraction(sparsifier, reducer, 1.0, size))


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
