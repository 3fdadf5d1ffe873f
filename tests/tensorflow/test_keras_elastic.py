"""Elastic Horovod for TensorFlow/Keras: hvd_sparse.tensorflow.keras.elastic.KerasState and
hvd_sparse.tensorflow.elastic.TensorFlowState / run.

In one process (Horovod size 1): commit/restore keep this rank's own sparse state, reset restarts the engine with the
residual kept or dropped, options are validated. Through real elastic `horovodrun` (hosts localhost:2 and
127.0.0.1:1; the 127.0.0.1 worker SIGKILLed at a step), Keras 3 with elastic_residuals="keep" and tf_keras with
"drop": the survivors redo the step at size 2 with fresh engine counters, the residual they resume with is the
committed one or zero, and they end with identical weights."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
pytest.importorskip("horovod.tensorflow")

import hvd_sparse.tensorflow as hvds  # noqa: E402
import hvd_sparse.tensorflow.keras as hvdk  # noqa: E402
from hvd_sparse.tensorflow import elastic as tf_elastic  # noqa: E402
from hvd_sparse.tensorflow.keras import elastic  # noqa: E402

from horovod_helpers import elastic_survivors, requires_horovod  # noqa: E402

keras = tf.keras
pytestmark = pytest.mark.usefixtures("horovod")  # hvd.init() in this process (conftest.py)


def _model_and_optimizer(**kw):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
    comp = kw.pop("compression", None) or hvdk.Compression.topka(0.25)
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=comp, **kw)
    x = np.random.default_rng(0).standard_normal((16, 6)).astype(np.float32)

    @tf.function
    def step(i):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x * tf.cast(i + 1, tf.float32))))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return model, opt, comp, step


def _residual(opt):
    return np.asarray(opt.sparse_state_dict()["units"]["model"]["residual"])


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_keras_state_commit_restore_and_reset_of_the_sparse_state(policy):
    model, opt, comp, step = _model_and_optimizer(elastic_residuals=policy)
    state = elastic.KerasState(model, opt, epoch=0)
    assert len(opt.variables) == 2 + len(model.trainable_variables)     # slots created before the first update
    step(tf.constant(0))
    step(tf.constant(1))
    state.epoch = 2
    state.commit()
    committed_w = [w.copy() for w in model.get_weights()]
    committed_r = _residual(opt)
    committed_it = int(opt.iterations.numpy())
    assert np.abs(committed_r).sum() > 0 and opt._hvds_reduce.states.get("model").steps == 2
    step(tf.constant(2))
    step(tf.constant(3))
    state.epoch = 4
    assert not np.array_equal(_residual(opt), committed_r)
    state.restore()                            # after a failure: everything back to the commit
    assert state.epoch == 2 and int(opt.iterations.numpy()) == committed_it
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), committed_w))
    assert np.array_equal(_residual(opt), committed_r) and opt._hvds_reduce.states.get("model").steps == 2
    state.reset()                              # the reset Horovod runs next: a fresh engine at the next step
    assert opt._hvds_reduce.states.get("model") is None
    r = _residual(opt) if policy == "keep" else opt.sparse_state_dict()["units"].get("model", {}).get("residual")
    if policy == "keep":
        assert np.array_equal(r, committed_r)
        assert opt.residual_norm() == pytest.approx(np.linalg.norm(committed_r.astype(np.float64)), rel=1e-12)
    else:
        assert r is None and opt.residual_norm() == 0.0
    state.sync()                               # size 1: rank 0's values are this rank's
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), committed_w))
    step(tf.constant(2))
    engine = opt._hvds_reduce.states.get("model")
    assert engine.steps == 1                   # counters start afresh
    state.restore()                            # a failure right after: back to the state after the reset
    units = opt.sparse_state_dict()["units"]
    if policy == "keep":
        assert units["model"]["steps"] == 0 and np.array_equal(units["model"]["residual"], committed_r)
    else:
        assert "model" not in units            # nothing to keep: the engine starts afresh at the next step


def test_keras_state_without_sparse_state_and_bad_arguments():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = hvdk.DistributedOptimizer(keras.optimizers.Adam(0.1))                      # dense: variables only
    state = elastic.KerasState(model, opt, step=0)
    w0 = [w.copy() for w in model.get_weights()]
    opt.apply_gradients(zip([tf.ones_like(v) for v in model.trainable_variables], model.trainable_variables))
    assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), w0))
    state.restore()
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), w0)) and int(opt.iterations.numpy()) == 0
    with pytest.raises(ValueError, match="no optimizer"):
        elastic.KerasState(model)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="must be built"):
        elastic.KerasState(unbuilt, keras.optimizers.SGD(0.1))
    for bad in ("keep ", "none", None):
        with pytest.raises(ValueError, match="elastic_residuals must be 'keep' or 'drop'"):
            hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1), elastic_residuals=bad)
        with pytest.raises(ValueError, match="elastic_residuals must be 'keep' or 'drop'"):
            tf_elastic.TensorFlowState([tf.Variable(1.0)], elastic_residuals=bad)
    with pytest.raises(TypeError, match="compression must be a sparse preset"):
        tf_elastic.TensorFlowState([tf.Variable(1.0)], compression=hvds.Compression.none)


def test_tensorflow_state_for_the_tape_path_keeps_the_compression_state():
    v = tf.Variable(np.linspace(-1, 1, 10).astype(np.float32))
    comp = hvds.Compression.topka(0.2)
    state = tf_elastic.TensorFlowState([v, v], compression=comp, step=0)          # duplicates counted once
    assert len(state.variables) == 1

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(v))
        g = hvds.DistributedGradientTape(tape, compression=comp).gradient(loss, [v])[0]
        v.assign_sub(0.1 * g)

    step()
    state.commit()
    saved_v, saved_r = v.numpy().copy(), comp.shared_state().get("model").state_dict()["residual"].copy()
    step()
    state.restore()
    assert np.array_equal(v.numpy(), saved_v)
    assert np.array_equal(comp.shared_state().get("model").state_dict()["residual"], saved_r)
    state.reset()
    shared = comp.shared_state()
    assert shared.get("model") is None and np.array_equal(shared.snapshot()["model"]["residual"], saved_r)
    step()
    assert comp.shared_state().get("model").steps == 1


def test_run_turns_peer_failures_into_horovod_internal_errors_and_reraises_the_rest(monkeypatch):
    """Horovod 0.28.1's horovod.tensorflow.elastic.run returns None for an UnknownError that does not name its
    allreduce/allgather/broadcast ops; ours re-raises it, and treats hvd_sparse's PeerFailureError (raised inside a
    tf.py_function) as a peer failure (restore and reset)."""
    from horovod.common.exceptions import HorovodInternalError

    monkeypatch.setattr(tf_elastic, "run_fn", lambda wrapper, reset: wrapper)   # the function Horovod would loop on

    def raising(error):
        def train(state):
            raise error
        return tf_elastic.run(train)

    peer = tf.errors.UnknownError(None, None, "PeerFailureError: hvd_sparse: collective 'hvd_sparse.model.indices' "
                                  "failed on rank 0: Horovod shut down ... HorovodAlltoall")
    with pytest.raises(HorovodInternalError):
        raising(peer)(None)
    with pytest.raises(tf.errors.UnknownError, match="diverged"):
        raising(tf.errors.UnknownError(None, None, "ReplicaDivergenceError: the replicas diverged"))(None)
    with pytest.raises(ValueError, match="plain"):
        raising(ValueError("plain"))(None)
    assert tf_elastic.run(lambda state: 42)(None) == 42


# -- through elastic horovodrun -----------------------------------------------------------------------------
ELASTIC_JOBS = [("keras3", "keep"), ("tf_keras", "drop")]


@requires_horovod
@pytest.mark.horovod
@pytest.mark.parametrize("flavour,policy", ELASTIC_JOBS, ids=[f"{f}-{p}" for f, p in ELASTIC_JOBS])
def test_elastic_keras_run_survives_a_killed_worker_and_resets_sparse_state(tmp_path, flavour, policy):
    # Gloo's default 30 s timeout is how long a survivor not directly connected to the dead worker waits: 10 s here
    survivors = elastic_survivors(tmp_path, "keras_elastic_worker.py", tmp_path, policy,
                                  env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "10", "TF_CPP_MIN_LOG_LEVEL": "3",
                                       "TF_USE_LEGACY_KERAS": "1" if flavour == "tf_keras" else "0"})
    assert len(survivors) == 2                                  # the worker on 127.0.0.1 died at step 4
    for s in survivors:
        steps, sizes, engine_steps, norms = s["records"].T
        assert steps.tolist() == list(range(8))                 # step 4 (uncommitted when the worker died) redone
        assert sizes.tolist() == [3] * 4 + [2] * 4
        # partitions, thresholds and counters start afresh after the reset: the engine counts again from 1
        assert engine_steps.tolist() == [1, 2, 3, 4] + [1, 2, 3, 4]
        (s0, size0, r0), (s1, size1, r1) = s["starts"].tolist()
        assert (s0, size0, r0) == (0, 3, 0.0) and (s1, size1) == (4, 2)
        # the residual resumed with: this process's residual at the last commit (after step 3), or zero
        assert norms[3] > 0 and np.abs(s["committed_before_kill"]).sum() > 0
        if policy == "keep":
            assert s["resumed"].tobytes() == s["committed_before_kill"].tobytes()
            assert r1 == norms[3]
        else:
            assert s["resumed"].size == 0 and r1 == 0.0
        assert int(s["iterations"]) == 8                        # optimizer variables restored to the commit
        assert int(s["guard_steps"]) == 4                       # the consistency guard ran after the reset too
        # the failure reached the loop as a TF error naming hvd_sparse's PeerFailureError (run() recovered)
        assert len(s["errors"]) == 1 and "PeerFailureError" in str(s["errors"][0])
    assert survivors[0]["weights"].tobytes() == survivors[1]["weights"].tobytes()
    assert survivors[0]["records"][:, 3].tolist() != survivors[1]["records"][:, 3].tolist()   # per-rank residuals
