"""Simulator tests of DCT-DP (hvd_sparse/core/sparsifiers/dct.py), docs/algorithms.md#dct.

DCT runs as SparseCompression(DCT(d, L), TopkA()) with ``shapes=`` (per-tensor thresholds); ``dct_reference`` below
is the per-tensor threshold rule with the rank-order aggregation, written out independently. Exact checks use
integer-valued float32 data (oracles.int_grads) or rank-order float32 sums reproduced by the reference.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_sparse.compression import SparseCompression
from hvd_sparse.core.reducers.topka import TopkA
from hvd_sparse.core.sparsifiers.dct import DCT, dct_k
from hvd_sparse.core.validate import options
from hvd_sparse.core.validate import real as real_option
from hvd_sparse.core.xp import backend_of
from hvd_sparse.testing import simulate

from oracles import PS, ctx_of, int_grads, real, ref_topk, run_world


# -- test double ----------------------------------------------------------------------------------------------------
@options
class RecDCT(DCT):
    """The paper's DCT (``drift=None``: thresholds recomputed every ``lifespan`` steps only) that leaves its
    selection in the state, with room for all of it: the wire's capacity (2k) cuts what DCT's rule selects beyond
    it, and these tests check the rule itself."""

    capacity_ratio = 1e9
    _: dataclasses.KW_ONLY
    drift: float = real_option(None, 1.0, low_incl=False, allow_none=True)

    def select(self, xp, acc, k, state, ctx):
        out = super().select(xp, acc, k, state, ctx)
        state["_idx"] = real(out).astype(np.int64)
        return out


# -- the independent reference: the per-tensor threshold rule + rank-order aggregation (TopkA with counts) ----------
def _k_ref(nl, d6, rounding):
    """K with the density given in millionths (exact integer arithmetic)."""
    if rounding == "ceil":
        K = -(-nl * d6 // 10**6)
    else:
        K = nl - (nl * (10**6 - d6)) // 10**6 + 1
    return min(max(K, 1), nl)


def dct_reference(g, layout, d6, L, guard=True, rounding="ceil", sync=False, drift=None):
    """Per step: u, E, M, Gt, the thresholds used and whether each rank recomputed them. ``drift``: a rank also
    recomputes when its previous |M| left [c / drift, c * drift], c its |M| on its last recompute."""
    steps, P, n = g.shape
    offs = np.concatenate([[0], np.cumsum(layout)]).astype(int)
    E = np.zeros((P, n), np.float32)
    tau = [[None] * len(layout) for _ in range(P)]
    drifted, counted = [False] * P, [0] * P
    out = []
    for t in range(steps):
        Gt = E + g[t]
        M = np.zeros((P, n), bool)
        taus_used = []
        recompute = [t % L == 0 or drifted[r] for r in range(P)]
        for r in range(P):
            if recompute[r]:
                for l, nl in enumerate(layout):
                    a = np.sort(np.nan_to_num(np.abs(Gt[r, offs[l]:offs[l + 1]]), nan=0, posinf=0, neginf=0))[::-1]
                    tau[r][l] = float(a[_k_ref(nl, d6, rounding) - 1])
        if sync and P > 1 and recompute[0]:
            for l in range(len(layout)):
                s = np.float32(tau[0][l])
                for r in range(1, P):
                    s = np.float32(s + np.float32(tau[r][l]))
                for r in range(P):
                    tau[r][l] = float(s) / P
        for r in range(P):
            for l in range(len(layout)):
                a = np.abs(Gt[r, offs[l]:offs[l + 1]])
                M[r, offs[l]:offs[l + 1]] = (a > 0) if (guard and tau[r][l] == 0) else (a >= tau[r][l])
            taus_used.append(list(tau[r]))
        u = np.zeros(n, np.float32)
        for r in range(P):
            u[M[r]] += Gt[r][M[r]]
            passed = int(M[r].sum())
            counted[r] = passed if recompute[r] else counted[r]
            drifted[r] = drift is not None and not counted[r] / drift <= passed <= counted[r] * drift
        Enew = np.where(M, np.float32(0), Gt)
        out.append({"u": u, "E": Enew, "M": M, "Gt": Gt, "tau": taus_used, "recompute": recompute})
        E = Enew
    return out


SHAPES = [(40,), (10, 10), (7,), (300,), (1,)]


def check_dct(recs, ref, P, layout, guard=True):
    offs = np.concatenate([[0], np.cumsum(layout)]).astype(int)
    for t, (rec, rt) in enumerate(zip(recs, ref)):
        for r in range(P):
            st = rec[r]["state"]
            M = np.zeros(sum(layout), bool)
            M[st["_idx"]] = True
            assert M.tolist() == rt["M"][r].tolist(), (t, r)
            assert st["tau"] == rt["tau"][r], (t, r)
            assert st["recomputed"] == rt["recompute"][r]
            assert st["nnz"] == [int(M[offs[l]:offs[l + 1]].sum()) for l in range(len(layout))]
            # 1. exact error-feedback identity: Ghat + E_new == G + E_old, Ghat * E_new == 0
            Gt = rt["Gt"][r]
            ghat = np.where(M, Gt, np.float32(0))
            assert rec[r]["res"].tobytes() == rt["E"][r].tobytes()
            assert (ghat + rec[r]["res"]).tobytes() == Gt.tobytes()
            assert not (ghat * rec[r]["res"]).any()
            # 4. output == sum of Ghat in rank order, identical on every rank
            assert rec[r]["u"].tobytes() == rt["u"].tobytes()
            assert rec[r]["u"].tobytes() == rec[0]["u"].tobytes()


# -- tests ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("rounding", ["ceil", "paper"])
def test_dct_matches_reference(P, rounding):
    layout = [int(np.prod(s)) for s in SHAPES]
    rng = np.random.default_rng(P)
    g = rng.standard_normal((8, P, sum(layout))).astype(np.float32)
    recs = run_world(SparseCompression(RecDCT(0.1, 3, k_rounding=rounding), TopkA()), g, shapes=SHAPES)
    ref = dct_reference(g, layout, 100000, 3, rounding=rounding)
    check_dct(recs, ref, P, layout)
    offs = np.concatenate([[0], np.cumsum(layout)]).astype(int)
    for t in range(8):
        for r in range(P):
            st = recs[t][r]["state"]
            Gt = ref[t]["Gt"][r]
            for l, nl in enumerate(layout):
                a = np.abs(Gt[offs[l]:offs[l + 1]])
                if t % 3 == 0:   # 2. recompute: nnz == K, tau == sorted(|Gt|, desc)[K-1]
                    K = _k_ref(nl, 100000, rounding)
                    assert st["nnz"][l] == K
                    assert st["tau"][l] == float(np.sort(a)[::-1][K - 1])
                else:            # 3. tau unchanged, M == (|Gt| >= tau)
                    assert st["tau"][l] == recs[t - 1][r]["state"]["tau"][l]
    # exact volume: the header (the count in it), then the capacity's indices (int32) and values per rank
    if P > 1:
        n = sum(layout)
        cap = min(n, int(RecDCT.capacity_ratio * max(1, int(0.1 * n))))
        for t in range(8):
            for r in range(P):
                ph = recs[t][r]["phases"]
                assert ph["sent_words"] == {"agree": 9 * (P - 1), "indices": cap * (P - 1), "values": cap * (P - 1)}
                assert ph["recv_words"]["indices"] == cap * (P - 1)
                assert ph["sent_bytes"]["indices"] == 4 * cap * (P - 1)


def test_dct_stale_threshold_lets_nnz_drift():
    g = np.random.default_rng(0).standard_normal((6, 2, 1000)).astype(np.float32)
    recs = run_world(SparseCompression(RecDCT(0.05, 6), TopkA()), g)
    nnz = [recs[t][0]["state"]["nnz"][0] for t in range(6)]
    assert nnz[0] == 50 and max(nnz[1:]) > 50           # error feedback grows the unsent entries


@pytest.mark.parametrize("P", [1, 3])
def test_dct_drift_recomputes_a_rank_whose_count_left_its_band(P):
    """Each rank recomputes at the step after its |M| left [c/2, 2c] (c: its |M| on its last recompute), and only
    then; the paper's rule (drift=None) lets |M| run out of that band on the same data."""
    g = np.random.default_rng(P).standard_normal((30, P, 500)).astype(np.float32)
    layout = [int(np.prod(s)) for s in SHAPES[:4]]
    g = g[:, :, :sum(layout)]
    drifting = RecDCT(0.05, 1000, drift=2.0)
    recs = run_world(SparseCompression(drifting, TopkA()), g, shapes=SHAPES[:4])
    ref = dct_reference(g, layout, 50000, 1000, drift=2.0)
    check_dct(recs, ref, P, layout)
    redone = [recs[t][r]["state"]["recomputed"] for t in range(1, 30) for r in range(P)]
    assert any(redone) and not all(redone)
    for t in range(30):
        for r in range(P):
            st = recs[t][r]["state"]
            assert st["passed"] == int(ref[t]["M"][r].sum())
            assert st["drifted"] == (not st["reference"] / 2 <= st["passed"] <= 2 * st["reference"])
    paper = dct_reference(g, layout, 50000, 1000)
    late = [np.mean([out[t]["M"].sum() / out[0]["M"].sum() for t in range(20, 30)]) for out in (ref, paper)]
    assert late[0] < 2 < late[1]


