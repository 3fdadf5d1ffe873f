"""Gaussiank (docs/algorithms.md#gaussiank): a threshold predicted from a Gaussian fit of the accumulator.

Per step, on every rank (``acc`` = a = residual + gradient, k = max(1, floor(d·n))):

    1. mu = mean(a) (signed);  sigma = std(a) (unbiased, N-1)
    2. th = mu + z·sigma,  z = Phi^-1(1 - d/2)         # 2.5758 for d=1%, 2.3263 for d=2%
    3. adjustment, cnt(th) = |{|a| > th}|, k34 = max(1, floor(3k/4)):
         lstm (default): repeat <= 50 times: if cnt < k34: th /= 1.012 else stop
         bert:           if cnt < k34: repeat <= 20 times while cnt < floor(5k/6): th /= 1.012
         vgg:            if cnt < k34: repeat <= 20 times while cnt < k34: th /= 1.02
                         elif cnt > floor(5k/4): repeat <= 20 times while cnt > floor(5k/4): th *= 1.02
    4. S = {|a| > th}                                   # residual: eps = a; eps[S] = 0 (engine, I = S)
    5. exchange: the ``topka`` reducer (counts allgather, then allgatherv of indices and values,
       sum in rank order) -- that pairing is the paper's Gaussiank baseline (Table 1: 2k(P-1) words).

Not exact-k: |S| can be larger or smaller than k (the paper's Fig. 6: the Gaussian fit under-estimates
k late in training; the loop only guarantees |S| >= floor(3k/4) unless it ran out of iterations).

Numerics. mu and sigma are computed in float64 (deterministic for a given backend; numpy and torch may
differ in the last float64 bit, which changes the selection only if a float32 value lies exactly on the
rounded threshold). The threshold is kept as a Python float (as in ref) and every comparison is done in
float32 against the largest float32 <= th, which is the same set as the exact comparison |a| > th.
Zeros are never selected (S = {|a| > max(th, 0)}): with th < 0 (a strongly negative mean) the reference's
rule would select zero entries, which a sparsifier must not do; for th <= 0 the loop stops early because
no further scaling can change the count.

Cost. Every count of step 3 and the selection of step 4 is a scan of the accumulator (``xp.scan``): on a CPU
float32 buffer (numpy, contiguous CPU torch) one read pass of the fused kernel each, no |a| copy, no mask;
elsewhere |a| once, then a compare per count; the same results either way. The float64 mean/std of steps 1-2
are one backend call (``xp.mean_std``).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..validate import choice, options
from .base import Sparsifier

#: Adjustment loops of step 3 (ref:LSTM, ref:BERT, ref:VGG).
ADJUST_VARIANTS = ("lstm", "bert", "vgg")


@functools.lru_cache(maxsize=64)
def gaussian_z(density):
    """z = Phi^-1(1 - d/2), the two-sided normal quantile of density ``d`` (scipy.special.ndtri)."""
    from scipy.special import ndtri

    return float(ndtri(1.0 - float(density) / 2.0))


def _f32_floor(th):
    """The largest float32 <= ``th`` (as a Python float): ``|a| > it`` equals ``|a| > th`` for float32 a."""
    t = np.float32(th)
    if float(t) > th:
        t = np.nextafter(t, np.float32(-np.inf))
    return float(t)


@options
class GaussianK(Sparsifier):
    """Gaussiank sparsifier (Shi et al., "Understanding Top-k Sparsification in Distributed Deep
    Learning", 2019; baseline of Li & Hoefler, PPoPP'22, §5; docs/algorithms.md#gaussiank).

    Predicts the threshold of the k largest magnitudes from a normal fit (mean, unbiased std) of the
    accumulator and rescales it until enough values pass (one O(n) count per iteration). Pair it with
    the ``topka`` reducer (variable-size allgather) to get the paper's Gaussiank baseline.

    Args:
        density (float): target fraction d = k/n in (0, 1]; sets z = Phi^-1(1 - d/2) and
            k = max(1, floor(d·n)).
        adjust (str): the threshold adjustment loop of step 3: ``"lstm"`` (ref:LSTM; the paper's
            "scale until more than 3k/4 values are selected"), ``"bert"`` or ``"vgg"``.
            Default: ``"lstm"``.

    State (per rank): ``threshold_initial`` (mu + z·sigma), ``threshold`` (after the adjustment, the
    value actually used), ``iterations`` (adjustment iterations run), ``mean``, ``std``.
    """

    name = "gaussiank"
    exact_k = False

    _: dataclasses.KW_ONLY
    adjust: str = choice("lstm", ADJUST_VARIANTS, fix="use 'lstm' (the default) for the paper's loop")

    def initial_state(self):
        return {"threshold": 0.0, "threshold_initial": 0.0, "iterations": 0}

    def select(self, xp, acc, k, state, ctx):
        scan = xp.scan(acc)                 # a CPU buffer: each count is one read pass of the fused kernel

        def count(th):
            return scan.count(_f32_floor(max(th, 0.0)), "gt")

        # 1-2. Gaussian prediction of the k-th largest |a|
        mu, sd = (0.0, 0.0) if xp.numel(acc) == 0 else xp.mean_std(acc)
        th = mu + gaussian_z(self.density) * sd
        th0 = th
        # 3. adjustment loop (a threshold <= 0 already selects every nonzero: nothing left to change)
        k34 = max(1, (3 * k) // 4)          # at least one entry: k = 1 would otherwise never adjust
        it = 0
        if self.adjust == "lstm":
            while it < 50 and th > 0.0 and count(th) < k34:
                th /= 1.012
                it += 1
        elif self.adjust == "bert":
            if th > 0.0 and count(th) < k34:
                k56 = max(1, (5 * k) // 6)
                while it < 20 and th > 0.0 and count(th) < k56:
                    th /= 1.012
                    it += 1
        else:  # vgg
            k54 = (5 * k) // 4
            c = count(th) if th > 0.0 else None
            if c is not None and c < k34:
                while it < 20 and c < k34:
                    th /= 1.02
                    it += 1
                    c = count(th)
            elif c is not None and c > k54:
                while it < 20 and c > k54:
                    th *= 1.02
                    it += 1
                    c = count(th)
        # 4. S = {|a| > th}, zeros excluded
        idx = scan.select(_f32_floor(max(th, 0.0)), "gt", expect=k)[0]
        state["mean"] = mu
        state["std"] = sd
        state["threshold_initial"] = th0
        state["threshold"] = th
        state["iterations"] = it
        return idx
