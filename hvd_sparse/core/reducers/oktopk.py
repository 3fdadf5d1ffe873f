"""Ok-Topk: the O(k) sparse allreduce (docs/algorithms.md#oktopk; Li & Hoefler, PPoPP'22, Algorithm 1).

    oktopk_step(g):                                 # engine: a = eps + g; S = ThresholdReuse.select(a)
      reev  = (t % tau_p == 0)                      # t = 0 is always a re-eval AND repartition step
      if t % tau == 0: off = repartition(a, L)      # one allreduce (boundaries="periodic"; with
                                                    # "result"/"load": t = 0 only, then off = next_off below)
      ("measured", t > 0: H = allreduce(histogram of S, 2P bins; heavy bins finer); off = even split of H)
      rho   = split_and_reduce(a, S, off)           # region r of the sum
      if reev:                                      # global re-evaluation
          C   = allgather( (x+off[r], rho[x]) for x with rho[x] != 0 )    # identical on all ranks
          Gam = kth_abs(C.val, min(k, |C|));  G = deterministic top-min(k,|C|) of C
      else:                                         # threshold reuse
          mine = ((x+off[r], rho[x]) for x with |rho[x]| > Gam)           # or >= / nonzero per select_rule
          G    = balance_and_allgatherv(mine)       # sorted by global index
          Gam  = band_adjust(Gam, |G|, k, lo_G, hi_G, /relax, *tighten)
      I   = S ∩ G.idx;  eps = a;  eps[I] = 0        # Alg.2 line 6 (engine zeroes I)
      next_off = even split of avg(load CDF)        # "load": loads[r] = pairs region r received in the split,
                                                    # one more word in the count allgather; "result": the
                                                    # P quantiles of G (no word at all); see regions.py
      t += 1
      return SparseSum(G.idx, G.val), I             # the SUM, as out[G.idx] = G.val (the engine divides by P)

    repartition(a, L):
      idx = sorted global indexes of S;  m = len(idx);  c = m // P
      prop[j] = idx[j*c] (j = 1..P-1) if c >= 1 else floor(j*n/P)
      B = allreduce(prop as int64, op=Sum) // P;  return off = [0, B_1, ..., B_{P-1}, n]

    balance_and_allgatherv(mine):
      c = allgather([len(mine)])
      if policy == always or (policy == auto and max(c) > 4 * sum(c) / P):
          T = sum(c); b_q = T//P + (1 if q < T % P else 0); O_r = sum(c[:r]); Bo_q = sum(b[:q])
          splits[q] = | [O_r, O_r+c_r) ∩ [Bo_q, Bo_q+b_q) |;  mine = alltoall(mine, splits)
      return allgather(mine)

Collectives (phase names, each a distinct, stable collective; none at all when P = 1):
    boundaries     allreduce int64 (P-1)               repartition steps
    histogram      allreduce int64 (2P)                boundaries="measured", other steps, k < F·P
    refine         allreduce int64 (< 5P)              after the histogram, when a bin holds > a share
    split          alltoall  (rel. index, value) pairs every step (sources reduced in rank order)
    reeval_count   allgather 1 int64 (+1: the load)    re-eval steps
    reeval_gather  allgather (global index, value)     re-eval steps (skipped when every U_r = 0)
    ladder         allreduce int64 9 (+P: the loads)   global_control="ladder", other steps, k < F·P
    count          allgather 1 int64 (+1: the load)    other steps (ladder, k < F·P: only to balance, not
                                                       when balance="never" or K = 0; ladder, k >= F·P:
                                                       9 int64, the owner's ladder counts, +1: the load)
    balance        alltoall  (global index, value)     other steps, when the balance policy triggers
    gather         allgather (global index, value)     other steps (skipped when K = 0, known to all)

F = ``few_collectives_from``: at k/P >= F entries per region a step makes no histogram and no ladder
allreduce (the boundaries follow the last steps' load, as with "load").

Wire format: one (index, value) pair = two words of one array, the index followed by the
float32 value bit-cast to int32 (int64 words, value bits sign-extended in the low half, only when an index
does not fit int32). Indexes are never float-encoded. The split phase sends region-relative indexes
(int32 while every region has < 2^31 entries), the gathers global ones (int32 while n < 2^31).

Decisions (docs/algorithms.md#oktopk): the global re-evaluation takes the exact top-min(k, |C|) of the gathered
candidates in the same step (ref; ties by ascending global index); the residual rule is the exact
intersection S ∩ G; K = 0 is legal (Γ is then invalid and the next step re-evaluates);
P = 1 runs the same algorithm without any collective (G ⊆ S, out = a on G).
"""