@pytest.mark.parametrize("P", [1, 2, 3])
def test_dct_density_one_is_the_dense_sum(P):
    # density 1: K = n, tau = min|Gt|, all pass, out == sum of G, E stays 0
    g = int_grads(3, P, 200, seed=P)
    g[g == 0] = 1
    recs = run_world(SparseCompression(RecDCT(1.0, 1), TopkA()), g, shapes=[(50,), (150,)])
    for t in range(3):
        for r in range(P):
            assert recs[t][r]["state"]["nnz"] == [50, 150]
            assert not recs[t][r]["res"].any()
            np.testing.assert_array_equal(recs[t][r]["u"], g[t].sum(axis=0))
        assert recs[t][0]["state"]["tau"] == [float(np.abs(g[t, 0, :50]).min()),
                                                  float(np.abs(g[t, 0, 50:]).min())]


@pytest.mark.parametrize("P", [1, 2, 4])
def test_dct_lifespan_one_is_topk_with_error_feedback(P):
    # lifespan 1: distinct magnitudes -> per-tensor top-K with memory, every step
    layout = [64, 200, 36]
    g = np.random.default_rng(7 + P).standard_normal((6, P, 300)).astype(np.float32)
    recs = run_world(SparseCompression(RecDCT(0.05, 1), TopkA()), g, shapes=[(s,) for s in layout])
    E = np.zeros((P, 300), np.float32)
    offs = [0, 64, 264, 300]
    for t in range(6):
        u = np.zeros(300, np.float32)
        for r in range(P):
            a = E[r] + g[t, r]
            m = np.concatenate([ref_topk(a[offs[l]:offs[l + 1]], _k_ref(layout[l], 50000, "ceil"))
                                for l in range(3)])
            u[m] += a[m]
            E[r] = np.where(m, 0, a)
            assert recs[t][r]["res"].tobytes() == E[r].tobytes()
        for r in range(P):
            assert recs[t][r]["u"].tobytes() == u.tobytes()


