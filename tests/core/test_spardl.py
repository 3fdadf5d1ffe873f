"""SparDL on the simulator against its invariants (docs/algorithms.md#spardl).

The master oracle is ``spardl_reference``: the steps 5.1-5.6 of the module docstring of
hvd_sparse/core/reducers/spardl.py written out directly with loops over ranks, blocks and steps
(2-D blocks, a lexsort top-k, the schedule derived the code's way), which the reducer must equal on integer
data (every sum exact in float32).
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_sparse.compression import SparseCompression
from hvd_sparse.core.reducers.spardl import SparDL, h_controller_step, srs_schedule
from hvd_sparse.core.sparsifiers import TopK
from hvd_sparse.testing import simulate

from oracles import int_grads

PS = [1, 2, 3, 4, 5, 8]
# groups == P (P = 2, d = 2) warns by design; the warning itself is tested below
pytestmark = pytest.mark.filterwarnings("ignore:hvd_sparse.SparDL. groups == P:UserWarning")


def groups_for(P):
    return [d for d in (1, 2, 4) if P % d == 0 and (d != 4 or P == 8)]


def configs():
    """(P, d, sag, selection) covering every P of PS, d in {1, 2} (d = 4 for P = 8), both SAGs/selections."""
    out = []
    for P in PS + [6]:
        for d in groups_for(P) + ([3] if P == 6 else []):
            for sag in ("bruck", "recursive"):
                if sag == "recursive" and (d == 1 or d & (d - 1)):
                    continue
                for sel in ("lazy", "eager"):
                    out.append((P, d, sag, sel))
    return out


def comp(density, d=1, **kw):
    return SparseCompression(TopK(density), SparDL(groups=d, **kw))


# -- the independent reference ------------------------------------------------------------------------------
def ref_sel(x, kk):
    """kk largest |x| (NaN as +inf), ties by lower index, zeros allowed; sorted indices."""
    mag = np.abs(x.astype(np.float64))
    mag[np.isnan(mag)] = np.inf
    order = np.lexsort((np.arange(x.size), -mag))
    return np.sort(order[:kk])


def ref_schedule(Q):
    """The authors' code's derivation (step 5.2): size_list = reverse([1, 2, .., 2^(l-2)] + [Q - 2^(l-1)]),
    gap = Q - size_list[0], halved each step."""
    if Q == 1:
        return []
    l = math.ceil(math.log2(Q))
    sizes = ([2 ** i for i in range(l - 1)] + [Q - 2 ** (l - 1)])[::-1]
    gap, out = Q - sizes[0], []
    for m in sizes:
        out.append((gap, m))
        gap //= 2
    return out


def spardl_reference(g, density, d=1, selection="lazy", sag="bruck", h_mode="adaptive"):
    """SparDL on all P ranks at once. Returns per step: u (sum, not divided), residuals (P, n),
    F mask (n), h used (P), union sizes (P, d > 1 B-SAG) and final set size per block (Q)."""
    steps, P, n = g.shape
    Q = P // d
    c = -(-n // Q)
    k = max(1, int(density * n))
    kb = max(1, min(c, k * c // n))
    h0 = max(1, kb // d)
    hst = [[h0, (kb - h0) // 100, False] for _ in range(P)]
    res = np.zeros((P, n), np.float32)
    out = []
    for t in range(steps):
        V = res + g[t]
        A = np.zeros((P, Q, c), np.float32)
        A.reshape(P, -1)[:, :n] = V
        D = np.zeros_like(A)
        last = {}

        def select(w, b, kk):
            I = ref_sel(A[w, b], kk)
            keep = np.zeros(c, bool)
            keep[I] = True
            D[w, b] += np.where(keep, np.float32(0), A[w, b])
            A[w, b] = np.where(keep, A[w, b], np.float32(0))
            last[w, b] = I
            return I

        sched = ref_schedule(Q)
        if selection == "eager" and sched:
            for w in range(P):
                for b in range(Q):
                    select(w, b, kb)
        for gap, m in sched:
            msgs, sent = [], []
            for w in range(P):
                gg, r = divmod(w, Q)
                for j in range(m):
                    b = (r + gap + j) % Q
                    I = select(w, b, kb) if selection == "lazy" else last[w, b]
                    assert I.size == kb
                    msgs.append((gg * Q + (r + gap) % Q, b, I, A[w, b, I].copy()))
                    sent.append((w, b))
            for w, b in sent:                       # zero A[b] for the blocks sent
                A[w, b] = 0
            for dst, b, I, v in msgs:
                A[dst, b, I] += v
            if selection == "eager":
                for w in range(P):
                    r = w % Q
                    for j in range(m):
                        select(w, (r + j) % Q, kb)
        hs = np.zeros(P, np.int64)
        X = {}
        for w in range(P):
            r = w % Q
            if d == 1 or sag == "recursive":
                h = kb
            elif h_mode == "fixed":
                h = max(1, kb // d)
            else:
                h = hst[w][0]
            hs[w] = h = min(h, c)
            I = select(w, r, h)
            X[w] = (I, A[w, r, I].copy())
        F = {}
        unions = np.zeros(P, np.int64)
        for r in range(Q):
            if d == 1:
                F[r] = X[r]
            elif sag == "bruck":
                S = np.zeros(c, np.float32)
                for gg in range(d):                 # canonical team order
                    I, v = X[gg * Q + r]
                    S[I] += v
                U = np.unique(np.concatenate([X[gg * Q + r][0] for gg in range(d)]))
                keep = U[ref_sel(S[U], kb)] if U.size > kb else U
                F[r] = (keep, S[keep])
                for gg in range(d):
                    w = gg * Q + r
                    unions[w] = U.size
                    if h_mode == "adaptive":
                        hst[w] = list(h_controller_ref(*hst[w], U.size, kb, d))
            else:
                cur = {gg: X[gg * Q + r] for gg in range(d)}
                for s in range(int(math.log2(d))):
                    new = {}
                    for gg in range(d):
                        lo, hi = sorted((gg, gg ^ (1 << s)))
                        S = np.zeros(c, np.float32)
                        S[cur[lo][0]] += cur[lo][1]
                        S[cur[hi][0]] += cur[hi][1]
                        U = np.union1d(cur[lo][0], cur[hi][0])
                        if U.size > kb:
                            keep = U[ref_sel(S[U], kb)]
                            drop = np.setdiff1d(U, keep)
                            D[gg * Q + r, r, drop] += S[drop] * np.float32(0.5 ** (s + 1))
                        else:
                            keep = U
                        new[gg] = (keep, S[keep])
                    cur = new
                for gg in range(1, d):
                    assert np.array_equal(cur[gg][0], cur[0][0]) and np.array_equal(cur[gg][1], cur[0][1])
                F[r] = cur[0]
        u = np.zeros(Q * c, np.float32)
        Fm = np.zeros(Q * c, bool)
        for b in range(Q):
            u[b * c + F[b][0]] = F[b][1]
            Fm[b * c + F[b][0]] = True
        resid = np.zeros((P, Q * c), np.float32)
        resid[:, :n] = V
        for w in range(P):
            resid[w, Fm] = D[w].reshape(-1)[Fm]
        res = resid[:, :n].copy()
        out.append(dict(u=u[:n], res=res, F=Fm[:n], h=hs, union=unions, fsizes=[F[b][0].size for b in range(Q)],
                        kb=kb, V=V))
    return out


def h_controller_ref(h, step, inertia, u, kb, d):
    """The adaptive h controller of step 5.5, transcribed."""
    if (u > kb) ^ (step > 0):
        if inertia:
            step, inertia = step * 2, False
        else:
            inertia = True
    else:
        step = int(-0.5 * step) if abs(step) > 1 else -step
        inertia = False
    return max(h + step, int(kb / d) or 1), step, inertia


# -- runner with a spy communicator -------------------------------------------------------------------------
class Spy:
    """Delegates to a SimulatedCommunicator and logs every collective (kind, phase, splits, recv_splits)."""

    def __init__(self, comm):
        self.comm, self.rank, self.size, self.meter, self.log = comm, comm.rank, comm.size, comm.meter, []

    def alltoall(self, x, splits, phase, parts=None):
        y, rs = self.comm.alltoall(x, splits, phase, parts=parts)
        self.log.append(("alltoall", phase, list(splits), list(rs)))
        return y, rs

    def allgather(self, x, phase, parts=None):
        if phase != "agree":              # the engine's agreement, not SparDL's traffic
            self.log.append(("allgather", phase, None, None))
        return self.comm.allgather(x, phase, parts=parts)

    def allreduce(self, x, op, phase, bucket=None):
        self.log.append(("allreduce", phase, None, None))
        return self.comm.allreduce(x, op, phase, bucket=bucket)

    def broadcast(self, x, root, phase):
        self.log.append(("broadcast", phase, None, None))
        return self.comm.broadcast(x, root, phase)


def run(compression, g, backend="numpy", average=False):
    """``simulate`` ``compression`` on g (steps, P, n) over ``Spy`` communicators; per rank and step: u, res, info,
    meter, the collectives' log and their count."""
    steps, P, _ = g.shape

    def take_log(t, r, engine):
        log, engine.comm.log = engine.comm.log, []
        return log

    res = simulate(compression, g, average=average, backend=backend, communicator=Spy, after_step=take_log)
    return [[dict(u=res.updates[t, r], res=res.residuals[t, r], info=res.info[t][r], meter=res.phases[t][r],
                  log=res.observed[t][r], collectives=res.volume[t][r]["collectives"]) for t in range(steps)]
            for r in range(P)]


