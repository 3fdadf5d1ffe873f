"""Sparse data-parallel training of a small Keras CNN on scikit-learn's digits with a TensorFlow 2 custom loop.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow2_digits.py [--compression oktopk]
        [--density 0.01 | --byte-budget 0.05] [--epochs 12]

The gradients go through ``hvd_sparse.tensorflow.DistributedGradientTape`` inside a ``tf.function``: with
``--compression none`` that is Horovod's own dense allreduce, with a preset name (``topka``, ``oktopk``,
``gaussiank``, ...: ``PRESETS``) the whole model is exchanged sparsely, with error
feedback. Prints per epoch the training loss (averaged over ranks), the test accuracy, the achieved density and
the bytes sent per step by a rank. Works with Keras 3 (default) and with tf_keras (``TF_USE_LEGACY_KERAS=1``).
Digits (1,797 8x8 images) ships with scikit-learn: nothing is downloaded. The file stands alone: copy it into a
project.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hvd_sparse.quiet import filter_stderr  # noqa: E402

filter_stderr()   # TensorFlow's start-up lines out of the output (HVD_SPARSE_VERBOSE=1 keeps them)

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse.tensorflow as hvds  # noqa: E402

keras = tf.keras          # Keras 3, or tf_keras when TF_USE_LEGACY_KERAS=1

#: the sparse presets ``--compression`` takes (besides ``none``)
PRESETS = ("topka", "oktopk", "exdyna", "topk_dsa", "gtopk", "gaussiank", "dct", "spardl")


def load_arrays(seed):
    """Digits split 80/20 by a fixed permutation (the same on every rank), pixels in [0, 1], channels last."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = (x[perm] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1), y[perm].astype(np.int64)
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def make_model():
    """conv 3x3 (16) -> conv 3x3 (32) -> max-pool 2 -> dense 64 -> dense 10 (logits): 38,282 parameters."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="oktopk", choices=("none",) + PRESETS,
                   help="'none' (Horovod's dense allreduce) or a sparse preset (default: oktopk)")
    p.add_argument("--density", type=float, default=0.01, help="fraction of gradient entries sent (default: 0.01)")
    p.add_argument("--byte-budget", type=float, help="fraction of a dense allreduce's bytes sent, instead of --density")
    p.add_argument("--epochs", type=int, default=12, help="epochs (default: 12)")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default: 32)")
    p.add_argument("--base-lr", type=float, default=0.025,
                   help="initial SGD learning rate per worker, scaled by the number of workers, cosine-decayed to 0")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def last_step_stats(compression, n):
    """(density, bytes sent by this rank) of the last exchange: a tape keeps its state in its preset, which reports
    it (``compression.sparse_stats()``); Horovod's dense ring allreduce (``none``) sends 2 n (P-1)/P float32
    words."""
    stats = compression.sparse_stats() if hasattr(compression, "sparse_stats") else {}
    if not stats:
        return 1.0, 2.0 * n * (hvd.size() - 1) / hvd.size() * 4
    return float(stats["density"]), float(stats["sent_bytes"])


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    (x_tr, y_tr), (x_te, y_te) = load_arrays(args.seed)
    if args.compression == "none":
        compression = hvds.Compression.none
    else:
        preset = getattr(hvds.Compression, args.compression)
        compression = preset(byte_budget=args.byte_budget) if args.byte_budget is not None else preset(args.density)
    keras.utils.set_random_seed(args.seed + hvd.rank())    # different on purpose: the broadcast fixes it
    model = make_model()
    n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    # Same initial weights everywhere: rank 0's. The optimizer's slots start at zero and then only see averaged
    # gradients, so they agree too (the error-feedback residuals are per rank by design).
    # (hvds.broadcast_variables: Horovod's, also for Keras 3 variables and bfloat16 ones)
    hvds.broadcast_variables(model.variables, root_rank=0)

    shard = np.arange(hvd.rank(), len(x_tr), hvd.size())   # each rank its own shard of the training set
    steps_per_epoch = len(shard) // args.batch_size
    schedule = keras.optimizers.schedules.CosineDecay(args.base_lr * hvd.size(),
                                                      decay_steps=args.epochs * steps_per_epoch)
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvds.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def accuracy(x, y):
        pred = tf.argmax(model(x, training=False), axis=1)
        return tf.reduce_mean(tf.cast(tf.equal(pred, y), tf.float32))

    if hvd.rank() == 0:
        print(f"digits: {len(x_tr)} train / {len(x_te)} test images, {hvd.size()} workers, {n} parameters, "
              f"{keras.__name__.split('.')[0]} {getattr(keras, '__version__', '')}, compression "
              f"{compression!r}", flush=True)
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        order = shard[np.random.default_rng(args.seed * 1000 + epoch).permutation(len(shard))]
        loss_sum, density_sum, bytes_sum, t0 = 0.0, 0.0, 0.0, time.perf_counter()
        for s in range(steps_per_epoch):
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            loss_sum += float(train_step(tf.constant(x_tr[idx]), tf.constant(y_tr[idx])))
            density, sent = last_step_stats(compression, n)
            density_sum += density
            bytes_sum += sent
        avg = hvd.allreduce(tf.constant([loss_sum, density_sum, bytes_sum], tf.float64) / steps_per_epoch,
                            op=hvd.Average, name="tensorflow2_digits.epoch_stats", ignore_name_scope=True).numpy()
        acc = float(accuracy(tf.constant(x_te), tf.constant(y_te)))
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  loss {avg[0]:.4f}  test acc {acc * 100:6.2f}%  density {avg[1]:.4f}  "
                  f"sent/step {avg[2] / 1024:8.2f} KiB  ({time.perf_counter() - t0:.2f} s)", flush=True)
    # the weights are identical on every rank: check it cheaply
    checksum = tf.constant([float(sum(tf.reduce_sum(tf.cast(v, tf.float64)) for v in model.trainable_variables))],
                           tf.float64)
    spread = hvd.allreduce(checksum, op=hvd.Max, name="tensorflow2_digits.chk_max", ignore_name_scope=True) - \
        hvd.allreduce(checksum, op=hvd.Min, name="tensorflow2_digits.chk_min", ignore_name_scope=True)
    if hvd.rank() == 0:
        what = args.compression if args.compression == "none" else repr(compression)
        print(f"final test accuracy {acc * 100:.2f}% ({what}); weights identical on all ranks: "
              f"{float(spread[0]) == 0.0}", flush=True)
    return acc


if __name__ == "__main__":
    main()
