"""Runs under `horovodrun -np P --gloo` (Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1); each rank writes
<outdir>/kcb_<flavour>_<scenario>.rank<r>.npz. Every scenario runs model.fit compiled (graph) and with
run_eagerly=True ("eager"); keys are prefixed with the mode.

Scenarios:
  broadcast  ranks start from different weights (rank-dependent seed); weights and optimizer slots recorded at
             the first batch end just before and just after BroadcastGlobalVariablesCallback(0) (one kernel is
             registered as local and must stay rank-specific); with the real DistributedOptimizer (if present)
             the final weights too
  metrics    per-rank data; the epoch logs recorded before MetricAverageCallback (raw) and History (averaged)
  warmup     LearningRateWarmupCallback: the lr (and momentum) seen by each batch, History's "lr", and the
             weight change per batch of a probe whose gradient is 1 (so the change is the lr the step used)
  sparsity   SparsityCallback with a fake optimizer whose sparse_stats()/residual_norm() return rank- and
             step-dependent values (recorded), every_n_batches=2; and, if hvd_sparse.tensorflow.keras exists,
             with the real DistributedOptimizer (oktopk and none; compiled fit only)
  flavour    a model of the other Keras flavour is rejected by set_model with a TypeError
  bf16       a model with bfloat16 variables: hvd_sparse.tensorflow.broadcast_variables, then model.fit with
             BroadcastGlobalVariablesCallback and the DistributedOptimizer (Ok-Topk); Horovod's own broadcast
"""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse.tensorflow.keras.callbacks as hcb  # noqa: E402

from worker_helpers import KERAS_FLAVOUR as FLAVOUR, run_scenarios  # noqa: E402

keras = tf.keras
N, BATCH, EPOCHS = 24, 6, 3            # 4 steps per epoch
MODES = {"graph": False, "eager": True}

try:
    from hvd_sparse.tensorflow.keras import Compression, DistributedOptimizer  # noqa: E402
except ImportError:                      # written concurrently; the fake optimizer covers SparsityCallback
    DistributedOptimizer = None


def data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, 8)).astype(np.float32)
    y = rng.integers(0, 4, N)
    return x, y


def model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])


def compile_(m, opt, eager):
    m.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"], run_eagerly=eager)


def flat(variables):
    return np.concatenate([np.asarray(v.numpy(), dtype=np.float64).reshape(-1) for v in variables])


def opt_vars(opt):
    v = opt.variables
    return list(v() if callable(v) else v)