from __future__ import annotations

import math

from ..comm import SUM
from ..errors import check_positive_int
from ..sparsifiers.threshold_reuse import band_adjust, check_real, check_select_rule
from ..selection import intersect_sorted, topk_indices
from .base import Reducer, SparseSum, pack_pairs, unpack_pairs, wire_index_dtype
from .regions import load_boundaries, measure_load, measured_boundaries, next_boundaries, refine_load  # noqa: F401
from .topka import sum_sparse_in_rank_order

BALANCE_POLICIES = ("auto", "always", "never")
BOUNDARY_POLICIES = ("periodic", "result", "load", "measured")
FEW_COLLECTIVES_FROM = 1024         # k/P from which a step makes the fewest collectives (the default)


# -- index helpers ----------------------------------------------------------------------------------------
def region_split(xp, idx, offsets):
    """Split the sorted global indexes ``idx`` by regions ``offsets`` (o_0..o_P, non-decreasing).

    Returns ``(splits, rel)``: ``splits[j] = |idx ∩ [o_j, o_{j+1})|`` (Python ints) and the region-relative
    indexes ``rel = idx - o_{region(idx)}`` (int64), in the order of ``idx`` (= grouped by region)."""
    P = len(offsets) - 1
    bounds = xp.asarray(offsets, xp.index_dtype, like=idx)
    pos = [int(p) for p in xp.to_numpy(xp.searchsorted(idx, bounds))]
    splits = [pos[j + 1] - pos[j] for j in range(P)]
    if xp.numel(idx) == 0:
        return splits, idx
    region = xp.searchsorted(bounds[1:P], idx, right=True)     # j with o_j <= x < o_{j+1}
    return splits, idx - xp.take(bounds, region)


