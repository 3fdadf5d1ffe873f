"""The budget's split over buckets (hvd_sparse.core.allocation): counts at the whole model's threshold, shares that
keep the budget, the engine's share (density, a fresh scheme, checkpoints), and the bucketed simulator."""

import numpy as np
import pytest
import torch

import hvd_sparse
from hvd_sparse.bench.syncs import as_if_on_a_device
from hvd_sparse.core import allocation
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.core.xp import NumpyBackend, TorchBackend
from hvd_sparse.testing import simulate, simulate_buckets

NP, TORCH = NumpyBackend(), TorchBackend()


def test_counts_are_taken_from_the_highest_bin_up_that_holds_k():
    tallies = [[4, 3, 2, 1], [1, 2, 2, 0]]          # entries in bins 0..3 (ascending magnitudes)
    assert allocation.local_counts(tallies, 5).tolist() == [3, 2]     # from bin 2 up: 5 in all
    assert allocation.local_counts(tallies, 6).tolist() == [6, 4]     # from bin 1 up: 10
    assert allocation.local_counts(tallies, 100).tolist() == [10, 5]  # none holds k: from the lowest bin


def test_magnitude_bins_are_the_same_on_every_backend_and_path():
    x = np.array([0.0, -0.0, 1e-30, 1.0, -1.0, 1.24, 1.25, -1.5, 1.76, 2.0, 3e5, np.inf], np.float32)
    bins = {}
    for name, xp, arr in (("numpy", NP, x), ("torch", TORCH, torch.from_numpy(x.copy()))):
        bins[name] = np.asarray(xp.magnitude_counts(arr))
    with as_if_on_a_device():
        bins["device"] = TORCH.magnitude_counts(torch.from_numpy(x.copy())).numpy()
    counts = bins["numpy"]
    assert all(np.array_equal(counts, other) for other in bins.values()) and counts.sum() == x.size
    one = np.float32(1.0).view(np.uint32) >> 21                   # bins of [1, 1.25), [1.25, 1.5), [1.5, 1.75), ...
    assert counts[0] == 2 and counts[one:one + 4].tolist() == [3, 1, 1, 1] and counts[one + 4] == 1


def test_shares_keep_the_budget_and_put_it_where_the_counts_are():
    numels = [1000, 100, 9000]
    shares = allocation.shares(np.array([30, 60, 10]), numels)
    assert sum(s * n for s, n in zip(shares, numels)) == pytest.approx(sum(numels))
    assert shares[1] > shares[0] > 1 > shares[2]
    assert allocation.shares(np.array([0, 0, 0]), numels) is None
    assert allocation.shares(np.array([0, 5, 5]), numels)[0] == allocation.FLOOR


def test_a_factor_within_a_quarter_octave_is_kept():
    assert allocation.settled(2.0, 2.3) == 2.0 and allocation.settled(2.0, 1.7) == 2.0
    assert allocation.settled(2.0, 2.5) == 2.5 and allocation.settled(1.0, 0.5) == 0.5


def engine_pair(preset):
    return preset.new_engine(SimulatedWorld(1).communicators()[0])


def test_a_share_scales_k_and_starts_the_scheme_afresh_and_is_kept_in_the_checkpoint():
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((6, 4000)).astype(np.float32)
    engine = engine_pair(hvd_sparse.Compression.oktopk(0.01))
    for t in range(3):
        engine.step(grads[t])
    assert engine.last["k"] == 40
    engine.set_share(2.5)
    state = engine.state_dict()
    fresh = engine_pair(hvd_sparse.Compression.oktopk(0.01))
    fresh.load_state_dict(state)
    seen = []
    for e in (engine, fresh):
        e.step(grads[3])
        assert e.last["k"] == 100
        seen.append([e.step(g).copy() for g in grads[4:]])
    np.testing.assert_array_equal(seen[0], seen[1])          # the share and its start resume bit for bit
    assert fresh.share == 2.5 and fresh.share_since == 3


def test_the_first_step_at_a_new_share_is_the_schemes_step_zero():
    rng = np.random.default_rng(1)
    grads = rng.standard_normal((4, 1, 4000)).astype(np.float32)

    def look(t, rank, engine):
        if t == 1:
            engine.set_share(3.0)

    res = simulate(hvd_sparse.Compression.oktopk(0.01), grads, after_step=look, record=("info",))
    assert [i[0]["t"] for i in res.info] == [0, 1, 0, 1]          # without the new start: 0, 1, 2, 3
    assert (res.info[0][0]["K"], res.info[2][0]["K"]) == (40, 120)


def test_buckets_follow_the_whole_models_top_k_and_conserve_the_mass():
    """One bucket holds the large entries: the split moves the budget there, so that less is left behind than by size
    (the residual: nearly what whole-model top-k leaves); every update plus residual is the sum."""
    rng = np.random.default_rng(2)
    sizes, P, steps = [3000, 300, 3000], 2, 21
    scale = np.concatenate([np.full(3000, 0.1), np.full(300, 3.0), np.full(3000, 1.0)])
    grads = (rng.standard_normal((steps, P, sum(sizes))) * scale).astype(np.float32)
    buckets = [([(s,)], False) for s in sizes]
    preset = hvd_sparse.Compression.topka(0.01)
    run = simulate_buckets(preset, grads, buckets)
    by_size = simulate_buckets(preset, grads, buckets, budget="size")
    assert run.shares[0] == [1.0, 1.0, 1.0] and run.shares[-1][1] > 3 and run.shares[-1][0] < 1
    assert all(s == [1.0, 1.0, 1.0] for s in by_size.shares)
    whole = simulate(preset, grads, record=("residuals",)).residuals[-1]
    left = [float(np.linalg.norm(r)) for r in (whole, run.residuals, by_size.residuals)]
    assert left[1] - left[0] < 0.25 * (left[2] - left[0])     # measured: 8 against 84
    applied = run.updates.sum(axis=0, dtype=np.float64)[0] * P + run.residuals.sum(axis=0, dtype=np.float64)
    np.testing.assert_allclose(applied, grads.sum(axis=(0, 1), dtype=np.float64), rtol=1e-5, atol=1e-5)


def test_a_share_stops_where_the_bucket_would_send_what_the_dense_rule_refuses():
    topka = hvd_sparse.Compression.topka(0.01)        # P = 4: 2·4·d words per entry, dense's bytes at d = 1/4
    assert allocation.ceiling(topka, 4, 1.0) == pytest.approx(25.0)
    assert allocation.ceiling(topka, 4, 5.0) == pytest.approx(5.0)
    assert allocation.ceiling(topka, 1, 1.0) == float("inf")
    assert allocation.ceiling(topka, 4, 1.0, local_size=2) == pytest.approx(50.0)     # among 2 hosts: d = 1/2
