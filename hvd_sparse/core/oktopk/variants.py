"""Ok-Topk's variants (``Compression.oktopk(variant=...)``; docs/algorithms.md#oktopk): its local selection
(:class:`~hvd_sparse.core.oktopk.selection.ThresholdReuse`) and its exchange
(:class:`~hvd_sparse.core.oktopk.exchange.OkTopk`) with the knobs of one variant, each knob given once.

The two halves share the selection rule and τ' (``threshold_period``: the local threshold and the global one are
re-evaluated on the same steps), except where a variant re-evaluates the global threshold on steps of its own
(``global_threshold_period``: the library's, on every step); each variant names them once and both halves get
them. The local controllers (guard and band, on |S|) and the global ones (Γ's band or ladder, on K) are distinct
controllers of distinct counts, so they keep their own knobs. The authors' dense warm-up steps (128 / 512 / 0) are
not reproduced.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from .exchange import OkTopk
from .selection import ThresholdReuse


@dataclasses.dataclass(frozen=True)
class Variant:
    """The knobs of one variant: ``select_rule`` and ``threshold_period`` (τ') of both halves, the local selection's
    controllers (``local``: :class:`ThresholdReuse` options) and the exchange's (``exchange``: :class:`OkTopk`
    options); ``global_threshold_period``: the exchange's own τ' where it differs (None: ``threshold_period``)."""

    local: dict
    exchange: dict
    select_rule: str = "ge_nonzero"
    threshold_period: int = 32
    global_threshold_period: int = None


#: the variants by name
VARIANTS = {
    # the library's default: the paper's algorithm and balancing, exact-k selection, a local controller that keeps
    # |S| <= k, the global threshold re-evaluated on every step (G = the exact top-k of the owners' largest sums:
    # K = k; with a longer global period, a Γ ladder keeps K <= k on reuse steps), boundaries that split each step's
    # load evenly (the 6k(P-1)/P bound's assumptions) and at most 1.25k/P pairs from a rank to an owner in the split
    # and from an owner in the gather (the bound however the regions and Γ lie: docs/algorithms.md#oktopk)
    "library": Variant(
        global_threshold_period=1,
        local=dict(guard_ratio=1.15, guard_factor=1.03, guard_iters=30, guard_target=1.05, band_lo=0.95,
                   band_relax=1.03),
        exchange=dict(global_control="ladder", boundaries="measured", split_capacity=1.25, gather_capacity=1.25)),
    # the paper's: periodic exact re-evaluation only (no guard or band controllers), balancing iff max c_j > 4·avg
    "paper": Variant(
        local=dict(guard_ratio=None, band_relax=1.0, band_tighten=1.0),
        exchange=dict(global_relax=1.0, global_tighten=1.0)),
    # the authors' code, per model
    "ref_lstm": Variant(
        select_rule="gt",
        local=dict(guard_ratio=1.5, guard_factor=1.03, guard_iters=5, band_lo=0.75, band_hi=1.25, band_relax=1.012,
                   band_tighten=1.012),
        exchange=dict(global_band_lo=0.75, global_band_hi=1.25, global_relax=1.01, global_tighten=1.008)),
    "ref_vgg": Variant(
        select_rule="gt",
        local=dict(guard_ratio=4 / 3, guard_factor=1.03, guard_iters=5, band_lo=2 / 3, band_hi=1.25,
                   band_relax=1.012, band_tighten=1.012),
        exchange=dict(global_band_lo=2 / 3, global_band_hi=4 / 3, global_relax=1.008, global_tighten=1.008)),
    "ref_bert": Variant(
        select_rule="gt", threshold_period=128,
        local=dict(guard_ratio=None, band_lo=0.8, band_hi=1.25, band_relax=1.025, band_tighten=1.025),
        exchange=dict(global_band_lo=0.8, global_band_hi=1.25, global_relax=1.036, global_tighten=1.025)),
}


class OkTopkVariant(NamedTuple):
    """One of Ok-Topk's variants built: its local selection (density 1.0: ``Compression.oktopk`` sets it) and its
    exchange."""

    sparsifier: ThresholdReuse
    reducer: OkTopk


def build(variant):
    """The two halves of ``variant`` (a :class:`Variant`), at density 1.0 and repartition period 64."""
    shared = {"select_rule": variant.select_rule, "threshold_period": variant.threshold_period}
    period = variant.global_threshold_period or variant.threshold_period
    return OkTopkVariant(ThresholdReuse(1.0, **shared, **variant.local),
                         OkTopk(repartition_period=64, **dict(shared, threshold_period=period), **variant.exchange))


#: every variant built (``Compression.oktopk`` replaces the call's options in them)
OKTOPK_PRESETS = {name: build(v) for name, v in VARIANTS.items()}


def pair(variant, density, threshold_period, repartition_period, max_select_ratio, boundaries, few_collectives_from,
         global_fill, api, global_threshold_period=None):
    """The sparsifier and reducer of ``Compression.oktopk``: ``variant``'s, with the call's options
    (``global_threshold_period`` None: the variant's, or ``threshold_period`` with ``global_fill``, which acts on the
    global threshold's reuse steps; 1 with ``global_fill`` raises). Every variant but "library" fixes the three
    periods (other values raise, naming ``api``)."""
    if variant not in OKTOPK_PRESETS:
        raise ValueError(f"{api}: variant must be one of {sorted(OKTOPK_PRESETS)}, got {variant!r}")
    base = OKTOPK_PRESETS[variant]
    sp = {"density": density, "max_select_ratio": max_select_ratio}
    rd = {"max_select_ratio": max_select_ratio, "few_collectives_from": few_collectives_from,
          **({"global_fill": True} if global_fill else {})}
    knobs = {"threshold_period": threshold_period, "repartition_period": repartition_period}
    if global_fill and global_threshold_period == 1:
        raise ValueError(f"{api}: global_fill fills K on the global threshold's reuse steps, and "
                         "global_threshold_period=1 has none; leave global_threshold_period at None (with global_fill: "
                         "threshold_period) or give a longer one")
    if variant == "library":
        sp["threshold_period"] = threshold_period
        default = threshold_period if global_fill else VARIANTS[variant].global_threshold_period
        rd.update(knobs, threshold_period=global_threshold_period or default)
    elif knobs != {"threshold_period": 32, "repartition_period": 64} or global_threshold_period is not None:
        knobs["global_threshold_period"] = global_threshold_period
        raise ValueError(f"{api}: variant={variant!r} fixes threshold_period, repartition_period and "
                         f"global_threshold_period, got {knobs}; leave them at their defaults or use "
                         "variant='library'")
    if boundaries is not None:
        rd["boundaries"] = boundaries
    return dataclasses.replace(base.sparsifier, **sp), dataclasses.replace(base.reducer, **rd)
