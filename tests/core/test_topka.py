"""Simulator tests of TopkA (hvd_sparse/core/reducers/topka.py), docs/algorithms.md#topka: P·u is the sum of the
local top-k (``oracles.topka_reference``), the exact words, mass conservation, a rank with zero gradients, torch ==
numpy, and the sparse sum of more sources than one native merge takes, in rank order. The invariants TopkA shares
with the dense preset are in test_core_sim.py."""

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse.core.xp import backend_of
from hvd_sparse.testing import simulate

from oracles import int_grads, topka_reference

PS = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("density", [0.01, 0.1, 1.0])
def test_topka_equals_sum_of_local_topk(P, density):
    g = int_grads(4, P, 400, seed=10 + P)
    res = simulate(hvd_sparse.Compression.topka(density), g, average=False)
    ref_u, ref_eps, _ = topka_reference(g, density, average=False)
    k = max(1, int(density * 400))
    for t in range(4):
        for r in range(P):
            np.testing.assert_array_equal(res.updates[t, r], ref_u[t])
            np.testing.assert_array_equal(res.residuals[t, r], ref_eps[t, r])
            assert np.count_nonzero(res.updates[t, r]) <= min(400, P * k)
            # exactly 2k(P-1) words received per rank per step (k values + k indices from each other rank)
            assert res.volume[t][r]["recv_words"] == 2 * k * (P - 1)
            assert res.volume[t][r]["sent_words"] == 2 * k * (P - 1)
            assert res.volume[t][r]["collectives"] == (0 if P == 1 else 1)     # one grouped allgather


@pytest.mark.parametrize("P", [2, 4, 8])
def test_topka_average_is_exact_for_powers_of_two(P):
    g = int_grads(2, P, 300, seed=3)
    res = simulate(hvd_sparse.Compression.topka(0.05), g)
    ref_u, _, _ = topka_reference(g, 0.05, average=True)
    np.testing.assert_array_equal(res.updates[:, 0], ref_u)


@pytest.mark.parametrize("P", PS)
def test_topka_conserves_mass(P):
    g = int_grads(12, P, 500, seed=20 + P)
    res = simulate(hvd_sparse.Compression.topka(0.02), g, average=False)
    for t in range(12):
        applied = res.updates[: t + 1, 0].sum(axis=0, dtype=np.float64)
        kept = res.residuals[t].sum(axis=0, dtype=np.float64)
        np.testing.assert_array_equal(applied + kept, g[: t + 1].sum(axis=(0, 1), dtype=np.float64))


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_one_rank_all_zero_matches_reference(P):
    g = int_grads(4, P, 300, seed=7, zero_ranks=(P - 1,))
    res = simulate(hvd_sparse.Compression.topka(0.05), g, average=False)
    ref_u, ref_eps, _ = topka_reference(g, 0.05, average=False)
    assert (res.selected[:, P - 1] == 0).all()
    np.testing.assert_array_equal(res.updates[:, 0], ref_u)
    np.testing.assert_array_equal(res.residuals, ref_eps)


def test_torch_and_numpy_backends_agree():
    torch = pytest.importorskip("torch")
    from hvd_sparse.core.sim import SimulatedWorld

    g = np.random.default_rng(1).standard_normal((3, 3, 777)).astype(np.float32)
    ref = simulate(hvd_sparse.Compression.topka(0.03), g)
    comp = hvd_sparse.Compression.topka(0.03)
    world = SimulatedWorld(3)
    comms = world.communicators()
    engines = [comp.new_engine(c) for c in comms]

    def run(comm):
        return [engines[comm.rank].step(torch.from_numpy(g[t, comm.rank].copy())).numpy() for t in range(3)]

    outs = world.run(run, comms)
    for r in range(3):
        assert np.stack(outs[r]).tobytes() == ref.updates[:, r].tobytes()


@pytest.mark.parametrize("runs", [1, 255, 256, 257, 600])
def test_region_sums_of_more_sources_than_one_merge_takes_stay_in_rank_order(runs):
    """P > 256 (the native merge's limit): the chunked merge gives every sum as 0 + v_0 + v_1 + ... in rank
    order, bit for bit (float32 additions do not associate: a different grouping would show)."""
    from hvd_sparse.core.reducers.base import sum_sparse_in_rank_order

    rng = np.random.default_rng(runs)
    idx, val, counts = [], [], []
    for _ in range(runs):
        i = np.unique(rng.integers(0, 50, rng.integers(0, 12)))
        idx.append(i)
        val.append((rng.standard_normal(i.size) * 10.0 ** rng.integers(-3, 4, i.size)).astype(np.float32))
        counts.append(i.size)
    idx, val = np.concatenate(idx).astype(np.int64), np.concatenate(val)
    dense = np.zeros(50, np.float32)
    off = 0
    for c in counts:
        np.add.at(dense, idx[off:off + c], val[off:off + c])
        off += c
    where, sums = sum_sparse_in_rank_order(backend_of(val), idx, val, counts, val)
    np.testing.assert_array_equal(where, np.unique(idx))
    assert sums.tobytes() == dense[np.unique(idx)].tobytes()
