"""The two-level step through TensorFlow's tape (eagerly and inside tf.function) and Keras' `model.fit` on two hosts
of one machine (`horovodrun -np 4 -H localhost:2,127.0.0.1:2`, HOROVOD_DYNAMIC_PROCESS_SETS=1): the simulator's
bits."""

import numpy as np
import pytest

from hvd_sparse.bench import presets
from hvd_sparse.testing import simulate

from horovod_helpers import assert_ranks_equal_simulator, requires_horovod, scenario_job, tf_env

pytestmark = [pytest.mark.horovod, requires_horovod]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    env = tf_env(fusion=False, HOROVOD_DYNAMIC_PROCESS_SETS="1")
    return scenario_job(tmp_path_factory, "tf_two_levels", 4, "tf_worker.py", ["two_levels"], "tf_", timeout=600,
                        env=env, hosts="localhost:2,127.0.0.1:2")["two_levels"]


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("preset", ["topka", "oktopk", "exdyna"])
def test_the_tape_on_two_hosts_equals_the_simulator(job, preset, mode):
    tag = f"{preset}.{mode}"
    grads = np.stack([r[f"{tag}.raw"] for r in job], axis=1)
    sim = simulate(presets.make(preset, 0.05), grads, shapes=[(int(m),) for m in job[0]["layout"]],
                   backend="tensorflow", local_size=2)
    assert_ranks_equal_simulator(job, tag, sim, grads, preset, 2)


@pytest.fixture(scope="module")
def keras_job(tmp_path_factory):
    env = tf_env("keras3", fusion=False, HOROVOD_DYNAMIC_PROCESS_SETS="1")
    return scenario_job(tmp_path_factory, "keras_two_levels", 4, "keras_worker.py", ["two_levels"], "keras_keras3_",
                        timeout=600, env=env, hosts="localhost:2,127.0.0.1:2")["two_levels"]


@pytest.mark.parametrize("preset", ["topka", "oktopk"])
def test_keras_fit_on_two_hosts_equals_the_simulator(keras_job, preset):
    grads = np.stack([r[f"{preset}.raw"] for r in keras_job], axis=1)
    assert grads.shape[0] == 6                                  # one reduction per step: it really ran
    sim = simulate(presets.make(preset, 0.05), grads, shapes=[(int(m),) for m in keras_job[0]["layout"]],
                   backend="tensorflow", local_size=2)
    for r in range(4):
        assert keras_job[r][f"{preset}.weights"].tobytes() == keras_job[0][f"{preset}.weights"].tobytes()
        np.testing.assert_array_equal(keras_job[r][f"{preset}.red"], sim.updates[:, r])
