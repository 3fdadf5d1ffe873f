"""Ok-Topk's local selection with threshold reuse (docs/algorithms.md#oktopk; paper §3.1.3).

    select(a):                                      # t = ctx.step (sparse-step counter, from 0)
      reev  = (t % tau_p == 0)                      # t = 0 is always a re-evaluation step
      if reev:   L = kth_abs(a, k)                  # exact k-th largest |a| (per rank)
                 S = exact top-k of |a|             # ge_nonzero: topk_indices (ties -> lower index)
      else:                                         # one counting pass over the rungs L·f^j (f = guard_factor)
        if guard and count(a, L) > guard_ratio*k:   # ref:LSTM/VGG's pre-selection guard
          L = first rung j <= guard_iters with count(a, L·f^j) <= guard_target*k
        L = first rung at or above it with count(a, L) <= cap          # cap = capacity_ratio·k (1.25k)
        S = select(a, L)                            # ge_nonzero: |a| >= L and a != 0;  gt: |a| > L
      update (after the step, on the host):         # |S| and the rungs climbed ride in the opening's header
        L_nxt = band_adjust(L, |S|, k, lo_L, hi_L, /s_L, *s_L)     # takes effect next step
    band_adjust(th, cnt, k, lo, hi, relax, tighten): cnt < lo*k -> th/relax ; cnt > hi*k -> th*tighten ; else th

Thresholds are kept as Python floats (fp64, as in ref) and compared in fp32 (the rounded value is used for
every comparison, so numpy and torch select bit-identically). ``count(a, L)`` in the guard counts what the
configured rule would select (ref: strict ``>``, which is also what ``select_rule="gt"`` does).

Edge cases: a stored L <= 0 (the accumulator had fewer than k nonzeros at the last evaluation, or
density 1) would select every nonzero on reuse steps and no controller could ever raise it, so such a step
re-evaluates L exactly instead (local decision, no collective); zeros are never selected.

Cost of a reuse step. On the host, one scan of ``a`` (``xp.scan``) yields the candidates C = S(L) with their values
(or the engine hands them over: it collected them while it added the gradient into ``a``); the rungs are counted on
C only (raising L only shrinks the selection, so S(L·f^j) is the part of C the rule keeps). On a CPU float32 buffer
the scan is the fused select-and-compact kernel (one read pass, no |a| copy, no n-sized mask). On a device the rungs
are counted over ``a`` in one pass and the selection written padded to its capacity (``xp.select_capped``): no read
before the opening. The same indices and thresholds either way. Re-evaluation steps take the exact top-k.

This sparsifier is Ok-Topk's (pair it with :class:`hvd_sparse.core.oktopk.exchange.OkTopk`), but it is a
standalone sparsifier too: with the TopkA reducer it gives "TopkA with a reused threshold".
"""

from __future__ import annotations

import dataclasses

from ..sparsifiers.base import CLIMB, Sparsifier, ladder_factors
from ..validate import SELECT_RULE_FIX, SELECT_RULES, check_real, choice, integer, options, real


# -- the options both halves of Ok-Topk take (ThresholdReuse and exchange.OkTopk), each defined here once ----------
def threshold_period_option():
    """τ': the local and the global threshold are re-evaluated exactly every τ' sparse steps."""
    return integer(32)


def select_rule_option():
    """Which magnitudes a threshold selects: ``"ge_nonzero"`` (|x| >= th and x != 0) or ``"gt"`` (|x| > th)."""
    return choice("ge_nonzero", SELECT_RULES, fix=SELECT_RULE_FIX)


def max_select_ratio_option():
    """An optional hard cap on a count, in units of k (None: off)."""
    return real(None, 1.0, allow_none=True, fix="e.g. 4 (or None for no cap)")