class Hook(keras.callbacks.Callback):
    """Calls fn(self, event, index, logs) on epoch end, train batch begin and train batch end."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def on_epoch_end(self, epoch, logs=None):
        self.fn(self, "epoch_end", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.fn(self, "batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.fn(self, "batch_end", batch, logs)


def scenario_broadcast(out):
    res = {}
    for mode, eager in MODES.items():
        m = model(100 + hvd.rank())                  # different initial weights on every rank
        opt = keras.optimizers.SGD(0.05, momentum=0.9)
        if DistributedOptimizer is not None:
            opt = DistributedOptimizer(opt, compression=Compression.none)
        compile_(m, opt, eager)
        # Build the optimizer now and give its slots rank-dependent values, so that the broadcast of the optimizer
        # variables is visible (with averaged gradients the slots would otherwise agree after the first step).
        opt.build(m.trainable_variables)
        for v in opt_vars(opt):
            if v.dtype in ("float32", tf.float32) and "learning_rate" not in v.name:
                v.assign(tf.fill(v.shape, 0.01 * (hvd.rank() + 1)))
        local = m.layers[-1].kernel                   # stays worker-local (random init: differs per rank)
        seen = {}

        def record(tag):
            def fn(cb, event, index, logs):
                if event == "batch_end" and index == 0 and tag not in seen:
                    seen[tag] = True
                    # global variables = model minus the local bias, then optimizer slots and counters
                    res[f"{mode}.{tag}.model"] = flat([v for v in m.variables if v is not local])
                    res[f"{mode}.{tag}.local"] = flat([local])
                    res[f"{mode}.{tag}.opt"] = flat(opt_vars(m.optimizer))
            return fn

        res[f"{mode}.init"] = flat(m.trainable_variables)
        x, y = data(7 + hvd.rank())
        m.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
              callbacks=[Hook(record("before")),
                         hcb.BroadcastGlobalVariablesCallback(0, local_variables=[local]),
                         Hook(record("after"))])
        res[f"{mode}.final"] = flat([v for v in m.trainable_variables if v is not local])
    res["distributed"] = np.array(DistributedOptimizer is not None)
    np.savez(out, **res)


def scenario_metrics(out):
    res = {}
    for mode, eager in MODES.items():
        m = model(3)
        compile_(m, keras.optimizers.SGD(0.05), eager)
        raw = []
        x, y = data(11 + hvd.rank())
        xv, yv = data(50 + hvd.rank())
        hist = m.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False, validation_data=(xv, yv),
                     callbacks=[Hook(lambda cb, ev, i, logs: raw.append(dict(logs)) if ev == "epoch_end" else None),
                                hcb.MetricAverageCallback()]).history
        keys = sorted(raw[0])
        res[f"{mode}.keys"] = np.array(keys)
        res[f"{mode}.raw"] = np.array([[float(r[k]) for k in keys] for r in raw])
        res[f"{mode}.hist"] = np.array([[float(v) for v in hist[k]] for k in keys]).T
    np.savez(out, **res)


def scenario_warmup(out):
    res = {}
    legacy = FLAVOUR == "tf_keras"
    for mode, eager in MODES.items():
        m = model(3)
        # tf_keras's legacy SGD keeps momentum in a variable (momentum correction applies); Keras 3's SGD keeps
        # a Python float compiled into the train function (correction skipped, with a warning)
        sgd = keras.optimizers.legacy.SGD if legacy else keras.optimizers.SGD
        opt = sgd(0.123, momentum=0.9)
        compile_(m, opt, eager)
        rec = {"lr": [], "mom": [], "mom_after": []}

        def fn(cb, ev, i, logs):
            if ev == "batch_begin":
                rec["lr"].append(float(np.asarray(opt.learning_rate.numpy())))
                mom = opt.momentum
                rec["mom"].append(float(np.asarray(mom.numpy() if hasattr(mom, "numpy") else mom)))
            elif ev == "batch_end":
                mom = opt.momentum
                rec["mom_after"].append(float(np.asarray(mom.numpy() if hasattr(mom, "numpy") else mom)))

        x, y = data(11 + hvd.rank())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hist = m.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
                         callbacks=[hcb.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2), Hook(fn)])
        for k, v in rec.items():
            res[f"{mode}.{k}"] = np.array(v)
        res[f"{mode}.hist_lr"] = np.array(hist.history["lr"])
        res[f"{mode}.warned"] = np.array(any("momentum correction" in str(w.message) for w in caught))

        # The assigned lr is what the (compiled) train step uses: w <- w - lr * 1 with loss = mean(w * 1).
        probe = keras.Sequential([keras.Input((1,)),
                                  keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        probe.compile(optimizer=keras.optimizers.SGD(0.123), loss=lambda y_true, y_pred: tf.reduce_mean(y_pred),
                      run_eagerly=eager)
        kernel = probe.layers[-1].kernel
        deltas, before = [], []

        def watch(cb, ev, i, logs):
            if ev == "batch_begin":
                before.append(float(kernel.numpy().reshape(-1)[0]))
            elif ev == "batch_end":
                deltas.append(before[-1] - float(kernel.numpy().reshape(-1)[0]))

        probe.fit(np.ones((N, 1), np.float32), np.zeros((N, 1), np.float32), batch_size=BATCH, epochs=EPOCHS,
                  verbose=0, shuffle=False, callbacks=[hcb.LearningRateWarmupCallback(0.4, warmup_epochs=2,
                                                                                      momentum_correction=False),
                                                       Hook(watch)])
        res[f"{mode}.deltas"] = np.array(deltas)
    res["legacy"] = np.array(legacy)
    np.savez(out, **res)


def fake_sparse_sgd():
    base = keras.optimizers.SGD

    class FakeSparseSGD(base):
        """SGD with sparse_stats()/residual_norm() returning known rank- and step-dependent values."""

        def sparse_stats(self):
            it = int(self.iterations.numpy())
            r = hvd.rank()
            st = {"density": 0.01 * (r + 1) * (1 + it % 3), "sent_bytes": 1000.0 * (r + 1) + 10 * it,
                  "recv_bytes": 0.0, "selected": 1, "k": 1, "n": 100}
            self.returned.append([it, st["density"], st["sent_bytes"]])
            return st

        def residual_norm(self):
            self.norms.append(0.5 + hvd.rank() + 0.001 * int(self.iterations.numpy()))
            return self.norms[-1]

    opt = FakeSparseSGD(0.05)
    opt.returned, opt.norms = [], []
    return opt


def scenario_sparsity(out):
    res = {}
    keys = list(hcb.SparsityCallback.KEYS)
    configs = [("fake", None)]
    if DistributedOptimizer is not None:
        configs += [("oktopk", lambda: Compression.oktopk(0.05)), ("none", lambda: Compression.none)]
    for mode, eager in MODES.items():
        for name, comp in configs:
            if eager and comp is not None:
                continue          # the real optimizer: compiled fit only (its eager path is keras_worker's)
            m = model(3)
            opt = fake_sparse_sgd() if comp is None else DistributedOptimizer(keras.optimizers.SGD(0.05),
                                                                              compression=comp())
            compile_(m, opt, eager)
            batch_logs = []

            def fn(cb, ev, i, logs):
                if ev == "batch_end":
                    batch_logs.append([float(logs.get(k, np.nan)) for k in keys])

            x, y = data(11 + hvd.rank())
            hist = m.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
                         callbacks=[hcb.BroadcastGlobalVariablesCallback(0), hcb.MetricAverageCallback(),
                                    hcb.SparsityCallback(every_n_batches=2 if comp is None else 0), Hook(fn)])
            tag = f"{mode}.{name}"
            res[f"{tag}.hist"] = np.array([hist.history[k] for k in keys]).T        # (epochs, 3)
            res[f"{tag}.batch_logs"] = np.array(batch_logs)
            res[f"{tag}.final"] = flat(m.trainable_variables)
            if comp is None:
                res[f"{tag}.returned"] = np.array(opt.returned)
                res[f"{tag}.norms"] = np.array(opt.norms)
            res[f"{tag}.n"] = np.array(sum(int(np.prod(v.shape)) for v in m.trainable_variables))
    res["configs"] = np.array([c for c, _ in configs])
    np.savez(out, **res)


def scenario_bf16(out):
    """A model with bfloat16 variables (Horovod's broadcast has no bfloat16): ranks start from different weights;
    hvd_sparse.tensorflow.broadcast_variables (eager) makes them rank 0's; a second model is trained by model.fit with
    BroadcastGlobalVariablesCallback(0) and the DistributedOptimizer with Ok-Topk. Also records what Horovod's own
    broadcast_variables says to a bfloat16 variable."""
    import hvd_sparse.tensorflow as hvds

    def bf16_model(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", dtype="bfloat16"),
                                 keras.layers.Dense(4, dtype="bfloat16")])

    def bits(variables):
        return np.concatenate([tf.bitcast(tf.reshape(tf.convert_to_tensor(v), [-1]), tf.int16).numpy()
                               for v in variables])

    res = {}
    m = bf16_model(100 + hvd.rank())
    res["dtypes"] = np.array(sorted({tf.as_dtype(v.dtype).name for v in m.variables}))
    res["before"] = bits(m.variables)
    hvds.broadcast_variables(m.variables, root_rank=0)
    res["after"] = bits(m.variables)
    try:
        hvd.broadcast_variables([tf.Variable(tf.zeros(2, tf.bfloat16))], root_rank=0)
        res["horovod"] = np.array("accepted")
    except Exception as e:      # noqa: BLE001 - whatever Horovod raises is recorded
        res["horovod"] = np.array(f"{type(e).__name__}: {e}")
    m = bf16_model(200 + hvd.rank())
    opt = DistributedOptimizer(keras.optimizers.SGD(0.05), compression=Compression.oktopk(0.1))
    compile_(m, opt, False)
    x, y = data(7 + hvd.rank())
    m.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
          callbacks=[hcb.BroadcastGlobalVariablesCallback(0)])
    res["fit"] = bits(m.variables)
    res["fit_moved"] = np.array(bool((res["fit"] != bits(bf16_model(200).variables)).any()))
    np.savez(out, **res)


def scenario_flavour(out):
    """set_model with a model of the other Keras flavour raises TypeError; the own flavour is accepted. The other
    flavour's model is a stand-in: the callbacks only look at ``type(model).__module__`` (importing the other
    Keras would cost seconds)."""
    other = "keras.src.models.sequential" if FLAVOUR == "tf_keras" else "tf_keras.src.engine.sequential"
    other_model = type("Sequential", (), {"__module__": other})()
    own_model = model(0)
    res = {}
    for cls, args in ((hcb.BroadcastGlobalVariablesCallback, (0,)), (hcb.MetricAverageCallback, ()),
                      (hcb.LearningRateWarmupCallback, (0.1,)), (hcb.SparsityCallback, ())):
        cb = cls(*args)
        assert isinstance(cb, keras.callbacks.Callback)
        cb.set_model(own_model)
        try:
            cb.set_model(other_model)
            res[cls.__name__] = np.array("accepted")
        except TypeError as e:
            res[cls.__name__] = np.array(str(e))
    res["flavour"] = np.array(hcb.FLAVOUR)
    np.savez(out, **res)


if __name__ == "__main__":
    run_scenarios(hvd, f"kcb_{FLAVOUR}_", globals())
