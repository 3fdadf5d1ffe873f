"""Runs under `horovodrun -np P --gloo` (Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1); each rank writes
<outdir>/keras_<flavour>_<scenario>.rank<r>.npz.

Scenarios:
  fit      model.fit with hvd_sparse.tensorflow.keras.DistributedOptimizer for each preset (and "none"):
           the raw and reduced gradients of every step (recorded around the reduction) and the final weights
  eager    the same for one preset with run_eagerly=True (graph and eager must agree)
  misuse   wrapping twice raises; a preset shared by two models raises
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse.tensorflow as hvd_tf  # noqa: E402
import hvd_sparse.tensorflow.keras as hvds  # noqa: E402
from hvd_sparse.bench.digits import load_data  # noqa: E402
from hvd_sparse.bench.presets import make, names  # noqa: E402

keras = tf.keras
FLAVOUR = "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras3"
STEPS, BATCH, DENSITY = 6, 32, 0.05


def dataset():
    (x, y), _ = load_data(0)
    x = x.numpy().reshape(len(x), -1)[hvd.rank()::hvd.size()][:STEPS * BATCH]
    return x.astype(np.float32), y.numpy()[hvd.rank()::hvd.size()][:STEPS * BATCH]


def model():
    keras.utils.set_random_seed(0)            # same initial weights on every rank
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])


class Recorder:
    def __init__(self, inner):
        self.inner, self.raw, self.red = inner, [], []
        self.compression = inner.compression

    def __call__(self, grads, variables):
        out = self.inner(grads, variables)
        flat = lambda ts: tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in ts], 0)  # noqa: E731

        def record(a, b):
            self.raw.append(a.numpy())
            self.red.append(b.numpy())
            return 0

        with tf.control_dependencies([tf.py_function(record, [flat(grads), flat(out)], tf.int32)]):
            return [tf.identity(t) for t in out]


def fit(compression, run_eagerly=False):
    x, y = dataset()
    m = model()
    opt = hvds.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=compression)
    assert type(opt).__name__ == "SGD" and isinstance(opt, keras.optimizers.SGD)
    rec = opt._hvds_reduce = Recorder(opt._hvds_reduce)
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              run_eagerly=run_eagerly)
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    weights = np.concatenate([w.reshape(-1) for w in m.get_weights()])
    rebuilt = type(opt).from_config(opt.get_config())
    assert type(rebuilt) is type(opt)
    return np.array(rec.raw), np.array(rec.red), weights


def scenario_fit(out):
    res = {}
    wanted = os.environ.get("HVD_SPARSE_TEST_PRESETS")
    for name in ["none"] + (wanted.split(",") if wanted else names()):
        comp = hvds.Compression.none if name == "none" else make(name, DENSITY)
        res[f"{name}.raw"], res[f"{name}.red"], res[f"{name}.weights"] = fit(comp)
    res["layout"] = np.array([int(np.prod(v.shape)) for v in model().trainable_variables])
    np.savez(out, **res)


def scenario_eager(out):
    res = {}
    for eager in (False, True):
        tag = "eager" if eager else "graph"
        res[f"{tag}.raw"], res[f"{tag}.red"], res[f"{tag}.weights"] = fit(make("oktopk", DENSITY), eager)
    np.savez(out, **res)


def scenario_misuse(out):
    msgs = []
    opt = hvds.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=make("topka", 0.1))
    try:
        hvds.DistributedOptimizer(opt, compression=make("topka", 0.1))
    except ValueError as e:
        msgs.append(str(e))
    comp = make("topka", 0.1)
    first = hvds.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=comp)
    try:                                       # one preset, two optimizers
        hvds.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=comp)
    except ValueError as e:
        msgs.append(str(e))
    assert first is not None
    comp = make("topka", 0.1)
    x, y = dataset()
    for width in (16, 24):                     # one preset, two models through the TF tape path: layout check
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width), keras.layers.Dense(10)])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(m(x[:BATCH])))
        try:
            hvd_tf.DistributedGradientTape(tape, compression=comp).gradient(loss, m.trainable_variables)
        except Exception as e:                 # raised inside tf.py_function: surfaces wrapped by TensorFlow
            msgs.append(str(e))
    try:
        hvds.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=make("topka", 0.1), op=hvd.Adasum)
    except NotImplementedError as e:
        msgs.append(str(e))
    # ranks that build different models: a clear error at the first step, on every rank
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8 + hvd.rank()), keras.layers.Dense(10)])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(m(x[:BATCH])))
    try:
        hvd_tf.DistributedGradientTape(tape, compression=make("topka", 0.1)).gradient(loss, m.trainable_variables)
    except Exception as e:
        msgs.append(str(e))
    np.savez(out, msgs=np.array(msgs))


if __name__ == "__main__":
    hvd.init()
    outdir, scenarios = sys.argv[1], sys.argv[2:]
    for name in scenarios:
        globals()[f"scenario_{name}"](f"{outdir}/keras_{FLAVOUR}_{name}.rank{hvd.rank()}.npz")
