"""The Keras optimizer through real `horovodrun` (Gloo) under Keras 3 and under tf_keras (TF_USE_LEGACY_KERAS=1):
model.fit with every preset, checked against the simulator on the gradients recorded around the reduction."""

import numpy as np
import pytest

from hvd_sparse.bench import presets
from hvd_sparse.testing import simulate

from horovod_helpers import horovodrun, load_ranks, requires_horovod

pytestmark = [pytest.mark.horovod, requires_horovod]

FLOAT_ALLREDUCE = {"dense", "exdyna"}
#: (flavour, np, presets): Keras 3 runs every preset at np=2, a subset at np=3; tf_keras a subset at np=2
JOBS = [("keras3", 2, None), ("keras3", 3, "topka,oktopk"), ("tf_keras", 2, "topka,oktopk,exdyna")]


@pytest.fixture(scope="module", params=JOBS, ids=lambda j: f"{j[0]}-np{j[1]}")
def job(request, tmp_path_factory):
    flavour, P, wanted = request.param
    out = tmp_path_factory.mktemp(f"{flavour}_np{P}")
    env = {"HOROVOD_FUSION_THRESHOLD": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
    if wanted:
        env["HVD_SPARSE_TEST_PRESETS"] = wanted
    if flavour == "tf_keras":
        env["TF_USE_LEGACY_KERAS"] = "1"
    horovodrun(P, "keras_worker.py", out, "fit", "eager", "misuse", timeout=900, env=env)
    return P, {s: load_ranks(out, f"keras_{flavour}_{s}", P) for s in ("fit", "eager", "misuse")}


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
        assert "already used by another optimizer" in msgs[1]
        assert "cannot serve two models" in msgs[2]
        assert "Adasum" in msgs[3]
        assert "differ across ranks" in msgs[4] and "rank 1" in msgs[4]