def assert_matches_reference(out, ref, P):
    for t, rt in enumerate(ref):
        for w in range(P):
            np.testing.assert_array_equal(out[w][t]["u"], rt["u"], err_msg=f"u step {t} rank {w}")
            np.testing.assert_array_equal(out[w][t]["res"], rt["res"][w], err_msg=f"residual step {t} rank {w}")
            assert out[w][t]["info"]["h"] == rt["h"][w]
            assert out[w][t]["info"]["K"] == np.count_nonzero(rt["u"])


# -- master oracle --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P, d, sag, selection", configs())
@pytest.mark.parametrize("density", [0.05, 0.3])
def test_equals_reference_bitwise_on_integer_data(P, d, sag, selection, density):
    g = int_grads(4, P, 157, seed=P * 10 + d)
    out = run(comp(density, d, sag=sag, selection=selection), g)
    ref = spardl_reference(g, density, d, selection, sag)
    assert_matches_reference(out, ref, P)


@pytest.mark.parametrize("P, d", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_fixed_h_and_pack_two_equal_reference(P, d):
    g = int_grads(3, P, 211, seed=3)
    ref = spardl_reference(g, 0.1, d, h_mode="fixed")
    assert_matches_reference(run(comp(0.1, d, h_mode="fixed", pack="two"), g), ref, P)


@pytest.mark.parametrize("P, d", [(8, 1), (8, 2), (8, 4)])
def test_adaptive_h_moves_and_equals_reference(P, d):
    # c·ρ large enough for a nonzero initial h_step (c·ρ·(1 - 1/d) >= 100)
    g = int_grads(6, P, 8 * 800, seed=11)
    ref = spardl_reference(g, 0.5, d)
    out = run(comp(0.5, d), g)
    assert_matches_reference(out, ref, P)
    if d > 1:
        hs = [o["info"]["h"] for o in out[0]]
        assert len(set(hs)) > 1, hs
        assert all(o[t]["info"]["union"] == ref[t]["union"][w] for w, o in enumerate(out) for t in range(6))


def test_tiny_n_smaller_than_team_and_padding_blocks():
    for P, d, n in [(8, 1, 3), (8, 2, 5), (5, 1, 7), (6, 3, 1)]:
        g = int_grads(3, P, n, seed=n)
        assert_matches_reference(run(comp(0.5, d), g), spardl_reference(g, 0.5, d), P)


# -- schedule ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("Q", range(1, 17))
def test_srs_schedule_sends_every_block_once(Q):
    sched = srs_schedule(Q)
    assert sched == ref_schedule(Q)
    assert len(sched) == math.ceil(math.log2(Q)) if Q > 1 else sched == []
    if Q >= 2:
        l = len(sched)
        assert [m for _, m in sched] == [Q - 2 ** (l - 1)] + [2 ** (l - s) for s in range(2, l + 1)]
    assert sum(m for _, m in sched) == Q - 1
    for r in range(Q):
        sent = [(r + gap + j) % Q for gap, m in sched for j in range(m)]
        assert sorted(sent) == sorted(set(range(Q)) - {r})           # every non-own block exactly once
        for s, (gap, m) in enumerate(sched):
            later_recv = {(r + j) % Q for _, mt in sched[s:] for j in range(mt)}
            assert not later_recv & {(r + gap + j) % Q for j in range(m)}
    for gap, _ in sched:
        assert sorted((r + gap) % Q for r in range(Q)) == list(range(Q))  # a permutation
    assert {6: [(4, 2), (2, 2), (1, 1)], 5: [(4, 1), (2, 2), (1, 1)], 8: [(4, 4), (2, 2), (1, 1)],
            3: [(2, 1), (1, 1)], 2: [(1, 1)]}.get(Q, sched) == sched


# -- lossless limit ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("P, d, sag", [(P, 1, "bruck") for P in PS] + [(4, 2, "recursive"), (8, 4, "recursive"),
                                                                      (8, 8, "recursive")])
