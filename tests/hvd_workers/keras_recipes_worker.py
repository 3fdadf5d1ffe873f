"""Runs under `horovodrun -np 2 --gloo` (Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1): what real training
scripts and Horovod's own Keras test suite do with the optimizer. ``keras_recipes_worker.py OUTDIR SCENARIO...``;
for each scenario each rank writes <outdir>/recipes_<flavour>_<scenario>.rank<r>.npz (an exception is recorded
as ``error``, not raised, so that the test sees what every rank said).

Scenarios:
  loss_scale   mixed_float16: model.fit with hvd_sparse's optimizer (Keras wraps it in a LossScaleOptimizer), and
               an explicit LossScaleOptimizer(DistributedOptimizer(...)), also with backward_passes_per_step=2;
               rank 1 alone overflows at step 3: the weights, the loss scale and the iteration count of each run
  jit          model.compile(jit_compile=True) + fit, and a tape step in tf.function(jit_compile=True): the errors
  subclass     class MySGD(tf.keras.optimizers.SGD) (defined here, in __main__) with backward_passes_per_step=2 and
               a sparse preset on per-rank data: the weights, the number of exchanges and the iterations
  from_config  Horovod's test_from_config (configs equal) and a copy rebuilt by type(opt).from_config trained with
               model.fit on per-rank data: the weights
  local_vars   Horovod's test_gradient_aggregation_with_local_vars (register_local_var; backward_passes_per_step
               4, averaged or summed) with SGD(learning_rate=-1) in place of its assign_add optimizer, dense and
               sparse, plus backward_passes_per_step=1: the variables after every call
  schedule     Horovod's test_train_model_lr_schedule: warmup + three LearningRateScheduleCallback s with Adam:
               the learning rate at each epoch end and History's loss
  disagree     ranks that disagree on the compression: model.fit with another density or another preset on rank 1,
               and a DistributedGradientTape step (eager and in a tf.function) with another preset or other Ok-Topk
               periods on rank 1: the error each rank got and when
  stats        sparse_stats(average=True) and skipped_steps() after three sparse steps, as torch's optimizer has
  refused      a preset's factory not called (the optimizer's, the tape's and sparse_allreduce's compression=), and
               momentum_correction beside SGD's momentum, options of the sparse path with Compression.none or
               fp16: the error each rank got at construction
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse.tensorflow as hvd_tf  # noqa: E402
import hvd_sparse.tensorflow.keras as hvds  # noqa: E402

from worker_helpers import KERAS_FLAVOUR as FLAVOUR  # noqa: E402
from worker_helpers import keras_digits, keras_mlp, keras_weights, run_scenarios  # noqa: E402

keras = tf.keras
BATCH = 16


def fit(m, opt, x, y, **compile_kwargs):
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kwargs)
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return m


def scenario_loss_scale(res):
    steps = 6
    x, y = keras_digits(hvd, steps * BATCH)
    if hvd.rank() == 1:
        x[3 * BATCH] = 6e4                  # step 3: float16 activations overflow on this rank only
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        runs = [(name, comp, how, 1) for name, comp in (("topka", lambda: hvds.Compression.topka(0.1)),
                                                         ("none", lambda: hvds.Compression.none))
                for how in ("auto", "explicit")]
        runs += [("topka", lambda: hvds.Compression.topka(0.1), how, 2) for how in ("auto", "explicit")]
        for name, comp, how, passes in runs:
            opt = hvds.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=comp(),
                                            backward_passes_per_step=passes)
            if how == "explicit":
                opt = keras.mixed_precision.LossScaleOptimizer(opt)
            m = fit(keras_mlp(), opt, x, y)
            lso = m.optimizer
            scale = getattr(lso, "dynamic_scale", None)
            scale = lso.loss_scale if scale is None else scale
            key = f"{name}.{how}" + (f".passes{passes}" if passes > 1 else "")
            res[f"{key}.weights"] = keras_weights(m)
            res[f"{key}.moved"] = bool((res[f"{key}.weights"] != keras_weights(keras_mlp())).any())
            res[f"{key}.scale"] = float(np.asarray(scale))
            res[f"{key}.iterations"] = int(lso.iterations.numpy())
            res[f"{key}.lso"] = type(lso).__name__
    finally:
        keras.mixed_precision.set_global_policy("float32")
    try:                                    # the other way round is refused with the recipe
        hvds.DistributedOptimizer(keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.05)))
        res["wrapped_error"] = ""
    except ValueError as e:
        res["wrapped_error"] = str(e)


def scenario_jit(res):
    x, y = keras_digits(hvd, 2 * BATCH)
    try:
        fit(keras_mlp(), hvds.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=hvds.Compression.topka(0.1)),
            x, y, jit_compile=True)
        res["fit_error"] = ""
    except Exception as e:     # noqa: BLE001 - recorded for the test
        res["fit_error"] = f"{type(e).__name__}: {e}"
    m = keras_mlp()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, m(xb))
        tape = hvd_tf.DistributedGradientTape(tape, compression=hvd_tf.Compression.topka(0.1))
        return tape.gradient(loss, m.trainable_variables)

    try:
        step(x[:BATCH], y[:BATCH])
        res["tape_error"] = ""
    except Exception as e:     # noqa: BLE001
        res["tape_error"] = f"{type(e).__name__}: {e}"


class MySGD(keras.optimizers.SGD):
    """A user's optimizer subclass, defined in the training script (``__main__``)."""


