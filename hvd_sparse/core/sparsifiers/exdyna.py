"""ExDyna (docs/algorithms.md#exdyna): exclusive rotating partitions, threshold selection, topology adjustment and
online threshold scaling. The exchange is :class:`hvd_sparse.core.reducers.exdyna.ExDynaReducer` (step 5.7).

Iteration t, rank r, world size P, V = residual + gradient (the engine's ``acc``, float32, length n):

    5.2  geometry (first call only):
             a = n // num_blk ; sz_blk = a - a % align ; num_rem = n - sz_blk*num_blk
             q, m = divmod(num_blk, P) ; blk_part[i] = q + (i < m) ; blk_pos = prefix sums of blk_part
             start(p) = blk_pos[p]*sz_blk ; end(p) = (blk_pos[p]+blk_part[p])*sz_blk + (num_rem if p == P-1)
             tau = tau0 = 1 / (2*sqrt(k)),  k = max(1, int(density*n))
    5.5  p(r, t) = (t + r) mod P                                   # rotating exclusive partition
    5.6  st, en = start(p), end(p)
         I_r = st + nonzero(|V[st:en]| >= tau)                      # ascending, ties at tau selected
               in the capacity c = 2k/P: while more pass, tau·1.03^j_r (j_r <= 60), then the c largest (ours)
         if I_r is empty: I_r = [st + t mod (en - st)]              # fallback: a REAL selection
    5.7  (reducer) ks = allgather(k_r) ; S = concat_q I_q ; u[S] = allreduce_sum(V[S])
    5.8  (engine)  residual = V with residual[S] = 0               # on every rank, over the whole union
    5.9  update(), from this step's per-rank counts ks (for step t+1):
         5.3  load[(t + i) mod P] = ks[i] ; k_acc = max(1, int(K/P)) ; den_acc = K/n     (K = sum(ks))
              for i in 0..P-2 (sequential sweep):
                  det, det2 = load[i]/k_acc, load[i+1]/k_acc
                  if det > 1.05 and det2 < 1/1.05: move blk_move blocks i -> i+1 (unless blk_part[i] - 1 < min_blk)
                  if det < 1/1.05 and det2 > 1.05: move blk_move blocks i+1 -> i (unless blk_part[i+1] - 1 < min_blk)
                  (a move shifts mv = int(blk_move*sz_blk*den_acc) of estimated load with the blocks)
              tau = tau · 1.03^min_r(j_r)                               # ours: the climb every rank needed
         5.4  exam = K / k
              sf = 1.005 if exam > 1.1 else (band if exam > 0.909 else 0.995)
                   band: "reference" -> 1.00125 (the reference's dead `exam > 0` test), "symmetric" ->
                         1.00125 if exam > 1 else 0.9987
              tau = max(tau * sf, tau_min)
         k_prev = K ; ks_prev = ks

Edge cases: ``num_blk_eff = max(num_blk, min_blk_div*P)`` (warning when it differs); tiny n: retry with
align = 1, and if ``n < num_blk_eff`` use ``num_blk_eff = max(P, n)``, ``sz_blk = n // num_blk_eff`` (with
n < P some partitions are empty: k_r = 0 and no fallback); k = max(1, int(density·n)); k_acc >= 1.
P = 1: one partition [0, n), no topology sweep, threshold scaling still runs.
Cost of 5.6: one scan of the partition (``xp.scan``): on a CPU float32 buffer the fused kernel reads it once
(|V| >= tau in float32, offset st added in the same pass, no |V| copy); elsewhere the generic path.

All controller state (``blk_part``, ``blk_pos``, ``tau``, ``k_prev``, ``ks_prev``) is computed from globally
gathered counts only, so it is bitwise identical on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from ..comm import MAX, SUM
from ..validate import check_real, choice, flag, integer, options, real
from .base import CLIMB, Sparsifier

_API = "hvd_sparse.ExDyna"
THRESHOLD_RULES = ("reference", "symmetric", "proportional")


# -- pure bookkeeping (size-P lists; unit-tested directly) -------------------------------------------------
def exdyna_geometry(n, P, num_blk=1024, align=32, min_blk_div=4):
    """Step 5.2 with the edge-case fixes. Returns a dict: num_blk_eff, sz_blk, num_rem, blk_part, blk_pos, min_blk."""
    num_blk_eff = max(int(num_blk), int(min_blk_div) * P)            # P > num_blk / 4
    a = n // num_blk_eff
    sz_blk = a - a % align
    if sz_blk == 0:                                                   # tiny n, step 1: align = 1
        sz_blk = a
    if n < num_blk_eff:                                               # tiny n, step 2
        num_blk_eff = max(P, n)
        sz_blk = n // num_blk_eff
    num_rem = n - sz_blk * num_blk_eff
    q, m = divmod(num_blk_eff, P)
    blk_part = [q + 1 if i < m else q for i in range(P)]
    blk_pos = [0] * P
    for i in range(1, P):
        blk_pos[i] = blk_pos[i - 1] + blk_part[i - 1]
    return {"num_blk_eff": num_blk_eff, "sz_blk": sz_blk, "num_rem": num_rem, "blk_part": blk_part,
            "blk_pos": blk_pos, "min_blk": num_blk_eff / (min_blk_div * P)}


def partition_range(p, blk_part, blk_pos, sz_blk, num_rem):
    """Step 5.2: element range [start, end) of partition p; the tail num_rem belongs to the last partition."""
    P = len(blk_part)
    st = blk_pos[p] * sz_blk
    en = (blk_pos[p] + blk_part[p]) * sz_blk + (num_rem if p == P - 1 else 0)
    return st, en


def adjust_topology(blk_part, blk_pos, load, k_prev, n, sz_blk, min_blk, tol_hi=1.05, tol_lo=1 / 1.05,
                    blk_move=1):
    """Step 5.3: one left-to-right sweep over adjacent partitions; returns new (blk_part, blk_pos) lists.

    ``load[p]`` is the count partition p produced in the previous step (already mapped from ranks).
    """
    blk_part, blk_pos, load = list(blk_part), list(blk_pos), list(load)
    P = len(blk_part)
    k_acc = max(1, int(k_prev / P))                                   # k_acc >= 1
    den_acc = k_prev / n if n else 0.0
    mv = int(blk_move * sz_blk * den_acc)
    for i in range(P - 1):
        det = load[i] / k_acc
        det2 = load[i + 1] / k_acc                                    # both before this pair's move
        if det > tol_hi and det2 < tol_lo:                            # left heavy: shift right
            if blk_part[i] - blk_move < min_blk:
                continue
            blk_part[i] -= blk_move
            blk_part[i + 1] += blk_move
            blk_pos[i + 1] -= blk_move
            load[i] -= mv
            load[i + 1] += mv
        if det < tol_lo and det2 > tol_hi:                            # right heavy: shift left
            if blk_part[i + 1] - blk_move < min_blk:
                continue
            blk_part[i] += blk_move
            blk_part[i + 1] -= blk_move
            blk_pos[i + 1] += blk_move
            load[i] += mv
            load[i + 1] -= mv
    return blk_part, blk_pos


def threshold_factor(exam, rule="reference", band_hi=1.1, band_lo=0.909, sf_up=1.005, sf_band_up=1.00125,
                     sf_band_down=0.9987, sf_down=0.995):
    """Step 5.4: the multiplicative factor applied to tau for ``exam = k_prev / k``.

    ``rule="proportional"`` (a library option, not the reference's): ``exp(0.2 (exam - 1))`` clipped to
    [0.8, 2], where the caller passes for ``exam`` the mean of the last two global counts over k. A step
    in log(tau) proportional to the count's relative error: it follows a threshold that must grow tens of
    times (error feedback) within tens of steps instead of the reference's hundreds (the paper
    claims an accurate threshold "within a few iterations"; the code's fixed +-0.5% steps need
    ~200·ln(ratio) iterations), and, being linear in the count, it steers the *arithmetic* mean of the
    count to k. Not tau *= sqrt(exam) (oscillated with growing amplitude: rotation and
    error feedback make the count swing step to step) and exam ** 0.25 (damped, but settled 15% high: a
    log-symmetric rule steers the geometric mean, and the count is skewed).
    """
    if rule == "proportional":
        return min(max(math.exp(0.2 * (exam - 1.0)), 0.8), 2.0)
    if exam > band_hi:
        return sf_up
    if exam > band_lo:
        if rule == "reference":
            return sf_band_up if exam > 0 else sf_band_down            # the reference's (dead) test
        return sf_band_up if exam > 1 else sf_band_down
    return sf_down


def positive(default):
    """A field that takes a finite number > 0."""
    return real(default, 0.0, low_incl=False)


def _check_init_threshold(value, name, api):
    if value is None or value == "topk_once":
        return value
    return check_real(value, f"{name} (None, 'topk_once' or a float)", api, 0.0, low_incl=False)


@options
class ExDyna(Sparsifier):
    """ExDyna (Yoon & Oh, "Preserving Near-Optimal Gradient Sparsification Cost for Scalable Distributed
    Deep Learning", CCGrid 2024; docs/algorithms.md#exdyna): each rank thresholds ``|V| >= tau`` inside its own
    rotating exclusive partition of the flat buffer, so the union of all selections has no duplicates.
    Pair it with :class:`~hvd_sparse.core.reducers.exdyna.ExDynaReducer` (values of every rank all-reduced
    over the union, step 5.7); it also plugs into other reducers (the counts are then allgathered in
    ``update``, phase ``exdyna_counts``, unless the reducer's ``info`` has them).

    Args:
        density (float): target global density; k = max(1, int(density·n)). Required.
        num_blk (int): number of equal blocks (step 5.2); default 1024. Raised to ``min_blk_div·P`` if smaller.
        align (int): block size is rounded down to a multiple of this; default 32 (1 for tiny n).
        min_blk_div (int): a partition never shrinks below ``num_blk_eff / (min_blk_div·P)`` blocks; default 4.
        tol_hi (float): a partition is overloaded when load/mean > tol_hi; default 1.05.
        tol_lo (float): underloaded when load/mean < tol_lo; default 1/1.05.
        blk_move (int): blocks moved across one boundary per step; default 1.
        band_hi (float), band_lo (float): threshold band on exam = |S|/k; defaults 1.1 and 0.909.
        sf_up (float): factor when exam > band_hi (too many selected); default 1.005.
        sf_band_up (float), sf_band_down (float): factors inside the band; defaults 1.00125 and 0.9987.
        sf_down (float): factor when exam <= band_lo; default 0.995.
        threshold_rule (str): "proportional" (library option: tau *= exp(0.2 (|S|/k - 1)), clipped to
            [0.8, 2], on the mean of the last two counts; see ``threshold_factor``), or "reference" (default,
            faithful:
            always sf_band_up in the band) or "symmetric"
            (sf_band_up if exam > 1 else sf_band_down).
        init_threshold (None, float or "topk_once"): None (default) gives tau0 = 1/(2·sqrt(k)); a positive
            float is used as tau0; "topk_once" sets tau0 to the mean over ranks of the max(1, k//P)-th largest
            |V| in each rank's first partition (one allreduce, phase ``exdyna_tau0``; falls back to the
            default if that mean is 0).
        tau_min (float): floor of tau after every update; default 0.0 (off).
        freeze_tau_on_empty (bool): skip the tau update when every rank contributed at most one index and
            every rank's partition was entirely zero (one small allreduce MAX, phase ``exdyna_empty``, only
            on steps with max(ks) <= 1); default False (faithful: tau decays by sf_down).

    State (per rank, identical everywhere): ``tau``, ``blk_part``, ``blk_pos``, ``k_prev``, ``ks_prev``, the
    geometry (``n``, ``sz_blk``, ``num_rem``, ``num_blk_eff``, ``min_blk``) and statistics ``ks``,
    ``inefficiency`` (= max(ks)·P/|S| - 1), ``density_actual``, ``density_ratio``, ``partition``
    ([p, start, end] of this rank this step), ``fallback`` (this rank used the fallback index).
    """

    name = "exdyna"
    exact_k = False
    #: the selection's capacity in units of k/P (measured: docs/algorithms.md#the-wire)
    capacity_ratio = 2.0
    #: the ranks' selections are disjoint shares of one global selection of about k entries
    partitioned = True

    _: dataclasses.KW_ONLY
    num_blk: int = integer(1024)
    align: int = integer(32)
    min_blk_div: int = integer(4)
    tol_hi: float = positive(1.05)
    tol_lo: float = positive(1 / 1.05)
    blk_move: int = integer(1)
    band_hi: float = positive(1.1)
    band_lo: float = positive(0.909)
    sf_up: float = positive(1.005)
    sf_band_up: float = positive(1.00125)
    sf_band_down: float = positive(0.9987)
    sf_down: float = positive(0.995)
    threshold_rule: str = choice("reference", THRESHOLD_RULES)
    init_threshold: object = dataclasses.field(default=None, metadata={"check": _check_init_threshold})
    tau_min: float = real(0.0, 0.0)
    freeze_tau_on_empty: bool = flag(False)

    def check_together(self, api):
        if not self.tol_lo <= 1.0 <= self.tol_hi:
            raise ValueError(f"{api}: tol_lo <= 1 <= tol_hi must hold, got tol_lo={self.tol_lo!r}, "
                             f"tol_hi={self.tol_hi!r}; use e.g. tol_hi=1.05, tol_lo=1/1.05")
        if not self.band_lo < self.band_hi:
            raise ValueError(f"{api}: band_lo must be < band_hi, got band_lo={self.band_lo!r}, "
                             f"band_hi={self.band_hi!r}")

    # -- 5.2 geometry and tau0 -----------------------------------------------------------------------------
    def _init_state(self, xp, acc, n, k, state, ctx):
        P = ctx.size
        geo = exdyna_geometry(n, P, self.num_blk, self.align, self.min_blk_div)
        if geo["num_blk_eff"] > self.num_blk and n >= self.min_blk_div * P:
            warnings.warn(f"{_API}: num_blk={self.num_blk} < {self.min_blk_div}·P={self.min_blk_div * P}; "
                          f"using {geo['num_blk_eff']} blocks", RuntimeWarning, stacklevel=3)
        state.update(geo)
        state["n"] = n
        state["k_prev"] = 1
        state["ks_prev"] = []
        if self.init_threshold is None:
            tau0 = 1.0 / (2.0 * math.sqrt(k))                          # the reference's tau0
        elif self.init_threshold == "topk_once":
            p = (ctx.step + ctx.rank) % P
            st, en = partition_range(p, geo["blk_part"], geo["blk_pos"], geo["sz_blk"], geo["num_rem"])
            local, nonempty = 0.0, 0.0
            if en > st:
                kk = min(max(1, k // P), en - st)
                local, nonempty = float(xp.kth_largest(xp.abs(acc[st:en]), kk)), 1.0
            if P > 1:
                s = xp.to_numpy(ctx.comm.allreduce(xp.asarray([local, nonempty], xp.float32, like=acc), SUM,
                                                   "exdyna_tau0"))
                local, nonempty = float(s[0]), float(s[1])
            tau0 = local / nonempty if nonempty > 0 and local > 0 else 1.0 / (2.0 * math.sqrt(k))
            if not math.isfinite(tau0):
                tau0 = 1.0 / (2.0 * math.sqrt(k))
        else:
            tau0 = float(self.init_threshold)
        state["tau"] = max(tau0, self.tau_min)

    # -- 5.5 / 5.6 selection ---------------------------------------------------------------------------------
    def capacity(self, k, n, size=1):
        """The selection's size in a message: floor(``capacity_ratio``·k/P) (each rank selects in its own share)."""
        return max(1, min(n, int(self.capacity_ratio * k / size)))

    def communicates(self, state, ctx):
        """The first step with ``init_threshold="topk_once"`` averages tau0 over the ranks (one allreduce)."""
        return (self.init_threshold == "topk_once" and ctx.size > 1
                and (state.get("n") is None or len(state.get("blk_part", ())) != ctx.size))

    def select(self, xp, acc, k, state, ctx):
        n = xp.numel(acc)
        if state.get("n") != n or len(state.get("blk_part", ())) != ctx.size:
            self._init_state(xp, acc, n, k, state, ctx)
        P, t = ctx.size, ctx.step
        p = (t + ctx.rank) % P                                        # 5.5 rotation
        st, en = partition_range(p, state["blk_part"], state["blk_pos"], state["sz_blk"], state["num_rem"])
        state["partition"] = [p, st, en]
        state["fallback"] = False
        state["zero_partition"] = True
        if en <= st:                                                  # empty partition (n < P), no fallback
            state["k_r"], state["rung"] = 0, 0
            return xp.zeros(0, xp.index_dtype, like=acc)
        # 5.6 ascending, |V| >= tau, + st; in the capacity (past it tau climbs: the largest stay)
        idx, count, rung = xp.select_capped(acc[st:en], xp.ladder(state["tau"], CLIMB, acc), "ge",
                                            self.capacity(k, n, P), n, base=st)
        idx, empty = xp.first_unless(idx, n, st + t % (en - st))     # 5.6 fallback (rotating dummy) when empty
        if self.freeze_tau_on_empty:
            state["zero_partition"] = bool(xp.item(empty)) and xp.scan(acc[st:en]).count(0.0, "gt") == 0
        else:
            state["zero_partition"] = False
        state["fallback"] = empty
        state["k_r"] = xp.at_least_one(count)
        state["rung"] = rung
        return idx, state["k_r"], rung

    # -- 5.3 / 5.4 / 5.9 controllers --------------------------------------------------------------------------
    @staticmethod
    def _counts(xp, state, info, ctx):
        """``(ks, rungs)``: every rank's count and the rung its threshold climbed to in the capacity (its note), in
        rank order: from the reducer's ``info`` and the opening's header (``ctx.notes``; without them, no climb is
        learned), else one allgather of both (phase ``exdyna_counts``: a reducer that reports no counts)."""
        P = ctx.size
        ks = info.get("counts") if info else None
        if ks is not None and len(ks) == P:
            rungs = ctx.notes if len(ctx.notes) == P else [xp.item(state["rung"])] if P == 1 else [0] * P
            return [int(c) for c in ks], [int(j) for j in rungs]
        if P == 1:
            return [int(xp.item(state["k_r"]))], [int(xp.item(state["rung"]))]
        mine = [int(xp.item(state["k_r"])), int(xp.item(state["rung"]))]
        both = xp.to_numpy(ctx.comm.allgather(xp.asarray(mine, xp.index_dtype), "exdyna_counts")).reshape(P, 2)
        return both[:, 0].tolist(), both[:, 1].tolist()

    def update(self, xp, state, info, ctx):
        P, t, n = ctx.size, ctx.step, state["n"]
        ks, rungs = self._counts(xp, state, info, ctx)
        K = sum(ks)
        # 5.3 topology adjustment for step t+1: rank i served partition (t + i) mod P at step t
        if P > 1:
            load = [0] * P
            for i in range(P):
                load[(t + i) % P] = ks[i]
            state["blk_part"], state["blk_pos"] = adjust_topology(
                state["blk_part"], state["blk_pos"], load, K, n, state["sz_blk"], state["min_blk"],
                self.tol_hi, self.tol_lo, self.blk_move)
        # ours: tau takes the rung the capacity climbed to on every rank (the smallest climb), so that it reaches
        # a new scale in a few steps (at most x5.9 a step) instead of x1.005 (or x2) a step; then 5.4
        state["tau"] *= CLIMB[min(rungs)]
        state["rung"] = rungs[ctx.rank]
        # 5.4 online threshold scaling
        k = self.k_for(n)
        freeze = False
        if self.freeze_tau_on_empty and max(ks) <= 1:
            seen = 0 if state.get("zero_partition", False) else 1
            if P > 1:
                seen = int(xp.to_numpy(ctx.comm.allreduce(xp.asarray([seen], xp.index_dtype), MAX,
                                                          "exdyna_empty"))[0])
            freeze = seen == 0
        if not freeze:
            exam = K / k
            if self.threshold_rule == "proportional" and state.get("k_prev") is not None and t > 0:
                # error feedback makes the count alternate (a step that releases many values is followed
                # by one with few): react to the mean of the last two counts, not to each swing
                exam = (K + state["k_prev"]) / (2 * k)
            sf = threshold_factor(exam, self.threshold_rule, self.band_hi, self.band_lo, self.sf_up,
                                  self.sf_band_up, self.sf_band_down, self.sf_down)
            state["tau"] = max(state["tau"] * sf, self.tau_min)
        # 5.9 bookkeeping and statistics
        state["k_prev"] = K
        state["ks_prev"] = ks
        state["ks"] = ks
        state["tau_frozen"] = freeze
        state["inefficiency"] = max(ks) * P / K - 1.0 if K else 0.0
        state["density_actual"] = K / n if n else 0.0
        state["density_ratio"] = K / k
