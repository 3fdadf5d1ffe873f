"""Sparse data-parallel ``model.fit`` of a small Keras CNN on scikit-learn's digits, with hvd_sparse's Keras optimizer
and callbacks.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py [--compression oktopk] [--byte-budget 0.05]
    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py   # tf_keras

The optimizer is ``hvd_sparse.tensorflow.keras.DistributedOptimizer`` (``--compression none``: Horovod's dense
allreduce; a preset name such as ``oktopk`` or ``topka``: whole-model sparse exchange with error feedback). The
callbacks broadcast rank 0's weights after the first batch (the ranks start from different weights here, on
purpose), warm the learning rate up, average the epoch metrics over ranks and log ``sparse_density``,
``sparse_sent_bytes`` (per step and rank) and ``sparse_residual_norm`` into History; rank 0 prints one line per
epoch with them (``EpochLine``) and the final test accuracy. The Keras is ``tf.keras``: Keras 3, or tf_keras when
``TF_USE_LEGACY_KERAS=1`` (set before TensorFlow is imported). ``--log-stats-every N`` also logs the sparse
statistics every N steps through Python's ``logging``. Nothing is downloaded; the file stands alone: copy it into a
project.
"""

import argparse
import logging
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hvd_sparse.quiet import filter_stderr  # noqa: E402

filter_stderr()   # TensorFlow's start-up lines out of the output (HVD_SPARSE_VERBOSE=1 keeps them)

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse.tensorflow.keras as hvds  # noqa: E402
import hvd_sparse.tensorflow.keras.callbacks as hvds_callbacks  # noqa: E402

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


def make_compression(args):
    """``none``, or the sparse preset of ``--compression`` at ``--byte-budget`` if given, else at ``--density``."""
    if args.compression == "none":
        return hvds.Compression.none
    preset = getattr(hvds.Compression, args.compression)
    return preset(byte_budget=args.byte_budget) if args.byte_budget is not None else preset(args.density)


class EpochLine(keras.callbacks.Callback):
    """One line per epoch on rank 0 (after the averaging callbacks): loss, accuracies, sparse statistics, time."""

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 0:
            lg = logs or {}
            print(f"epoch {epoch + 1:2d}/{self.params['epochs']}  loss {lg['loss']:.4f}  "
                  f"acc {lg['accuracy'] * 100:6.2f}%  test acc {lg['val_accuracy'] * 100:6.2f}%  "
                  f"density {lg['sparse_density']:.4f}  sent/step {lg['sparse_sent_bytes'] / 1024:6.2f} KiB  "
                  f"residual {lg['sparse_residual_norm']:.3f}  ({time.perf_counter() - self.t0:.1f} s)", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="oktopk", choices=("none",) + PRESETS,
                   help="'none' (Horovod's dense allreduce) or a sparse preset (default: oktopk)")
    p.add_argument("--density", type=float, default=0.01, help="fraction of gradient entries sent (default: 0.01)")
    p.add_argument("--byte-budget", type=float, help="fraction of a dense allreduce's bytes sent, instead of --density")
    p.add_argument("--epochs", type=int, default=12, help="epochs (default: 12)")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default: 32)")
    p.add_argument("--base-lr", type=float, default=0.025,
                   help="SGD learning rate per worker after warmup, scaled by the number of workers")
    p.add_argument("--log-stats-every", type=int, default=0, help="log the sparse statistics every N steps")
    p.add_argument("--warmup-epochs", type=int, default=2, help="learning-rate warmup epochs (default: 2)")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    if args.log_stats_every:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    (x_tr, y_tr), (x_te, y_te) = load_arrays(args.seed)
    # each rank its own shard, cut to the same number of full batches everywhere (the ranks must run the same
    # number of steps: every step is a collective)
    steps = len(x_tr) // hvd.size() // args.batch_size
    shard = np.arange(hvd.rank(), len(x_tr), hvd.size())[:steps * args.batch_size]
    compression = make_compression(args)
    lr = args.base_lr * hvd.size()

    keras.utils.set_random_seed(args.seed + hvd.rank())    # different weights per rank: the broadcast fixes it
    model = make_model()
    options = {"log_stats_every": args.log_stats_every} if args.compression != "none" else {}
    optimizer = hvds.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9), compression=compression, **options)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        hvds_callbacks.BroadcastGlobalVariablesCallback(0),
        hvds_callbacks.MetricAverageCallback(),
        # Keras 3's and tf_keras's SGD compile momentum as a constant: no momentum correction possible
        hvds_callbacks.LearningRateWarmupCallback(lr, warmup_epochs=args.warmup_epochs,
                                                  momentum_correction=False),
        hvds_callbacks.SparsityCallback(),
        EpochLine(),
    ]
    if hvd.rank() == 0:
        n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        print(f"digits: {len(x_tr)} train / {len(x_te)} test images, {hvd.size()} workers, {n} parameters, "
              f"{hvds_callbacks.FLAVOUR}, compression {compression!r}", flush=True)
    history = model.fit(x_tr[shard], y_tr[shard], batch_size=args.batch_size, epochs=args.epochs,
                        validation_data=(x_te, y_te), callbacks=callbacks, verbose=0)
    loss, acc = model.evaluate(x_te, y_te, verbose=0)
    # identical weights on every rank (same test accuracy everywhere)
    accs = hvd.allgather(tf.constant([acc], tf.float64), name="keras_digits.acc", ignore_name_scope=True).numpy()
    if hvd.rank() == 0:
        h = history.history
        what = args.compression if args.compression == "none" else repr(compression)
        print(f"final test accuracy {acc * 100:.2f}% ({what}, {hvds_callbacks.FLAVOUR}); last epoch: "
              f"sparse_density {h['sparse_density'][-1]:.4f}, sent/step {h['sparse_sent_bytes'][-1] / 1024:.2f} KiB, "
              f"residual norm {h['sparse_residual_norm'][-1]:.4f}; same accuracy on all ranks: "
              f"{bool((accs == accs[0]).all())}", flush=True)
    return acc


if __name__ == "__main__":
    main()