def scenario_subclass(res):
    x, y = keras_digits(hvd, 6 * BATCH)
    opt = hvds.DistributedOptimizer(MySGD(0.05), compression=hvds.Compression.topka(0.1), backward_passes_per_step=2)
    m = fit(keras_mlp(), opt, x, y)
    res["weights"] = keras_weights(m)
    res["iterations"] = int(opt.iterations.numpy())
    engine = opt._hvds_reduce.states.get("model")
    res["exchanges"] = engine.steps if engine else 0


def scenario_from_config(res):
    hopt = hvds.DistributedOptimizer(keras.optimizers.Adam(), compression=hvds.Compression.topka(0.1))
    cfg = hopt.get_config()
    res["config_equal"] = hopt.from_config(cfg).get_config() == cfg and \
        hopt.__class__.from_config(cfg).get_config() == cfg
    x, y = keras_digits(hvd, 4 * BATCH)
    copy = type(hopt).from_config(cfg)
    m = fit(keras_mlp(), copy, x, y)
    res["weights"] = keras_weights(m)
    res["separate_state"] = copy._hvds_reduce.states is not hopt._hvds_reduce.states


def local_vars_run(compression, passes, average):
    """Horovod's test_gradient_aggregation_with_local_vars; returns x, y after each of 10 calls and the iterations."""
    opt = hvds.DistributedOptimizer(keras.optimizers.SGD(learning_rate=-1.0), compression=compression,
                                    backward_passes_per_step=passes, average_aggregated_gradients=average,
                                    sparse_as_dense=True)
    xs = [tf.Variable([0.0]) for _ in range(8)]
    ys = [tf.Variable([1.0, 2.0]) for _ in range(8)]
    for i in range(4):
        opt.register_local_var(xs[i])
        opt.register_local_var(ys[i])
    variables = xs + ys

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum([x - float(hvd.rank() + 1) * tf.gather(yv, [0]) for x, yv in zip(xs, ys)])
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))

    x_hist, y_hist, iters = [], [], []
    for _ in range(10):
        step()
        x_hist.append(np.array([v.numpy() for v in xs]))
        y_hist.append(np.array([v.numpy() for v in ys]))
        iters.append(int(opt.iterations.numpy()))
    return np.array(x_hist), np.array(y_hist), np.array(iters)


def scenario_local_vars(res):
    runs = {"dense": lambda: hvds.Compression.none, "sparse": lambda: hvds.Compression.topka(1.0)}
    for name, comp in runs.items():
        for passes, average in ((4, True), (4, False), (1, False)):
            key = f"{name}.{passes}.{int(average)}"
            res[f"{key}.x"], res[f"{key}.y"], res[f"{key}.iterations"] = local_vars_run(comp(), passes, average)


def scenario_schedule(res):
    initial_lr = 0.1 * hvd.size()
    opt = hvds.DistributedOptimizer(keras.optimizers.Adam(initial_lr), compression=hvds.Compression.topka(0.5))
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.RepeatVector(3)])
    model.compile(loss="mse", optimizer=opt)
    rng = np.random.default_rng(hvd.rank())
    x, y = rng.random((10, 3)).astype(np.float32), rng.random((10, 3, 2)).astype(np.float32)
    lrs = []

    class StoreLearningRate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    cb = hvds.callbacks
    callbacks = [cb.BroadcastGlobalVariablesCallback(0), cb.MetricAverageCallback(),
                 cb.LearningRateWarmupCallback(initial_lr=initial_lr, warmup_epochs=5),
                 cb.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-1, start_epoch=5, end_epoch=10),
                 cb.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-2, start_epoch=10,
                                                 end_epoch=15),
                 cb.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=lambda epoch: epoch,
                                                 start_epoch=15, end_epoch=20),
                 StoreLearningRate()]
    history = model.fit(x, y, steps_per_epoch=5, batch_size=2, callbacks=callbacks, epochs=20, verbose=0)
    res["lr"] = np.array(lrs)
    res["initial_lr"] = initial_lr
    res["loss"] = np.array(history.history["loss"])
    res["weights"] = keras_weights(model)


