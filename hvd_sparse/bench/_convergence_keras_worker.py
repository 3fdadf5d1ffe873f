"""Keras worker of ``python -m hvd_sparse.bench convergence --framework keras``: one Horovod rank.

    horovodrun -np 2 -H localhost:2 --gloo python -m hvd_sparse.bench._convergence_keras_worker \
        --algorithms dense,oktopk --epochs 12 --density 0.01 --out result.json
    TF_USE_LEGACY_KERAS=1 horovodrun ...     # tf_keras instead of Keras 3 (set before TensorFlow loads)

Trains the digits CNN (:func:`hvd_sparse.bench.digits_keras.make_model`) once per algorithm with the recipe of
``examples/keras_digits.py``: ``model.fit`` with ``hvd_sparse.tensorflow.keras.DistributedOptimizer`` around
SGD with momentum 0.9, and hvd_sparse's Keras callbacks --

    BroadcastGlobalVariablesCallback(0)   every rank starts from its own weights (seed + rank); rank 0's
                                          weights and optimizer slots reach every rank after the first batch
    MetricAverageCallback()               the epoch's training loss averaged over ranks
    LearningRateWarmupCallback(lr, warmup_epochs)   lr/P -> lr over the warmup epochs, then constant
    SparsityCallback()                    sparse_density and sparse_sent_bytes per step, averaged over ranks

``--lr-decay cosine`` (not in the example) adds a cosine decay of the learning rate after the warmup, to 0 at
the last step, as the PyTorch recipe does over the whole run: the final accuracy is then that of a settled
model, not of one noisy SGD step at the full learning rate.

Each rank fits its own shard of the training set (cut to the same number of full batches on every rank: each
step is a collective), shuffled by Keras. Every run re-seeds Keras (``keras.utils.set_random_seed(seed +
rank)``) before building its model, so all algorithms start from the same initial weights and see the same
batches. "dense" is Horovod's dense allreduce (``Compression.none``); every other name is a preset of
:mod:`hvd_sparse.bench.presets`.

Rank 0 prints one progress line per epoch (prefix :data:`hvd_sparse.bench._convergence_worker.PROGRESS`) and
writes the same JSON as the PyTorch worker to ``--out``.
"""

from __future__ import annotations

import math
import os
import time

from ._convergence_worker import PROGRESS, parser, run_all


def parse_args(argv=None):
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--warmup-epochs", type=int, default=2, help="epochs of learning-rate warmup (from lr/P)")
    p.add_argument("--lr-decay", choices=("none", "cosine"), default="none",
                   help="after the warmup: none (the example's constant lr) or cosine to 0 at the last step")
    return p.parse_args(argv)


def _callbacks(keras, hvds_callbacks, args, name, partitioned, test_set, steps):
    """The recipe's callbacks, between a timer (first: its epoch end comes before the others' collectives)
    and a recorder (last: it reads the averaged logs)."""
    import horovod.tensorflow as hvd
    import numpy as np

    x_te, y_te = test_set

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.t0

    class Recorder(keras.callbacks.Callback):
        def __init__(self, timer):
            super().__init__()
            self.timer, self.history = timer, []

        def on_epoch_end(self, epoch, logs=None):
            # weights are identical on every rank (the broadcast, then averaged updates): so is the accuracy
            logits = np.asarray(self.model(x_te, training=False))
            acc = float((logits.argmax(axis=1) == y_te).mean())
            # SparsityCallback averages over ranks; a partitioned sparsifier (ExDyna) splits one global
            # selection between the ranks, so there the ranks' densities add up
            dens = logs["sparse_density"] * (hvd.size() if partitioned else 1)
            rec = dict(epoch=epoch + 1, loss=float(logs["loss"]), accuracy=acc, seconds=self.timer.seconds,
                       density=float(dens), sent_bytes=float(logs["sparse_sent_bytes"]),
                       lr=float(np.asarray(self.model.optimizer.learning_rate)))
            self.history.append(rec)
            if hvd.rank() == 0:
                print(f"{PROGRESS} [{name}] epoch {epoch + 1}/{args.epochs}  loss {rec['loss']:.4f}  "
                      f"test acc {acc * 100:6.2f}%  density {dens:.4f}  "
                      f"sent/step {rec['sent_bytes'] / 1024:8.1f} KiB  ({rec['seconds']:.2f} s)", flush=True)

    class CosineDecay(keras.callbacks.Callback):
        """From the end of the warmup: lr = lr0 (1 + cos(pi t / T)) / 2 before step t of the T remaining."""

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            total = (args.epochs - args.warmup_epochs) * steps
            if self.epoch >= args.warmup_epochs and total > 0:
                t = (self.epoch - args.warmup_epochs) * steps + batch
                self.model.optimizer.learning_rate.assign(args.lr * 0.5 * (1 + math.cos(math.pi * t / total)))

    timer = Timer()
    recorder = Recorder(timer)
    return recorder, [
        timer,
        hvds_callbacks.BroadcastGlobalVariablesCallback(0),
        hvds_callbacks.MetricAverageCallback(),
        # Keras 3's and tf_keras's SGD compile momentum as a constant: no momentum correction possible
        hvds_callbacks.LearningRateWarmupCallback(args.lr, warmup_epochs=args.warmup_epochs,
                                                  momentum_correction=False),
        *([CosineDecay()] if args.lr_decay == "cosine" else []),
        hvds_callbacks.SparsityCallback(),
        recorder,
    ]


def _keras_version(flavour):
    import importlib

    return getattr(importlib.import_module("tf_keras" if flavour == "tf_keras" else "keras"), "__version__", "")


def train(args, name, train_set, test_set):
    """One run; returns (n, per-epoch records identical on every rank except ``seconds``)."""
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import hvd_sparse.tensorflow.keras as hvds
    import hvd_sparse.tensorflow.keras.callbacks as hvds_callbacks

    from .digits_keras import make_model
    from .presets import make

    keras = tf.keras
    # the baseline is Horovod's dense allreduce, not the engine's Dense reducer
    compression = hvds.Compression.none if name == "dense" else make(name, args.density)
    partitioned = getattr(getattr(compression, "sparsifier", None), "partitioned", False)
    keras.backend.clear_session()
    keras.utils.set_random_seed(args.seed + hvd.rank())     # the broadcast callback makes rank 0's win
    model = make_model(keras)
    n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    optimizer = hvds.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9), compression=compression)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x_tr, y_tr = train_set
    steps = len(x_tr) // hvd.size() // args.batch_size
    shard = np.arange(hvd.rank(), len(x_tr), hvd.size())[:steps * args.batch_size]
    recorder, callbacks = _callbacks(keras, hvds_callbacks, args, name, partitioned, test_set, steps)
    model.fit(x_tr[shard], y_tr[shard], batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              verbose=0)
    return n, recorder.history


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_sparse.tensorflow.keras.callbacks as hvds_callbacks

    from .digits import load_arrays

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    train_set, test_set = load_arrays(args.seed, layout="channels_last")
    run_all(args, train, train_set, test_set, hvd.rank(), hvd.size(), keras_flavour=hvds_callbacks.FLAVOUR,
            keras_version=_keras_version(hvds_callbacks.FLAVOUR))
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    main()