@pytest.mark.parametrize("P", [1, 2, 3])
def test_dct_all_zero_layer_and_zero_tau_guard(P):
    # an all-zero layer: tau = 0 selects nothing with zero_tau_guard
    g = int_grads(3, P, 120, seed=1)
    g[:, :, 20:70] = 0
    shapes = [(20,), (50,), (50,)]
    recs = run_world(SparseCompression(RecDCT(0.1, 2), TopkA()), g, shapes=shapes)
    for t in range(3):
        assert recs[t][0]["state"]["nnz"][1] == 0 and not recs[t][0]["u"][20:70].any()
        if t == 0:
            assert recs[t][0]["state"]["tau"][1] == 0.0
    with pytest.raises(ValueError, match="zero_tau_guard=False would select the zero entries"):
        RecDCT(0.1, 2, zero_tau_guard=False)           # tau = 0 would select every zero: refused
    # fully zero gradients with the guard: nothing is sent at all
    z = np.zeros((3, P, 120), np.float32)
    recs = run_world(SparseCompression(RecDCT(0.1, 2), TopkA()), z, shapes=shapes)
    for t in range(3):
        for r in range(P):
            assert recs[t][r]["state"]["nnz"] == [0, 0, 0]
            assert not recs[t][r]["u"].any() and not recs[t][r]["res"].any()


