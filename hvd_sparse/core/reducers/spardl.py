"""SparDL (docs/algorithms.md#spardl; Zhao et al., ICDE 2024): Spar-Reduce-Scatter (SRS) with block-wise top-k/P,
Global Residual Collection (GRC), Spar-All-Gather across d teams (SAG), final All-Gather in each team.

Rank (g, r): team g = rank // Q, local rank r = rank % Q, Q = P/d. n entries in Q blocks of c = ceil(n/Q)
(zero-padded to Q·c). Per-block budget k_b = max(1, floor(k·c/n)) (= int(c·ρ) of the authors' code for k = ρn).

    5.1  V = acc;  A = V zero-padded (block b = A[b·c:(b+1)·c]);  D = 0        # lazy: D lives in A
         select(b, kk): I = top-kk of |A[b]| (larger |x| first, ties -> lower index, zeros may be chosen)
                        D[b] += A[b] with I zeroed;  A[b] = A[b] with the rest zeroed;  return (I, A[b][I])
    5.2  l = ceil(log2 Q);  step s = 1..l:  gap_s = 2^(l-s),  m_s = Q - 2^(l-1) if s == 1 else 2^(l-s)
    5.3  for s in 1..l:
             [eager, s == 1: select(b, k_b) for every block b]
             payload = select(b, k_b) (lazy) | latest selection of b (eager),  b = r+gap_s+j mod Q, j < m_s
             alltoall "srs.<s>": send to (g, r+gap_s), receive from (g, r-gap_s)   # m_s·k_b pairs, always
             A[b][I_recv] += V_recv                                                 # one scatter-add
             [eager: select(b, k_b) for every received block b = r+j, j < m_s]
         (I_r, v_r) = select(r, h)                            # h = k_b for d = 1 and for R-SAG
    5.5  d > 1, sag="bruck": Bruck all-gather of the h-sets among {(g', r)}: alltoalls "sag.<s>",
             step s sends the first min(2^s, d-2^s) buffers to ((g-2^s) mod d, r)
             S = sum of the d sets IN TEAM ORDER 0..d-1;  U = union;  F_r = U, or top-k_b of |S| if |U| > k_b
             h-controller (h_mode="adaptive") with u = |U|; h_mode="fixed": h = k_b // d
         d > 1, sag="recursive": for s < log2 d: alltoall "rsag.<s>" with (g XOR 2^s, r); S = lower team's
             set + higher team's set; keep top-k_b; every dropped S[j] adds S[j]/2^(s+1) to D[r][j] on each
             of the 2^(s+1) ranks that now hold the set (so the group stores it exactly once)
    5.6  final all-gather of (F_b, values) inside the team: d = 1: allgather "final" (k_b pairs per rank);
             d > 1: Bruck alltoalls "final.<s>" (sizes vary: a count per buffer leads the message)
         u[F] = values                                        # the engine divides by the WORLD size P
    5.4  GRC:  residual = V;  residual[F] = D[F]              # returned as info["residual"]

Every point-to-point step is one ``comm.alltoall`` with single-peer splits (Horovod has no send/recv); with
``pack="bitcast"`` the int32 indices travel bit-cast to float32 ahead of the values in ONE float32 tensor
(never apply fp16 compression to it). P = 1 issues no collective (Q = 1, d = 1: u = top-k_b of V).
"""

from __future__ import annotations

import dataclasses
import warnings

from ..validate import choice, integer, options
from .base import Reducer, wire_index_dtype

_API = "hvd_sparse.SparDL"


@dataclasses.dataclass
class _SparDLStep:
    """One step's plan (team, blocks, budgets) and working blocks: A, D and the eager selections."""

    d: int
    Q: int
    g: int
    r: int
    base: int
    n: int
    c: int
    kb: int
    h: int
    eager: bool
    wire: object
    A: object
    D: object
    last: list


# -- schedules and controller (pure functions, unit-tested) ------------------------------------------------
def ceil_log2(x):
    """ceil(log2 x) for x >= 1 (0 for x = 1)."""
    return (int(x) - 1).bit_length()


def srs_schedule(Q):
    """The SRS steps of a team of Q ranks (step 5.2): ``[(gap_s, m_s) for s = 1..ceil(log2 Q)]``.

    Step s sends blocks (r+gap_s+j) mod Q, j < m_s, to local rank (r+gap_s) mod Q.
    """
    l = ceil_log2(Q)
    return [(1 << (l - s), Q - (1 << (l - 1)) if s == 1 else 1 << (l - s)) for s in range(1, l + 1)]


