"""Runs under `horovodrun -np P --gloo` (Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1); each rank writes
<outdir>/keras_<flavour>_<scenario>.rank<r>.npz.

Scenarios:
  fit      model.fit with hvd_sparse.tensorflow.keras.DistributedOptimizer for each preset (and "none"):
           the raw and reduced gradients of every step (recorded around the reduction) and the final weights
  eager    the same for one preset with run_eagerly=True (graph and eager must agree)
  misuse   wrapping twice raises; a preset shared by two models through the tape raises
  bpps     backward_passes_per_step=2: Compression.none (averaged) next to a bpps=1 run on double batches, and
           a sparse preset (summed), with what reached the reduction and the final weights
  two_levels  (two hosts: -H localhost:2,127.0.0.1:2) model.fit with TopkA and Ok-Topk at hierarchical=True
  checkpoint  oktopk: 12 uninterrupted steps vs 6 steps -> tf.train.Checkpoint with SparseState (one file per
           rank) -> a rebuilt model/optimizer/preset restored -> 6 more; a cold restart (no SparseState); the
           errors of restoring the other rank's file and of restoring into another preset
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse.tensorflow as hvd_tf  # noqa: E402
import hvd_sparse.tensorflow.keras as hvds  # noqa: E402
from hvd_sparse.bench.presets import make, names  # noqa: E402

from worker_helpers import KERAS_FLAVOUR as FLAVOUR  # noqa: E402
from worker_helpers import keras_digits, keras_mlp, keras_weights, run_scenarios  # noqa: E402

keras = tf.keras
STEPS, BATCH, DENSITY = 6, 32, 0.05


class Recorder:
    def __init__(self, inner):
        self.inner, self.raw, self.red = inner, [], []
        self.compression = inner.compression

    def __getattr__(self, name):               # densify, process_set, ...: the wrapped reduction's
        return getattr(self.inner, name)

    def __call__(self, grads, variables):
        return self.reduce_flagged(grads, variables)[0]

    def reduce_flagged(self, grads, variables):     # the optimizers' entry point: (grads, non-finite skip flag)
        out, skipped = self.inner.reduce_flagged(grads, variables)
        flat = lambda ts: tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in ts], 0)  # noqa: E731

        def record(a, b):
            self.raw.append(a.numpy())
            self.red.append(b.numpy())
            return 0

        with tf.control_dependencies([tf.py_function(record, [flat(grads), flat(out)], tf.int32)]):
            return [tf.identity(t) for t in out], skipped


def fit(compression, run_eagerly=False, batch=BATCH, info=None, **kwargs):
    x, y = keras_digits(hvd, STEPS * BATCH)
    m = keras_mlp()
    opt = hvds.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=compression, **kwargs)
    assert type(opt).__name__ == "SGD" and isinstance(opt, keras.optimizers.SGD)
    rec = opt._hvds_reduce = Recorder(opt._hvds_reduce)
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              run_eagerly=run_eagerly)
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    rebuilt = type(opt).from_config(opt.get_config())
    assert type(rebuilt) is type(opt)
    if info is not None:
        info["iterations"] = int(opt.iterations.numpy())
        info["w0"] = keras_weights(keras_mlp())
    return np.array(rec.raw), np.array(rec.red), keras_weights(m)


def scenario_fit(out):
    res = {}
    wanted = os.environ.get("HVD_SPARSE_TEST_PRESETS")
    for name in ["none"] + (wanted.split(",") if wanted else names()):
        comp = hvds.Compression.none if name == "none" else make(name, DENSITY)
        res[f"{name}.raw"], res[f"{name}.red"], res[f"{name}.weights"] = fit(comp)
    res["layout"] = np.array([int(np.prod(v.shape)) for v in keras_mlp().trainable_variables])
    np.savez(out, **res)


def scenario_two_levels(out):
    res = {}
    for name in ("topka", "oktopk"):
        res[f"{name}.raw"], res[f"{name}.red"], res[f"{name}.weights"] = fit(make(name, DENSITY, hierarchical=True))
    res["layout"] = np.array([int(np.prod(v.shape)) for v in keras_mlp().trainable_variables])
    np.savez(out, **res)


def scenario_eager(out):
    res = {}
    for eager in (False, True):
        tag = "eager" if eager else "graph"
        res[f"{tag}.raw"], res[f"{tag}.red"], res[f"{tag}.weights"] = fit(make("oktopk", DENSITY), eager)
    np.savez(out, **res)


def scenario_bpps(out):
    res = {}
    info = {}
    # Compression.none, 2 passes per step, averaged: the reduction sees the sum of 2 batch gradients
    res["none2.raw"], res["none2.red"], res["none2.weights"] = fit(
        hvds.Compression.none, backward_passes_per_step=2, average_aggregated_gradients=True, info=info)
    res["none2.iterations"], res["w0"] = info["iterations"], info["w0"]
    # the reference: 1 pass per step on batches twice as large (the mean over 64 = the mean of two means of 32)
    res["none1.raw"], res["none1.red"], res["none1.weights"] = fit(hvds.Compression.none, batch=2 * BATCH, info=info)
    res["none1.iterations"] = info["iterations"]
    # a sparse preset, 2 passes per step, summed (average_aggregated_gradients=False, Horovod's default); the
    # eager tf.cond is tested in one process (tests/tensorflow/test_tf_local.py)
    res["sparse2.raw"], res["sparse2.red"], res["sparse2.weights"] = fit(
        make("oktopk", DENSITY), backward_passes_per_step=2, info=info)
    res["sparse2.iterations"] = info["iterations"]
    res["layout"] = np.array([int(np.prod(v.shape)) for v in keras_mlp().trainable_variables])
    np.savez(out, **res)


def scenario_checkpoint(out):
    outdir = os.path.dirname(out)
    x, y = keras_digits(hvd, 12 * BATCH)
    half = 6 * BATCH
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build(seed, compression=None):
        keras.utils.set_random_seed(seed)
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
        comp = compression or hvds.Compression.oktopk(DENSITY, threshold_period=3)
        opt = hvds.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression=comp)
        m.compile(optimizer=opt, loss=loss)
        opt.build(m.trainable_variables)       # slots exist before a restore (assert_consumed)
        return m, opt

    def ckpt(m, opt):
        return tf.train.Checkpoint(model=m, optimizer=opt, sparse=hvd_tf.SparseState(opt))

    res = {}
    m, opt = build(0)                                     # 12 uninterrupted steps
    m.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    res["straight"] = keras_weights(m)
    m, opt = build(0)                                     # 6 steps, then a checkpoint per rank
    m.fit(x[:half], y[:half], batch_size=BATCH, shuffle=False, verbose=0)
    path = ckpt(m, opt).write(f"{outdir}/ckpt_rank{hvd.rank()}")
    hvd.allreduce(tf.constant(0), name="barrier.written")    # every rank's file exists
    m, opt = build(1)                                     # rebuilt from scratch (other initial weights)
    ckpt(m, opt).read(path).assert_consumed()
    m.fit(x[half:], y[half:], batch_size=BATCH, shuffle=False, verbose=0)
    res["resumed"] = keras_weights(m)
    res["resumed_iterations"] = int(opt.iterations.numpy())
    m, opt = build(1)                                     # cold restart: model and optimizer only
    tf.train.Checkpoint(model=m, optimizer=opt).read(path).expect_partial()
    m.fit(x[half:], y[half:], batch_size=BATCH, shuffle=False, verbose=0)
    res["cold"] = keras_weights(m)
    msgs = []
    other = f"{outdir}/ckpt_rank{(hvd.rank() + 1) % hvd.size()}"
    for comp in (None, hvds.Compression.topka(DENSITY)):   # the other rank's file; another preset
        m, opt = build(1, comp)
        try:
            ckpt(m, opt).read(other if comp is None else path)
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    res["msgs"] = np.array(msgs)
    np.savez(out, **res)


def scenario_misuse(out):
    msgs = []
    opt = hvds.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=make("topka", 0.1))
    try:
        hvds.DistributedOptimizer(opt, compression=make("topka", 0.1))
    except ValueError as e:
        msgs.append(str(e))
    comp = make("topka", 0.1)
    x, y = keras_digits(hvd, STEPS * BATCH)
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
    run_scenarios(hvd, f"keras_{FLAVOUR}_", globals())
