"""The Keras optimizer through real `horovodrun` (Gloo) under Keras 3 and under tf_keras (TF_USE_LEGACY_KERAS=1):
model.fit with every preset, checked against the simulator on the gradients recorded around the reduction;
backward_passes_per_step (both flavours) and tf.train.Checkpoint with SparseState (Keras 3) in the np=2 jobs."""

import numpy as np
import pytest

from hvd_sparse.bench import presets
from hvd_sparse.testing import simulate

from horovod_helpers import FLOAT_ALLREDUCE, requires_horovod, scenario_job, tf_env

pytestmark = [pytest.mark.horovod, requires_horovod]

BASE = ("fit", "eager", "misuse")
#: (flavour, np, presets, scenarios): Keras 3 runs every preset at np=2, a subset at np=3; tf_keras a subset at np=2
JOBS = [("keras3", 2, None, BASE + ("bpps", "checkpoint")), ("keras3", 3, "topka,oktopk", BASE),
        ("tf_keras", 2, "topka,oktopk,exdyna", BASE + ("bpps",))]


@pytest.fixture(scope="module", params=JOBS, ids=lambda j: f"{j[0]}-np{j[1]}")
def job(request, tmp_path_factory):
    flavour, P, wanted, scenarios = request.param
    env = tf_env(flavour, fusion=False, **({"HVD_SPARSE_TEST_PRESETS": wanted} if wanted else {}))
    return P, scenario_job(tmp_path_factory, f"{flavour}_np{P}", P, "keras_worker.py", scenarios, f"keras_{flavour}_",
                           timeout=900, env=env)


@pytest.mark.parametrize("preset", ["none"] + presets.names())
def test_fit_weights_identical_and_equal_to_simulator(job, preset):
    P, res = job
    ranks = res["fit"]
    if f"{preset}.raw" not in ranks[0]:
        pytest.skip("not run in this job")
    grads = np.stack([r[f"{preset}.raw"] for r in ranks], axis=1)
    assert grads.shape[0] == 6                                # one reduction per step: it really ran
    if preset == "none":
        expected = [grads.sum(axis=1) / P] * P                # the dense reference: the plain average
    else:
        sim = simulate(presets.make(preset, 0.05), grads, shapes=[(int(m),) for m in ranks[0]["layout"]])
        expected = [sim.updates[:, r] for r in range(P)]
    for r in range(P):
        assert ranks[r][f"{preset}.weights"].tobytes() == ranks[0][f"{preset}.weights"].tobytes()
        got = ranks[r][f"{preset}.red"]
        if (preset in FLOAT_ALLREDUCE or preset == "none") and P > 2:
            np.testing.assert_allclose(got, expected[r], rtol=1e-6, atol=1e-6 * np.abs(grads).max())
        else:
            assert got.tobytes() == expected[r].tobytes(), f"rank {r} differs from the reference"


def test_graph_and_eager_fit_agree(job):
    P, res = job
    e = res["eager"][0]
    np.testing.assert_array_equal(e["graph.raw"], e["eager.raw"])
    np.testing.assert_array_equal(e["graph.red"], e["eager.red"])
    np.testing.assert_array_equal(e["graph.weights"], e["eager.weights"])


def test_misuse_raises_clear_errors(job):
    P, res = job
    for r in range(P):
        msgs = list(res["misuse"][r]["msgs"])
        assert "already a distributed optimizer" in msgs[0]
        assert "cannot serve two models" in msgs[1]
        assert "Adasum" in msgs[2]
        assert "differ across ranks" in msgs[3] and "rank 1" in msgs[3]


def needs(res, scenario):
    if scenario not in res:
        pytest.skip(f"{scenario} is not run in this job")
    return res[scenario]


def test_backward_passes_per_step_none_equals_double_batches(job):
    """bpps=2 with Compression.none and average_aggregated_gradients=True on batches of 32 against bpps=1 on
    batches of 64 (the same samples): the reduction runs every 2nd call, on the sum of the 2 batch gradients, and
    the optimizer applies it averaged; iterations count every call (Horovod's semantics)."""
    P, res = job
    ranks = needs(res, "bpps")
    r0 = ranks[0]
    assert r0["none2.raw"].shape[0] == 3 and r0["none1.raw"].shape[0] == 3     # 6 calls, 3 reductions
    assert int(r0["none2.iterations"]) == 6 and int(r0["none1.iterations"]) == 3
    # what reached the reduction: the sum of two gradients of 32 samples == 2 x the mean gradient of 64
    np.testing.assert_allclose(r0["none2.raw"], 2 * r0["none1.raw"], rtol=1e-4, atol=1e-6)
    # the dense reduction: Horovod's average of the ranks' sums, exactly
    expected = sum(r["none2.raw"] for r in ranks) / P
    for r in range(P):
        assert ranks[r]["none2.red"].tobytes() == expected.tobytes()
        assert ranks[r]["none2.weights"].tobytes() == ranks[0]["none2.weights"].tobytes()
    # applied averaged (/2): the weights of the bpps=1 run on double batches
    np.testing.assert_allclose(r0["none2.weights"], r0["none1.weights"], rtol=1e-4, atol=1e-6)
    moved = np.abs(r0["none1.weights"] - r0["w0"]).max()
    assert moved > 100 * np.abs(r0["none2.weights"] - r0["none1.weights"]).max()    # the oracle can fail


def test_backward_passes_per_step_sparse_equals_simulator_on_the_sums(job):
    P, res = job
    ranks = needs(res, "bpps")
    tag = "sparse2"
    grads = np.stack([r[f"{tag}.raw"] for r in ranks], axis=1)                   # (3, P, n): the local sums
    assert grads.shape[0] == 3 and int(ranks[0][f"{tag}.iterations"]) == 6
    sim = simulate(presets.make("oktopk", 0.05), grads, shapes=[(int(m),) for m in ranks[0]["layout"]])
    for r in range(P):
        assert ranks[r][f"{tag}.red"].tobytes() == sim.updates[:, r].tobytes(), f"rank {r} differs"
        assert ranks[r][f"{tag}.weights"].tobytes() == ranks[0][f"{tag}.weights"].tobytes()
    # SGD(0.05) applied the 3 reduced sums, not divided (average_aggregated_gradients=False)
    w = ranks[0]["w0"] - np.float32(0.05) * sim.updates[:, 0].sum(axis=0)
    np.testing.assert_allclose(ranks[0][f"{tag}.weights"], w, rtol=1e-5, atol=1e-6)


def test_checkpoint_resume_is_bit_identical_to_an_uninterrupted_run(job):
    P, res = job
    ranks = needs(res, "checkpoint")
    for r in range(P):
        c = ranks[r]
        assert c["resumed"].tobytes() == c["straight"].tobytes(), f"rank {r}: resumed run differs"
        assert c["resumed"].tobytes() == ranks[0]["resumed"].tobytes()
        assert int(c["resumed_iterations"]) == 12
        assert not np.array_equal(c["cold"], c["straight"])      # without SparseState it would differ


def test_checkpoint_of_another_rank_or_preset_is_refused(job):
    P, res = job
    ranks = needs(res, "checkpoint")
    for r in range(P):
        other_rank, other_preset = list(ranks[r]["msgs"])
        assert f"saved by rank {(r + 1) % P} of {P}" in other_rank and f"this is rank {r}" in other_rank
        assert "hvd.rank()" in other_rank
        assert "TopK(density=0.05) + TopkA()" in other_preset and "OkTopk(" in other_preset