@pytest.mark.parametrize("selection", ["lazy", "eager"])
def test_density_one_is_lossless(P, d, sag, selection):
    g = int_grads(2, P, 131, seed=P)
    with pytest.warns(UserWarning, match="groups == P") if d == P > 1 else _nullcontext():
        out = run(comp(1.0, d, sag=sag, selection=selection), g)
    for t in range(2):
        for w in range(P):
            np.testing.assert_array_equal(out[w][t]["u"], g[t].sum(axis=0))
            assert not out[w][t]["res"].any()


def test_bruck_fixed_h_is_not_lossless_at_density_one():
    g = int_grads(1, 4, 64, seed=1)
    out = run(comp(1.0, 2, h_mode="fixed"), g)
    assert out[0][0]["res"].any() or out[1][0]["res"].any()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# -- conservation, global residual collection ---------------------------------------------------------------------
@pytest.mark.parametrize("P, d, sag, selection", configs())
def test_mass_conservation_exact(P, d, sag, selection):
    g = int_grads(6, P, 143, seed=5 + P)
    res = simulate(comp(0.05, d, sag=sag, selection=selection), g, average=False)
    for t in range(6):
        applied = res.updates[: t + 1, 0].sum(axis=0, dtype=np.float64)
        kept = res.residuals[t].sum(axis=0, dtype=np.float64)
        np.testing.assert_array_equal(applied + kept, g[: t + 1].sum(axis=(0, 1), dtype=np.float64))


