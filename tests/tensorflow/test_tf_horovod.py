"""The TensorFlow adapter (DistributedGradientTape, sparse_allreduce) through real `horovodrun` (Gloo),
eagerly and inside tf.function, checked against the simulator. The engine runs on TensorFlow tensors in the TF
path; the numpy simulator is its oracle because the TensorFlow engine equals the numpy one bit for bit
(tests/core/test_tf_backend.py). np=2 runs every preset; np=3 a subset, to keep CI time reasonable."""

import numpy as np
import pytest

from hvd_sparse.bench import presets
from hvd_sparse.testing import simulate

from horovod_helpers import assert_ranks_equal_simulator, requires_horovod, scenario_job, tf_env

pytestmark = [pytest.mark.horovod, requires_horovod]

NP3_PRESETS = ["topka", "oktopk", "exdyna"]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"np{p}")
def job(request, tmp_path_factory):
    P = request.param
    env = tf_env(fusion=False, **({"HVD_SPARSE_TEST_PRESETS": ",".join(NP3_PRESETS)} if P == 3 else {}))
    return P, scenario_job(tmp_path_factory, f"tf_np{P}", P, "tf_worker.py", ("tape", "none", "op"), "tf_", timeout=900,
                           env=env)


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("preset", presets.names())
def test_tape_equals_simulator_eager_and_in_tf_function(job, preset, mode):
    P, res = job
    ranks = res["tape"]
    tag = f"{preset}.{mode}"
    if f"{tag}.raw" not in ranks[0]:
        pytest.skip(f"{preset} runs at np=2 only")
    grads = np.stack([r[f"{tag}.raw"] for r in ranks], axis=1)
    sim = simulate(presets.make(preset, 0.05), grads, shapes=[(int(m),) for m in ranks[0]["layout"]])
    assert_ranks_equal_simulator(ranks, tag, sim, grads, preset, P)


def test_graph_and_eager_agree(job):
    """TF's graph and eager kernels may round the *raw* gradients differently (seen: an ulp), so the two
    modes are compared on step 0, where both start from the same weights: raw gradients within rounding,
    and the reduced gradients to rounding as well (the exchange itself is exact, see the simulator test)."""
    P, res = job
    checked = 0
    for key in res["tape"][0]:
        if key.endswith(".eager.red"):
            graph = key.replace(".eager.", ".graph.")
            raw_e, raw_g = res["tape"][0][key.replace(".red", ".raw")], res["tape"][0][graph.replace(".red", ".raw")]
            np.testing.assert_allclose(raw_e[0], raw_g[0], rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(res["tape"][0][key][0], res["tape"][0][graph][0], rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked >= len(NP3_PRESETS)


def test_none_is_horovods_own_tape(job):
    P, res = job
    for r in range(P):
        assert res["none"][r]["hvd_sparse"].tobytes() == res["none"][r]["horovod"].tobytes()


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_sparse_allreduce_op_equals_simulator(job, mode):
    P, res = job
    ranks = res["op"]
    import hvd_sparse

    grads = np.stack([r[f"{mode}.ins"] for r in ranks], axis=1)
    sim = simulate(hvd_sparse.Compression.topka(0.1), grads)
    for r in range(P):
        assert ranks[r][f"{mode}.outs"].tobytes() == sim.updates[:, r].tobytes()


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_oktopk_op_on_a_moving_load_equals_simulator(job, mode):
    """Ok-Topk's default on a load that moves every step (k = 6 < 8P²: its regions follow the load the owners
    report): the regions move after the first step, and every rank gets the simulator's bits."""
    P, res = job
    ranks = res["op"]
    import hvd_sparse

    grads = np.stack([r[f"{mode}.oktopk.ins"] for r in ranks], axis=1)
    sim = simulate(hvd_sparse.Compression.oktopk(0.1), grads, record=("updates", "phases", "info"))
    assert {p for t in range(4) for p in sim.phases[t][0]["calls"]} == \
        {"agree", "boundaries", "split", "gather.head", "gather.indices", "gather.values"}
    assert any(sim.info[t][0]["offsets"] != sim.info[0][0]["offsets"] for t in range(1, 4))
    for r in range(P):
        assert ranks[r][f"{mode}.oktopk.outs"].tobytes() == sim.updates[:, r].tobytes()
