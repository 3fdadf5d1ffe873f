"""One process (hvd.init() alone, P = 1) or under horovodrun: the non-finite policy of the Keras optimizer and the
TensorFlow tape, under the Keras flavour of the environment (TF_USE_LEGACY_KERAS). Prints one JSON line."""

import json
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse.tensorflow as hvdt  # noqa: E402
import hvd_sparse.tensorflow.keras as hvds  # noqa: E402

hvd.init()
legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
out = {}
NAN = tf.constant([1, np.nan, 1, 1, 1, 1], tf.float32)


def keras_run(mode):
    v = tf.Variable(np.arange(6, dtype=np.float32))
    opt = hvds.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                                    compression=hvds.Compression.topka(0.5))

    def apply(g):
        if legacy:
            opt.apply_gradients([(g, v)])
        else:
            opt.apply([g], [v])

    f = tf.function(apply) if mode == "function" else apply
    f(tf.ones(6))
    before, iters = v.numpy().copy(), int(opt.iterations.numpy())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(NAN)
    skipped_ok = bool((v.numpy() == before).all()) and int(opt.iterations.numpy()) == iters
    f(tf.ones(6))
    return {"unchanged": skipped_ok, "moves_after": bool((v.numpy() != before).any()),
            "warned": any("non-finite gradient on rank 0" in str(w.message) for w in caught),
            "skipped": int(opt.sparse_stats().get("skipped", -1) is False)}


for mode in ("eager", "function"):
    out[mode] = keras_run(mode)

opt = hvds.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=hvds.Compression.topka(0.5),
                                nonfinite="raise")
try:
    w = tf.Variable(np.zeros(3, np.float32))
    (opt.apply_gradients([(tf.constant([np.nan] * 3), w)]) if legacy else opt.apply([tf.constant([np.nan] * 3)], [w]))
    out["raise"] = ""
except Exception as e:      # noqa: BLE001 - the py_function wraps it in a tf error
    out["raise"] = str(e)

x = tf.Variable(np.ones(4, np.float32))
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(x * tf.constant([1.0, np.inf, 1.0, 1.0]))
tape = hvdt.DistributedGradientTape(tape, compression=hvdt.Compression.topka(0.5))
out["tape_all_nan"] = bool(np.isnan(tape.gradient(loss, [x])[0].numpy()).all())
try:
    hvdt.sparse_allreduce(tf.constant([1, 2]), compression=hvdt.Compression.topka(0.5))
except TypeError as e:
    out["int_error"] = str(e)
print("RESULT " + json.dumps(out))
