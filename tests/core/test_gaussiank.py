"""Simulator tests of Gaussiank (hvd_sparse/core/sparsifiers/gaussiank.py), docs/algorithms.md#gaussiank: the
threshold fit and its adjustment loops against ``oracles.gaussian_select_ref``, with TopkA against the allgather
reference, edge cases, arguments, and a hypothesis property. The invariants it shares with TopkDSA and gTopk are in
test_scheme_invariants.py."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.special import ndtri

from hvd_sparse.core.reducers import TopkA
from hvd_sparse.core.reducers.gtopk import GTopk
from hvd_sparse.core.reducers.topk_dsa import TopkDSA
from hvd_sparse.core.sparsifiers.gaussiank import GaussianK
from hvd_sparse.testing import simulate

from oracles import (NP, PS, allgather_reference, assert_mass_conserved, cases, comp, gaussian_select_ref,
                     int_grads, k_of, real)


@pytest.mark.parametrize("density, z", [(0.01, 2.5758), (0.02, 2.3263), (0.001, 3.2905)])
def test_gaussiank_initial_threshold_is_mean_plus_z_sigma(density, z):
    a = (np.random.default_rng(3).standard_normal(5000) * 3 + 0.5).astype(np.float32)
    state = {}
    GaussianK(density).select(NP, a, k_of(density, a.size), state, None)
    a64 = a.astype(np.float64)
    expect = a64.mean() + ndtri(1 - density / 2) * a64.std(ddof=1)
    assert state["threshold_initial"] == pytest.approx(expect, rel=1e-12)
    assert (state["threshold_initial"] - a64.mean()) / a64.std(ddof=1) == pytest.approx(z, abs=1e-4)


@pytest.mark.parametrize("descend", [True, False])
@pytest.mark.parametrize("adjust", ["lstm", "bert", "vgg"])
@pytest.mark.parametrize("dist", ["normal", "uniform", "laplace", "spiky"])
def test_gaussiank_adjustment_loops_match_the_reference_loops(adjust, dist, descend):
    rng = np.random.default_rng(7)
    n, density = 4000, 0.02
    a = {"normal": rng.standard_normal(n), "uniform": rng.uniform(-1, 1, n),
         "laplace": rng.laplace(size=n), "spiky": np.r_[rng.uniform(-1, 1, n - 1), 1e4]}[dist]
    a = a.astype(np.float32)
    state = {}
    idx = real(GaussianK(density, adjust=adjust, descend=descend).select(NP, a, k_of(density, n), state, None))
    mask, th0, th, it = gaussian_select_ref(a, density, adjust, descend)
    if dist == "spiky":          # one huge entry: the loop runs out below 3k/4, the descent reaches it
        assert (mask.sum() >= (3 * k_of(density, n)) // 4) == descend
    np.testing.assert_array_equal(idx, np.flatnonzero(mask))
    assert state["iterations"] == it and state["threshold"] == pytest.approx(th, rel=1e-12)
    assert state["threshold_initial"] == pytest.approx(th0, rel=1e-12)
    if dist == "uniform":
        assert it > 0            # light tails: the Gaussian fit over-estimates the threshold


def test_gaussiank_lstm_loop_reaches_three_quarters_k_or_runs_out():
    rng = np.random.default_rng(11)
    n, density = 1000, 0.05
    k = k_of(density, n)
    a = rng.uniform(-1, 1, n).astype(np.float32)           # loop converges
    s = {}
    assert real(GaussianK(density).select(NP, a, k, s, None)).size >= (3 * k) // 4 and 0 < s["iterations"] < 50
    a[0] = 1e4                                              # one outlier: sigma explodes, 50 iterations
    s = {}
    assert real(GaussianK(density, descend=False).select(NP, a, k, s, None)).size < (3 * k) // 4
    assert s["iterations"] == 50
    s = {}                                                  # the descent goes on to 3k/4
    assert (3 * k) // 4 <= real(GaussianK(density).select(NP, a, k, s, None)).size <= 2 * k
    assert s["iterations"] == 50 and s["threshold"] < s["threshold_initial"] * 1.012 ** -50


@pytest.mark.parametrize("P", PS)
def test_gaussiank_with_topka_sums_the_selections(P):
    g = int_grads(5, P, 600, seed=30 + P)
    res = simulate(comp(GaussianK(0.02), TopkA()), g, average=False)
    ref_u, ref_eps, sels = allgather_reference(g, lambda a: gaussian_select_ref(a, 0.02)[0])
    np.testing.assert_array_equal(res.updates, np.repeat(ref_u[:, None], P, axis=1))
    np.testing.assert_array_equal(res.residuals, ref_eps)
    assert (res.selected == np.array([[m.sum() for m in s] for s in sels])).all()
    # a fixed shape: the capacity (2k slots, the real ones first) from every other rank, the counts in the header
    cap = 2 * k_of(0.02, 600)
    for t in range(5):
        for r in range(P):
            assert res.phases[t][r]["recv_words"].get("indices", 0) == cap * (P - 1)
            assert "count" not in res.phases[t][r]["recv_words"]


def test_gaussiank_never_selects_zeros_and_handles_constant_input():
    a = np.zeros(100, np.float32)
    a[:3] = -7.0
    s = {}
    assert real(GaussianK(0.5).select(NP, a, 50, s, None)).tolist() == [0, 1, 2]
    a = np.full(10, -5.0, np.float32)                       # sigma = 0, th = mu < 0: all nonzeros
    assert real(GaussianK(0.5).select(NP, a, 5, {}, None)).tolist() == list(range(10))
    one = np.array([3.0], np.float32)                       # n = 1: std undefined -> 0, th = 3
    s = {}
    assert real(GaussianK(1.0).select(NP, one, 1, s, None)).tolist() == [0]   # |a| > th after one adjustment:
    assert s["threshold"] == 3.0 * (1 / 1.012) and s["iterations"] == 1       # k = 1 still asks for one entry


def test_gaussiank_arguments_are_validated_and_configuration_is_hashable():
    with pytest.raises(ValueError, match="adjust must be one of"):
        GaussianK(0.01, adjust="resnet")
    with pytest.raises(ValueError, match="density"):
        GaussianK(0.0)
    with pytest.raises(TypeError):
        GaussianK(0.01, "lstm")                             # adjust is keyword-only
    assert GaussianK(0.01) == GaussianK(0.01, adjust="lstm") != GaussianK(0.01, adjust="vgg")
    assert len({GaussianK(0.01), GaussianK(0.01), TopkDSA(), TopkDSA(), GTopk()}) == 3
    assert GaussianK.name == "gaussiank" and not GaussianK.exact_k
    assert TopkDSA.name == "topk_dsa" and GTopk.name == "gtopk"


# -- hypothesis -----------------------------------------------------------------------------------------------------
@given(cases, st.sampled_from(["lstm", "bert", "vgg"]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_gaussiank_with_topka(case, adjust):
    P, n, density, seed, scale = case
    g = int_grads(2, P, n, seed=seed, scale=scale)
    res = simulate(comp(GaussianK(density, adjust=adjust), TopkA()), g, average=False)
    ref_u, ref_eps, _ = allgather_reference(g, lambda a: gaussian_select_ref(a, density, adjust)[0])
    np.testing.assert_array_equal(res.updates[:, 0], ref_u)
    np.testing.assert_array_equal(res.residuals, ref_eps)
    assert_mass_conserved(g, res)
