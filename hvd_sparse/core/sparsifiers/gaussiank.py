"""Gaussiank (docs/algorithms.md#gaussiank): a threshold predicted from a Gaussian fit of the accumulator.

Per step, on every rank (``acc`` = a = residual + gradient, k = max(1, floor(d·n))):

    1. mu = mean(a) (signed);  sigma = std(a) (unbiased, N-1)
    2. th = mu + z·sigma,  z = Phi^-1(1 - d/2)         # 2.5758 for d=1%, 2.3263 for d=2%
    3. adjustment, cnt(th) = |{|a| > th}|, k34 = max(1, floor(3k/4)):
         lstm (default): repeat <= 50 times: if cnt < k34: th /= 1.012 else stop
         bert:           if cnt < k34: repeat <= 20 times while cnt < floor(5k/6): th /= 1.012
         vgg:            if cnt < k34: repeat <= 20 times while cnt < k34: th /= 1.02
                         elif cnt > floor(5k/4): repeat <= 20 times while cnt > floor(5k/4): th *= 1.02
       descend (ours): if the loop ran out with cnt < k34: th /= 1.03 until cnt >= k34 (at most 300 times)
    4. capacity: while more than 2k pass, th *= 1.03 (up to 60 times, not to an empty selection), then the 2k
       largest
    5. S = {|a| > th}                                   # residual: eps = a; eps[S] = 0 (engine, I = S)
    6. exchange: the ``topka`` reducer (one allgather of 2k pairs, padded; sum in rank order) -- that
       pairing is the paper's Gaussiank baseline (Table 1: 2k(P-1) words).

Not exact-k: |S| can be larger or smaller than k (the paper's Fig. 6: the Gaussian fit under-estimates
k late in training; the loop only guarantees |S| >= floor(3k/4) unless it ran out of iterations). Step 4 is
ours: the selection travels in a message of a fixed size, 2k (docs/algorithms.md#the-wire); the largest stay.

Numerics. mu and sigma are computed in float64 (deterministic for a given backend; numpy and torch may
differ in the last float64 bit, which changes the selection only if a float32 value lies exactly on the
rounded threshold). The threshold is kept as a Python float (as in ref) and every comparison is done in
float32 against the largest float32 <= th, which is the same set as the exact comparison |a| > th.
Zeros are never selected (S = {|a| > max(th, 0)}): with th < 0 (a strongly negative mean) the reference's
rule would select zero entries, which a sparsifier must not do; for th <= 0 the loop stops early because
no further scaling can change the count.

Cost. The counts at every threshold steps 3 and 4 may try (the loop's factors and the capacity's ladder) are one
counting pass over the accumulator (``xp.ladder_counts``), read on the host with the float64 mean and std in one
transfer; the loop then runs on those counts, and step 5 is one compare and a compaction (on a device, padded to
the capacity without a read).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..validate import choice, flag, options
from .base import CLIMB, Sparsifier

#: rungs (÷1.03 each, as the capacity's ladder climbs, 300 of them: down to 1/7,100 of where the loop ended) the
#: threshold descends on where the adjustment loop ends with fewer than 3k/4 selected (``descend``); the capacity then
#: climbs back on them where the rung reached passes more than fit
DESCENT = tuple(1.03 ** -j for j in range(1, 301))

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
        descend (bool): where the loop spends its iterations and still selects fewer than 3k/4 (a few huge entries
            inflate sigma, so that mu + z·sigma lies far above the k-th largest), the threshold descends on, ÷1.03
            a rung (:data:`DESCENT`), to the first rung that selects 3k/4 (ours: the loop alone lowers it by at most
            x0.55, and the entries below are never sent while such entries recur). Default True; False: the
            paper's loop alone.

    State (per rank): ``threshold_initial`` (mu + z·sigma), ``threshold`` (after the adjustment, the
    value actually used), ``iterations`` (adjustment iterations run), ``mean``, ``std``.
    """

    name = "gaussiank"
    exact_k = False

    _: dataclasses.KW_ONLY
    adjust: str = choice("lstm", ADJUST_VARIANTS, fix="use 'lstm' (the default) for the paper's loop")
    descend: bool = flag(True)

    #: the selection's capacity in units of k (measured: docs/algorithms.md#the-wire)
    capacity_ratio = 2.0

    def initial_state(self):
        return {"threshold": 0.0, "threshold_initial": 0.0, "iterations": 0}

    def _loop(self):
        """The adjustment loop of ``adjust`` as data: its factors going down (each the last / f), up (each the
        last · f; vgg only) and its most iterations."""
        f, iters = (1.02, 20) if self.adjust == "vgg" else (1.012, 50 if self.adjust == "lstm" else 20)
        down, up = [1.0], [1.0]
        for _ in range(iters):
            down.append(down[-1] / f)
            up.append(up[-1] * f)
        return down, (up if self.adjust == "vgg" else [1.0]), iters

    def _factors(self):
        """Every factor of th0 a step may count at: the loop's (down, and up for vgg), the descent past the loop's
        last (``descend``) and the capacity's ladder, ascending."""
        down, up, _ = self._loop()
        descent = [down[-1] * f for f in DESCENT] if self.descend else []
        return sorted(set(down) | set(up) | set(descent) | set(CLIMB))

    def _adjust(self, th0, counted, k):
        """Step 3 on the counts of every threshold the loop may try (``counted[factor]``: the count at th0·factor),
        then the descent (``descend``): ``(factor, iterations)``, th = th0·factor."""
        fac, it = self._loop_adjust(th0, counted, k)
        last = self._loop()[0][-1]                 # only where the loop went all the way down is the count short
        if self.descend and fac == last and th0 > 0.0 and counted[fac] < max(1, (3 * k) // 4):
            below = [last * f for f in DESCENT]
            fac = next((f for f in below if counted[f] >= max(1, (3 * k) // 4)), below[-1])
        return fac, it

    def _loop_adjust(self, th0, counted, k):
        """Step 3, the loop of ``adjust`` alone: ``(factor, iterations)``. A threshold <= 0 already selects every
        nonzero: nothing left to change."""
        down, up, iters = self._loop()
        k34 = max(1, (3 * k) // 4)          # at least one entry: k = 1 would otherwise never adjust
        it, c0 = 0, counted[1.0]
        if self.adjust == "lstm":
            while it < iters and th0 * down[it] > 0.0 and counted[down[it]] < k34:
                it += 1
            return down[it], it
        if self.adjust == "bert":
            if th0 > 0.0 and c0 < k34:
                k56 = max(1, (5 * k) // 6)
                while it < iters and th0 * down[it] > 0.0 and counted[down[it]] < k56:
                    it += 1
            return down[it], it
        k54 = (5 * k) // 4                  # vgg
        if th0 > 0.0 and c0 < k34:
            while it < iters and counted[down[it]] < k34:
                it += 1
            return down[it], it
        if th0 > 0.0 and c0 > k54:
            while it < iters and counted[up[it]] > k54:
                it += 1
            return up[it], it
        return 1.0, 0

    def select(self, xp, acc, k, state, ctx):
        """Steps 1-4. Every threshold the loop may try, and the ladder above it that the selection climbs past its
        capacity (``CLIMB``), are counted in one pass and read with the mean and the std in one transfer (on a GPU,
        the step's one wait before its opening); the loop and the climb then run on the host, and the selection at
        the threshold they chose is one compare and a compaction on the device."""
        n = xp.numel(acc)
        if n == 0:
            state.update(mean=0.0, std=0.0, threshold_initial=0.0, threshold=0.0, iterations=0)
            return xp.zeros(0, xp.index_dtype, like=acc)
        # 1-2. Gaussian prediction of the k-th largest |a|, and the count at every rung, on the device
        mu, sd = xp.mean_std_values(acc)
        factors = self._factors()
        th0 = mu + gaussian_z(self.density) * sd
        counts = xp.ladder_counts(acc, xp.clamp_min(xp.ladder(th0, factors, acc), 0.0), "above")
        mu, sd, counts = xp.read(mu, sd, counts)
        mu, sd = float(mu[0]), float(sd[0])
        th0 = mu + gaussian_z(self.density) * sd
        counted = dict(zip(factors, (int(c) for c in counts)))
        # 3. the adjustment loop, on the counts; then up the ladder while more than the capacity pass (but not to
        # an empty selection: k = 1 has a capacity of 2, and a rung can take 3 to 0)
        fac, it = self._adjust(th0, counted, k)
        cap = self.capacity(k, n)
        above = [f for f in factors if f >= fac]
        fit = next((i for i, f in enumerate(above) if counted[f] <= cap), len(above) - 1)
        if fit and counted[above[fit]] == 0:        # a rung that empties the selection: the one below, cut
            fit -= 1
        fac = above[fit]
        th = th0 * fac
        # 4. S = {|a| > th}, zeros excluded, at most the capacity
        idx = xp.select_at(acc, xp.floor32([th])[0], "gt", cap, n, counted[fac])
        state.update(mean=mu, std=sd, threshold_initial=th0, threshold=th, iterations=it)
        return idx, min(counted[fac], cap)
