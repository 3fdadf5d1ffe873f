"""Deep Gradient Compression's recipe beyond momentum correction (Lin et al., ICLR 2018), as the engine runs it: the
density warm-up's stages and local gradient clipping (docs/algorithms.md, "The training recipe").

**Density warm-up** (``warmup_density=d0, warmup_stage_steps=T, warmup_factor=f``): the sparse steps start at
density d0 and divide it by f every T steps while it stays above the preset's own density d, which then holds for
the rest of the run (DGC: 25%, 6.25%, 1.5625%, 0.4%, then 0.1%)::

    stages   d0, d0/f, d0/f², ...   every one above d (:func:`stage_densities`); then d
    stage i  the steps [W + i·T, W + (i+1)·T)   W = warmup_dense_steps, the dense steps before them

The position in the schedule is the engine's step counter, the same on every rank and kept in its checkpoint, so
every rank runs the same stage and a resumed run continues the schedule where it stopped (:func:`stage_at`). Each
stage runs the preset's sparsifier with the stage's density (a twin: ``dataclasses.replace``), so every sparsifier
reads one density throughout a stage (Gaussiank's z, DCT's per-tensor K, ExDyna's and Ok-Topk's k and capacities),
and at the first step of a stage the scheme starts afresh, as after the dense warm-up: thresholds, partitions and
the scheme's step counter (``ctx.step``) as at its step 0, the residual carried over. Each stage has its own k, so
a schedule of S stages adds S message shapes to each of the preset's collectives, each negotiated once.

**Local gradient clipping** (``local_clip_norm=c``): each rank scales its own gradient g, before it enters the
velocity (momentum correction) and error feedback's accumulator, by ``min(1, c / (sqrt(P)·||g||))`` -- the global
threshold c scaled by P^-1/2, DGC's rule (:func:`clip_local`). ||g|| is the L2 norm of the unit's whole gradient on
this rank, in float64.

**Small tensors dense** (``dense_share=s``): a unit's smallest tensors, taken smallest first (ties in layout order)
while together they hold at most s·n of its n entries, are allreduced dense on every step, and the sparse step
runs on the other tensors alone (:func:`dense_tensors`; the engine's ``_step_split``). A top-k over the whole model
gives the small tensors whose gradients are large per entry -- biases, the convolutions of a CNN, the output layer --
more than their size, yet their entries still wait in the residual between the steps that send them; sent dense they
are exact on every step, for 8·n_small·(P−1)/P bytes a rank (a ring allreduce). Their error feedback stays empty.
"""

from __future__ import annotations

import math

import numpy as np

#: relative slack under which a stage's density counts as the preset's own (no stage of the same density)
SAME_DENSITY = 1e-9


def stage_densities(start, final, factor):
    """The densities of the warm-up's stages: ``start``, ``start/factor``, ... while above ``final`` (the preset's
    density, which follows them); empty when ``start`` is not above ``final``."""
    out, d = [], float(start)
    while d > final * (1.0 + SAME_DENSITY):
        out.append(d)
        d /= factor
    return tuple(out)


def stage_at(step, first, stage_steps, stages):
    """``(index, since)`` of the sparse step ``step`` (at or after ``first``, the first sparse step): the stage it is
    in (``stages`` for the preset's own density, after the ``stages`` warm-up stages of ``stage_steps`` steps each)
    and the step that stage began at."""
    index = min((step - first) // stage_steps, stages) if stage_steps else stages
    return index, first + index * stage_steps


def clip_local(xp, pieces, threshold, size):
    """The gradient ``pieces`` of one rank clipped by DGC's rule: scaled by ``min(1, threshold / (sqrt(size)·||g||))``
    (float64, rounded to float32 once). On the host a gradient within the limit, or one with a NaN or Inf, is returned
    as it is (the non-finite policy then sees it); on a device the factor stays there (no read), a NaN norm making the
    result NaN. Returns a list of pieces: ``pieces`` itself, or one float32 array."""
    limit = float(threshold) / math.sqrt(size)
    norm = xp.norm_f64(pieces)
    if isinstance(norm, float):
        if not (math.isfinite(norm) and norm > limit):
            return pieces
        factor = float(np.float32(limit / norm))
    else:
        factor = xp.astype(xp.clamp_max(limit / norm, 1.0), xp.float32)
    flat = xp.astype(pieces[0] if len(pieces) == 1 else xp.concat(pieces), xp.float32)
    return [xp.mul(flat, factor)]


def dense_tensors(layout, share):
    """The indexes (ascending) of the tensors of ``layout`` (their numels) that ``dense_share=share`` sends dense:
    the smallest first (ties in layout order) while their sum stays at most ``share`` of the whole; empty when none
    fits, or when all would (nothing left to sparsify)."""
    total = sum(layout)
    picked, held = [], 0
    for i in sorted(range(len(layout)), key=lambda i: (layout[i], i)):
        if held + layout[i] > share * total:
            break
        picked.append(i)
        held += layout[i]
    return () if len(picked) == len(layout) else tuple(sorted(picked))
