"""Ok-Topk's local selection with threshold reuse (docs/algorithms.md#oktopk; paper §3.1.3).

    select(a):                                      # t = ctx.step (sparse-step counter, from 0)
      reev  = (t % tau_p == 0)                      # t = 0 is always a re-evaluation step
      if reev:   L = kth_abs(a, k)                  # exact k-th largest |a| (per rank)
                 S = exact top-k of |a|             # ge_nonzero: topk_indices (ties -> lower index)
      else:
        if guard:                                   # ref:LSTM/VGG only
          repeat guard_iters(5): if count(a, L) > guard_ratio*k: L *= guard_factor(1.03) else break
        S = select(a, L)                            # ge_nonzero: |a| >= L and a != 0;  gt: |a| > L
        if max_select_ratio and |S| > max_select_ratio*k:      # optional hard cap
          L = kth_abs(a, k); S = exact top-k        # local, no consensus needed
      L_nxt = band_adjust(L, |S|, k, lo_L, hi_L, /s_L, *s_L)    # takes effect next step
      L = L_nxt
    band_adjust(th, cnt, k, lo, hi, relax, tighten): cnt < lo*k -> th/relax ; cnt > hi*k -> th*tighten ; else th

Thresholds are kept as Python floats (fp64, as in ref) and compared in fp32 (the rounded value is used for
every comparison, so numpy and torch select bit-identically). ``count(a, L)`` in the guard counts what the
configured rule would select (ref: strict ``>``, which is also what ``select_rule="gt"`` does).

Edge cases: a stored L <= 0 (the accumulator had fewer than k nonzeros at the last evaluation, or
density 1) would select every nonzero on reuse steps and no controller could ever raise it, so such a step
re-evaluates L exactly instead (local decision, no collective); zeros are never selected.

Cost of a reuse step. One scan of ``a`` (``xp.scan``) yields the candidates C = S(L) with their values (or the
engine hands them over: it collected them while it added the gradient into ``a``); the guard then counts and
raises L on C only (raising L only shrinks the selection, so S(L·f) is the part of C the rule keeps) -- no extra
pass over ``a`` per raise. On a CPU float32 buffer the scan is the fused select-and-compact kernel (one read pass,
no |a| copy, no n-sized mask); elsewhere (CUDA, TensorFlow, ``HVD_SPARSE_NATIVE=0``) |a| once, a compare and a
nonzero; the same indices and thresholds either way. Re-evaluation steps take the exact top-k.

This sparsifier is Ok-Topk's (pair it with :class:`hvd_sparse.core.reducers.oktopk.OkTopk`), but it is a
standalone sparsifier too: with the TopkA reducer it gives "TopkA with a reused threshold".
"""

from __future__ import annotations

import dataclasses

from ..selection import topk_indices
from ..validate import SELECT_RULE_FIX, SELECT_RULES, check_real, choice, integer, options, real
from ..xp.generic import f32
from .base import Sparsifier


def band_adjust(th, cnt, k, lo, hi, relax, tighten):
    """The post-hoc band controller of the authors' code: ``th/relax`` below ``lo·k``, ``th·tighten`` above
    ``hi·k``, else ``th``. Pure Python floats (fp64, as ref)."""
    if cnt < lo * k:
        return th / relax
    if cnt > hi * k:
        return th * tighten
    return th


