"""Ok-Topk (Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning", PPoPP'22): the O(k) sparse
allreduce, all of it in this package (docs/algorithms.md#oktopk).

One step on every rank, beside Algorithm 1 of the paper (a = ε + g, the accumulator the engine hands over; τ' the
threshold period, τ the repartition period; t counts this unit's sparse steps from 0):

    paper (Algorithm 1)                         here
    -----------------------------------------   ---------------------------------------------------------------------
    reev = t mod τ' == 0                        selection.ThresholdReuse.select   (t = 0 always re-evaluates)
    L = k-th largest |a| (reev), else reused    selection: the exact top-k, else the stored L with its guard
    S = {i : |a_i| >= L}                        selection: S, padded to its capacity (1.25k), ascending
    off = repartition every τ steps             regions.Regions.opening/plan: the proposals (or a histogram of S)
                                                ride in the step's opening; every rank places the same regions
    ρ = region r of Σ_p S_p  (split-reduce)     exchange.OkTopk._split: one alltoall of S's pairs (the library's
                                                preset: at most s = 1.25k/P to an owner), added in rank order
    reev: G = top-k of allgather(ρ), Γ = its    exchange.OkTopk._gather: one collective of at most c pairs per
          k-th magnitude                        owner (1.25k/P in the library's preset), from Γ up (its count
                                                below Γ in the header);
    else: G = allgatherv({|ρ| >= Γ}), Γ moves   exchange.OkTopk._select: the top-k (reev) or the pairs at Γ's rung
    ε = a; ε[S ∩ G] = 0                         exchange.OkTopk._finish: I = S ∩ G (the engine zeroes I in ε)
    L, Γ follow |S| and K (the authors' code)   selection.ThresholdReuse.update (L), exchange.Band / Ladder (Γ)

Where the data of a step goes: ``OkTopk.reduce`` runs the phases in order, each handing its result to the next
(:class:`~hvd_sparse.core.oktopk.exchange.Step` -> ``Placement`` -> the region's sums -> ``Gathered`` ->
``Chosen``); nothing else is written during a step but the reducer's state at its end.

Files:

* ``selection.py`` -- :class:`ThresholdReuse`, the local selection (a sparsifier: it pairs with any reducer);
* ``exchange.py`` -- :class:`OkTopk`, the exchange (a reducer: it pairs with any sparsifier), with Γ's controllers
  (:class:`~hvd_sparse.core.oktopk.exchange.Band`, :class:`~hvd_sparse.core.oktopk.exchange.Ladder`);
* ``regions.py`` -- where the region boundaries come from (pure functions of data every rank holds alike);
* ``variants.py`` -- the variants of ``Compression.oktopk(variant=...)``, each knob given once.

Departures from the paper for fixed-shape collectives (one Horovod negotiation per phase) are listed in
``exchange.py`` and docs/algorithms.md#oktopk.
"""

from .exchange import FEW_COLLECTIVES_FROM, Band, Ladder, OkTopk
from .selection import ThresholdReuse, band_adjust
from .variants import OKTOPK_PRESETS, VARIANTS

__all__ = ["FEW_COLLECTIVES_FROM", "OKTOPK_PRESETS", "VARIANTS", "Band", "Ladder", "OkTopk", "ThresholdReuse",
           "band_adjust"]