@pytest.mark.parametrize("P, d", [(2, 1), (4, 1), (8, 1), (8, 2), (4, 4)])
def test_conservation_with_average_applied_times_P(P, d):
    g = int_grads(5, P, 120, seed=2)
    res = simulate(comp(0.1, d), g)                          # applied = u / P (exact for P a power of two)
    for t in range(5):
        lhs = res.updates[: t + 1, 0].sum(axis=0, dtype=np.float64) * P + res.residuals[t].sum(0, dtype=np.float64)
        np.testing.assert_array_equal(lhs, g[: t + 1].sum(axis=(0, 1), dtype=np.float64))


@pytest.mark.parametrize("P, d, sag, selection", configs())
def test_global_residual_collection_rule(P, d, sag, selection):
    g = int_grads(3, P, 97, seed=7)
    out = run(comp(0.1, d, sag=sag, selection=selection), g)
    ref = spardl_reference(g, 0.1, d, selection, sag)
    Q = P // d
    c = -(-97 // Q)
    for t in range(3):
        F = ref[t]["F"]
        for w in range(P):
            V = (out[w][t - 1]["res"] if t else 0) + g[t, w]
            assert out[w][t]["res"][~F].tobytes() == V[~F].tobytes()
            if d == 1 and selection == "lazy":       # the owner has nothing left inside its F_b
                own = np.zeros(97, bool)
                own[w * c:(w + 1) * c] = True
                assert not out[w][t]["res"][F & own].any()


# -- volume and single-peer exchanges ------------------------------------------------------------------------
@pytest.mark.parametrize("P", PS + [6])
@pytest.mark.parametrize("pack", ["bitcast", "two"])
def test_volume_with_one_team_is_exact(P, pack):
    n, density = 100 * P, 0.05                             # k = 5P, c = 100, k_b = 5 = k/P
    g = int_grads(2, P, n, seed=P)
    out = run(comp(density, 1, pack=pack), g)
    kb, k = 5, 5 * P
    sched = srs_schedule(P)
    for t in range(2):
        for w in range(P):
            m = out[w][t]["meter"]
            for s, (gap, ms) in enumerate(sched, start=1):
                names = [f"srs.{s}"] if pack == "bitcast" else [f"srs.{s}.idx", f"srs.{s}.val"]
                assert sum(m["sent_words"][x] for x in names) == 2 * ms * kb
                assert sum(m["recv_words"][x] for x in names) == 2 * ms * kb
                assert sum(m["sent_bytes"][x] for x in names) == 8 * ms * kb
                assert all(m["calls"][x] == 1 for x in names)
            if P > 1:
                fin = ["final"] if pack == "bitcast" else ["final.idx", "final.val"]
                assert sum(m["recv_words"][x] for x in fin) == 2 * kb * (P - 1)  # exactly h = k_b per block
            recv = sum(v for phase, v in m["recv_words"].items() if phase != "agree")   # the agreement's: control
            assert recv * P == 4 * k * (P - 1)                                   # 4k(P-1)/P (cost model)
            calls = len(sched) + (1 if P > 1 else 0)
            assert out[w][t]["collectives"] == calls * (1 if pack == "bitcast" else 2)
            assert np.count_nonzero(out[w][t]["u"]) <= P * kb
            assert max(np.count_nonzero(out[w][t]["u"][b * 100:(b + 1) * 100]) for b in range(P)) <= kb


@pytest.mark.parametrize("P, d, sag", [(4, 2, "bruck"), (8, 2, "bruck"), (8, 4, "bruck"), (6, 3, "bruck"),
                                       (6, 2, "bruck"), (8, 2, "recursive"), (8, 4, "recursive")])
def test_volume_with_teams_is_exact(P, d, sag):
    n = 240
    g = int_grads(3, P, n, seed=d)
    out = run(comp(0.1, d, sag=sag), g)
    ref = spardl_reference(g, 0.1, d, sag=sag)
    Q = P // d
    for t in range(3):
        kb = ref[t]["kb"]
        for w in range(P):
            m, r = out[w][t]["meter"], w % Q
            srs = sum(v for x, v in m["recv_words"].items() if x.startswith("srs."))
            assert srs == 2 * (Q - 1) * kb
            if sag == "bruck":
                h = ref[t]["h"][w]
                for s in range(math.ceil(math.log2(d))):
                    assert m["recv_words"][f"sag.{s}"] == 2 * h * min(2 ** s, d - 2 ** s)
                    assert m["sent_words"][f"sag.{s}"] == 2 * h * min(2 ** s, d - 2 ** s)
            else:
                assert all(m["recv_words"][f"rsag.{s}"] == 2 * kb for s in range(int(math.log2(d))))
            fin = sum(v for x, v in m["recv_words"].items() if x.startswith("final."))
            assert fin == sum(2 * ref[t]["fsizes"][b] + 1 for b in range(Q) if b != r)   # pairs + one count
            assert all(f <= kb for f in ref[t]["fsizes"])


@pytest.mark.parametrize("P, d, sag", [(5, 1, "bruck"), (8, 1, "bruck"), (6, 2, "bruck"), (8, 4, "bruck"),
                                       (8, 2, "recursive"), (4, 4, "bruck")])
def test_single_peer_alltoalls_with_scheduled_peers(P, d, sag):
    g = int_grads(2, P, 120, seed=1)
    with pytest.warns(UserWarning) if d == P else _nullcontext():
        out = run(comp(0.1, d, sag=sag), g)
    Q = P // d
    for t in range(2):
        logs = [out[w][t]["log"] for w in range(P)]
        assert all([e[:2] for e in lg] == [e[:2] for e in logs[0]] for lg in logs)   # same phases everywhere
        phases = [e[1] for e in logs[0]]
        assert len(phases) == len(set(phases))                                        # distinct per step
        for w in range(P):
            gg, r = divmod(w, Q)
            expect = {f"srs.{s}": (gg * Q + (r + gap) % Q, gg * Q + (r - gap) % Q)
                      for s, (gap, _) in enumerate(srs_schedule(Q), start=1)}
            for s in range(math.ceil(math.log2(d))):
                if sag == "bruck":
                    expect[f"sag.{s}"] = (((gg - 2 ** s) % d) * Q + r, ((gg + 2 ** s) % d) * Q + r)
                else:
                    expect[f"rsag.{s}"] = ((gg ^ 2 ** s) * Q + r,) * 2
            if d > 1:
                for s in range(math.ceil(math.log2(Q))):
                    expect[f"final.{s}"] = (gg * Q + (r - 2 ** s) % Q, gg * Q + (r + 2 ** s) % Q)
            seen = {}
            for kind, phase, splits, rsplits in logs[w]:
                if kind != "alltoall":
                    assert (kind, phase) == ("allgather", "final") and d == 1
                    continue
                assert isinstance(splits, list) and len(splits) == P
                assert [q for q, x in enumerate(splits) if x] == [expect[phase][0]]
                assert [q for q, x in enumerate(rsplits) if x] == [expect[phase][1]]
                seen[phase] = True
            assert set(seen) == set(expect)


# -- replica consistency -----------------------------------------------------------------------------------
@pytest.mark.parametrize("P, d, sag, selection", configs())
def test_replica_consistency_on_float_data(P, d, sag, selection):
    rng = np.random.default_rng(P + d)
    g = (rng.standard_normal((3, P, 500)) * rng.lognormal(0, 2, size=500)).astype(np.float32)
    res = simulate(comp(0.02, d, sag=sag, selection=selection), g)
    for w in range(1, P):
        assert res.updates[:, w].tobytes() == res.updates[:, 0].tobytes()


# -- h controller, worked example ---------------------------------------------------------------------------
def test_adaptive_h_controller_sequence():
    h, step, inertia = 500, 5, False                 # k_b = 1000, d = 2: h0 = 500, h_step0 = 5
    got = []
    for u in (900, 950, 980, 1010, 1005, 990):
        h, step, inertia = h_controller_step(h, step, inertia, u, 1000, 2)
        got.append((step, inertia, h))
    assert got == [(5, True, 505), (10, False, 515), (10, True, 525), (-5, False, 520), (-5, True, 515),
                   (2, False, 517)]
    assert h_controller_step(3, 0, False, 5, 4, 2)[:2] == (3, 0)               # h_step 0 never moves
    assert h_controller_step(3, 0, False, 1, 4, 2)[:2] == (3, 0)
    assert h_controller_step(2, -4, False, 0, 10, 2) == (5, 2, False)         # floor k_b // d


def test_worked_example_two_ranks_four_entries():
    g = np.array([[[1, -5, 2, 0.5], [3, 1, -1, 2]]], np.float32)
    res = simulate(comp(0.5), g)
    for w in range(2):
        np.testing.assert_array_equal(res.updates[0, w], [0, -2.5, 0, 1.0])
    np.testing.assert_array_equal(res.residuals[0], [[1, 0, 2, 0.5], [3, 1, -1, 0]])
    np.testing.assert_array_equal(2 * res.updates[0, 0] + res.residuals[0].sum(0), [4, -4, 1, 2.5])


# -- P = 1, zeros, torch, edge cases ------------------------------------------------------------------------
def test_single_rank_issues_no_collective_and_keeps_top_k():
    g = int_grads(4, 1, 300, seed=9)
    out = run(comp(0.05), g)
    ref = spardl_reference(g, 0.05)
    assert_matches_reference(out, ref, 1)
    V = np.zeros(300, np.float32)
    for t in range(4):
        V = V + g[t, 0]
        m = np.zeros(300, bool)
        m[ref_sel(V, 15)] = True
        np.testing.assert_array_equal(out[0][t]["u"], np.where(m, V, 0))
        np.testing.assert_array_equal(out[0][t]["res"], np.where(m, 0, V))
        V = out[0][t]["res"]
        assert out[0][t]["collectives"] == 0 and out[0][t]["log"] == []


@pytest.mark.parametrize("P", PS)
def test_all_zero_gradients(P):
    for d in groups_for(P):
        res = simulate(comp(0.1, d), np.zeros((3, P, 77), np.float32))
        assert not res.updates.any() and not res.residuals.any()


@pytest.mark.parametrize("P, d, sag, selection", [(3, 1, "bruck", "lazy"), (8, 2, "bruck", "lazy"),
                                                  (8, 4, "recursive", "eager"), (6, 3, "bruck", "eager")])
def test_torch_and_numpy_backends_agree_bitwise(P, d, sag, selection):
    pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    g = (rng.standard_normal((3, P, 333)) * rng.lognormal(0, 2, size=333)).astype(np.float32)
    c = comp(0.05, d, sag=sag, selection=selection)
    a, b = run(c, g), run(c, g, backend="torch")
    for w in range(P):
        for t in range(3):
            assert a[w][t]["u"].tobytes() == b[w][t]["u"].tobytes()
            assert a[w][t]["res"].tobytes() == b[w][t]["res"].tobytes()
            assert a[w][t]["info"]["h"] == b[w][t]["info"]["h"]


def test_nan_gradient_and_overflowing_accumulator_are_skipped_by_the_engine_before_spardl():
    g = int_grads(1, 4, 40, seed=1)
    g[0, 2, 7] = np.nan
    res = simulate(comp(0.1, 1), g)                 # the engine's nonfinite="skip": all ranks skip
    assert np.isnan(res.updates[0]).all()
    # finite gradients whose accumulator overflows at step 1 (3e38 left in the residual + 3e38): the engine sees
    # a non-finite accumulator and skips that step on every rank, residuals untouched
    big = np.full((2, 4, 40), 3e38, dtype=np.float32)
    with pytest.warns(RuntimeWarning, match="skipped on every rank"):
        res = simulate(comp(0.1, 1), big)
    assert np.isnan(res.updates[1]).all() and np.array_equal(res.residuals[1], res.residuals[0])


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="groups must divide the number of ranks P, got groups=3 with P=4"):
        simulate(comp(0.1, 3), int_grads(1, 4, 20))
    with pytest.raises(ValueError, match="groups"):
        SparDL(0)
    with pytest.raises(ValueError, match="groups must be a power of two"):
        SparDL(3, sag="recursive")
    for kw in ({"sag": "ring"}, {"selection": "greedy"}, {"h_mode": "auto"}, {"pack": "fp16"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SparDL(**kw)
    assert SparDL(2) == SparDL(groups=2) and hash(SparDL(2)) == hash(SparDL(2)) and SparDL(2) != SparDL()
    assert SparDL.name == "spardl"


def test_spardl_preset_reaches_every_knob():
    from hvd_sparse import Compression

    kw = dict(sag="recursive", selection="eager", h_mode="fixed", pack="two")
    preset = Compression.spardl(0.1, groups=2, **kw)
    assert preset.reducer == SparDL(2, **kw)
    assert repr(preset) == ("Compression.spardl(density=0.1, groups=2, sag='recursive', selection='eager', "
                            "h_mode='fixed', pack='two')")
    assert repr(Compression.spardl(0.1)) == "Compression.spardl(density=0.1)"         # defaults left out
    g = int_grads(3, 4, 64, seed=5)
    a, b = simulate(preset, g), simulate(comp(0.1, 2, **kw), g)
    assert a.updates.tobytes() == b.updates.tobytes() and a.residuals.tobytes() == b.residuals.tobytes()


def test_groups_equal_P_warns():
    with pytest.warns(UserWarning, match="groups == P"):
        simulate(comp(0.1, 4), int_grads(1, 4, 50))


# -- hypothesis ---------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), P=st.sampled_from([1, 2, 3, 4, 5, 6, 8]), n=st.integers(1, 180),
       density=st.floats(0.005, 1.0), seed=st.integers(0, 2 ** 16),
       selection=st.sampled_from(["lazy", "eager"]), h_mode=st.sampled_from(["adaptive", "fixed"]))
def test_property_equals_reference_conserves_and_agrees(data, P, n, density, seed, selection, h_mode):
    d = data.draw(st.sampled_from([x for x in range(1, P + 1) if P % x == 0 and x < max(P, 2)]), label="d")
    sag = data.draw(st.sampled_from(["bruck", "recursive"] if d & (d - 1) == 0 and d > 1 else ["bruck"]))
    g = int_grads(2, P, n, seed=seed, scale=64)
    out = run(comp(density, d, sag=sag, selection=selection, h_mode=h_mode), g)
    ref = spardl_reference(g, density, d, selection, sag, h_mode)
    assert_matches_reference(out, ref, P)
    total = g.sum(axis=(0, 1), dtype=np.float64)
    applied = sum(out[0][t]["u"].astype(np.float64) for t in range(2))
    kept = sum(out[w][1]["res"].astype(np.float64) for w in range(P))
    np.testing.assert_array_equal(applied + kept, total)
    for w in range(P):
        assert out[w][1]["u"].tobytes() == out[0][1]["u"].tobytes()


@pytest.mark.parametrize("selection", ["lazy", "eager"])
def test_rsag_three_rounds_conserves_mass(selection):
    """d = 8 R-SAG: a sum dropped at round s >= 1 can come back in a later round; each of the 2^(s+1)
    holders must keep 1/2^(s+1) of it (a plain "half" is exact only for round 0)."""
    P = 8
    g = int_grads(4, P, 64, seed=3, scale=8)
    with pytest.warns(UserWarning, match="groups == P"):
        out = run(comp(0.1, 8, sag="recursive", selection=selection), g)
    assert_matches_reference(out, spardl_reference(g, 0.1, 8, selection, "recursive"), P)
    for t in range(4):
        applied = sum(out[0][s]["u"].astype(np.float64) for s in range(t + 1))
        kept = sum(out[w][t]["res"].astype(np.float64) for w in range(P))
        np.testing.assert_array_equal(applied + kept, g[: t + 1].sum(axis=(0, 1), dtype=np.float64))