@options
class ThresholdReuse(Sparsifier):
    """Ok-Topk local selection (Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning",
    PPoPP'22, §3.1.3; docs/algorithms.md#oktopk): the exact k-th largest ``|acc|`` is computed every
    ``threshold_period`` steps and reused in between, with ref's pre-selection guard and band controller.

    Args:
        density (float): target fraction in (0, 1]; k = max(1, floor(density·n)).
        threshold_period (int): τ', re-evaluate L exactly on steps t % τ' == 0 (t = ctx.step). Default 32.
        select_rule (str): ``"ge_nonzero"`` (default: |a| >= L and a != 0; exactly the deterministic top-k
            on re-evaluation steps) or ``"gt"`` (ref-compatible strict |a| > L; k-1 values on re-eval steps).
        guard_ratio (float or None): pre-selection guard on reuse steps: while count > guard_ratio·k raise L
            by ``guard_factor``, at most ``guard_iters`` times. Default 1.5 (ref:LSTM); None disables (ref:BERT).
        guard_factor (float): default 1.03.
        guard_iters (int): default 5.
        guard_target (float or None): once triggered, keep raising L until count <= guard_target·k (at most
            ``guard_iters`` times). Default None = guard_ratio (ref). The library's ``Compression.oktopk``
            uses guard_ratio=1.15, guard_factor=1.03, guard_iters=30, guard_target=1.05 (``OKTOPK_PRESETS``):
            after a cold start or a gradient spike the ref guard (at most x1.16 per step) lets |S| reach 5k
            for several steps; this one brings |S| to <= 1.05k within the step (up to x2.4; each extra raise
            is one count over the candidates, and only on overshooting steps).
        band_lo, band_hi (float): local band [lo·k, hi·k] of the post-hoc controller. Default 0.75, 1.25.
        band_relax (float): L /= band_relax when |S| < lo·k. Default 1.012 (1.0 disables).
        band_tighten (float): L *= band_tighten when |S| > hi·k. Default 1.012 (1.0 disables).
        max_select_ratio (float or None): optional hard cap: if |S| > ratio·k on a reuse step,
            recompute L exactly and select the exact top-k for this step. Default None (off, as ref).

    Per-rank state (``state``): ``threshold`` (L for the next step), ``threshold_used`` (L of this step),
    ``selected`` (|S|), ``reeval`` (bool), ``guard_raises`` (int), ``capped`` (bool), ``size`` (P).
    The guard and band are heuristics of the authors' code, not part of the paper.
    """

    name = "threshold_reuse"
    exact_k = False

    threshold_period: int = integer(32)
    _: dataclasses.KW_ONLY
    select_rule: str = choice("ge_nonzero", SELECT_RULES, fix=SELECT_RULE_FIX)
    guard_ratio: float = real(1.5, 0.0, low_incl=False, allow_none=True,
                              fix="e.g. 1.5 (ref:LSTM), 4/3 (ref:VGG) or None (no guard)")
    guard_factor: float = real(1.03, 1.0, low_incl=False, fix="e.g. 1.03")
    guard_iters: int = integer(5, minimum=0)
    band_lo: float = real(0.75, 0.0, fix="e.g. 0.75")
    band_hi: float = real(1.25, 0.0, fix="e.g. 1.25")
    band_relax: float = real(1.012, 1.0, fix="e.g. 1.012 (1.0 disables)")
    band_tighten: float = real(1.012, 1.0, fix="e.g. 1.012 (1.0 disables)")
    max_select_ratio: float = real(None, 1.0, allow_none=True, fix="e.g. 4 (or None for no cap)")
    guard_target: float = real(None, 0.0, low_incl=False, allow_none=True,
                               fix="e.g. 1.0 (or None: the same as guard_ratio)")

    def check_together(self, api):
        check_real(self.band_hi, "band_hi", api, self.band_lo, fix="band_hi must be >= band_lo")

    def initial_state(self):
        return {"threshold": None}

    def _exact(self, xp, acc, k):
        """Exact re-evaluation: (S, L). ge_nonzero: exactly the deterministic top-k; gt: |a| > k-th |a|."""
        if self.select_rule == "ge_nonzero":
            return topk_indices(xp, acc, k)
        n = xp.numel(acc)
        mag = xp.abs(acc)
        th = float(xp.kth_largest(mag, min(k, n)))
        return xp.nonzero(xp.gt(mag, f32(th))), th

    def _reuse(self, xp, acc, k, L, ctx):
        """The reuse step: (S, L, guard raises, capped).

        1. C, v = the indices and values ``rule`` selects at L       (one scan of acc; or none:
           ``ctx.prefiltered``, collected by the engine while it added the gradient into acc)
        2. guard: count and raise L on (C, v) only -- raising L only shrinks the selection, so the set
           at a raised L is the subset of C that the rule keeps; C is in ascending order, so is S
        3. hard cap (optional): exact top-k, which reads acc again
        """
        rule = self.select_rule
        raises, capped = 0, False
        guard = self.guard_ratio is not None and self.guard_iters > 0
        pre = ctx.prefiltered
        if pre is not None and pre.threshold == L and pre.rule == rule:     # collected by the add pass
            cand, vals = pre.indices, pre.values
        else:
            cand, vals = xp.scan(acc).select(L, rule, values=guard, expect=k)
        if guard and xp.numel(cand) > self.guard_ratio * k:        # pre-selection guard (ref:LSTM/VGG)
            cand, L, raises = self._guard(xp, cand, vals, L, k)
        if self.max_select_ratio is not None and xp.numel(cand) > self.max_select_ratio * k:
            cand, L = self._exact(xp, acc, k)               # hard cap: exact for this step
            capped = True
        return cand, L, raises, capped

    def _guard(self, xp, cand, vals, L, k):
        """``(S, L, raises)`` after the guard, which triggered (|C| > guard_ratio·k): L is raised by guard_factor
        until at most guard_target·k (guard_ratio·k without a target) candidates pass, at most guard_iters times.
        The raised thresholds L·f, L·f², ... are counted on the candidates' values in one read (one wait on a GPU)."""
        ths, th = [], L
        for _ in range(self.guard_iters):
            th *= self.guard_factor
            ths.append(th)
        limit = (self.guard_target if self.guard_target is not None else self.guard_ratio) * k
        candidates = xp.scan(vals)
        counts = candidates.counts(ths, self.select_rule, until=lambda c: c <= limit)
        raises = next((j + 1 for j, c in enumerate(counts) if c <= limit), len(ths))
        L = ths[raises - 1]
        return xp.take(cand, candidates.select(L, self.select_rule)[0]), L, raises

    def _reevaluates(self, state, ctx):
        L = state.get("threshold")
        return (ctx.step % self.threshold_period == 0 or L is None or not L > 0.0
                or state.get("size", ctx.size) != ctx.size)

    def prefilter(self, state, ctx):
        """On reuse steps the selection starts from what the stored threshold L selects (fused CPU kernel):
        ``(L, select_rule)``; None on re-evaluation steps."""
        return None if self._reevaluates(state, ctx) else (state["threshold"], self.select_rule)

    def select(self, xp, acc, k, state, ctx):
        n = xp.numel(acc)
        L = state.get("threshold")
        reev = self._reevaluates(state, ctx)
        raises, capped = 0, False
        if n == 0:
            idx, L = xp.zeros(0, xp.index_dtype, like=acc), 0.0
        elif reev:                                          # exact k-th |a| (re-evaluation step)
            idx, L = self._exact(xp, acc, k)
        else:
            idx, L, raises, capped = self._reuse(xp, acc, k, L, ctx)
        m = xp.numel(idx)
        state["threshold_used"] = L
        state["threshold"] = band_adjust(L, m, k, self.band_lo, self.band_hi, self.band_relax,
                                         self.band_tighten)
        state["selected"] = m
        state["reeval"] = bool(reev)
        state["guard_raises"] = raises
        state["capped"] = capped
        state["size"] = ctx.size
        return idx
