"""Ok-Topk: the O(k) sparse allreduce (docs/algorithms.md#oktopk; Li & Hoefler, PPoPP'22, Algorithm 1), on three
fixed-shape collectives per step (docs/algorithms.md#the-wire).

    reduce(a, S):                                   # engine: a = eps + g; S = ThresholdReuse.select(a), padded
      _start             reev = (t % tau_p == 0)    # t = 0 is always a re-eval AND repartition step
      1 opening          every rank's proposals (P-1 words: S's even split) and, for "measured" regions below
                         F·P entries, its histogram of S (2P words) ride in the step's opening
                         (core/comm.py: one allgather, the agreement's header in front)
        regions.plan     off = mean of the proposals (repartition steps) | even split of the summed histogram
                         ("measured") | the last step's (they follow it: regions.follow)
      2 _split           rho = region r of the sum of the selections: one alltoall of S's pairs (a message of the
                         selection's capacity every step; the unused slots go to this rank itself), at most s to
                         an owner (split_capacity·k/P: its largest; the rest stays out of S), the sources added in
                         rank order on the received support (xp.merge_add_padded)
      3 _gather          every owner sends its pairs at Γ, or at the first rung above that fits c (c =
                         gather_capacity·k/P; reev: its c largest), its counts below Γ (the ladder's Γ/f) and its
                         load (regions that follow it) in the message's header: one collective of one shape (a
                         device: an allgather of c pairs an owner, every count at Γ·f^j in the header; the host:
                         an alltoall of the real pairs, whose counts from Γ up the receivers count, _gather_real)
        _select          reev: G = exact top-k of the gathered pairs, Γ = its K-th magnitude
                         else: control.threshold: the rung (Ladder: the smallest Γ·f^j at which G holds <= k, each
                               owner's share its count there, at most what it sent; Band: Γ); G = the gathered
                               pairs at it, at Γ where it lies below (fill: top-k above the rung below); Γ moves
                               for the next step (Ladder: to the rung; Band: band_adjust(Γ, K, k, lo, hi, ...))
      _finish            I = S ∩ G;  eps = a;  eps[I] = 0            # Alg.2 line 6 (the engine zeroes I)
                         regions.follow: next_off                   # "load": the owners' loads; "result": G
                         t += 1;  return SparseSum(G.idx, G.val), I # the SUM (the engine divides by P)

Collectives (phase names; none at all when P = 1), each of one shape on every step of a run:
    agree (opening)  allgather: header + proposals (+ histogram)        every step
    split            alltoall (global index, value) pairs               every step
    gather           allgather: 2-11 header words + c (index, value)    every step  (on the host an alltoall of
                                                                                     0-2 header words and the
                                                                                     real pairs, at most c)

Departures from the paper, for fixed shapes (docs/algorithms.md#oktopk):
  * the owners' candidates travel in a gather of a capacity c per owner, its largest pairs by magnitude: no count
    collective, no balancing alltoall (an owner sends at most c pairs, so nothing is unbalanced); an owner with more
    than c pairs at the threshold keeps the rest out of G (their senders keep them in their residuals, I = S ∩ G).
    On a device every owner sends c pairs, padding included (counting them would make the host wait); on the host,
    where the count is free, only its real ones, in an alltoall whose shape is fixed all the same (the rest of the
    message goes to the owner itself). Volume: 2|S|(P-1)/P + at most 2c(P-1) data words, <= 6k(P-1)/P while
    |S| <= k and c <= 2k/P; gather_capacity is 1.5, 1.25 in the library's preset (measured: the owners' share of G,
    docs/algorithms.md#the-wire);
  * the library's preset sends an owner at most s = 1.25k/P pairs of a rank's selection in the split (the paper
    sends them all): no owner receives more than 2s(P-1) words however the regions lie, so a steady step receives
    at most (P-1)(2s + 2c + 2) words on the host, within 6k(P-1)/P from k/P = 6;
  * the re-evaluation takes the exact top-k of the gathered candidates (the owners' top-c), the reuse step
    decides its rung from the owners' counts, in the gather itself (in its header below Γ; on the host the pairs
    sent from Γ up are their own count): the same two collectives on every step;
  * the "measured" regions count the step's load in the opening (no refinement of heavy bins).

Wire format: an (index, value) pair is an index and the float32 value's bits, int32 words (int64 only when an index
does not fit int32; never float-encoded).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..reducers.base import Reducer, SparseSum, pair_blocks, unpack_pair_rows, values_of_bits, wire_index_dtype
from ..sparsifiers.base import CLIMB
from ..validate import check_real, choice, flag, integer, options, real
from ..xp.fixed import lower_bounds, run_rung_counts
from ..xp.generic import rule_mask
from .regions import Regions, region_split
from .selection import band_adjust, max_select_ratio_option, select_rule_option, threshold_period_option

BOUNDARY_POLICIES = ("periodic", "result", "load", "measured")
FEW_COLLECTIVES_FROM = 1024         # k/P from which "measured" regions follow the load instead of a histogram
#: "measured" regions count a histogram only from k >= this·P²: the allgathered histogram's 2P(P-1) words a rank
#: are then at most a quarter of k(P-1)/P (below, a split balanced by the load of the last steps and capped by the
#: split capacity costs less: docs/algorithms.md#oktopk)
HISTOGRAM_FROM = 8
#: exponents j of the Γ ladder Γ·f^j (global_control="ladder"): the owners count their sums at every rung and send
#: those from Γ (j = 0) up; the count at Γ/f lets Γ come down a rung (docs/algorithms.md#oktopk)
LADDER_STEPS = tuple(range(-1, 8))


# -- the global control: how Γ follows K between re-evaluations (OkTopk.global_control) --------------------------
@dataclasses.dataclass(frozen=True)
class Band:
    """``global_control="band"`` (the authors' post-hoc controller): a reuse step keeps the owners' pairs at the
    stored Γ, and Γ moves one small step after the step (``band_adjust``): Γ·``tighten`` when K > ``hi``·k,
    Γ/``relax`` when K < ``lo``·k (``OkTopk``'s ``global_band_lo/hi``, ``global_relax``, ``global_tighten``). It
    lags behind a growing residual and lets K grow well above k (measured: docs/algorithms.md, "oktopk",
    *Controllers*)."""

    lo: float
    hi: float
    relax: float
    tighten: float
    rule: str
    #: the first rung whose pairs the owners send
    start = 0

    def rungs(self, gamma):
        """The thresholds an owner counts its pairs at: Γ alone."""
        return [gamma]

    def threshold(self, totals, k):
        """The rung taken, from what G would hold at each rung (every owner's share summed)."""
        return 0

    def next_threshold(self, rungs, j, totals, k):
        return band_adjust(rungs[0], totals[j], k, self.lo, self.hi, self.relax, self.tighten)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """``global_control="ladder"``: each owner counts its sums at the thresholds Γ·f^j, j = -1..7 (f =
    ``factor``, ``OkTopk.ladder_factor``) and sends those from Γ up (at most c), and every rank takes the smallest
    rung at which G holds at most k (each owner's share: its count there, at most what it sent; below Γ, at most
    c); Γ keeps it. So K <= k on reuse steps whenever the ladder reaches; where even its top rung holds more than k
    (Γ is more than 1.95x below the sums, as on the steps after a re-evaluation while error feedback grows them),
    G holds them all: K > k then applies more of the sum, and moves no word more (the gather has carried them
    already). A rung below Γ is taken for the next step: G keeps the pairs at Γ (all it has), Γ comes down to it.

    ``fill`` (``OkTopk.global_fill``): the owners' sums pile up above the local thresholds, so a rung can hold
    several times the next one's count and the rung taken can leave K well below k (measured: docs/algorithms.md,
    "oktopk", *Filling K up to k*). When the rung holds K < k and the one below (Γ or above) > k, G is the exact
    top-k of the gathered pairs above the rung below: K = k, no collective more. A rung above Γ that holds none is
    filled so always, and where Γ's own holds none Γ comes down a rung (without them, a step whose sums lie within
    one rung of each other would apply nothing, and Γ, kept at the empty rung, could stay above them step after
    step)."""

    factor: float
    fill: bool
    rule: str
    #: the first rung whose pairs the owners send: Γ's
    start = LADDER_STEPS.index(0)

    def rungs(self, gamma):
        return [gamma * self.factor ** j for j in LADDER_STEPS]

    def threshold(self, totals, k):
        return next((j for j, tot in enumerate(totals) if tot <= k), len(totals) - 1)

    def next_threshold(self, rungs, j, totals, k):
        return rungs[j - 1] if j == self.start and j and totals[j] == 0 else rungs[j]


# -- what one step knows, phase by phase (each phase's result, passed on in arguments) ---------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    """What a step knows before any data moves: P, this rank, n, k; the step counter t and the Γ it starts with;
    whether it re-evaluates Γ exactly (``reev``), and whether its regions count no histogram (``few``)."""

    P: int
    r: int
    n: int
    k: int
    t: int
    gamma: float
    reev: bool
    few: bool


@dataclasses.dataclass(frozen=True)
class Placement:
    """The step's regions, from the opening: the boundaries o_0..o_P (``offsets``), whether they were placed from
    the ranks' proposals (``repart``), the histogram's bins and summed counts (``edges``, ``hist``: None without
    one), and how many real entries this rank's selection holds (``own``)."""

    offsets: list
    repart: bool
    edges: list
    hist: list
    own: int


@dataclasses.dataclass(frozen=True)
class Gathered:
    """The owners' pairs, gathered: indexes and values in global index order ((P, c), padding included, on a device;
    on the host the real pairs alone, one flat run), every owner's share of G at each of the control's rungs
    (``counts``: its count there, at most c below Γ and at most the pairs it sent from Γ up; None on re-evaluation
    steps), the pairs its region received (``loads``, None unless the regions follow the load) and how many real
    pairs it sent (``sent``, None on re-evaluation steps)."""

    idx: object
    val: object
    counts: list
    loads: list
    sent: list = None


@dataclasses.dataclass(frozen=True)
class Chosen:
    """G and Γ: the pairs kept (``idx``, ``val``: ascending, padded with (n, 0.0)), K = |G|, the Γ used and the Γ
    of the next step, each owner's share of G (None on re-evaluation steps), and whether the hard cap
    (``capped``) or the fill (``filled``) acted."""

    idx: object
    val: object
    K: int
    used: float
    gamma_next: float
    owner_counts: list = None
    capped: bool = False
    filled: bool = False


@options
class OkTopk(Reducer):
    """Ok-Topk O(k) sparse allreduce (Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep
    Learning", PPoPP'22, Algorithm 1; docs/algorithms.md#oktopk). Pair it with
    :class:`hvd_sparse.core.oktopk.selection.ThresholdReuse` (its local selection).

    Args:
        threshold_period (int): τ', re-evaluate the global threshold Γ exactly every τ' sparse steps
            (t % τ' == 0, t = this reducer's own step counter from 0). Default 32.
        repartition_period (int): τ, recompute the region boundaries every τ steps (``periodic``). Default 64.
        gather_capacity (float or None): c, the most pairs each owner sends in the gather, in units of k/P (at most
            k): an owner with more pairs at the threshold keeps its c largest in G. On a device every owner sends c
            (the padding crosses); on the host its real ones. None: more than an owner ever holds (nothing is cut;
            for studies, at many times the words on a device). Default 1.5 (measured: docs/algorithms.md).
        split_capacity (float or None): s, the most pairs a rank sends each other owner in the split, in units of
            k/P: where its selection holds more in a region, its s largest there go and the rest stays in its
            residual, so no owner receives more than 2s(P-1) words however the regions lie. None (default, the
            paper): the whole selection. The ``Compression.oktopk`` preset: measured, docs/algorithms.md#oktopk.
        boundaries (str): how the regions follow the selection: ``"periodic"`` (default, paper), ``"result"``,
            ``"load"`` or ``"measured"`` (the ``Compression.oktopk`` preset); each rule is described in
            :class:`~hvd_sparse.core.oktopk.regions.Regions`, the policy object built from these options.
        load_smoothing (float): β of ``load`` (and of ``measured``'s bins): the boundaries split β·(average so far)
            + (1-β)·(this step's) of the measured load CDFs evenly. 0: the last step only. Default 0.5.
        boundary_tolerance (float): the recompute trigger of ``result`` and ``load``; 1.0 recomputes on
            every step. Default 1.0.
        global_band_lo, global_band_hi (float): band [lo·k, hi·k] for K on reuse steps. Default 0.75, 1.25.
        global_relax (float): Γ /= global_relax when K < lo·k. Default 1.01 (1.0 disables).
        global_tighten (float): Γ *= global_tighten when K > hi·k. Default 1.008 (1.0 disables).
        select_rule (str): owners' pairs on reuse steps: ``"ge_nonzero"`` (default, |ρ| >= Γ and
            ρ != 0) or ``"gt"`` (ref: |ρ| > Γ). Re-evaluation steps always take the exact top-k.
        max_select_ratio (float or None): optional hard cap: when K > ratio·k on a reuse step, keep the exact
            top-k of G and re-evaluate Γ from them. Default None (off, as ref).
        global_control (str): how Γ follows K between re-evaluations: ``"band"`` (default, the authors' code;
            :class:`Band`, with the four ``global_*`` options above) or ``"ladder"`` (the ``Compression.oktopk``
            preset: K <= k on reuse steps; :class:`Ladder`, with the two below).
        ladder_factor (float): f of the ladder. Default 1.1 (Γ moves by up to x1.95 up or /1.1 down a step).
        global_fill (bool): with the ladder, K up to k on reuse steps (:class:`Ladder`). Default False.
        few_collectives_from (int or None): at k >= this·P (k/P: the same on every rank) ``measured`` regions
            count no histogram (2P(P-1) words a step in the opening) and follow the smoothed load instead (the
            ``load`` rule, a good forecast at many entries per region). None: never. Default 1024. They do the same
            below k = 8·P² (``HISTOGRAM_FROM``), where the histogram would cost more than a quarter of k(P-1)/P.

    Per-rank state: ``t`` (sparse steps so far), ``gamma`` (Γ, identical on all ranks), ``offsets``
    (o_0..o_P, Python ints, identical on all ranks), ``size`` (P). Info returned each step: ``K`` (the entries
    of G: what the sum holds), ``threshold`` (Γ used this step), ``next_threshold``, ``reeval``, ``repartition``,
    ``capped``, ``filled`` (a fill acted), ``offsets``, ``owner_counts`` (each owner's share of G), ``t``.
    """

    name = "oktopk"
    sparse_result = True
    opens = True

    threshold_period: int = threshold_period_option()
    repartition_period: int = integer(64)
    _: dataclasses.KW_ONLY
    gather_capacity: float = real(1.5, 0.0, low_incl=False, allow_none=True,
                                  fix="e.g. 1.5 (the pairs per owner, in k/P; None: never cut)")
    split_capacity: float = real(None, 0.0, low_incl=False, allow_none=True,
                                 fix="e.g. 1.25 (the pairs a rank sends one owner, in k/P; None: all)")
    global_band_lo: float = real(0.75, 0.0, fix="e.g. 0.75")
    global_band_hi: float = real(1.25, 0.0, fix="e.g. 1.25")
    global_relax: float = real(1.01, 1.0, fix="e.g. 1.01 (1.0 disables)")
    global_tighten: float = real(1.008, 1.0, fix="e.g. 1.008 (1.0 disables)")
    select_rule: str = select_rule_option()
    max_select_ratio: float = max_select_ratio_option()
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

    def split_limit(self, k, P):
        """s: the most pairs a rank sends one other owner in the split (``split_capacity``·k/P, at least 1), or None:
        its whole part of the selection."""
        return None if self.split_capacity is None else max(1, math.ceil(self.split_capacity * k / P))

    def owner_capacity(self, k, P):
        """c: the pairs each owner sends in the gather: at most k (G holds no more after a re-evaluation or on a
        reuse step of the ladder); ``gather_capacity`` None: 2·P·k, more than an owner ever holds (nothing is cut:
        for studies, at P times the words)."""
        return 2 * P * k if self.gather_capacity is None else max(1, min(k, math.ceil(self.gather_capacity * k / P)))

    # -- one step ----------------------------------------------------------------------------------------
    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        """One step of Algorithm 1 (the module docstring), a method per phase, each handing its result to the next:

        1. :meth:`_start`   re-evaluation or reuse step, a histogram or not (a :class:`Step`);
        2. :meth:`_open`    the opening: the regions' proposals (and histogram); the step's regions (a
                            :class:`Placement`);
        3. :meth:`_split`   region r of the sum of the selections (one alltoall);
        4. :meth:`_gather`  every owner's largest pairs, its counts and load (one allgather; a
                            :class:`Gathered`);
        5. :meth:`_select`  G and Γ: the exact top-k (re-evaluation) or the control's threshold (reuse; a
                            :class:`Chosen`);
        6. :meth:`_finish`  I = S ∩ G, the next boundaries (``regions.follow``) and the state.
        """
        step, offsets = self._start(xp, acc, k, comm, state)
        placed = self._open(xp, idx, state, ctx, step, offsets)
        region, load, idx = self._split(xp, idx, comm, ctx, step, placed)
        gathered = self._gather(xp, region, load, comm, step)
        chosen = self._select(xp, gathered, step)
        return self._finish(xp, idx, state, step, placed, gathered, chosen)

    def _start(self, xp, acc, k, comm, state):
        """``(step, offsets)``: the step's :class:`Step` and the last step's regions (None: none yet); a new world
        size or layout (elastic, a new model) starts over."""
        P, n = comm.size, xp.numel(acc)
        offsets = state.get("offsets")
        if state.get("size") != P or (offsets is not None and (len(offsets) != P + 1 or offsets[-1] != n)):
            state.update(t=0, gamma=None, offsets=None, size=P, cdf=None)
            offsets = None
        t, gamma = state["t"], state["gamma"]
        reev = t % self.threshold_period == 0 or gamma is None or not math.isfinite(gamma)
        # many entries per region (k, P: the same on every rank): the last steps' load forecasts the next one well;
        # few entries per rank (k < 8P²): the histogram's 2P(P-1) words would be more than a quarter of k(P-1)/P
        few = P > 1 and (self.few_collectives_from is not None and k >= self.few_collectives_from * P
                         or k < HISTOGRAM_FROM * P * P)
        return Step(P=P, r=comm.rank, n=n, k=k, t=t, gamma=gamma, reev=reev, few=few), offsets

    def _open(self, xp, idx, state, ctx, step, offsets):
        """The opening (``ctx.open``): this rank's proposals and histogram for the regions (``regions.opening``),
        read on the host with the agreement's header; ``regions.plan`` places the step's regions from them."""
        repart = self.regions.repartitions(step, offsets)
        words, parts, edges = self.regions.opening(xp, idx, ctx.selected, state, step, repart)
        _, counts, host = ctx.open(xp.astype(words, wire_index_dtype(xp, step.n)), parts, read=xp.numel(words))
        placed, hist = self.regions.plan(host, state, step, offsets, repart, edges)
        return Placement(offsets=placed, repart=repart, edges=edges, hist=hist, own=counts[step.r])

    def _split(self, xp, idx, comm, ctx, step, placed):
        """``(region, load, idx)``: region r of the sum of the selections
        (:class:`~hvd_sparse.core.xp.fixed.RegionSums`), the pairs it received and the selection as it was sent
        (:meth:`_cap_split`). One alltoall of the selection's whole capacity as (index, value bits) rows: the pairs of
        region q to rank q, the padding to this rank itself (so the message has the same shape every step, and no
        padding crosses the wire); the sources added in rank order."""
        r, offsets = step.r, placed.offsets
        splits = region_split(xp, idx, offsets)                 # the step's second host read: the send splits
        idx, splits = self._cap_split(xp, idx, ctx, splits, step)
        cap, own = xp.numel(idx), sum(splits)
        lo = sum(splits[:r + 1])                                # regions 0..r, the padding, regions r+1..P-1
        order = np.concatenate([np.arange(lo), np.arange(own, cap), np.arange(lo, own)])
        pairs = xp.take(idx, xp.asarray(order, xp.index_dtype, like=idx))
        packed = xp.stack(pair_blocks(xp, pairs, xp.take(ctx.padded, pairs), wire_index_dtype(xp, step.n)), axis=1)
        send = list(splits)
        send[r] += cap - own
        recv, recv_splits = packed, send
        if step.P > 1:
            recv, recv_splits = comm.alltoall(packed, send, "split")
        load = sum(recv_splits) - (cap - own)
        pieces = [p for q, m in enumerate(recv_splits)                 # this rank's own run ends in the padding
                  for p in ([(m, True)] if q != r else [(m - (cap - own), True), (cap - own, False)])]
        r_idx, r_bits = xp.unbind(xp.transpose(recv))
        r_val = values_of_bits(xp, r_bits)
        return xp.region_sums(r_idx, r_val, pieces, offsets[r], offsets[r + 1], step.n), load, idx

    def _cap_split(self, xp, idx, ctx, splits, step):
        """``(idx, splits)``: the selection as the split sends it: at most s = ``split_capacity``·k/P pairs to each
        other owner, its largest magnitudes there (ties by the lower index), the rest replaced by the padding (n):
        they stay in this rank's residual (I = S ∩ G of what was sent). Unchanged where no other owner's part
        exceeds s (known on the host from the splits: nothing more to compute), or without a split capacity."""
        s, r = self.split_limit(step.k, step.P), step.r
        if s is None or all(m <= s for q, m in enumerate(splits) if q != r):
            return idx, splits
        caps, cap = [m if q == r else min(m, s) for q, m in enumerate(splits)], xp.numel(idx)
        pos = xp.largest_in_runs(xp.take(ctx.padded, idx), splits + [cap - sum(splits)], caps + [0], cap)
        return xp.take(xp.concat([idx, xp.full(1, step.n, xp.index_dtype, like=idx)], like=idx), pos), caps

    def _gather(self, xp, region, load, comm, step):
        """Every owner's pairs (ascending index; padding: n, 0.0) and, in the message's header, its counts and its
        ``load``: one collective. A reuse step's owner sends its pairs at Γ, or at the first rung above where at most
        c pass (``xp.select_capped``: the largest stay); a re-evaluation's, its c largest. Returns the
        :class:`Gathered` pairs in global index order (the owners hold the regions in order), with what each owner's
        share of G would be at each rung and the loads: on a device the (P, c) rows of one
        allgather, padding included, every count in the header; on the host, where an owner's count costs no read,
        only the real pairs and the counts below Γ (:meth:`_gather_real`), the others counted in the pairs."""
        c, values, S = self.owner_capacity(step.k, step.P), region.values, self.control.start
        rungs = self.control.rungs(1.0 if step.reev else step.gamma)
        R, m = len(rungs), xp.numel(values)
        wire, host = wire_index_dtype(xp, step.n), not xp.on_device(values)
        if step.reev:
            pos, _, real = xp.topk_padded(values, c)
            counts = xp.zeros(R, wire, like=values)
        else:
            ths = rungs + [rungs[-1] * f for f in CLIMB[1:]]
            pos, real, _, counts = xp.select_capped(values, ths, self.select_rule, c, m, counts=R, start=S)
        top, vals = region.pairs(xp, pos)
        blocks, loads = pair_blocks(xp, top, vals, wire), [load] if self.regions.follows_load else []
        if host:
            below = [min(int(x), c) for x in xp.to_list(counts)[:S]]
            table, g_idx, g_val, sent = self._gather_real(xp, xp.asarray(below + loads, wire, like=values), blocks,
                                                          real, c, comm, step)
            above = None if step.reev else run_rung_counts(np.abs(xp.to_numpy(g_val)),
                                                           lower_bounds(rungs[S:], self.select_rule), sent).tolist()
        else:
            head = [xp.astype(counts, wire)] + [xp.asarray(loads, wire, like=values)] * bool(loads)
            msg = xp.concat(head + [xp.astype(xp.reshape(real, (1,)), wire)] + blocks, like=values)
            H = R + len(loads) + 1                              # the counts, the load, the pairs sent
            if step.P > 1:
                msg = comm.allgather(msg, "gather",
                                     parts=(("gather.head", H), ("gather.indices", c), ("gather.values", c)))
            msg = xp.reshape(msg, (step.P, -1))
            table = xp.to_list(xp.columns(msg, 0, H))            # the step's third host read: the owners' counts
            g_idx, g_val = unpack_pair_rows(xp, msg, H)
            sent = [row[H - 1] for row in table]
            above = [[min(x, m) for x in row[S:R]] for row, m in zip(table, sent)]
            table = [row[:S] + row[R:H - 1] for row in table]   # as the host's: the counts below Γ, the load
        # what each owner's share of G would be at each rung: below Γ its count there, at most c (what it could
        # send); from Γ up its count there, at most the pairs it sent (the largest: those that pass the rung)
        shares = None if step.reev else [[min(x, c) for x in row[:S]] + a for row, a in zip(table, above)]
        return Gathered(idx=g_idx, val=g_val, counts=shares, loads=[row[S] for row in table] if loads else None,
                        sent=None if step.reev else sent)

    def _gather_real(self, xp, head, blocks, real, c, comm, step):
        """The gather as an allgatherv of the real pairs in a message of one shape: each owner sends its ``head``
        (its counts below Γ and its load) and its ``real`` pairs (indices, then value bits) to every other rank, in
        one alltoall of (P-1)·(H + 2c) words whose rest, the spare, goes to the owner itself. The shape is the same
        every step (Horovod's response cache serves it) and no padding crosses the wire. The same pairs as the
        allgather's without its padding, so the same bits. Returns every owner's header (host lists), the owners'
        real pairs in rank order (ascending) and how many each sent."""
        P, r, H = step.P, step.r, xp.numel(head)
        idx, bits = blocks
        msg = xp.concat([head, idx[:real], bits[:real]], like=idx)
        owners = [msg]
        if P > 1:
            L = xp.numel(msg)
            spare = xp.zeros((P - 1) * (H + 2 * c - L), xp.dtype_of(msg), like=msg)
            splits = [L] * P
            splits[r] = xp.numel(spare)
            recv, got = comm.alltoall(xp.concat([msg] * r + [spare] + [msg] * (P - 1 - r), like=msg), splits,
                                      "gather", parts=lambda w: (("gather.head", H), ("gather.indices", (w - H) // 2),
                                                                 ("gather.values", (w - H) // 2)))
            starts = np.cumsum([0] + got[:-1])
            owners = [msg if q == r else recv[s:s + w] for q, (s, w) in enumerate(zip(starts, got))]
        table = xp.to_list(xp.reshape(xp.concat([o[:H] for o in owners], like=msg), (P, H)))
        half = [(xp.numel(o) - H) // 2 for o in owners]                             # each owner's real pairs
        g_idx = xp.concat([o[H:H + m] for o, m in zip(owners, half)], like=msg)
        g_bits = xp.concat([o[H + m:] for o, m in zip(owners, half)], like=msg)
        return table, g_idx, values_of_bits(xp, g_bits), half

    def _select(self, xp, gathered, step):
        """G and Γ (a :class:`Chosen`): the exact top-k of the gathered pairs on re-evaluation steps (Γ its K-th
        magnitude), else the pairs at the rung the control takes from what G would hold at each (the owners' shares
        summed; fill: the exact top-k above the rung below), at Γ where that rung lies below what the owners sent
        (Γ then comes down to it for the next step); the hard cap (``max_select_ratio``) takes the exact top-k of G
        and re-evaluates Γ from it. G keeps the pairs it holds in ascending order, the others replaced by the
        padding (n, 0.0): compacted on the host, in place on a device (``xp.keep``). K counts what G holds: each
        owner's share at the rung kept."""
        g_idx, g_val, k, n = gathered.idx, gathered.val, step.k, step.n
        if step.reev:
            idx, val, K, gamma = self._topk(xp, g_idx, g_val, k, n)
            return Chosen(idx=idx, val=val, K=K, used=gamma, gamma_next=gamma)
        rungs, S = self.control.rungs(step.gamma), self.control.start
        totals = [sum(col) for col in zip(*gathered.counts)]
        j = self.control.threshold(totals, k)
        at = max(j, S)
        owner_counts = [row[at] for row in gathered.counts]
        K, filled = totals[at], False
        if isinstance(self.control, Ladder) and at > S and totals[at] < k < totals[at - 1] and (
                self.control.fill or totals[at] == 0):             # (an empty rung is filled always)
            above = xp.masked(g_val, rule_mask(xp, xp.abs(g_val), rungs[at - 1], self.select_rule))
            idx, val, K, _ = self._topk(xp, g_idx, above, k, n)
            filled = True
        else:
            idx, val = xp.keep(g_idx, g_val, rungs[at], self.select_rule, n)
        gamma_next = self.control.next_threshold(rungs, j, totals, k)
        if self.max_select_ratio is not None and K > self.max_select_ratio * k:     # hard cap
            idx, val, K, gamma_next = self._topk(xp, idx, val, k, n)
            return Chosen(idx=idx, val=val, K=K, used=rungs[at], gamma_next=gamma_next, owner_counts=owner_counts,
                          capped=True, filled=filled)
        return Chosen(idx=idx, val=val, K=K, used=rungs[at], owner_counts=owner_counts, filled=filled,
                      gamma_next=gamma_next)

    def _topk(self, xp, g_idx, g_val, k, n):
        """``(idx, val, K, Γ)``: the exact top-k of the (index, value) pairs, in index order (ties by ascending
        index; K = min(k, nonzeros)), and its K-th magnitude (read on the host with K; inf when it is empty)."""
        g_idx, g_val = xp.reshape(g_idx, (xp.numel(g_idx),)), xp.reshape(g_val, (xp.numel(g_val),))
        pos = xp.topk_padded(g_val, k)[0]
        idx, val = self._take(xp, g_idx, g_val, pos, n)
        K, smallest = xp.read(xp.count_below(idx, n), xp.smallest_magnitude(val))
        K = int(K[0])
        return idx, val, K, float(smallest[0]) if K else math.inf

    @staticmethod
    def _take(xp, g_idx, g_val, pos, n):
        """The pairs at positions ``pos`` (the padding position, len: index n and 0.0)."""
        ext_i = xp.concat([xp.astype(g_idx, xp.index_dtype), xp.full(1, n, xp.index_dtype, like=g_idx)], like=g_idx)
        ext_v = xp.concat([g_val, xp.zeros(1, xp.float32, like=g_val)], like=g_val)
        return xp.take(ext_i, pos), xp.take(ext_v, pos)

    def _finish(self, xp, idx, state, step, placed, gathered, chosen):
        """The output (the sum is G itself, sorted and unique, then padding: the engine scatters it), the included
        set I = S ∩ G (exact; the rest of S padded with n), the next boundaries and the state."""
        u = SparseSum(chosen.idx, chosen.val)
        included = xp.members(idx, chosen.idx, step.n)
        measured = None if placed.hist is None else (placed.edges, placed.hist)
        nxt = self.regions.follow(xp, state, step, placed.offsets, gathered.loads, chosen.idx, measured)
        state.update(t=step.t + 1, gamma=chosen.gamma_next, offsets=list(placed.offsets if nxt is None else nxt),
                     size=step.P)
        info = {"K": chosen.K, "threshold": chosen.used, "next_threshold": chosen.gamma_next,
                "reeval": bool(step.reev), "repartition": bool(placed.repart), "capped": chosen.capped,
                "filled": chosen.filled, "offsets": list(placed.offsets), "owner_counts": chosen.owner_counts,
                "t": step.t, "rebalanced": nxt is not None or placed.hist is not None}
        return u, included, info