def h_controller_step(h, h_step, inertia, u, k_b, d):
    """One update of the adaptive B-SAG selection size (step 5.5, as in the authors' code).

    Returns the new ``(h, h_step, inertia)`` after a union of size ``u``.
    """
    if (u > k_b) != (h_step > 0):          # still moving in the right direction
        if inertia:
            h_step *= 2
            inertia = False
        else:
            inertia = True
    else:                                  # overshoot: reverse at half size (or flip if |step| <= 1)
        h_step = int(-0.5 * h_step) if abs(h_step) > 1 else -h_step
        inertia = False
    return max(h + h_step, max(1, k_b // d)), h_step, inertia


def _segments(start, m, Q):
    """Blocks (start+j) mod Q, j < m, as at most two contiguous ranges [lo, hi), in that order."""
    start %= Q
    if start + m <= Q:
        return [(start, start + m)]
    return [(start, Q), (0, start + m - Q)]


def _flat_index(xp, cols, lo, c, like):
    """Flat indices (row-major) of the columns ``cols`` (m, k) of blocks lo..lo+m-1."""
    m = cols.shape[0]
    rows = (xp.arange(m, xp.index_dtype, like=like) + lo) * c
    return xp.reshape(rows[:, None] + cols, (-1,))


@options
class SparDL(Reducer):
    """SparDL (Zhao, Yin, Mao, Liu, Chen, Gao, "SparDL: Distributed Deep Learning Training with Efficient
    Sparse Communication", ICDE 2024; docs/algorithms.md#spardl).

    SparDL chooses its own values: the sparsifier's selection ``idx`` is IGNORED (pair it with
    ``TopK(density)``; only the sparsifier's budget k = max(1, floor(density·n)) is used, giving the
    per-block budget k_b = max(1, floor(k·c/n))). The reducer takes the whole accumulator, runs
    Spar-Reduce-Scatter with block-wise top-k_b, Spar-All-Gather across teams and the final all-gather, and
    returns the rank's Global-Residual-Collection residual as ``info["residual"]`` (the engine keeps it
    instead of zeroing an included set). ``included`` is the support of the output (informational).

    Args:
        groups (int): number of teams d (default 1, the reference code's value); must divide P (checked at
            the first step). d = P (no SRS) is allowed with a warning.
        sag (str): Spar-All-Gather across teams for d > 1: ``"bruck"`` (B-SAG, default) or
            ``"recursive"`` (R-SAG, d a power of two).
        selection (str): ``"lazy"`` (default, code: each block top-k'ed once, just before it is sent) or
            ``"eager"`` (paper: top-k_b of every block first, re-selected after every receive).
        h_mode (str): B-SAG selection size h of the own block: ``"adaptive"`` (default, the code's
            controller, start h = k_b // d) or ``"fixed"`` (h = k_b // d). Irrelevant for d = 1 (h = k_b).
        pack (str): ``"bitcast"`` (default: indices bit-cast to float32 and values in one tensor, one
            alltoall per step) or ``"two"`` (separate index and value collectives, phases ``<phase>.idx`` /
            ``<phase>.val``).

    Non-finite values are the engine's business: it checks every accumulator before any reducer sees it
    (``nonfinite=``), so the reducer never receives a NaN or Inf.
    """

    name = "spardl"
    uses_selection = False

    groups: int = integer(1)
    _: dataclasses.KW_ONLY
    sag: str = choice("bruck", ("bruck", "recursive"))
    selection: str = choice("lazy", ("lazy", "eager"))
    h_mode: str = choice("adaptive", ("adaptive", "fixed"))
    pack: str = choice("bitcast", ("bitcast", "two"))

    def check_together(self, api):
        if self.sag == "recursive" and self.groups & (self.groups - 1):
            raise ValueError(f"{api}: groups must be a power of two with sag='recursive', got "
                             f"{self.groups}; use sag='bruck' or groups in (1, 2, 4, 8, ...)")

    # -- communication helpers ----------------------------------------------------------------------------
    def _exchange(self, xp, comm, phase, peer, ints, vals, header=0):
        """Send (ints, vals) to ``peer`` with single-peer alltoalls; return what the one source sent me.

        ``ints`` = ``header`` ints then one index per value; the received ints keep that layout.
        """
        P = comm.size
        if self.pack == "bitcast":
            payload = xp.concat([xp.bitcast(ints, xp.float32), vals], like=vals)
            splits = [0] * P
            splits[peer] = xp.numel(payload)
            y, _ = comm.alltoall(payload, splits, phase)
            w = xp.itemsize(ints) // 4
            npairs = (xp.numel(y) - w * header) // (w + 1)
            cut = w * (header + npairs)
            return xp.bitcast(y[:cut], xp.dtype_of(ints)), y[cut:]
        si = [0] * P
        si[peer] = xp.numel(ints)
        sv = [0] * P
        sv[peer] = xp.numel(vals)
        ri, _ = comm.alltoall(ints, si, phase + ".idx")
        rv, _ = comm.alltoall(vals, sv, phase + ".val")
        return ri, rv

    def _allgather_fixed(self, xp, comm, phase, ints, vals):
        """Allgather of equal-size (ints, vals) messages; returns all ints and all values in rank order."""
        if self.pack == "two":
            return comm.allgather(ints, phase + ".idx"), comm.allgather(vals, phase + ".val")
        w = xp.itemsize(ints) // 4
        kk = xp.numel(vals)
        y = comm.allgather(xp.concat([xp.bitcast(ints, xp.float32), vals], like=vals), phase)
        y2 = xp.reshape(y, (comm.size, (w + 1) * kk))
        return (xp.bitcast(xp.reshape(y2[:, :w * kk], (-1,)), xp.dtype_of(ints)),
                xp.reshape(y2[:, w * kk:], (-1,)))

    # -- one step -----------------------------------------------------------------------------------------
    def reduce(self, xp, acc, idx, k, comm, state, ctx):
        """One step of SparDL (the module docstring), a method per phase:

        5.1      :meth:`_start`                       teams, blocks, budgets; the working blocks A (and D)
        5.2-5.3  :meth:`_spar_reduce_scatter`         the team's blocks reduced, this rank's own block selected
        5.5      :meth:`_bruck_spar_all_gather` or    across the d teams (B-SAG),
                 :meth:`_recursive_spar_all_gather`   or pairwise by recursive doubling (R-SAG)
        5.6      :meth:`_final_all_gather`            every block's final set inside the team
        5.4      :meth:`_global_residual_collection`  u, the included set, and the residual
        """
        if comm.size % self.groups:
            raise ValueError(f"{_API}: groups must divide the number of ranks P, got groups={self.groups} with "
                             f"P={comm.size}; pick a divisor of {comm.size} (e.g. groups=1)")
        n = xp.numel(acc)
        if n == 0:
            return (xp.zeros(0, xp.float32, like=acc), xp.zeros(0, xp.index_dtype, like=acc),
                    {"K": 0, "residual": xp.copy(acc)})
        s = self._start(xp, acc, k, comm, state, ctx)
        own_idx, own_vals = self._spar_reduce_scatter(xp, acc, comm, s)
        info = {"k_b": s.kb, "h": s.h, "srs_pairs": (s.Q - 1) * s.kb}
        if s.d > 1 and self.sag == "bruck":
            F_idx, F_vals = self._bruck_spar_all_gather(xp, acc, comm, state, s, own_idx, own_vals, info)
        elif s.d > 1:
            F_idx, F_vals = self._recursive_spar_all_gather(xp, acc, comm, s, own_idx, own_vals)
        else:
            F_idx, F_vals = own_idx, own_vals
        all_idx, all_vals = self._final_all_gather(xp, acc, comm, s, F_idx, F_vals)
        return self._global_residual_collection(xp, acc, s, all_idx, all_vals, info)

    def _start(self, xp, acc, k, comm, state, ctx):
        """5.1: rank (g, r) of Q = P/d in team g; n in Q blocks of c; the per-block budget k_b and h (the adaptive
        controller's, or fixed); the working blocks: A = acc zero-padded (lazy: A doubles as D -- a block is
        selected once, then only dropped values remain in it), eager: a separate D accumulates every drop."""
        P, d, n = comm.size, self.groups, xp.numel(acc)
        Q = P // d
        g, r = divmod(comm.rank, Q)
        if Q == 1 and d > 1 and comm.rank == 0 and ctx.step == 0:
            warnings.warn(f"{_API}: groups == P = {P}: no Spar-Reduce-Scatter, every rank runs B-SAG over "
                          "the whole vector (the paper's lowest accuracy); consider groups < P", stacklevel=3)
        c = -(-n // Q)                                 # block size; blocks zero-padded to Q·c
        kb = max(1, min(c, (k * c) // n))             # per-block budget k_b (= int(c·ρ) for k = ρn)
        if d == 1 or self.sag == "recursive":
            h = kb
        elif self.h_mode == "fixed":
            h = max(1, kb // d)
        else:
            if state.get("k_b") != kb:                 # first step (or a new budget): h0 = k_b/d
                h0 = max(1, kb // d)
                state.update(k_b=kb, h=h0, h_step=(kb - h0) // 100, inertia=False)
            h = state["h"]
        eager = self.selection == "eager"
        # Every write rebinds A / D to the result (TensorFlow tensors are immutable).
        A = xp.concat([acc, xp.zeros(Q * c - n, xp.float32, like=acc)], like=acc) if Q * c > n else xp.copy(acc)
        return _SparDLStep(d=d, Q=Q, g=g, r=r, base=g * Q, n=n, c=c, kb=kb, h=min(h, c), eager=eager,
                           wire=wire_index_dtype(xp, Q * c), A=A,
                           D=xp.zeros(Q * c, xp.float32, like=acc) if eager else None, last=[None] * Q)

    def _select(self, xp, acc, s, lo, hi, kk):
        """select(b, kk) for the blocks lo..hi-1 (module docstring, 5.1): (flat int64 indices in block order,
        values); the selected values leave A (lazy: what is left is D[b]; eager: D[b] gets the rest)."""
        c = s.c
        seg = s.A[lo * c:hi * c]
        cols = xp.topk_rows(xp.reshape(seg, (hi - lo, c)), kk)
        flat = _flat_index(xp, cols, lo, c, acc)
        vals = xp.take(s.A, flat)
        if s.eager:
            dropped = xp.put_(xp.copy(seg), flat - lo * c, 0.0)
            s.D = xp.add_slice_(s.D, lo * c, hi * c, dropped)
            s.A = xp.set_slice_(s.A, lo * c, hi * c, 0.0)
            s.A = xp.put_(s.A, flat, vals)
            for i in range(hi - lo):
                s.last[lo + i] = flat[i * kk:(i + 1) * kk]
        else:
            s.A = xp.put_(s.A, flat, 0.0)              # A[b] now holds what was dropped here: D[b]
        return flat, vals

    def _spar_reduce_scatter(self, xp, acc, comm, s):
        """5.2-5.3: in ceil(log2 Q) steps each rank sends the blocks of its schedule to (g, r + gap_s) and adds
        what it receives; then it selects h entries of its own block r."""
        sched = srs_schedule(s.Q)
        if s.eager and sched:
            self._select(xp, acc, s, 0, s.Q, s.kb)       # paper: local top-k/P of every block first
        for step, (gap, m) in enumerate(sched, start=1):
            if s.eager:
                flat = xp.concat([s.last[b % s.Q] for b in range(s.r + gap, s.r + gap + m)], like=acc)
                vals = xp.take(s.A, flat)
            else:
                parts = [self._select(xp, acc, s, lo, hi, s.kb) for lo, hi in _segments(s.r + gap, m, s.Q)]
                flat = xp.concat([p[0] for p in parts], like=acc)
                vals = xp.concat([p[1] for p in parts], like=acc)
            ri, rv = self._exchange(xp, comm, f"srs.{step}", s.base + (s.r + gap) % s.Q, xp.astype(flat, s.wire),
                                    vals)
            s.A = xp.scatter_add_(s.A, xp.astype(ri, xp.index_dtype), rv)    # indices unique within a message
            if s.eager:
                for lo, hi in _segments(s.r, m, s.Q):
                    self._select(xp, acc, s, lo, hi, s.kb)
        own = self._select(xp, acc, s, s.r, s.r + 1, s.h)  # final own block, h entries
        if not s.eager:
            s.D = s.A                                   # lazy: what is left in A is what this rank dropped
        return own

    def _union_top(self, xp, acc, s, sets):
        """The sum S of ``sets`` (added in the order given: identical on every rank that holds them), its support
        U, and the kept entries: U, or the top-k_b of |S| on U."""
        S = xp.zeros(s.c, xp.float32, like=acc)
        mark = xp.zeros(s.c, xp.float32, like=acc)
        for bi, bv in sets:
            loc = xp.astype(bi, xp.index_dtype) - s.r * s.c
            S = xp.scatter_add_(S, loc, bv)
            mark = xp.put_(mark, loc, 1.0)
        U = xp.nonzero(xp.gt(mark, 0))
        u = xp.numel(U)
        keep = U if u <= s.kb else xp.take(U, xp.reshape(xp.topk_rows(xp.reshape(xp.take(S, U), (1, u)), s.kb),
                                                          (-1,)))
        return S, mark, U, keep

    def _bruck_spar_all_gather(self, xp, acc, comm, state, s, own_idx, own_vals, info):
        """5.5, B-SAG: a Bruck all-gather of the h-sets among the ranks {(g', r)}, their sum in team order, trimmed
        to k_b; the adaptive h-controller reads the union's size."""
        bufs = [(xp.astype(own_idx, s.wire), own_vals)]              # bufs[j] = team (g + j) mod d
        for step_s in range(ceil_log2(s.d)):
            step = 1 << step_s
            m = min(step, s.d - step)
            ri, rv = self._exchange(xp, comm, f"sag.{step_s}", ((s.g - step) % s.d) * s.Q + s.r,
                                    xp.concat([b[0] for b in bufs[:m]], like=acc),
                                    xp.concat([b[1] for b in bufs[:m]], like=acc))
            for j in range(m):
                bufs.append((ri[j * s.h:(j + 1) * s.h], rv[j * s.h:(j + 1) * s.h]))
        S, _, U, keep = self._union_top(xp, acc, s, [bufs[(t - s.g) % s.d] for t in range(s.d)])  # team order
        info["union"] = u = xp.numel(U)
        if self.h_mode == "adaptive":
            state["h"], state["h_step"], state["inertia"] = h_controller_step(
                state["h"], state["h_step"], state["inertia"], u, s.kb, s.d)
        return keep + s.r * s.c, xp.take(S, keep)

    def _recursive_spar_all_gather(self, xp, acc, comm, s, own_idx, own_vals):
        """5.5, R-SAG: pairwise with team g XOR 2^t; the lower team's set first; an entry dropped by the trim adds
        S[j]/2^(t+1) to D on each of the 2^(t+1) ranks that now hold the set (stored once in the group)."""
        F_idx, F_vals = own_idx, own_vals
        for t in range(ceil_log2(s.d)):
            pg = s.g ^ (1 << t)
            ri, rv = self._exchange(xp, comm, f"rsag.{t}", pg * s.Q + s.r, xp.astype(F_idx, s.wire), F_vals)
            mine, theirs = (F_idx, F_vals), (xp.astype(ri, xp.index_dtype), rv)
            S, mark, U, keep = self._union_top(xp, acc, s, (mine, theirs) if s.g < pg else (theirs, mine))
            if xp.numel(U) > s.kb:
                drop = xp.nonzero(xp.gt(xp.put_(mark, keep, 0.0), 0))
                s.D = xp.scatter_add_(s.D, drop + s.r * s.c, xp.mul(xp.take(S, drop), 0.5 ** (t + 1)))
            F_idx, F_vals = keep + s.r * s.c, xp.take(S, keep)
        return F_idx, F_vals

    def _final_all_gather(self, xp, acc, comm, s, F_idx, F_vals):
        """5.6: every block's final set inside the team: d = 1: one allgather (k_b pairs per rank); d > 1: Bruck
        alltoalls of variable sizes (a count per buffer leads the message)."""
        if s.Q == 1:
            return F_idx, F_vals
        if s.d == 1:                                                 # exactly k_b pairs per rank
            return self._allgather_fixed(xp, comm, "final", xp.astype(F_idx, s.wire), F_vals)
        held_i, held_v = [xp.astype(F_idx, s.wire)], [F_vals]        # held[j] = block (r + j) mod Q
        for t in range(ceil_log2(s.Q)):
            step = 1 << t
            m = min(step, s.Q - step)
            counts = xp.asarray([xp.numel(x) for x in held_i[:m]], s.wire, like=acc)
            ri, rv = self._exchange(xp, comm, f"final.{t}", s.base + (s.r - step) % s.Q,
                                    xp.concat([counts] + held_i[:m], like=acc),
                                    xp.concat(held_v[:m], like=acc), header=m)
            oi, ov = m, 0
            for cnt in xp.to_numpy(ri[:m]).tolist():
                held_i.append(ri[oi:oi + cnt])
                held_v.append(rv[ov:ov + cnt])
                oi += cnt
                ov += cnt
        return xp.concat(held_i, like=acc), xp.concat(held_v, like=acc)

    def _global_residual_collection(self, xp, acc, s, all_idx, all_vals, info):
        """5.4 (GRC) after 5.6: u = the final sets (the engine divides by the world size P); the residual is this
        rank's own value outside F and what it dropped inside F; I = the support of u."""
        all_idx = xp.astype(all_idx, xp.index_dtype)
        out = xp.put_(xp.zeros(s.Q * s.c, xp.float32, like=acc), all_idx, all_vals)   # F unique; padding: 0
        kept = xp.take(s.D, all_idx)
        D = xp.put_(xp.set_slice_(s.D, 0, s.n, acc), all_idx, kept)
        included = xp.sort(xp.take(all_idx, xp.nonzero(xp.gt(xp.abs(all_vals), 0))))   # support of u
        info.update(K=xp.numel(included), final_entries=xp.numel(all_idx), residual=D[:s.n])
        return out[:s.n], included, info