def balance_splits(counts, rank):
    """Send splits of ``rank`` for the balancing alltoall: the interval intersections of
    its slice [O_r, O_r + c_r) of the global concatenation with the balanced blocks [Bo_q, Bo_q + b_q)."""
    P = len(counts)
    T = sum(counts)
    b = [T // P + (1 if q < T % P else 0) for q in range(P)]
    lo = sum(counts[:rank])
    hi = lo + counts[rank]
    splits, bo = [], 0
    for q in range(P):
        splits.append(max(0, min(hi, bo + b[q]) - max(lo, bo)))
        bo += b[q]
    return splits


def global_topk(xp, c_idx, c_val, k):
    """Deterministic top-min(k, |C|) of candidates sorted by global index (ties: ascending index).

    Returns ``(G.idx, G.val, Γ)`` with Γ the K-th largest |value| (``inf`` when C is empty)."""
    m = xp.numel(c_val)
    if m == 0:
        return c_idx, c_val, math.inf
    if m > k:
        pos, th = topk_indices(xp, c_val, k)
        return xp.take(c_idx, pos), xp.take(c_val, pos), th
    return c_idx, c_val, float(xp.kth_largest(xp.abs(c_val), m))


def _allgather_count(xp, m, comm, phase, like):
    return [int(c) for c in xp.to_numpy(comm.allgather(xp.asarray([m], xp.index_dtype, like=like), phase))]


def _allgather_counts(xp, counts, comm, phase, like):
    """Allgather a vector of counts per rank; returns a P x len(counts) list of lists."""
    flat = xp.to_numpy(comm.allgather(xp.asarray(counts, xp.index_dtype, like=like), phase))
    w = len(counts)
    return [[int(c) for c in flat[r * w:(r + 1) * w]] for r in range(comm.size)]


#: exponents j of the Γ ladder Γ·f^j (global_control="ladder")
LADDER_STEPS = tuple(range(-2, 7))


class OkTopk(Reducer):
    """Ok-Topk O(k) sparse allreduce (Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep
    Learning", PPoPP'22, Algorithm 1; docs/algorithms.md#oktopk). Pair it with
    :class:`hvd_sparse.core.sparsifiers.threshold_reuse.ThresholdReuse` (its local selection).

    Args:
        threshold_period (int): τ', re-evaluate the global threshold Γ exactly every τ' sparse steps
            (t % τ' == 0, t = this reducer's own step counter from 0). Default 32.
        repartition_period (int): τ, recompute the region boundaries every τ steps. Default 64.
        boundaries (str): how the regions follow the selection (docs/algorithms.md#oktopk, ``regions.py``).
            ``"periodic"`` (default, paper): the allreduce repartition every ``repartition_period`` steps only;
            the selection drifts in between (a region received 2.3x its share at P = 256 within 40 steps).
            ``"result"``: the P quantiles of the step's global result G (no communication; G is more
            concentrated than the selections, so the split stays uneven). ``"load"``: the pairs each region
            received ride in the step's count collective (+1 word per owner in the allgather, +P per rank in
            the ladder's allreduce) and the next boundaries split this load evenly. ``"measured"`` (the
            ``Compression.oktopk`` preset): before the split, one allreduce (phase ``histogram``, 2P int64)
            sums the ranks' counts in 2 bins per region and the step's boundaries split this, its own load,
            evenly (a forecast is poor at ~10 entries per region: a step clears the entries that carried the
            last one's load). ``result`` and ``load`` recompute when the last step's imbalance exceeds
            ``boundary_tolerance``; with all three the allreduce repartition runs only on the first step (and
            after a change of P or n).
        load_smoothing (float): β of ``load`` (and of ``measured``'s bins): the boundaries split an exponential
            average of the measured load CDFs, β·(average so far) + (1-β)·(this step's), evenly
            (``smoothed_load_boundaries``): the hot entries a step clears move the load elsewhere, and the
            last step alone forecasts the next poorly. 0: the last step only. Default 0.5.
        boundary_tolerance (float): the recompute trigger of ``result`` and ``load``; 1.0 recomputes on
            every step. Default 1.0.
        balance (str): data balancing before the final allgatherv: ``"auto"`` (default, paper: iff
            max c_j > balance_factor·Σc/P), ``"always"`` (ref:BERT) or ``"never"`` (ref:LSTM/VGG).
        balance_factor (float): the ``auto`` trigger factor. Default 4.0.
        global_band_lo, global_band_hi (float): band [lo·k, hi·k] for K on reuse steps. Default 0.75, 1.25.
        global_relax (float): Γ /= global_relax when K < lo·k. Default 1.01 (1.0 disables).
        global_tighten (float): Γ *= global_tighten when K > hi·k. Default 1.008 (1.0 disables).
        select_rule (str): owners' candidates on reuse steps: ``"ge_nonzero"`` (default, |ρ| >= Γ and
            ρ != 0) or ``"gt"`` (ref: |ρ| > Γ). Re-evaluation steps always take the exact top-k.
        max_select_ratio (float or None): optional hard cap: when K > ratio·k on a reuse step
            (known from the allgathered counts), keep the exact top-k of the gathered values and
            re-evaluate Γ from them. Default None (off, as ref).
        global_control (str): how Γ follows K between re-evaluations. ``"band"`` (default, ref): the
            authors' post-hoc controller (Γ·``global_tighten`` above hi·k, Γ/``global_relax`` below lo·k, one
            small step per iteration); it lags behind a growing residual (measured: K = 2-8k on synthetic and
            digits gradients, see docs/benchmarks.md). ``"ladder"`` (the ``Compression.oktopk`` preset):
            each owner counts its candidates at the thresholds Γ·f^j, j = -2..6 (f = ``ladder_factor``), one
            allreduce (phase ``ladder``) sums the 9 counts, and every rank takes the smallest Γ·f^j whose
            global count is <= k; Γ keeps it. So K <= k on reuse steps whenever the ladder reaches (the
            paper's volume bound assumes K <= k). The sum costs 2·9 words received where an allgather of the
            count vectors would cost 9(P-1); the owners' own counts (1 word each, phase ``count``) travel
            only when the balance rule needs them.
        ladder_factor (float): f of the ladder. Default 1.1 (Γ moves by up to x1.77 up or /1.21 down a step).
        few_collectives_from (int or None): at k >= this·P (k/P: the same on every rank) no histogram and
            no ladder allreduce: ``measured`` boundaries follow the smoothed load (the ``load`` rule, a good
            forecast at many entries per region) and each owner's 9 ladder counts and load ride in the count
            allgather (10(P-1) words, <= 1% of k(P-1)/P): two collectives' latency less. None: never.
            Default 1024.

    Per-rank state: ``t`` (sparse steps so far), ``gamma`` (Γ, identical on all ranks), ``offsets``
    (o_0..o_P, Python ints, identical on all ranks), ``size`` (P). Info returned each step: ``K``,
    ``threshold`` (Γ used this step), ``next_threshold``, ``reeval``, ``repartition``, ``balanced``,
    ``capped``, ``offsets``, ``owner_counts`` (per-owner candidate counts: U_r on re-eval steps, c_r on
    others), ``t``.
    """

    name = "oktopk"
    sparse_result = True

    def __init__(self, threshold_period=32, repartition_period=64, balance="auto", *, balance_factor=4.0,
                 global_band_lo=0.75, global_band_hi=1.25, global_relax=1.01, global_tighten=1.008,
                 select_rule="ge_nonzero", max_select_ratio=None, global_control="band", ladder_factor=1.1,
                 boundaries="periodic", boundary_tolerance=1.0, load_smoothing=0.5,
                 few_collectives_from=FEW_COLLECTIVES_FROM):
        api = "hvd_sparse.OkTopk"
        if few_collectives_from is not None:
            few_collectives_from = check_positive_int(few_collectives_from, "few_collectives_from", api)
        self.few_collectives_from = few_collectives_from
        if boundaries not in BOUNDARY_POLICIES:
            raise ValueError(f"{api}: boundaries must be one of {BOUNDARY_POLICIES}, got {boundaries!r}")
        self.boundaries = boundaries
        self.load_smoothing = check_real(load_smoothing, "load_smoothing", api, 0.0, fix="e.g. 0.5 (0: last step only)")
        if self.load_smoothing >= 1.0:
            raise ValueError(f"{api}: load_smoothing must be in [0, 1), got {load_smoothing!r}")
        self.boundary_tolerance = check_real(boundary_tolerance, "boundary_tolerance", api, 1.0,
                                             fix="e.g. 1.1 (1.0: every step)")
        if global_control not in ("ladder", "band"):
            raise ValueError(f"{api}: global_control must be 'ladder' or 'band', got {global_control!r}")
        self.global_control = global_control
        self.ladder_factor = check_real(ladder_factor, "ladder_factor", api, 1.0, low_incl=False, fix="e.g. 1.1")
        self.threshold_period = check_positive_int(threshold_period, "threshold_period", api)
        self.repartition_period = check_positive_int(repartition_period, "repartition_period", api)
        if balance not in BALANCE_POLICIES:
            raise ValueError(f"{api}: balance must be one of {BALANCE_POLICIES}, got {balance!r}; 'auto' "
                             "balances when the largest owner holds > balance_factor x the average")
        self.balance = balance
        self.balance_factor = check_real(balance_factor, "balance_factor", api, 0.0, low_incl=False,
                                          fix="e.g. 4.0 (paper)")
        self.global_band_lo = check_real(global_band_lo, "global_band_lo", api, 0.0, fix="e.g. 0.75")
        self.global_band_hi = check_real(global_band_hi, "global_band_hi", api, self.global_band_lo,
                                          fix="global_band_hi must be >= global_band_lo")
        self.global_relax = check_real(global_relax, "global_relax", api, 1.0, fix="e.g. 1.01 (1.0 disables)")
        self.global_tighten = check_real(global_tighten, "global_tighten", api, 1.0,
                                          fix="e.g. 1.008 (1.0 disables)")
        self.select_rule = check_select_rule(select_rule, api)
        self.max_select_ratio = check_real(max_select_ratio, "max_select_ratio", api, 1.0, allow_none=True,
                                            fix="e.g. 4 (or None for no cap)")

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def initial_state(self):
        return {"t": 0, "gamma": None, "offsets": None, "size": None}

    # -- repartition--------------------------------------------------------------------------------------
    @staticmethod
    def _repartition(xp, idx, n, comm):
        P = comm.size
        if P == 1:
            return [0, n]
        m = xp.numel(idx)
        c = m // P
        if c >= 1:       # this rank's balanced boundaries
            prop = xp.take(idx, xp.asarray([j * c for j in range(1, P)], xp.index_dtype, like=idx))
        else:            # library fallback (ref: c = 0 -> idx[0]; m = 0 -> crash)
            prop = xp.asarray([(j * n) // P for j in range(1, P)], xp.index_dtype, like=idx)
        total = comm.allreduce(prop, SUM, "boundaries")            # int64: no overflow
        return [0] + [int(b) // P for b in xp.to_numpy(total)] + [n]

    # -- split and reduce--------------------------------------------------------------------------------------
    @staticmethod
    def _split_and_reduce(xp, acc, idx, offsets, comm):
        """Region r of the sum of the selections: its nonzeros as (global int64 idx, float32 value), the
        number of pairs the region received (its load, this rank's own included) and this rank's splits
        (pairs sent to each region: summed over the ranks, they are every region's load)."""
        r = comm.rank
        splits, rel = region_split(xp, idx, offsets)
        wire = wire_index_dtype(xp, max(offsets[j + 1] - offsets[j] for j in range(comm.size)))
        packed = pack_pairs(xp, rel, xp.take(acc, idx), wire, acc)
        recv, recv_splits = comm.alltoall(packed, [2 * s for s in splits], "split")
        rel_r, val_r = unpack_pairs(xp, recv)
        # 4. reduction: rho^r = the sum of the P sparse pieces, sources added in rank order 0..P-1, on the
        # support of what arrived (no |R_r|-sized buffer: a region can span most of the model)
        where, rho = sum_sparse_in_rank_order(xp, rel_r, val_r, [s // 2 for s in recv_splits], acc)
        nz = xp.nonzero(xp.gt(xp.abs(rho), 0.0))
        return xp.add(xp.take(where, nz), offsets[r]), xp.take(rho, nz), sum(recv_splits) // 2, splits

    def _gather(self, xp, c_idx, c_val, n, comm, phase, like):
        flat = comm.allgather(pack_pairs(xp, c_idx, c_val, wire_index_dtype(xp, n), like), phase)
        return unpack_pairs(xp, flat)

    # -- one step ----------------------------------------------------------------------------------------
    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        P, r, n = comm.size, comm.rank, xp.numel(acc)
        offsets = state.get("offsets")
        if state.get("size") != P or (offsets is not None and (len(offsets) != P + 1 or offsets[-1] != n)):
            state.update(t=0, gamma=None, offsets=None, size=P, cdf=None)      # elastic / new layout: start over
            offsets = None
        t = state["t"]
        gamma = state["gamma"]
        reev = t % self.threshold_period == 0 or gamma is None or not math.isfinite(gamma)
        if self.boundaries == "periodic":
            repart = t % self.repartition_period == 0 or offsets is None
        else:                       # boundaries from the last result; the allreduce only to start
            repart = offsets is None

        # many entries per region (k, P: the same on every rank): the step's latency outweighs the words the
        # histogram and the ladder's allreduce save, and the last steps' load forecasts the next one well
        few = P > 1 and self.few_collectives_from is not None and k >= self.few_collectives_from * P
        hist = None
        if repart:                                                  # repartition
            offsets = self._repartition(xp, idx, n, comm)
        elif self.boundaries == "measured" and not few and P > 1:   # this step's load, before the split
            edges, hist = refine_load(xp, idx, *measure_load(xp, idx, state.get("cdf"), n, comm, acc), comm, acc)
            offsets = measured_boundaries(edges, hist, state.get("cdf"), n, P) or offsets
        if P == 1:                                                  # rho = a on S (no collective)
            vals = xp.take(acc, idx)
            nz = xp.nonzero(xp.gt(xp.abs(vals), 0.0))
            c_idx, c_val = xp.take(idx, nz), xp.take(vals, nz)
        else:                                                       # split and reduce
            c_idx, c_val, load, splits = self._split_and_reduce(xp, acc, idx, offsets, comm)
        # "load" boundaries (and "measured" ones without a histogram): the owners' split loads ride in the
        # step's count collective (one more word each in an allgather, the senders' splits in the ladder)
        with_load = P > 1 and hist is None and self.boundaries in ("load", "measured")
        loads = None

        balanced = capped = False
        if reev:                                                    # global re-evaluation
            if P > 1:
                if with_load:
                    owner_counts, loads = map(list, zip(*_allgather_counts(xp, [xp.numel(c_idx), load], comm,
                                                                           "reeval_count", acc)))
                else:
                    owner_counts = _allgather_count(xp, xp.numel(c_idx), comm, "reeval_count", acc)
                if sum(owner_counts):                               # (skipped when K = 0 everywhere)
                    c_idx, c_val = self._gather(xp, c_idx, c_val, n, comm, "reeval_gather", acc)
            else:
                owner_counts = [xp.numel(c_idx)]
            g_idx, g_val, gamma = global_topk(xp, c_idx, c_val, k)
            used = gamma_next = gamma
        else:                                                       # threshold Γ reused + balance
            used = gamma
            owned = xp.scan(c_val)                  # the owner's candidates: counts and selection on |c_val|
            table = None                            # every owner's ladder counts (few collectives)
            if self.global_control == "ladder":
                ladder = [gamma * self.ladder_factor ** j for j in LADDER_STEPS]
                mine = [owned.count(th, self.select_rule) for th in ladder]
                totals = mine
                if few:                             # the counts (and the loads) of every owner: one allgather
                    table = _allgather_counts(xp, mine + [load] if with_load else mine, comm, "count", acc)
                    loads = [row.pop() for row in table] if with_load else None
                    totals = [sum(col) for col in zip(*table)]
                elif P > 1:                         # their totals (and the senders' splits) by one allreduce
                    totals = [int(v) for v in xp.to_numpy(comm.allreduce(xp.asarray(
                        mine + splits if with_load else mine, xp.index_dtype, like=acc), SUM, "ladder"))]
                    totals, loads = totals[:len(ladder)], (totals[len(ladder):] if with_load else None)
                j = next((j for j, tot in enumerate(totals) if tot <= k), len(ladder) - 1)
                used = ladder[j]
            keep = owned.select(used, self.select_rule)[0]
            m_idx, m_val = xp.take(c_idx, keep), xp.take(c_val, keep)
            if P > 1:
                if self.global_control == "ladder":                 # the owners' counts only to balance
                    T = totals[j]
                    if table is not None:
                        owner_counts = [row[j] for row in table]
                    else:
                        owner_counts = None if self.balance == "never" else [0] * P if T == 0 else \
                            _allgather_count(xp, xp.numel(m_idx), comm, "count", acc)
                elif with_load:
                    owner_counts, loads = map(list, zip(*_allgather_counts(xp, [xp.numel(m_idx), load], comm,
                                                                           "count", acc)))
                else:
                    owner_counts = _allgather_count(xp, xp.numel(m_idx), comm, "count", acc)
                if self.global_control != "ladder":
                    T = sum(owner_counts)
                if T == 0:                                          # K = 0, known to every rank
                    g_idx, g_val = m_idx, m_val
                else:
                    packed = pack_pairs(xp, m_idx, m_val, wire_index_dtype(xp, n), acc)
                    balanced = self.balance == "always" or (
                        self.balance == "auto" and max(owner_counts) * P > self.balance_factor * T)
                    if balanced:
                        packed, _ = comm.alltoall(packed, [2 * s for s in balance_splits(owner_counts, r)],
                                                  "balance")
                    g_idx, g_val = unpack_pairs(xp, comm.allgather(packed, "gather"))
            else:
                owner_counts = [xp.numel(m_idx)]
                g_idx, g_val = m_idx, m_val
                T = owner_counts[0]
            if self.max_select_ratio is not None and T > self.max_select_ratio * k:
                g_idx, g_val, gamma_next = global_topk(xp, g_idx, g_val, k)    # hard cap
                capped = True
            elif self.global_control == "ladder":
                gamma_next = used
            else:
                gamma_next = band_adjust(gamma, T, k, self.global_band_lo, self.global_band_hi,
                                         self.global_relax, self.global_tighten)

        # output and included set I = S ∩ G (exact); the sum is G itself (sorted, unique): the engine
        # scatters it into the outputs, no n-sized buffer here
        u = SparseSum(g_idx, g_val)
        included = intersect_sorted(xp, idx, g_idx)
        nxt = None if self.boundaries == "periodic" or P == 1 else next_boundaries(
            self.boundaries, xp, g_idx, offsets, loads, n, state, self.boundary_tolerance, self.load_smoothing,
            hist and (edges, hist))
        state.update(t=t + 1, gamma=gamma_next, offsets=list(offsets if nxt is None else nxt), size=P)
        info = {"K": xp.numel(g_idx), "threshold": used, "next_threshold": gamma_next, "reeval": bool(reev),
                "repartition": bool(repart), "balanced": balanced, "capped": capped, "offsets": list(offsets),
                "owner_counts": owner_counts, "t": t, "rebalanced": nxt is not None or hist is not None}
        return u, included, info


# -- presets (docs/algorithms.md#oktopk); the authors' dense warm-up steps (128 / 512 / 0) are not reproduced ---
OKTOPK_PRESETS = {
    # the library's default (Compression.oktopk): the paper's algorithm and balancing, exact-k selection,
    # controllers that keep |S| <= k and K <= k on reuse steps (the assumptions of the 6k(P-1)/P bound),
    # region boundaries that split every step's measured load evenly (the bound's third assumption)
    "library": {
        "sparsifier": {"threshold_period": 32, "select_rule": "ge_nonzero", "guard_ratio": 1.15,
                       "guard_factor": 1.03, "guard_iters": 30, "guard_target": 1.05, "band_lo": 0.95,
                       "band_relax": 1.03},
        "reducer": {"threshold_period": 32, "repartition_period": 64, "balance": "auto",
                    "select_rule": "ge_nonzero", "global_control": "ladder", "boundaries": "measured"},
    },
    # the paper's algorithm: periodic exact re-evaluation only (no guard, no band controllers: 1.0 = off),
    # balancing iff max c_j > 4·avg, "values above the threshold" with exact k (ge_nonzero)
    "paper": {
        "sparsifier": {"threshold_period": 32, "select_rule": "ge_nonzero", "guard_ratio": None,
                       "band_relax": 1.0, "band_tighten": 1.0},
        "reducer": {"threshold_period": 32, "repartition_period": 64, "balance": "auto", "balance_factor": 4.0,
                    "global_relax": 1.0, "global_tighten": 1.0, "select_rule": "ge_nonzero",
                    "global_control": "band"},
    },
    "ref_lstm": {
        "sparsifier": {"threshold_period": 32, "select_rule": "gt", "guard_ratio": 1.5, "guard_factor": 1.03,
                       "guard_iters": 5, "band_lo": 0.75, "band_hi": 1.25, "band_relax": 1.012,
                       "band_tighten": 1.012},
        "reducer": {"threshold_period": 32, "repartition_period": 64, "balance": "never",
                    "global_band_lo": 0.75, "global_band_hi": 1.25, "global_relax": 1.01,
                    "global_tighten": 1.008, "select_rule": "gt", "global_control": "band"},
    },
    "ref_vgg": {
        "sparsifier": {"threshold_period": 32, "select_rule": "gt", "guard_ratio": 4 / 3, "guard_factor": 1.03,
                       "guard_iters": 5, "band_lo": 2 / 3, "band_hi": 1.25, "band_relax": 1.012,
                       "band_tighten": 1.012},
        "reducer": {"threshold_period": 32, "repartition_period": 64, "balance": "never",
                    "global_band_lo": 2 / 3, "global_band_hi": 4 / 3, "global_relax": 1.008,
                    "global_tighten": 1.008, "select_rule": "gt", "global_control": "band"},
    },
    "ref_bert": {
        "sparsifier": {"threshold_period": 128, "select_rule": "gt", "guard_ratio": None, "band_lo": 0.8,
                       "band_hi": 1.25, "band_relax": 1.025, "band_tighten": 1.025},
        "reducer": {"threshold_period": 128, "repartition_period": 64, "balance": "always",
                    "global_band_lo": 0.8, "global_band_hi": 1.25, "global_relax": 1.036,
                    "global_tighten": 1.025, "select_rule": "gt", "global_control": "band"},
    },
}