def scenario_disagree(res):
    x, y = keras_digits(hvd, 3 * BATCH)
    one = hvd.rank() == 1
    fit_cases = {"density": lambda: hvds.Compression.topka(0.3 if one else 0.1),
                 "preset": lambda: (hvds.Compression.topka if one else hvds.Compression.oktopk)(0.1)}
    tape_cases = {"preset": lambda: (hvd_tf.Compression.topka if one else hvd_tf.Compression.gtopk)(0.1),
                  "periods": lambda: hvd_tf.Compression.oktopk(0.1, threshold_period=4 if one else 8,
                                                               repartition_period=8 if one else 16)}

    def attempt(key, fn):
        start = time.time()
        try:
            fn()
            res[key] = ""
        except Exception as e:     # noqa: BLE001 - recorded for the test
            res[key] = f"{type(e).__name__}: {e}"
        res[f"{key}.seconds"] = time.time() - start

    for name, comp in fit_cases.items():
        attempt(f"fit.{name}", lambda: fit(keras_mlp(), hvds.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                                                            compression=comp()), x, y))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for name, comp in tape_cases.items():
        for mode in ("eager", "function"):
            m, preset = keras_mlp(), comp()

            def step():
                with tf.GradientTape() as tape:
                    loss = loss_fn(y[:BATCH], m(x[:BATCH]))
                tape = hvd_tf.DistributedGradientTape(tape, compression=preset)
                return tape.gradient(loss, m.trainable_variables)

            attempt(f"tape.{name}.{mode}", tf.function(step) if mode == "function" else step)


def error_of(fn):
    try:
        fn()
    except Exception as e:     # noqa: BLE001 - recorded for the test
        return f"{type(e).__name__}: {e}"
    return ""


def scenario_refused(res):
    res["optimizer.factory"] = error_of(lambda: hvds.DistributedOptimizer(keras.optimizers.SGD(0.05),
                                                                          compression=hvds.Compression.topka))
    res["tape.factory"] = error_of(lambda: hvd_tf.DistributedGradientTape(tf.GradientTape(),
                                                                          compression=hvd_tf.Compression.topka))
    res["allreduce.factory"] = error_of(lambda: hvd_tf.sparse_allreduce(tf.ones(8),
                                                                        compression=hvd_tf.Compression.topka))
    res["allreduce.positional"] = error_of(lambda: hvd_tf.sparse_allreduce(tf.ones(8), hvd_tf.Compression.topka(0.5)))
    res["momentum_twice"] = error_of(lambda: hvds.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), compression=hvds.Compression.topka(0.1, momentum_correction=0.9)))
    res["momentum_once"] = error_of(lambda: hvds.DistributedOptimizer(
        keras.optimizers.SGD(0.05), compression=hvds.Compression.topka(0.1, momentum_correction=0.9)))
    res["dense.optimizer"] = error_of(lambda: hvds.DistributedOptimizer(
        keras.optimizers.SGD(0.05), compression=hvds.Compression.none, nonfinite="raise"))
    res["dense.elastic_residuals"] = error_of(lambda: hvds.DistributedOptimizer(
        keras.optimizers.SGD(0.05), compression=hvds.Compression.fp16, elastic_residuals="drop"))
    res["dense.tape"] = error_of(lambda: hvd_tf.DistributedGradientTape(
        tf.GradientTape(), compression=hvd_tf.Compression.none, nonfinite="raise"))
    res["dense.consistency"] = error_of(lambda: hvds.DistributedOptimizer(       # works on the dense path too
        keras.optimizers.SGD(0.05), compression=hvds.Compression.none, consistency_check_every=5))


def scenario_stats(res):
    x, y = keras_digits(hvd, 3 * BATCH)
    opt = hvds.DistributedOptimizer(keras.optimizers.SGD(0.05), compression=hvds.Compression.topka(0.1))
    fit(keras_mlp(), opt, x, y)                                    # three sparse steps
    for key, value in opt.sparse_stats(average=True).items():
        res[f"averaged.{key}"] = value
    res["again"] = len(opt.sparse_stats(average=True))            # no step since the last call: {}
    res["skipped"] = opt.skipped_steps()
    res["last.sent_bytes"] = opt.sparse_stats()["sent_bytes"]


def recorded(scenario, path):
    """Run ``scenario(res)``; write ``res`` with the error it raised, if any (every rank records what it saw), and
    the seconds it took."""
    res = {}
    start = time.time()
    try:
        scenario(res)
    except Exception as e:     # noqa: BLE001 - every rank records what it saw
        res["error"] = f"{type(e).__name__}: {e}"
    res["seconds"] = time.time() - start
    np.savez(path, **res)


if __name__ == "__main__":
    run_scenarios(hvd, f"recipes_{FLAVOUR}_", globals(), run=recorded)
