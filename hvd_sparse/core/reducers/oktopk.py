"""Ok-Topk: the O(k) sparse allreduce (docs/algorithms.md#oktopk; Li & Hoefler, PPoPP'22, Algorithm 1).

    reduce(a, S):                                   # engine: a = eps + g; S = ThresholdReuse.select(a)
      _start             reev = (t % tau_p == 0)    # t = 0 is always a re-eval AND repartition step
      regions.plan       if t % tau == 0: off = repartition(a, L)    # one allreduce ("periodic"; "result", "load",
                                                    # "measured": t = 0 only, then off = next_off below)
                         ("measured", t > 0: H = allreduce(histogram of S, 2P bins; heavy bins finer);
                          off = even split of H)
      _split_and_reduce  rho = region r of the sum of the selections          # alltoall
      if reev:
        _reevaluate      C = allgather((x+off[r], rho[x]) for rho[x] != 0)    # identical on all ranks
                         Gam = kth_abs(C.val, min(k, |C|));  G = deterministic top-min(k,|C|) of C
      else:
        _reuse           control.threshold: Gam (Ladder: the smallest Gam*f^j whose global count <= k, one
                                            allreduce of 9 counts; Band: the stored Gam)
                         control.keep: mine = ((x+off[r], rho[x]) for |rho[x]| >= Gam)   # or > per select_rule
                               (Ladder, fill: K < k -> owner r adds its largest
                                floor((k-K)·b_r/B) pairs between Gam/f and Gam)  # b_r its, B all owners' there
                         G = _balance_and_allgatherv(mine)                      # sorted by global index
                         Gam = control.next_threshold   # Band: band_adjust(Gam, |G|, k, lo, hi, /relax, *tighten)
      _finish            I = S ∩ G;  eps = a;  eps[I] = 0   # Alg.2 line 6 (the engine zeroes I)
                         regions.follow: next_off = even split of the load  # "load": the pairs region r received,
                                           # one more word in the count collective; "result": P quantiles of G
                         t += 1;  return SparseSum(G.idx, G.val), I   # the SUM (the engine divides by P)

    repartition(a, L):
      idx = sorted global indexes of S;  m = len(idx);  c = m // P
      prop[j] = idx[j*c] (j = 1..P-1) if c >= 1 else floor(j*n/P)
      B = allreduce(prop as int64, op=Sum) // P;  return off = [0, B_1, ..., B_{P-1}, n]

    _balance_and_allgatherv(mine):
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

import dataclasses
import math

from ..comm import SUM
from ..selection import global_topk
from ..sparsifiers.threshold_reuse import band_adjust
from ..validate import SELECT_RULE_FIX, SELECT_RULES, check_real, choice, flag, integer, options, real
from .base import (Reducer, SparseSum, allgather_count, allgather_counts, pack_pairs, sum_sparse_in_rank_order,
                   unpack_pairs, wire_index_dtype)
from .regions import Regions, region_split

BALANCE_POLICIES = ("auto", "always", "never")
BOUNDARY_POLICIES = ("periodic", "result", "load", "measured")
FEW_COLLECTIVES_FROM = 1024         # k/P from which a step makes the fewest collectives (the default)


# -- helpers --------------------------------------------------------------------------------------------------
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


#: exponents j of the Γ ladder Γ·f^j (global_control="ladder")
LADDER_STEPS = tuple(range(-2, 7))


# -- the global control: how Γ follows K between re-evaluations (OkTopk.global_control) --------------------------
# Each answers OkTopk._reuse's four calls on the step record s: threshold (s.used, this step's Γ), keep (the owner's
# candidates kept), owner_counts (s.owner_counts, s.T: to balance) and next_threshold (the next reuse step's Γ).
@dataclasses.dataclass(frozen=True)
class Band:
    """``global_control="band"`` (the authors' post-hoc controller): a reuse step keeps the owners' candidates at
    the stored Γ, every owner's count is gathered (phase ``count``, with its load when the regions follow it), and Γ
    moves one small step after the step (``band_adjust``): Γ·``tighten`` when K > ``hi``·k, Γ/``relax`` when
    K < ``lo``·k (``OkTopk``'s ``global_band_lo/hi``, ``global_relax``, ``global_tighten``). It lags behind a
    growing residual (measured: K = 2-8k on synthetic and digits gradients, docs/benchmarks.md)."""

    lo: float
    hi: float
    relax: float
    tighten: float
    rule: str

    def threshold(self, xp, acc, owned, comm, s):
        s.used = s.gamma

    def keep(self, xp, owned, c_val, s):
        return owned.select(s.used, self.rule)[0]

    def owner_counts(self, xp, acc, m_idx, comm, s, balance):
        if s.with_load:
            s.owner_counts, s.loads = map(list, zip(*allgather_counts(xp, [xp.numel(m_idx), s.load], comm, "count",
                                                                       acc)))
        else:
            s.owner_counts = allgather_count(xp, xp.numel(m_idx), comm, "count", acc)
        s.T = sum(s.owner_counts)

    def next_threshold(self, s):
        return band_adjust(s.gamma, s.T, s.k, self.lo, self.hi, self.relax, self.tighten)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """``global_control="ladder"``: each owner counts its candidates at the thresholds Γ·f^j, j = -2..6 (f =
    ``factor``, ``OkTopk.ladder_factor``), one allreduce (phase ``ladder``) sums the 9 counts, and every rank takes
    the smallest rung whose global count is <= k; Γ keeps it. So K <= k on reuse steps whenever the ladder reaches
    (the paper's volume bound assumes K <= k), for 2·9 words received where an allgather of the count vectors
    would cost 9(P-1); the owners' own counts (phase ``count``) travel only when the balance rule needs them.

    ``fill`` (``OkTopk.global_fill``): the owners' sums pile up above the local thresholds, so a rung can hold
    2-3x the next one's count (K = 0.5-0.9k on MNIST-1D). When the rung holds K < k and the one below > k, owner
    r also keeps its largest floor((k - K)·b_r / B) of the b_r candidates between them (B: all owners'):
    k - P < K <= k, no collective more."""

    factor: float
    fill: bool
    rule: str

    def threshold(self, xp, acc, owned, comm, s):
        """The rung: the owners' 9 counts summed by one allreduce (with the senders' splits when the regions follow
        the load), or gathered with the loads when few; the fill's (lower rung, k - K, B) when it applies."""
        ladder = [s.gamma * self.factor ** j for j in LADDER_STEPS]
        if s.few:                                   # the counts (and the loads) of every owner: one allgather
            mine = owned.counts(ladder, self.rule)
            s.table = allgather_counts(xp, mine + [s.load] if s.with_load else mine, comm, "count", acc)
            s.loads = [row.pop() for row in s.table] if s.with_load else None
            totals = [sum(col) for col in zip(*s.table)]
        elif s.P > 1:                               # their totals (and the senders' splits) by one allreduce
            mine = owned.count_array(ladder, self.rule)                 # on the device: read only the totals
            if s.with_load:
                mine = xp.concat([mine, xp.asarray(s.splits, xp.index_dtype, like=acc)], like=acc)
            totals = [int(v) for v in xp.to_numpy(comm.allreduce(mine, SUM, "ladder"))]
            totals, s.loads = totals[:len(ladder)], (totals[len(ladder):] if s.with_load else None)
        else:
            totals = owned.counts(ladder, self.rule)
        s.rung = next((j for j, tot in enumerate(totals) if tot <= s.k), len(ladder) - 1)
        s.used, s.T = ladder[s.rung], totals[s.rung]
        if self.fill and s.rung > 0 and s.T < s.k < totals[s.rung - 1]:
            s.fill = (ladder[s.rung - 1], s.k - s.T, totals[s.rung - 1] - s.T)

    def keep(self, xp, owned, c_val, s):
        """The owner's candidates at Γ, and with a fill its q largest under Γ: the h + q largest at the rung below."""
        keep = owned.select(s.used, self.rule)[0]
        if s.fill is None:
            return keep
        wide = owned.select(s.fill[0], self.rule)[0]
        h = xp.numel(keep)
        q = s.quota(xp.numel(wide), h)
        return keep if q == 0 else xp.take(wide, xp.topk(xp.take(c_val, wide), h + q)[0])

    def owner_counts(self, xp, acc, m_idx, comm, s, balance):
        if s.table is not None:                     # from the gathered ladder counts
            s.owner_counts = [row[s.rung] + s.quota(row[s.rung - 1], row[s.rung]) for row in s.table]
            s.T = sum(s.owner_counts)
        elif balance == "never":
            s.owner_counts = None
        else:
            s.owner_counts = [0] * s.P if s.T == 0 and s.fill is None else \
                allgather_count(xp, xp.numel(m_idx), comm, "count", acc)
            s.T = sum(s.owner_counts)

    def next_threshold(self, s):
        return s.used


@dataclasses.dataclass
class _OkStep:
    """What one step of :meth:`OkTopk.reduce` knows, filled in phase by phase: P, this rank, n, k; the step counter
    and Γ it starts with; whether it re-evaluates, repartitions, makes few collectives; the regions (and the
    measured histogram); the split's load and splits; the owners' counts (and loads); G; the Γ used and next."""

    P: int
    r: int
    n: int
    k: int
    offsets: list
    t: int
    gamma: float
    reev: bool = False
    few: bool = False
    repart: bool = False
    edges: object = None
    hist: object = None
    with_load: bool = False
    load: int = None
    splits: list = None
    loads: list = None
    owner_counts: list = None
    table: list = None
    rung: int = None
    T: int = None
    g_idx: object = None
    g_val: object = None
    used: float = None
    gamma_next: float = None
    balanced: bool = False
    capped: bool = False
    fill: tuple = None

    def quota(self, below, at):
        """An owner's share of ``global_fill``: floor((k - K)·b_r / B), b_r = ``below - at`` (0 without a fill)."""
        return 0 if self.fill is None else self.fill[1] * (below - at) // self.fill[2]


@options
class OkTopk(Reducer):
    """Ok-Topk O(k) sparse allreduce (Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep
    Learning", PPoPP'22, Algorithm 1; docs/algorithms.md#oktopk). Pair it with
    :class:`hvd_sparse.core.sparsifiers.threshold_reuse.ThresholdReuse` (its local selection).

    Args:
        threshold_period (int): τ', re-evaluate the global threshold Γ exactly every τ' sparse steps
            (t % τ' == 0, t = this reducer's own step counter from 0). Default 32.
        repartition_period (int): τ, recompute the region boundaries every τ steps (``periodic``). Default 64.
        boundaries (str): how the regions follow the selection: ``"periodic"`` (default, paper), ``"result"``,
            ``"load"`` or ``"measured"`` (the ``Compression.oktopk`` preset); each rule is described in
            :class:`~hvd_sparse.core.reducers.regions.Regions`, the policy object built from these four options.
        load_smoothing (float): β of ``load`` (and of ``measured``'s bins): the boundaries split β·(average so far)
            + (1-β)·(this step's) of the measured load CDFs evenly. 0: the last step only. Default 0.5.
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
        global_control (str): how Γ follows K between re-evaluations: ``"band"`` (default, the authors' code;
            :class:`Band`, with the four ``global_*`` options above) or ``"ladder"`` (the ``Compression.oktopk``
            preset: K <= k on reuse steps; :class:`Ladder`, with the two below).
        ladder_factor (float): f of the ladder. Default 1.1 (Γ moves by up to x1.77 up or /1.21 down a step).
        global_fill (bool): with the ladder, K up to k on reuse steps (:class:`Ladder`). Default False.
        few_collectives_from (int or None): at k >= this·P (k/P: the same on every rank) no histogram and
            no ladder allreduce: ``measured`` boundaries follow the smoothed load (the ``load`` rule, a good
            forecast at many entries per region) and each owner's 9 ladder counts and load ride in the count
            allgather (10(P-1) words, <= 1% of k(P-1)/P): two collectives' latency less. None: never.
            Default 1024.

    Per-rank state: ``t`` (sparse steps so far), ``gamma`` (Γ, identical on all ranks), ``offsets``
    (o_0..o_P, Python ints, identical on all ranks), ``size`` (P). Info returned each step: ``K``,
    ``threshold`` (Γ used this step), ``next_threshold``, ``reeval``, ``repartition``, ``balanced``, ``capped``,
    ``filled`` (``global_fill`` acted), ``offsets``, ``owner_counts`` (per-owner candidate counts: U_r on re-eval
    steps, c_r on others), ``t``.
    """

    name = "oktopk"
    sparse_result = True

    threshold_period: int = integer(32)
    repartition_period: int = integer(64)
    balance: str = choice("auto", BALANCE_POLICIES, fix="'auto' balances when the largest owner holds > "
                                                        "balance_factor x the average")
    _: dataclasses.KW_ONLY
    balance_factor: float = real(4.0, 0.0, low_incl=False, fix="e.g. 4.0 (paper)")
    global_band_lo: float = real(0.75, 0.0, fix="e.g. 0.75")
    global_band_hi: float = real(1.25, 0.0, fix="e.g. 1.25")
    global_relax: float = real(1.01, 1.0, fix="e.g. 1.01 (1.0 disables)")
    global_tighten: float = real(1.008, 1.0, fix="e.g. 1.008 (1.0 disables)")
    select_rule: str = choice("ge_nonzero", SELECT_RULES, fix=SELECT_RULE_FIX)
    max_select_ratio: float = real(None, 1.0, allow_none=True, fix="e.g. 4 (or None for no cap)")
    global_control: str = choice("band", ("ladder", "band"))
    ladder_factor: float = real(1.1, 1.0, low_incl=False, fix="e.g. 1.1")
    boundaries: str = choice("periodic", BOUNDARY_POLICIES)
    boundary_tolerance: float = real(1.0, 1.0, fix="e.g. 1.1 (1.0: every step)")
    load_smoothing: float = real(0.5, 0.0, below=1.0, fix="e.g. 0.5 (0: last step only)")
    few_collectives_from: int = integer(FEW_COLLECTIVES_FROM, allow_none=True)
    global_fill: bool = flag(False)

    def check_together(self, api):
        check_real(self.global_band_hi, "global_band_hi", api, self.global_band_lo,
                   fix="global_band_hi must be >= global_band_lo")
        if self.global_fill and self.global_control != "ladder":
            raise ValueError(f"{api}: global_fill needs global_control='ladder', got {self.global_control!r}")

    def __post_init__(self):
        super().__post_init__()
        # the two policies, each a small object of the options it reads (the fields above stay the public options)
        object.__setattr__(self, "regions", Regions(self.boundaries, self.repartition_period, self.boundary_tolerance,
                                                    self.load_smoothing))
        object.__setattr__(self, "control", Ladder(self.ladder_factor, self.global_fill, self.select_rule)
                           if self.global_control == "ladder" else
                           Band(self.global_band_lo, self.global_band_hi, self.global_relax, self.global_tighten,
                                self.select_rule))

    def initial_state(self):
        return {"t": 0, "gamma": None, "offsets": None, "size": None}

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

    # -- one step ----------------------------------------------------------------------------------------
    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        """One step of Algorithm 1 (the module docstring), a method per phase:

        1. :meth:`_start`             re-evaluation or reuse step, few collectives or not;
        2. ``regions.plan``           the regions (:class:`~.regions.Regions`): the allreduce repartition, or the
                                      step's measured load;
        3. :meth:`_split_and_reduce`  region r of the sum of the selections (P = 1: ``acc`` on S);
        4. :meth:`_reevaluate`        re-evaluation steps: the exact global top-k of the gathered candidates, or
           :meth:`_reuse`             the others: the owners' candidates at Γ (``control``: :class:`Ladder` or
                                      :class:`Band`) and :meth:`_balance_and_allgatherv`;
        5. :meth:`_finish`            I = S ∩ G, the next boundaries (``regions.follow``) and the state.
        """
        s = self._start(xp, acc, k, comm, state)
        self.regions.plan(xp, acc, idx, comm, state, s)
        if s.P == 1:                                                # rho = a on S (no collective)
            vals = xp.take(acc, idx)
            nz = xp.nonzero(xp.gt(xp.abs(vals), 0.0))
            c_idx, c_val = xp.take(idx, nz), xp.take(vals, nz)
        else:
            c_idx, c_val, s.load, s.splits = self._split_and_reduce(xp, acc, idx, s.offsets, comm)
        if s.reev:
            self._reevaluate(xp, acc, c_idx, c_val, comm, s)
        else:
            self._reuse(xp, acc, c_idx, c_val, comm, s)
        return self._finish(xp, idx, state, s)

    def _start(self, xp, acc, k, comm, state):
        """The step's plan (a :class:`_OkStep`); a new world size or layout (elastic, a new model) starts over."""
        P, n = comm.size, xp.numel(acc)
        offsets = state.get("offsets")
        if state.get("size") != P or (offsets is not None and (len(offsets) != P + 1 or offsets[-1] != n)):
            state.update(t=0, gamma=None, offsets=None, size=P, cdf=None)
            offsets = None
        s = _OkStep(P=P, r=comm.rank, n=n, k=k, offsets=offsets, t=state["t"], gamma=state["gamma"])
        s.reev = s.t % self.threshold_period == 0 or s.gamma is None or not math.isfinite(s.gamma)
        # many entries per region (k, P: the same on every rank): the step's latency outweighs the words the
        # histogram and the ladder's allreduce save, and the last steps' load forecasts the next one well
        s.few = P > 1 and self.few_collectives_from is not None and k >= self.few_collectives_from * P
        return s

    def _reevaluate(self, xp, acc, c_idx, c_val, comm, s):
        """Global re-evaluation: every owner's candidates gathered (identical on every rank), G their exact
        top-min(k, |C|), Γ its K-th magnitude."""
        if s.P > 1:
            if s.with_load:
                s.owner_counts, s.loads = map(list, zip(*allgather_counts(xp, [xp.numel(c_idx), s.load], comm,
                                                                           "reeval_count", acc)))
            else:
                s.owner_counts = allgather_count(xp, xp.numel(c_idx), comm, "reeval_count", acc)
            if sum(s.owner_counts):                                 # (skipped when K = 0 everywhere)
                packed = pack_pairs(xp, c_idx, c_val, wire_index_dtype(xp, s.n), acc)
                c_idx, c_val = unpack_pairs(xp, comm.allgather(packed, "reeval_gather"))
        else:
            s.owner_counts = [xp.numel(c_idx)]
        s.g_idx, s.g_val, s.gamma = global_topk(xp, c_idx, c_val, s.k)
        s.used = s.gamma_next = s.gamma

    def _reuse(self, xp, acc, c_idx, c_val, comm, s):
        """Threshold reuse: each owner keeps its candidates at the global threshold (``control``: the ladder's rung
        or the band's Γ), G is their balanced allgatherv, and Γ moves for the next step (the cap, or ``control``)."""
        owned = xp.scan(c_val)                      # the owner's candidates: counts and selection on |c_val|
        self.control.threshold(xp, acc, owned, comm, s)
        keep = self.control.keep(xp, owned, c_val, s)
        m_idx, m_val = xp.take(c_idx, keep), xp.take(c_val, keep)
        if s.P > 1:
            self._balance_and_allgatherv(xp, acc, m_idx, m_val, comm, s)
        else:
            s.owner_counts = [xp.numel(m_idx)]
            s.g_idx, s.g_val = m_idx, m_val
            s.T = s.owner_counts[0]
        if self.max_select_ratio is not None and s.T > self.max_select_ratio * s.k:
            s.g_idx, s.g_val, s.gamma_next = global_topk(xp, s.g_idx, s.g_val, s.k)    # hard cap
            s.capped = True
        else:
            s.gamma_next = self.control.next_threshold(s)

    def _balance_and_allgatherv(self, xp, acc, m_idx, m_val, comm, s):
        """G: every owner's kept pairs, gathered in global index order; first balanced by an alltoall when the
        policy says so (the owners' counts: ``control.owner_counts``)."""
        self.control.owner_counts(xp, acc, m_idx, comm, s, self.balance)
        if s.T == 0 and (s.fill is None or s.owner_counts is not None):     # K = 0, known to every rank
            s.g_idx, s.g_val = m_idx, m_val
            return
        packed = pack_pairs(xp, m_idx, m_val, wire_index_dtype(xp, s.n), acc)
        s.balanced = self.balance == "always" or (
            self.balance == "auto" and max(s.owner_counts) * s.P > self.balance_factor * s.T)
        if s.balanced:
            packed, _ = comm.alltoall(packed, [2 * c for c in balance_splits(s.owner_counts, s.r)], "balance")
        s.g_idx, s.g_val = unpack_pairs(xp, comm.allgather(packed, "gather"))

    def _finish(self, xp, idx, state, s):
        """The output (the sum is G itself, sorted and unique: the engine scatters it), the included set
        I = S ∩ G (exact), the next boundaries and the state."""
        u = SparseSum(s.g_idx, s.g_val)
        included = xp.intersect(idx, s.g_idx)       # S ∩ G, ascending
        nxt = self.regions.follow(xp, state, s)
        state.update(t=s.t + 1, gamma=s.gamma_next, offsets=list(s.offsets if nxt is None else nxt), size=s.P)
        info = {"K": xp.numel(s.g_idx), "threshold": s.used, "next_threshold": s.gamma_next, "reeval": bool(s.reev),
                "repartition": bool(s.repart), "balanced": s.balanced, "capped": s.capped, "filled": s.fill is not None,
                "offsets": list(s.offsets), "owner_counts": s.owner_counts, "t": s.t,
                "rebalanced": nxt is not None or s.hist is not None}
        return u, included, info
