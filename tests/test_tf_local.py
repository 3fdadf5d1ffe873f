"""TensorFlow/Keras adapter in one process (Horovod size 1): argument handling and the size-1 semantics
(sparsification and error feedback run at P = 1 too, with no collective)."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
hvd = pytest.importorskip("horovod.tensorflow")

import hvd_sparse.tensorflow as hvds  # noqa: E402
import hvd_sparse.tensorflow.keras as hvdk  # noqa: E402
from hvd_sparse.testing import simulate  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield


def test_distributed_optimizer_forwards_keras_optimizers_and_rejects_v1():
    opt = hvds.DistributedOptimizer(tf.keras.optimizers.Adam(0.01), compression=hvds.Compression.oktopk(0.01))
    assert type(opt).__name__ == "Adam" and isinstance(opt, tf.keras.optimizers.Adam)
    assert opt.sparse_stats() == {} and opt.residual_norm() == 0.0
    assert type(type(opt).from_config(opt.get_config())) is type(opt)
    with pytest.raises(NotImplementedError, match="tf.compat.v1"):
        hvds.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(ValueError, match="already a distributed optimizer"):
        hvdk.DistributedOptimizer(opt)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), backward_passes_per_step=2)


def test_single_process_fit_sparsifies_with_error_feedback_like_the_simulator():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((5,)), tf.keras.layers.Dense(3)])
    comp = hvdk.Compression.topka(0.2)
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.0), compression=comp)   # lr 0: fixed weights
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    y = np.zeros((4, 3), np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    g = np.concatenate([t.numpy().reshape(-1) for t in tape.gradient(loss, model.trainable_variables)])
    model.fit(x, y, batch_size=4, epochs=3, verbose=0)             # the same gradient three times
    stats = opt.sparse_stats()
    assert stats["selected"] == stats["k"] == 3 and stats["collectives"] == 0
    sim = simulate(hvdk.Compression.topka(0.2), np.stack([g[None]] * 3), shapes=[(15,), (3,)])
    np.testing.assert_allclose(opt.residual_norm(), np.linalg.norm(sim.residuals[-1, 0]), rtol=1e-5)