@pytest.mark.parametrize("P", [1, 2, 3])
def test_dct_flush_drain_sends_everything(P):
    # drain (mode "flush"): out == sum of G + E_old, E == 0
    g = int_grads(4, P, 90, seed=2)
    recs = run_world(SparseCompression(RecDCT(0.1, 3, ef_drain_period=1), TopkA()), g)
    for t in range(4):
        for r in range(P):
            assert not recs[t][r]["res"].any()
            assert recs[t][r]["state"]["drained"]
            np.testing.assert_array_equal(recs[t][r]["u"], g[t].sum(axis=0))
    # Bernoulli(1/T_d) draws are rank-identical and deterministic
    sp = DCT(0.1, 3, ef_drain_period=4, drain_seed=5)
    draws = [sp._drain_now(t) for t in range(400)]
    assert draws == [DCT(0.1, 3, ef_drain_period=4, drain_seed=5)._drain_now(t) for t in range(400)]
    assert 60 < sum(draws) < 140
    with pytest.raises(ValueError, match="ef_drain_mode"):
        DCT(0.1, ef_drain_mode="discard")


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_dct_sync_threshold(P):
    # sync_threshold: tau equal on all ranks after each recompute (one allreduce, phase "dct_tau", on those steps)
    layout = [int(np.prod(s)) for s in SHAPES]
    g = np.random.default_rng(P).standard_normal((5, P, sum(layout))).astype(np.float32)
    recs = run_world(SparseCompression(RecDCT(0.1, 2, sync_threshold=True), TopkA()), g, shapes=SHAPES)
    ref = dct_reference(g, layout, 100000, 2, sync=True)
    check_dct(recs, ref, P, layout)
    for t in range(5):
        for r in range(P):
            assert recs[t][r]["state"]["tau"] == recs[t][0]["state"]["tau"]
            assert recs[t][r]["phases"]["calls"].get("dct_tau", 0) == (1 if t % 2 == 0 else 0)


def test_dct_worked_example():
    # worked example: P=1, G=[0.5,-2,0.1,3,-0.2], rho=0.4 (K=2), L=2, E=0
    f = np.float32
    G = np.array([0.5, -2, 0.1, 3, -0.2], f)
    g = np.stack([G[None]] * 3)
    recs = run_world(SparseCompression(RecDCT(0.4, 2), TopkA()), g, average=True)
    E = np.zeros(5, f)
    for t in range(3):
        st = recs[t][0]["state"]
        Gt = E + G
        assert st["tau"] == [2.0] and st["recomputed"] == (t != 1)
        assert st["_idx"].tolist() == [1, 3]
        np.testing.assert_array_equal(recs[t][0]["u"], np.array([0, -2, 0, 3, 0], f))
        E = np.where([False, True, False, True, False], f(0), Gt)
        np.testing.assert_array_equal(recs[t][0]["res"], E)
        assert recs[t][0]["collectives"] == 0
    np.testing.assert_allclose(E, [1.5, 0, 0.3, 0, -0.6], rtol=1e-6)
    assert dct_k(5, 0.4) == 2 and dct_k(5, 0.4, "paper") == 3


def test_dct_k_rounding():
    assert dct_k(100, 0.07) == 7 and dct_k(1000, 0.001) == 1 and dct_k(3, 0.001) == 1 and dct_k(10, 1.0) == 10
    assert dct_k(10, 0.25) == 3 and dct_k(10, 0.25, "paper") == 4 and dct_k(10, 1.0, "paper") == 10
    for nl in range(1, 200):
        for d6 in (1000, 10000, 70000, 100000, 333333, 500000, 900000):
            assert dct_k(nl, d6 / 10**6) == _k_ref(nl, d6, "ceil")
            assert dct_k(nl, d6 / 10**6, "paper") == _k_ref(nl, d6, "paper")


