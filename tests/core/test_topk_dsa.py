"""Simulator tests of TopkDSA (hvd_sparse/core/reducers/topk_dsa.py), docs/algorithms.md#topk_dsa: TopkDSA == TopkA
(sum and residual, bit for bit), the dense switch at N >= n/3, the words of every phase, and a hypothesis property.
The invariants it shares with Gaussiank and gTopk are in test_scheme_invariants.py."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from hvd_sparse.core.reducers import TopkA
from hvd_sparse.core.reducers.topk_dsa import TopkDSA, regions
from hvd_sparse.core.sparsifiers import TopK
from hvd_sparse.core.sparsifiers.gaussiank import GaussianK
from hvd_sparse.testing import simulate

from oracles import PS, assert_mass_conserved, cases, comp, int_grads, k_of, topka_reference


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("density", [0.01, 0.05, 0.3, 1.0])
def test_topk_dsa_equals_topka(P, density):
    n = 301
    g = int_grads(4, P, n, seed=40 + P)
    a = simulate(comp(TopK(density), TopkA()), g, average=False)
    d = simulate(comp(TopK(density), TopkDSA()), g, average=False)
    assert d.updates.tobytes() == a.updates.tobytes()
    assert d.residuals.tobytes() == a.residuals.tobytes()
    ref_u, ref_eps, _ = topka_reference(g, density)
    np.testing.assert_array_equal(d.updates[:, 0], ref_u)
    for t in range(4):
        N = int(np.count_nonzero(ref_u[t]))
        path = d.phases[t][0]["calls"]
        if P > 1:
            assert ("dense" in path) == (3 * N >= n) and ("sparse" in path) == (3 * N < n)
            assert d.volume[t][0]["collectives"] == 3
    if P >= 2:   # the parametrization crosses the switch: sparse at 1%, dense at 100%
        expect = {0.01: "sparse", 1.0: "dense"}.get(density)
        assert expect is None or all(expect in d.phases[t][0]["calls"] for t in range(4))


@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("k_target, path", [(30, "dense"), (29, "sparse")])
def test_topk_dsa_dense_switch_exactly_at_n_over_3(P, k_target, path):
    n = 90                                                  # n/3 = 30; identical workers: N = k
    density = k_target / n
    assert k_of(density, n) == k_target
    row = np.random.default_rng(5).permutation(np.arange(1, n + 1)).astype(np.float32)
    g = np.broadcast_to(row, (1, P, n)).copy()
    d = simulate(comp(TopK(density), TopkDSA()), g, average=False)
    a = simulate(comp(TopK(density), TopkA()), g, average=False)
    assert path in d.phases[0][0]["calls"]
    assert d.updates.tobytes() == a.updates.tobytes()


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_topk_dsa_equals_topka_with_gaussiank_and_real_valued_data(P):
    rng = np.random.default_rng(P)
    g = (rng.standard_normal((3, P, 2000)) * rng.lognormal(0, 2, 2000)).astype(np.float32)
    for sp in (GaussianK(0.01), TopK(0.01), TopK(0.4)):
        a = simulate(comp(sp, TopkA()), g, average=False)
        d = simulate(comp(sp, TopkDSA()), g, average=False)
        assert d.updates.tobytes() == a.updates.tobytes()       # same summation order: bitwise
        assert d.residuals.tobytes() == a.residuals.tobytes()


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("density", [0.02, 0.5])
def test_topk_dsa_words_received_per_phase(P, density):
    n = 203                                                 # n mod P != 0: a longer last region
    g = int_grads(3, P, n, seed=50 + P)
    d = simulate(comp(TopK(density), TopkDSA()), g, average=False)
    ref_u, _, sels = topka_reference(g, density)
    off = regions(n, P)
    assert off[-2] == (P - 1) * (n // P) and off[-1] == n
    for t in range(3):
        N = int(np.count_nonzero(ref_u[t]))
        for r in range(P):
            lo, hi = off[r], off[r + 1]
            ph = d.phases[t][r]
            recv = 2 * sum(int(sels[t][s][lo:hi].sum()) for s in range(P) if s != r)
            sent = 2 * sum(int(sels[t][r][off[j]:off[j + 1]].sum()) for j in range(P) if j != r)
            assert ph["recv_words"]["scatter"] == recv and ph["sent_words"]["scatter"] == sent
            assert ph["recv_words"]["count"] == P - 1
            U = int(np.count_nonzero(ref_u[t][lo:hi]))
            if 3 * N < n:
                assert ph["recv_words"]["sparse"] == 2 * (N - U)
                assert ph["sent_words"]["sparse"] == 2 * U * (P - 1)
            else:
                assert ph["recv_words"]["dense"] == n - (hi - lo)
            assert ph["recv_bytes"]["scatter"] == 4 * recv          # int32 words


def test_topk_dsa_handles_fewer_entries_than_ranks():
    g = int_grads(2, 8, 5, seed=1)                          # q = 0: all data in the last region
    d = simulate(comp(TopK(0.4), TopkDSA()), g, average=False)
    a = simulate(comp(TopK(0.4), TopkA()), g, average=False)
    assert d.updates.tobytes() == a.updates.tobytes()


# -- hypothesis -----------------------------------------------------------------------------------------------------
@given(cases)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_topk_dsa_equals_topka(case):
    P, n, density, seed, scale = case
    g = int_grads(2, P, n, seed=seed, scale=scale)
    a = simulate(comp(TopK(density), TopkA()), g, average=False)
    d = simulate(comp(TopK(density), TopkDSA()), g, average=False)
    assert d.updates.tobytes() == a.updates.tobytes()
    assert d.residuals.tobytes() == a.residuals.tobytes()
    assert_mass_conserved(g, d)
