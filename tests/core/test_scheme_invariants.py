"""The invariants Gaussiank (with TopkA), TopkDSA and gTopk share on the simulator (docs/algorithms.md#invariants),
each test parametrized over the three schemes: density 1 is the dense sum, mass conservation (gTopk loses pruned
values by design: test_gtopk.py), replica consistency, P = 1, all-zero gradients, determinism, torch == numpy."""

import numpy as np
import pytest

from hvd_sparse.compression import SparseCompression
from hvd_sparse.core.reducers import Dense, TopkA
from hvd_sparse.core.reducers.gtopk import GTopk
from hvd_sparse.core.reducers.topk_dsa import TopkDSA
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.core.sparsifiers import TopK
from hvd_sparse.core.sparsifiers.gaussiank import GaussianK
from hvd_sparse.testing import simulate

from oracles import (PS, allgather_reference, assert_mass_conserved, comp, gaussian_select_ref, gtopk_reference,
                     int_grads, topka_reference)


SCHEMES = {
    "gaussiank": lambda d: comp(GaussianK(d), TopkA()),
    "topk_dsa": lambda d: comp(TopK(d), TopkDSA()),
    "gtopk": lambda d: comp(TopK(d), GTopk()),
}


def reference(scheme, g, density):
    """The independent reference of ``scheme`` (a key of SCHEMES) on g: (updates, residuals, selections)."""
    if scheme == "gtopk":
        return gtopk_reference(g, density)
    if scheme == "gaussiank":
        return allgather_reference(g, lambda a: gaussian_select_ref(a, density)[0])
    return topka_reference(g, density)


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("scheme", ["topk_dsa", "gtopk"])
def test_density_one_equals_dense_and_leaves_no_residual(P, scheme):
    g = int_grads(3, P, 150, seed=70 + P, scale=8)
    if P >= 2:
        g[:, 1, :40] = -g[:, 0, :40]                        # exact cancellations in the sum
        g[:, 1, 40:50] = 0
    res = simulate(SCHEMES[scheme](1.0), g, average=False)
    dense = simulate(SparseCompression(None, Dense()), g, average=False)
    np.testing.assert_array_equal(res.updates, dense.updates)
    assert not res.residuals.any()
    if scheme == "topk_dsa" and P > 1:
        assert all("dense" in res.phases[t][0]["calls"] for t in range(3))


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("scheme", ["gaussiank", "topk_dsa"])
def test_mass_conservation(P, scheme):
    g = int_grads(10, P, 500, seed=80 + P)
    res = simulate(SCHEMES[scheme](0.02), g, average=False)
    assert_mass_conserved(g, res)


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_replica_consistency(P, scheme):
    rng = np.random.default_rng(P)
    g = (rng.standard_normal((4, P, 1000)) * rng.lognormal(0, 2, size=1000)).astype(np.float32)
    res = simulate(SCHEMES[scheme](0.02), g)
    for r in range(1, P):
        assert res.updates[:, r].tobytes() == res.updates[:, 0].tobytes()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_single_rank_issues_no_collective_and_keeps_semantics(scheme):
    g = int_grads(5, 1, 200, seed=5)
    res = simulate(SCHEMES[scheme](0.05), g)
    assert all(v[0]["collectives"] == 0 and v[0]["recv_words"] == 0 for v in res.volume)
    ref_u, ref_eps, _ = reference(scheme, g, 0.05)
    np.testing.assert_array_equal(res.updates[:, 0], ref_u)
    np.testing.assert_array_equal(res.residuals, ref_eps)


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_all_zero_gradients(P, scheme):
    g = np.zeros((3, P, 100), np.float32)
    res = simulate(SCHEMES[scheme](0.1), g)
    assert not res.updates.any() and not res.residuals.any() and not res.selected.any()


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_one_rank_all_zero_matches_reference(P, scheme):
    g = int_grads(4, P, 300, seed=7, zero_ranks=(P - 1,))
    res = simulate(SCHEMES[scheme](0.05), g, average=False)
    ref_u, ref_eps, _ = reference(scheme, g, 0.05)
    assert (res.selected[:, P - 1] == 0).all()
    np.testing.assert_array_equal(res.updates[:, 0], ref_u)
    np.testing.assert_array_equal(res.residuals, ref_eps)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_two_runs_are_bit_identical(scheme):
    g = np.random.default_rng(2).standard_normal((4, 5, 900)).astype(np.float32)
    r1 = simulate(SCHEMES[scheme](0.03), g)
    r2 = simulate(SCHEMES[scheme](0.03), g)
    assert r1.updates.tobytes() == r2.updates.tobytes()
    assert r1.residuals.tobytes() == r2.residuals.tobytes()


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("density", [0.03, 0.6])
def test_torch_and_numpy_backends_agree(scheme, density):
    torch = pytest.importorskip("torch")
    P, steps = 3, 3
    g = np.random.default_rng(1).standard_normal((steps, P, 777)).astype(np.float32)
    ref = simulate(SCHEMES[scheme](density), g)
    compression = SCHEMES[scheme](density)
    world = SimulatedWorld(P)
    comms = world.communicators()
    engines = [compression.new_engine(c) for c in comms]

    def run(comm):
        e = engines[comm.rank]
        out = []
        for t in range(steps):
            out.append(e.step(torch.from_numpy(g[t, comm.rank].copy())).numpy())
            assert isinstance(e.memory.residual, torch.Tensor)
            assert e.memory.residual.numpy().tobytes() == ref.residuals[t, comm.rank].tobytes()
        return out

    outs = world.run(run, comms)
    for r in range(P):
        assert np.stack(outs[r]).tobytes() == ref.updates[:, r].tobytes()