def test_dct_layout_change_recomputes_and_nan_is_kept_out_of_tau():
    sp = DCT(0.2, 100)
    acc = np.array([1, -5, 3, 2, 8, -1, 0, 4, 2, 6], np.float32)
    xp = backend_of(acc)
    state = {}
    sp.select(xp, acc, 2, state, ctx_of(layout=(10,)))
    assert state["tau"] == [6.0] and state["recomputed"]
    idx = real(sp.select(xp, acc, 2, state, ctx_of(step=1, layout=(10,))))
    assert not state["recomputed"] and idx.tolist() == [4, 9]
    idx = real(sp.select(xp, acc, 2, state, ctx_of(step=2, layout=(5, 5))))
    assert state["recomputed"] and state["tau"] == [8.0, 6.0] and idx.tolist() == [4, 9]
    bad = acc.copy()
    bad[[0, 9]] = [np.nan, np.inf]
    idx = real(sp.select(xp, bad, 3, {}, ctx_of(layout=(10,))))
    assert idx.tolist() == [1, 4, 9]        # tau = 5 (NaN/Inf count as 0); NaN never passes, +Inf does
    with pytest.raises(ValueError, match="layout"):
        sp.select(xp, acc, 2, {}, ctx_of(layout=(4,)))


def test_dct_single_rank_no_collective():
    g = int_grads(4, 1, 300, seed=9)
    comp = SparseCompression(DCT(0.05, 2, sync_threshold=True, drift=None), TopkA())
    res = simulate(comp, g, shapes=[(100,), (200,)])
    assert all(v[0]["collectives"] == 0 and v[0]["recv_words"] == 0 for v in res.volume)


def test_dct_torch_and_numpy_backends_agree():
    pytest.importorskip("torch")
    g = np.random.default_rng(3).standard_normal((5, 3, 448)).astype(np.float32)
    g[:, :, 100:120] = 0
    comp = SparseCompression(RecDCT(0.07, 2, sync_threshold=True), TopkA())
    a = run_world(comp, g, shapes=SHAPES)
    b = run_world(comp, g, shapes=SHAPES, backend="torch")
    for t in range(5):
        for r in range(3):
            assert a[t][r]["u"].tobytes() == b[t][r]["u"].tobytes()
            assert a[t][r]["res"].tobytes() == b[t][r]["res"].tobytes()
            assert a[t][r]["state"]["tau"] == b[t][r]["state"]["tau"]
            assert a[t][r]["state"]["_idx"].tolist() == b[t][r]["state"]["_idx"].tolist()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 80), min_size=1, max_size=5), P=st.integers(1, 5),
       d6=st.sampled_from([1000, 50000, 100000, 250000, 500000, 1000000]), L=st.integers(1, 4),
       steps=st.integers(1, 5), rounding=st.sampled_from(["ceil", "paper"]), sync=st.booleans(),
       seed=st.integers(0, 99))
def test_dct_property_matches_reference(sizes, P, d6, L, steps, rounding, sync, seed):
    g = int_grads(steps, P, sum(sizes), seed=seed, scale=8)       # many ties and zeros
    sp = RecDCT(d6 / 10**6, L, k_rounding=rounding, sync_threshold=sync)
    recs = run_world(SparseCompression(sp, TopkA()), g, shapes=[(s,) for s in sizes])
    ref = dct_reference(g, sizes, d6, L, rounding=rounding, sync=sync)
    check_dct(recs, ref, P, sizes)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lifespan=0), "lifespan"), (dict(k_rounding="floor"), "k_rounding"),
    (dict(zero_tau_guard=1), "zero_tau_guard"), (dict(sync_threshold="yes"), "sync_threshold"),
    (dict(ef_drain_period=0), "ef_drain_period"), (dict(drain_seed=-1), "drain_seed"), (dict(drift=1.0), "drift"),
    (dict(drift=2.0, sync_threshold=True), "drift=None")])
def test_dct_arguments_are_validated(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DCT(0.01, **kwargs)
