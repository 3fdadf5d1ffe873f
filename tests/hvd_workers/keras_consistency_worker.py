"""Runs under `horovodrun -np 2 --gloo` (Keras 3): the consistency guard of hvd_sparse's Keras DistributedOptimizer
and hvd_sparse.tensorflow.check_consistency. Each rank writes <outdir>/consistency.rank<r>.npz.

Scenarios, in one job:
  pass     model.fit (graph), topka, consistency_check_every=1: identical replicas pass every check
  fit      model.fit (graph), topka, consistency_check_every=2; rank 1 nudges one kernel entry after step 3
           (a callback): the check after step 4 fails on both ranks (inside the train function: UnknownError)
  eager    the same with run_eagerly=True and Compression.none: ReplicaDivergenceError itself
  tape     hvd_sparse.tensorflow.check_consistency(variables): eagerly and inside a tf.function, then with one
           variable nudged on rank 1
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse  # noqa: E402
import hvd_sparse.tensorflow as hvds  # noqa: E402
import hvd_sparse.tensorflow.keras as hvdk  # noqa: E402

keras = tf.keras
STEPS, BATCH = 6, 8


def data():
    rng = np.random.default_rng(hvd.rank())
    return rng.standard_normal((STEPS * BATCH, 10)).astype(np.float32), rng.integers(0, 3, STEPS * BATCH)


def build(compression, every, run_eagerly=False):
    keras.utils.set_random_seed(0)                      # same initial weights on every rank
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=compression,
                                    consistency_check_every=every)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=run_eagerly)
    return model, opt


class Nudge(keras.callbacks.Callback):
    """Rank 1 changes one entry of the last layer's kernel after batch ``at`` (0-based)."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at and hvd.rank() == 1:
            kernel = self.model.layers[-1].kernel
            kernel.assign(kernel + tf.scatter_nd([[1, 2]], [1e-3], kernel.shape))


def fit(model, nudge_at=None):
    x, y = data()
    callbacks = [Nudge(nudge_at)] if nudge_at is not None else []
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    except Exception as e:             # noqa: BLE001 - recorded and asserted by the test
        return f"{type(e).__name__}: {e}"
    return ""


def main(outdir):
    hvd.init()
    out = {}
    model, opt = build(hvdk.Compression.topka(0.2), every=1)
    out["pass_msg"] = fit(model)
    out["pass_checks"] = opt._hvds_guard.steps
    opt.check_consistency()                             # on demand, eagerly: passes

    model, opt = build(hvdk.Compression.topka(0.2), every=2)
    out["fit_msg"] = fit(model, nudge_at=2)
    out["fit_name"] = model.layers[-1].kernel.path
    out["fit_steps"] = int(opt.iterations.numpy())

    model, opt = build(hvdk.Compression.none, every=2, run_eagerly=True)
    out["eager_msg"] = fit(model, nudge_at=2)
    out["eager_name"] = model.layers[-1].kernel.path

    model, _ = build(hvdk.Compression.topka(0.2), every=0)
    variables = model.trainable_variables
    hvds.check_consistency(variables)                   # identical: passes eagerly ...
    graph_check = tf.function(lambda: hvds.check_consistency(variables, name="hvd_sparse.test.graph", step=7))
    graph_check()                                       # ... and in a tf.function
    if hvd.rank() == 1:
        variables[0].assign_add(tf.ones_like(variables[0]) * 1e-6)
    try:
        hvds.check_consistency(variables, step=3)
        out["tape_msg"] = ""
    except hvd_sparse.ReplicaDivergenceError as e:
        out["tape_msg"] = f"{type(e).__name__}: {e}"
    try:
        graph_check()
        out["tape_graph_msg"] = ""
    except tf.errors.OpError as e:
        out["tape_graph_msg"] = f"{type(e).__name__}: {e}"
    out["tape_name"] = variables[0].path
    np.savez(os.path.join(outdir, f"consistency.rank{hvd.rank()}.npz"), **{k: np.array(v) for k, v in out.items()})


if __name__ == "__main__":
    main(sys.argv[1])
