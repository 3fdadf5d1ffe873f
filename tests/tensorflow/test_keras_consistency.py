"""The consistency guard for TensorFlow/Keras: ``consistency_check_every=N`` and ``check_consistency()`` of
hvd_sparse's Keras DistributedOptimizer, and ``hvd_sparse.tensorflow.check_consistency`` for the tape path. Argument
checks in one process; identical replicas pass and one nudged weight raises on both ranks, naming it, through
`horovodrun -np 2` (model.fit in graph mode and eagerly, the tape-path function eagerly and in a tf.function)."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
pytest.importorskip("horovod.tensorflow")

import hvd_sparse.tensorflow as hvds  # noqa: E402
import hvd_sparse.tensorflow.keras as hvdk  # noqa: E402
from hvd_sparse.core.errors import checksums  # noqa: E402

from horovod_helpers import requires_horovod, scenario_job, tf_env  # noqa: E402

keras = tf.keras
pytestmark = pytest.mark.usefixtures("horovod")  # hvd.init() in this process (conftest.py)


def test_consistency_check_every_is_validated_and_off_by_default():
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="consistency_check_every must be an integer >= 0"):
            hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), consistency_check_every=bad)
        with pytest.raises(ValueError, match="consistency_check_every"):
            hvds.DistributedOptimizer(keras.optimizers.SGD(0.1), consistency_check_every=bad)
    assert hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1))._hvds_guard.every == 0
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvdk.Compression.topka(0.5))
    with pytest.raises(ValueError, match="pass variables=model.trainable_variables"):
        opt.check_consistency()                 # no update yet: it does not know the variables


def test_guard_counts_applied_updates_in_a_tf_function_at_size_1():
    """P = 1: no collective, but the count runs in the traced update (every applied call, in graph mode)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvdk.Compression.topka(0.5),
                                    consistency_check_every=2)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((12, 3), np.float32), np.zeros((12, 2), np.float32), batch_size=4, epochs=1, verbose=0)
    assert opt._hvds_guard.steps == 3
    opt.check_consistency()
    assert hvds.check_consistency(model.trainable_variables) is None


def test_checksums_see_one_bit_and_swapped_words():
    a = np.arange(6, dtype=np.float32)
    b = a.copy()
    b.view(np.int32)[3] ^= 1                    # one bit
    c = a[[1, 0, 2, 3, 4, 5]]                   # two words swapped
    assert checksums(a) == checksums(a.copy())
    assert checksums(a)[0] != checksums(b)[0]
    assert checksums(a)[0] == checksums(c)[0] and checksums(a)[1] != checksums(c)[1]
    assert checksums(np.zeros(3, np.float64)) == [0, 0] and len(checksums(np.ones(2, np.float16))) == 2


def test_checksums_of_raw_bytes_are_those_of_the_words():
    """The torch optimizer hands its parameters' raw bytes (bfloat16 has no numpy dtype): the same checksums."""
    a = np.random.default_rng(0).standard_normal(7).astype(np.float32)
    assert checksums(a.view(np.uint8), itemsize=4) == checksums(a)
    h = a.astype(np.float16)
    assert checksums(h.view(np.uint8), itemsize=2) == checksums(h) != checksums(a)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return scenario_job(tmp_path_factory, "keras_consistency", 2, "keras_consistency_worker.py", ["consistency"],
                        args=(), env=tf_env())["consistency"]


@requires_horovod
@pytest.mark.horovod
def test_identical_replicas_pass_every_check(job):
    for r in job:
        assert str(r["pass_msg"]) == ""
        assert int(r["pass_checks"]) == 6       # checked after each of the 6 updates of model.fit


@requires_horovod
@pytest.mark.horovod
@pytest.mark.parametrize("mode", ["fit", "eager"])
def test_one_nudged_weight_raises_on_both_ranks_naming_it(job, mode):
    """Rank 1 nudges the last kernel after step 3; with consistency_check_every=2 the check after step 4 fails on
    both ranks. model.fit in graph mode: the py_function's error (UnknownError) carries the message; run_eagerly:
    ReplicaDivergenceError itself."""
    for r in job:
        msg, name = str(r[f"{mode}_msg"]), str(r[f"{mode}_name"])
        assert f"after step 4 parameter '{name}' differs on rank 1 from rank 0 (1 of 4 parameters differ)" in msg
        assert name.endswith("kernel")
        assert msg.startswith("ReplicaDivergenceError" if mode == "eager" else "UnknownError")
        assert "ReplicaDivergenceError" in msg
    assert int(job[0]["fit_steps"]) == 4        # the check ran after the 4th update, not before it


@requires_horovod
@pytest.mark.horovod
def test_tape_path_function_eager_and_in_tf_function(job):
    for r in job:
        name = str(r["tape_name"])
        assert str(r["tape_msg"]).startswith("ReplicaDivergenceError")
        assert f"after step 3 parameter '{name}' differs on rank 1" in str(r["tape_msg"])
        assert f"after step 7 parameter '{name}' differs on rank 1" in str(r["tape_graph_msg"])


def test_log_stats_every_logs_the_averaged_statistics_in_model_fit(caplog):
    """P = 1: every second applied update of model.fit logs one line on the logger ``hvd_sparse``; refused with a
    dense compression, naming the option."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=hvdk.Compression.topka(0.5),
                                    log_stats_every=2)
    model.compile(optimizer=opt, loss="mse")
    with caplog.at_level("INFO", logger="hvd_sparse"):
        model.fit(np.ones((20, 3), np.float32), np.zeros((20, 2), np.float32), batch_size=4, epochs=1, verbose=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "hvd_sparse"]
    assert [line.split(":")[0] for line in lines] == ["hvd_sparse step 2", "hvd_sparse step 4"]
    assert all("density 0.5000," in line for line in lines)          # k = 4 of 8 on one rank
    with pytest.raises(ValueError, match="log_stats_every"):
        hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), log_stats_every=2)


def test_a_tapes_statistics_are_read_from_its_preset():
    compression = hvds.Compression.topka(0.5)
    assert compression.sparse_stats() == {}
    x = tf.Variable(tf.ones(8))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x * tf.range(8, dtype=tf.float32))
    tape = hvds.DistributedGradientTape(tape, compression=compression)
    tape.gradient(loss, [x])
    stats = compression.sparse_stats()
    assert stats["n"] == 8 and stats["k"] == 4 and stats["density"] == 0.5
