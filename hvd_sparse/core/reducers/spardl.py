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

import warnings

from ..errors import check_positive_int
from .base import Reducer, wire_index_dtype

_API = "hvd_sparse.SparDL"


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


def _choice(value, name, allowed):
    if value not in allowed:
        raise ValueError(f"{_API}: {name} must be one of {list(allowed)}, got {value!r}")
    return value


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

    def __init__(self, groups=1, *, sag="bruck", selection="lazy", h_mode="adaptive", pack="bitcast"):
        self.groups = check_positive_int(groups, "groups", _API)
        self.sag = _choice(sag, "sag", ("bruck", "recursive"))
        self.selection = _choice(selection, "selection", ("lazy", "eager"))
        self.h_mode = _choice(h_mode, "h_mode", ("adaptive", "fixed"))
        self.pack = _choice(pack, "pack", ("bitcast", "two"))
        if self.sag == "recursive" and self.groups & (self.groups - 1):
            raise ValueError(f"{_API}: groups must be a power of two with sag='recursive', got "
                             f"{self.groups}; use sag='bruck' or groups in (1, 2, 4, 8, ...)")

    def __repr__(self):
        return (f"SparDL(groups={self.groups}, sag={self.sag!r}, selection={self.selection!r}, "
                f"h_mode={self.h_mode!r}, pack={self.pack!r})")

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
        P, rank, d = comm.size, comm.rank, self.groups
        if P % d:
            raise ValueError(f"{_API}: groups must divide the number of ranks P, got groups={d} with P={P}; "
                             f"pick a divisor of {P} (e.g. groups=1)")
        Q = P // d
        g, r = divmod(rank, Q)
        base = g * Q
        n = xp.numel(acc)
        f32, i64 = xp.float32, xp.index_dtype
        if n == 0:
            return xp.zeros(0, f32, like=acc), xp.zeros(0, i64, like=acc), {"K": 0, "residual": xp.copy(acc)}
        if Q == 1 and d > 1 and rank == 0 and ctx.step == 0:
            warnings.warn(f"{_API}: groups == P = {P}: no Spar-Reduce-Scatter, every rank runs B-SAG over "
                          "the whole vector (the paper's lowest accuracy); consider groups < P", stacklevel=2)
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
        h = min(h, c)
        wire = wire_index_dtype(xp, Q * c)
        eager = self.selection == "eager"

        # 5.1 working blocks (dense); lazy: A doubles as D (a block is selected once, then only dropped
        # values remain in it; D = A once the SRS is done), eager: a separate D accumulates every drop.
        # Every write rebinds A / D to the result (TensorFlow tensors are immutable).
        A = xp.concat([acc, xp.zeros(Q * c - n, f32, like=acc)], like=acc) if Q * c > n else xp.copy(acc)
        D = xp.zeros(Q * c, f32, like=acc) if eager else None
        last = [None] * Q                              # eager: latest selection (flat indices) per block

        def select(lo, hi, kk):
            """5.3 select(b, kk) for the blocks lo..hi-1: (flat int64 indices in block order, values)."""
            nonlocal A, D
            seg = A[lo * c:hi * c]
            cols = xp.topk_rows(xp.reshape(seg, (hi - lo, c)), kk)
            flat = _flat_index(xp, cols, lo, c, acc)
            vals = xp.take(A, flat)
            if eager:
                dropped = xp.put_(xp.copy(seg), flat - lo * c, 0.0)
                D = xp.add_slice_(D, lo * c, hi * c, dropped)
                A = xp.set_slice_(A, lo * c, hi * c, 0.0)
                A = xp.put_(A, flat, vals)
                for i in range(hi - lo):
                    last[lo + i] = flat[i * kk:(i + 1) * kk]
            else:
                A = xp.put_(A, flat, 0.0)              # A[b] now holds what was dropped here: D[b]
            return flat, vals

        # 5.2-5.3 Spar-Reduce-Scatter inside the team
        sched = srs_schedule(Q)
        if eager and sched:
            select(0, Q, kb)                           # paper: local top-k/P of every block first
        for s, (gap, m) in enumerate(sched, start=1):
            if eager:
                flat = xp.concat([last[b % Q] for b in range(r + gap, r + gap + m)], like=acc)
                vals = xp.take(A, flat)
            else:
                parts = [select(lo, hi, kb) for lo, hi in _segments(r + gap, m, Q)]
                flat = xp.concat([p[0] for p in parts], like=acc)
                vals = xp.concat([p[1] for p in parts], like=acc)
            ri, rv = self._exchange(xp, comm, f"srs.{s}", base + (r + gap) % Q, xp.astype(flat, wire), vals)
            A = xp.scatter_add_(A, xp.astype(ri, i64), rv)  # indices unique within a message
            if eager:
                for lo, hi in _segments(r, m, Q):
                    select(lo, hi, kb)
        own_idx, own_vals = select(r, r + 1, h)       # final own block, h entries
        if not eager:
            D = A                                      # lazy: what is left in A is what this rank dropped
        info = {"k_b": kb, "h": h, "srs_pairs": (Q - 1) * kb}

        # 5.5 Spar-All-Gather across the d teams (ranks {(g', r)})
        if d > 1 and self.sag == "bruck":
            bufs = [(xp.astype(own_idx, wire), own_vals)]          # bufs[j] = team (g + j) mod d
            for s in range(ceil_log2(d)):
                step = 1 << s
                m = min(step, d - step)
                ri, rv = self._exchange(xp, comm, f"sag.{s}", ((g - step) % d) * Q + r,
                                        xp.concat([b[0] for b in bufs[:m]], like=acc),
                                        xp.concat([b[1] for b in bufs[:m]], like=acc))
                for j in range(m):
                    bufs.append((ri[j * h:(j + 1) * h], rv[j * h:(j + 1) * h]))
            S = xp.zeros(c, f32, like=acc)
            mark = xp.zeros(c, f32, like=acc)
            for t in range(d):                                       # canonical team order (rank-identical sums)
                bi, bv = bufs[(t - g) % d]
                loc = xp.astype(bi, i64) - r * c
                S = xp.scatter_add_(S, loc, bv)
                mark = xp.put_(mark, loc, 1.0)
            U = xp.nonzero(xp.gt(mark, 0))
            u = xp.numel(U)
            if u > kb:                                               # the trim, identical on all d ranks
                keep = xp.take(U, xp.reshape(xp.topk_rows(xp.reshape(xp.take(S, U), (1, u)), kb), (-1,)))
            else:
                keep = U
            F_idx, F_vals = keep + r * c, xp.take(S, keep)
            info["union"] = u
            if self.h_mode == "adaptive":
                state["h"], state["h_step"], state["inertia"] = h_controller_step(
                    state["h"], state["h_step"], state["inertia"], u, kb, d)
        elif d > 1:                                                  # R-SAG
            F_idx, F_vals = own_idx, own_vals
            for s in range(ceil_log2(d)):
                pg = g ^ (1 << s)
                ri, rv = self._exchange(xp, comm, f"rsag.{s}", pg * Q + r, xp.astype(F_idx, wire), F_vals)
                mine, theirs = (F_idx, F_vals), (xp.astype(ri, i64), rv)
                S = xp.zeros(c, f32, like=acc)
                mark = xp.zeros(c, f32, like=acc)
                for bi, bv in ((mine, theirs) if g < pg else (theirs, mine)):   # lower team first
                    S = xp.scatter_add_(S, bi - r * c, bv)
                    mark = xp.put_(mark, bi - r * c, 1.0)
                U = xp.nonzero(xp.gt(mark, 0))
                u = xp.numel(U)
                if u > kb:
                    keep = xp.take(U, xp.reshape(xp.topk_rows(xp.reshape(xp.take(S, U), (1, u)), kb), (-1,)))
                    mark = xp.put_(mark, keep, 0.0)
                    drop = xp.nonzero(xp.gt(mark, 0))
                    D = xp.scatter_add_(D, drop + r * c, xp.mul(xp.take(S, drop), 0.5 ** (s + 1)))
                else:
                    keep = U
                F_idx, F_vals = keep + r * c, xp.take(S, keep)
        else:
            F_idx, F_vals = own_idx, own_vals

        # 5.6 final all-gather of the per-block final sets inside the team
        if Q == 1:
            all_idx, all_vals = F_idx, F_vals
        elif d == 1:                                                 # exactly k_b pairs per rank
            all_idx, all_vals = self._allgather_fixed(xp, comm, "final", xp.astype(F_idx, wire), F_vals)
        else:                                                        # Bruck, variable sizes (<= k_b)
            held_i, held_v = [xp.astype(F_idx, wire)], [F_vals]      # held[j] = block (r + j) mod Q
            for s in range(ceil_log2(Q)):
                step = 1 << s
                m = min(step, Q - step)
                counts = xp.asarray([xp.numel(x) for x in held_i[:m]], wire, like=acc)
                ri, rv = self._exchange(xp, comm, f"final.{s}", base + (r - step) % Q,
                                        xp.concat([counts] + held_i[:m], like=acc),
                                        xp.concat(held_v[:m], like=acc), header=m)
                oi, ov = m, 0
                for cnt in xp.to_numpy(ri[:m]).tolist():
                    held_i.append(ri[oi:oi + cnt])
                    held_v.append(rv[ov:ov + cnt])
                    oi += cnt
                    ov += cnt
            all_idx, all_vals = xp.concat(held_i, like=acc), xp.concat(held_v, like=acc)
        all_idx = xp.astype(all_idx, i64)
        out = xp.put_(xp.zeros(Q * c, f32, like=acc), all_idx, all_vals)   # F unique; padding carries 0
        u = out[:n]

        # 5.4 Global Residual Collection: own value outside F, what this rank dropped inside F
        kept = xp.take(D, all_idx)
        D = xp.put_(xp.set_slice_(D, 0, n, acc), all_idx, kept)
        included = xp.sort(xp.take(all_idx, xp.nonzero(xp.gt(xp.abs(all_vals), 0))))   # support of u
        info.update(K=xp.numel(included), final_entries=xp.numel(all_idx), residual=D[:n])
        return u, included, info
