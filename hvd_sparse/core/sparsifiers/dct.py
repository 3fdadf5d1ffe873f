"""DCT-DP (docs/algorithms.md#dct): per-tensor hard threshold, refreshed by a top-K every ``lifespan`` steps, or sooner
when the count it passes drifts.
Exchanged by :class:`hvd_sparse.core.reducers.topka.TopkA` (one allgather of 2k pairs, padded).

Rank p, step t (``ctx.step``), tensor l of ``ctx.layout`` (numels n_l, offsets = prefix sums):

    Gt   = G + E_l                          # error feedback (the engine's ``acc``)
    if t % L == 0 (or the layout changed, or drifted):  # life-span expired (t = 0 included), or the count drifted
        a     = nan_to_num(|Gt|, nan=0, posinf=0, neginf=0)
        K     = clamp(ceil(rho * n_l), 1, n_l)          # k_rounding="paper": n_l - floor(n_l*(1-rho)) + 1
        tau_l = K-th largest value of a
        if sync_threshold: tau_l = allreduce(tau_l, SUM)/P   # all tensors in one call, phase "dct_tau"
    M    = (|Gt| >= tau_l)                  # zero_tau_guard and tau_l == 0: M = (|Gt| > 0)
    while |M| > 2k: tau *= 1.03             # every tensor's alike (ours: the capacity, docs/algorithms.md#the-wire),
                                            #   at most 60 times, then the 2k largest of M
    send (nonzero(M) + offset_l, Gt[M])     # TopkA: one allgather of 2k pairs, padded; rank-order sum
    E_l  = where(M, 0, Gt)                  # the engine's error feedback (residual[included] = 0)
    drifted = |M| > 2k                      # ours: the capacity cut, the thresholds are stale; recompute next step
           or |M| outside [c/drift, c*drift]    # ours: c = |M| of the last recompute step

Between recomputes tau_l is stale: error feedback grows the unsent entries, so |M| grows with each step, to many
times k with L = 1000 (measured on a small CNN's gradients: docs/benchmarks.md, "While the model trains: every
preset (P = 4)"). Where |M| passes the capacity, the thresholds are recomputed at the next step, so a jump in the
gradients' scale is absorbed in one step (the paper, which sends all of M, has no capacity to pass). ``drift``
(default 2; None: the paper's schedule otherwise) also recomputes when |M| has left a band around the count of the
last recompute. |M| travels in the opening's header (the selection's note), so neither check reads anything more
on the host; with ``sync_threshold`` every rank's |M| does, and a cut on any rank recomputes on all.

NaN never passes the mask (it stays in E), ±Inf passes.
Optional drain (the paper's Remark 2), "flush" only: with ``ef_drain_period = T_d`` a Bernoulli(1/T_d) draw keyed by
(drain_seed, t) -- identical on every rank -- selects every entry this step, of which the capacity sends the 2k
largest (a full flush, Ghat = Gt and E = 0, would need a dense exchange: another shape on the wire). Mode "discard"
(drop E without sending) needs the residual to be cleared by the engine and is not available through the
sparsifier interface.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..comm import SUM
from ..validate import choice, flag, integer, options, real
from .base import CLIMB, Sparsifier

K_ROUNDINGS = ("ceil", "paper")
DRAIN_MODES = ("flush",)


# -- the size K of a tensor ------------------------------------------------------------------------------
def _snap(x):
    """``x`` rounded to the nearest integer when it is within float noise of it (0.07*100 -> 7), else None."""
    r = round(x)
    return int(r) if abs(x - r) <= 1e-9 * max(1.0, abs(x)) else None


def dct_k(n_l, density, k_rounding="ceil"):
    """K for a tensor of n_l entries : ceil(rho·n_l) ("ceil") or the paper's n_l - floor(n_l·(1-rho)) + 1
    ("paper"), clamped to [1, n_l]; products within float noise of an integer count as that integer."""
    if k_rounding == "ceil":
        x = density * n_l
        s = _snap(x)
        K = s if s is not None else math.ceil(x)
    else:
        x = (1.0 - density) * n_l
        s = _snap(x)
        K = n_l - (s if s is not None else math.floor(x)) + 1
    return min(max(K, 1), n_l)


@options
class DCT(Sparsifier):
    """DCT-DP (Gupta et al., "Training Recommender Systems at Scale: Communication-Efficient Model and Data
    Parallelism", KDD 2021; docs/algorithms.md#dct): one hard threshold per parameter tensor, recomputed as the
    K-th largest |Gt| only every ``lifespan`` steps; every entry with |Gt| >= tau is sent. Pair it with the
    TopkA reducer (allgather with counts, rank-order sum). Not exact-k.

    Args:
        density (float): rho in (0, 1]; K = clamp(ceil(rho·n_l), 1, n_l) per tensor. Required.
        lifespan (int): L, steps between threshold recomputes (t % L == 0); default 1000.
        k_rounding (str): "ceil" (default) or "paper" (K = n_l - floor(n_l·(1-rho)) + 1, clamped).
        zero_tau_guard (bool): when tau_l == 0 select |Gt| > 0 instead of >= 0; always on (False is refused: no
            sparsifier may send a zero entry).
        sync_threshold (bool): average tau over ranks on recompute steps (one allreduce of the per-tensor
            thresholds, phase ``dct_tau``); default False (each rank keeps its own tau, as in the paper).
        ef_drain_period (int or None): T_d of the stochastic drain; default None (off).
        ef_drain_mode (str): "flush" (default; the only mode available, see the module docstring).
        drain_seed (int): seed of the rank-identical drain draws; default 0.
        drift (float or None): the thresholds are also recomputed at the next step when the count they pass
            (before the capacity) leaves [c / drift, c · drift], c the count of the last recompute step; default 2.
            None: only every ``lifespan`` steps, as in the paper. Not with ``sync_threshold`` (the ranks' counts
            differ, the allreduce needs them all at one step).

    State (per rank): ``tau`` (list, one per tensor), ``layout``, ``reference`` (the count passed on the last
    recompute step), ``drifted`` (recompute at the next step), and statistics ``nnz`` (list, per tensor: on a
    device a device array), ``recomputed``, ``drained``, ``selected`` (the selection's size), ``passed`` (the count
    the thresholds passed, before the capacity).
    """

    name = "dct"
    exact_k = False
    #: the selection's capacity in units of k (measured: docs/algorithms.md#the-wire)
    capacity_ratio = 2.0

    lifespan: int = integer(1000)
    _: dataclasses.KW_ONLY
    k_rounding: str = choice("ceil", K_ROUNDINGS)
    zero_tau_guard: bool = flag(True)
    sync_threshold: bool = flag(False)
    ef_drain_period: int = integer(None, allow_none=True)
    ef_drain_mode: str = choice("flush", DRAIN_MODES, fix="'discard' (drop the error buffer without sending it) "
                                                          "is not available through the sparsifier interface")
    drain_seed: int = integer(0, minimum=0)
    drift: float = real(2.0, 1.0, low_incl=False, allow_none=True)

    def check_together(self, api):
        if self.sync_threshold and self.drift is not None:
            raise ValueError(f"{api}: sync_threshold=True averages the thresholds over the ranks, so every rank must "
                             "recompute them at the same step, and drift recomputes them when this rank's own count "
                             f"leaves its band (drift={self.drift!r}); pass drift=None with sync_threshold=True")
        if not self.zero_tau_guard:
            raise ValueError(f"{api}: zero_tau_guard=False would select the zero entries of a tensor whose threshold "
                             "is 0, and no sparsifier may send a zero (it is always on); leave zero_tau_guard=True")

    def _drain_now(self, t):
        """The drain: Bernoulli(1/T_d) keyed by (drain_seed, t): the same draw on every rank, no communication."""
        if self.ef_drain_period is None:
            return False
        if self.ef_drain_period == 1:
            return True
        return bool(np.random.default_rng([self.drain_seed, int(t)]).random() < 1.0 / self.ef_drain_period)

    def _recomputes(self, state, ctx, layout):
        return (ctx.step % self.lifespan == 0 or state.get("layout") != layout or "tau" not in state
                or state.get("drifted", False))

    def communicates(self, state, ctx):
        """A recompute step with ``sync_threshold`` averages the thresholds by an allreduce."""
        return self.sync_threshold and ctx.size > 1 and self._recomputes(state, ctx, list(ctx.layout))

    def _thresholds(self, xp, mag, layout, offsets, ctx):
        """The per-tensor thresholds of a recompute step: the K-th largest |Gt| of each tensor (NaN and Inf counted
        as 0), read to the host in one transfer, or averaged over the ranks with ``sync_threshold``."""
        mag = xp.nan_to_zero(mag)
        kth = [xp.kth_largest(mag[offsets[l]:offsets[l + 1]], dct_k(nl, self.density, self.k_rounding)) if nl
               else 0.0 for l, nl in enumerate(layout)]
        if self.sync_threshold and ctx.size > 1 and kth:
            mine = xp.stack([xp.asarray(v, xp.float32, like=mag) for v in kth])
            return [float(v) / ctx.size for v in xp.to_numpy(ctx.comm.allreduce(mine, SUM, "dct_tau"))]
        return [float(v[0]) for v in xp.read(*kth)]

    def select(self, xp, acc, k, state, ctx):
        """M = |Gt| >= tau of each entry's tensor, as the score |Gt| / tau >= 1 (tau = 0: |Gt| > 0), so that one
        capped selection serves every tensor: past the capacity, every tensor's threshold climbs alike (``CLIMB``)."""
        n = xp.numel(acc)
        layout = [int(x) for x in (ctx.layout if ctx.layout is not None else (n,))]
        if sum(layout) != n:
            raise ValueError(f"hvd_sparse.DCT: the layout {layout} does not add up to the buffer size n={n}")
        t = ctx.step
        recompute = self._recomputes(state, ctx, layout)
        mag = xp.abs(acc)
        offsets = [0]
        for nl in layout:
            offsets.append(offsets[-1] + nl)
        if recompute:                                          # threshold life-span expired
            state["tau"] = self._thresholds(xp, mag, layout, offsets, ctx)
            state["layout"] = layout
        state["capacity"] = self.capacity(k, n)
        if self._drain_now(t):                                 # drain "flush": M = all-true
            state.update(nnz=list(layout), recomputed=recompute, drained=True, selected=n)
            return xp.arange(n, xp.index_dtype, like=acc)
        score = xp.div(mag, xp.repeat(xp.asarray(state["tau"], xp.float32, like=acc), layout, n))
        idx, count, _, passed = xp.select_capped(score, xp.ladder(1.0, CLIMB, acc), "ge", state["capacity"], n,
                                                 counts=1)
        bounds = xp.searchsorted(idx, xp.asarray(offsets, xp.index_dtype, like=acc))
        state.update(nnz=xp.segment_counts(bounds), recomputed=recompute, drained=False, selected=count)
        return idx, count, passed[0]

    def update(self, xp, state, info, ctx):
        """The drift check, on the host: ``ctx.note`` is how many entries the thresholds passed (before the
        capacity), back with the opening's header. A recompute step sets the reference count; a later step whose
        count leaves [reference / drift, reference · drift] marks the thresholds stale, to be recomputed at the
        next step."""
        if state.get("drained"):
            return
        passed = int(ctx.note)
        if state.get("recomputed"):
            state["reference"] = passed
        state["passed"] = passed
        ref = state.get("reference", passed)
        # the capacity climbed (on any rank where the thresholds are averaged: they are recomputed together)
        cut = max(ctx.notes if self.sync_threshold else [passed], default=0) > state["capacity"]
        state["drifted"] = cut or self.drift is not None and not ref / self.drift <= passed <= ref * self.drift