def band_adjust(th, cnt, k, lo, hi, relax, tighten, xp=None):
    """The post-hoc band controller of the authors' code: ``th/relax`` below ``lo·k``, ``th·tighten`` above
    ``hi·k``, else ``th``. Python floats (fp64, as ref), or with ``xp`` values that may live on a device."""
    if xp is None:
        return th / relax if cnt < lo * k else th * tighten if cnt > hi * k else th
    return xp.choose(cnt < lo * k, th / relax, xp.choose(cnt > hi * k, th * tighten, th))


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
        max_select_ratio (float or None): optional hard cap: the selection's capacity is at most ratio·k (L climbs
            until at most that many pass; the largest stay). Default None (off, as ref; the capacity is 1.25k).

    Per-rank state (``state``): ``threshold`` (L for the next step), ``threshold_used`` (L of this step),
    ``selected`` (|S|), ``reeval`` (bool), ``guard_raises`` (the rungs L climbed this step), ``size`` (P).
    The guard and band are heuristics of the authors' code, not part of the paper.
    """

    name = "threshold_reuse"
    exact_k = False

    threshold_period: int = threshold_period_option()
    _: dataclasses.KW_ONLY
    select_rule: str = select_rule_option()
    guard_ratio: float = real(1.5, 0.0, low_incl=False, allow_none=True,
                              fix="e.g. 1.5 (ref:LSTM), 4/3 (ref:VGG) or None (no guard)")
    guard_factor: float = real(1.03, 1.0, low_incl=False, fix="e.g. 1.03")
    guard_iters: int = integer(5, minimum=0)
    band_lo: float = real(0.75, 0.0, fix="e.g. 0.75")
    band_hi: float = real(1.25, 0.0, fix="e.g. 1.25")
    band_relax: float = real(1.012, 1.0, fix="e.g. 1.012 (1.0 disables)")
    band_tighten: float = real(1.012, 1.0, fix="e.g. 1.012 (1.0 disables)")
    max_select_ratio: float = max_select_ratio_option()
    guard_target: float = real(None, 0.0, low_incl=False, allow_none=True,
                               fix="e.g. 1.0 (or None: the same as guard_ratio)")

    def check_together(self, api):
        check_real(self.band_hi, "band_hi", api, self.band_lo, fix="band_hi must be >= band_lo")

    @property
    def _climb(self):
        """The factors of the reuse step's ladder: the guard's (f^j, j <= guard_iters), then on to the capacity's
        (``CLIMB``'s reach, in the guard's factor)."""
        return ladder_factors(self.guard_factor, max(self.guard_iters, len(CLIMB) - 1))

    def initial_state(self):
        return {"threshold": None}

    #: the selection's capacity in units of k (measured: docs/algorithms.md#the-wire)
    capacity_ratio = 1.25

    def capacity(self, k, n, size=1):
        """The selection's size in a message: ``capacity_ratio``·k, at most ``max_select_ratio``·k."""
        cap = super().capacity(k, n, size)
        return cap if self.max_select_ratio is None else max(1, min(cap, int(self.max_select_ratio * k)))

    def _exact(self, xp, acc, k, cap):
        """Exact re-evaluation: (S, |S|, L), L read on the host (once per τ' steps). ge_nonzero: exactly the
        deterministic top-k; gt: |a| > k-th |a|."""
        if self.select_rule == "ge_nonzero":
            idx, th, count = xp.topk_padded(acc, k)
            return idx, count, float(xp.item(th))
        th = float(xp.kth_largest(xp.abs(acc), min(k, xp.numel(acc))))
        return (*xp.select_capped(acc, [th], "gt", cap, xp.numel(acc))[:2], th)

    def _reuse(self, xp, acc, k, L, cap, ctx):
        """The reuse step: ``(S, |S|, raises)``.

        1. the candidates: on the host, C and their values v, the indices and values ``rule`` selects at L (one
           scan of acc, or none: ``ctx.prefiltered``, collected by the engine while it added the gradient into
           acc); on a device, acc itself (nothing is compacted before the selection)
        2. the counts at L·f^j (f = guard_factor) in one pass (``xp.select_capped``): guard -- when the count at L
           exceeds guard_ratio·k, L rises to the first rung (at most guard_iters) with at most guard_target·k --
           and capacity -- past it, L climbs on until the selection fits (the largest magnitudes stay). Raising L
           only shrinks the selection, so the set at a raised L is the part of C the rule keeps; C is in ascending
           order, so is S. ``raises``: the rungs L climbed. When C fits and the guard does not act, S is C.
        """
        rule, n = self.select_rule, xp.numel(acc)
        cand, x = None, acc
        if not xp.on_device(acc):
            pre = ctx.prefiltered
            if pre is not None and pre.threshold == L and pre.rule == rule:     # collected by the add pass
                cand, x = pre.indices, pre.values
            else:
                cand, x = xp.scan(acc).select(L, rule, values=True, expect=k)
        guard = None
        if self.guard_ratio is not None and self.guard_iters > 0:          # pre-selection guard (ref:LSTM/VGG)
            limit = (self.guard_target if self.guard_target is not None else self.guard_ratio) * k
            guard = (self.guard_ratio * k, limit, self.guard_iters)
        m = None if cand is None else xp.numel(cand)
        if m is not None and m <= cap and (guard is None or m <= guard[0]):
            # every candidate passes at L (the rule chose them at it), and neither the guard nor the capacity
            # climbs: S is C, padded (the climb below would count and select them all again)
            return xp.concat([cand, xp.full(cap - m, n, xp.index_dtype, like=cand)], like=cand), m, 0
        ths = [L * f for f in self._climb]                  # L is a host float: the bounds go up in one copy
        # with L > 0, ge_nonzero is ge (one compare less on a device)
        pos, count, raises = xp.select_capped(x, ths, "ge" if rule == "ge_nonzero" else rule, cap, xp.numel(x),
                                              guard=guard)
        if cand is None:
            return pos, count, raises
        return xp.take(xp.concat([cand, xp.full(1, n, xp.index_dtype, like=cand)], like=cand), pos), count, raises

    def _reevaluates(self, state, ctx):
        """A re-evaluation step: every τ' steps, and when the stored L is not positive (an exact evaluation found
        fewer than k nonzeros: L <= 0 would select every nonzero on reuse steps and no controller could raise it)."""
        L = state.get("threshold")
        return (ctx.step % self.threshold_period == 0 or L is None or not L > 0.0
                or state.get("size", ctx.size) != ctx.size)

    def prefilter(self, state, ctx):
        """On reuse steps the selection starts from what the stored threshold L selects (fused CPU kernel):
        ``(L, select_rule)``; None on re-evaluation steps."""
        return None if self._reevaluates(state, ctx) else (state["threshold"], self.select_rule)

    def select(self, xp, acc, k, state, ctx):
        """``(S, |S|, raises)``: the exact top-k on re-evaluation steps (L read on the host), else the reuse step at
        the stored L (:meth:`_reuse`). Its controllers run in :meth:`update`, with ``|S|`` and ``raises`` back on the
        host in the opening's header (``ctx.selected``, ``ctx.note``)."""
        n = xp.numel(acc)
        cap = self.capacity(k, n)
        reev = self._reevaluates(state, ctx)
        state["reeval"] = bool(reev)
        if n == 0:
            state["threshold_used"] = 0.0
            return xp.zeros(0, xp.index_dtype, like=acc), 0, 0
        if reev:                                            # exact k-th |a| (re-evaluation step)
            idx, m, state["threshold_used"] = self._exact(xp, acc, k, cap)
            return idx, m, 0
        state["threshold_used"] = state["threshold"]
        return self._reuse(xp, acc, k, state["threshold"], cap, ctx)

    def update(self, xp, state, info, ctx):
        """The controllers, on the host: L used = the stored L times the guard factor ``raises`` times (the rungs
        the reuse step climbed), and the band controller for the next step from |S|."""
        k = self.k_for(ctx.layout and sum(ctx.layout) or 0)
        raises, m = ctx.note, ctx.selected
        L = state["threshold_used"] if state.get("reeval") else state["threshold_used"] * self._climb[raises]
        state["threshold_used"] = L
        state["threshold"] = band_adjust(L, m, k, self.band_lo, self.band_hi, self.band_relax, self.band_tighten)
        state["selected"] = m
        state["guard_raises"] = raises
        state["size"] = ctx.size
