"""Sparse data-parallel ``model.fit`` of a small Keras CNN on scikit-learn's digits, with hvd_sparse's Keras optimizer
and callbacks.

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py [--compression oktopk] [--density 0.01]
    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py   # tf_keras

The optimizer is ``hvd_sparse.tensorflow.keras.DistributedOptimizer`` (``--compression none``: Horovod's dense
allreduce; a preset name such as ``oktopk`` or ``topka``: whole-model sparse exchange with error feedback). The
callbacks broadcast rank 0's weights after the first batch (the ranks start from different weights here, on
purpose), warm the learning rate up, average the epoch metrics over ranks and log ``sparse_density``,
``sparse_sent_bytes`` (per step and rank) and ``sparse_residual_norm`` into History; rank 0 prints one line per
epoch with them (``EpochLine``) and the final test accuracy. The Keras is ``tf.keras``: Keras 3, or tf_keras when
``TF_USE_LEGACY_KERAS=1`` (set before TensorFlow is imported). Nothing is downloaded.
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

import hvd_sparse.tensorflow.keras as hvds  # noqa: E402
import hvd_sparse.tensorflow.keras.callbacks as hvds_callbacks  # noqa: E402
from hvd_sparse.bench import presets  # noqa: E402
from hvd_sparse.bench.digits import load_arrays  # noqa: E402  (the 80/20 split of sklearn's digits, numpy)
from hvd_sparse.bench.digits_keras import make_model  # noqa: E402  (the digits CNN, 38,282 parameters)

keras = tf.keras          # Keras 3, or tf_keras when TF_USE_LEGACY_KERAS=1


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
    p.add_argument("--compression", default="oktopk", choices=["none"] + presets.names(),
                   help="'none' (Horovod's dense allreduce) or a sparse preset (default: oktopk)")
    p.add_argument("--density", type=float, default=0.01, help="fraction of gradient entries sent (default: 0.01)")
    p.add_argument("--epochs", type=int, default=12, help="epochs (default: 12)")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default: 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate after warmup (default: 0.05)")
    p.add_argument("--warmup-epochs", type=int, default=2, help="learning-rate warmup epochs (default: 2)")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    (x_tr, y_tr), (x_te, y_te) = load_arrays(args.seed, layout="channels_last")
    # each rank its own shard, cut to the same number of full batches everywhere (the ranks must run the same
    # number of steps: every step is a collective)
    steps = len(x_tr) // hvd.size() // args.batch_size
    shard = np.arange(hvd.rank(), len(x_tr), hvd.size())[:steps * args.batch_size]
    compression = hvds.Compression.none if args.compression == "none" else presets.make(args.compression,
                                                                                         args.density)

    keras.utils.set_random_seed(args.seed + hvd.rank())    # different weights per rank: the broadcast fixes it
    model = make_model(keras)    # conv 16 -> conv 32 -> max-pool -> dense 64 -> dense 10, channels last
    optimizer = hvds.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9), compression=compression)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        hvds_callbacks.BroadcastGlobalVariablesCallback(0),
        hvds_callbacks.MetricAverageCallback(),
        # Keras 3's and tf_keras's SGD compile momentum as a constant: no momentum correction possible
        hvds_callbacks.LearningRateWarmupCallback(args.lr, warmup_epochs=args.warmup_epochs,
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
        what = args.compression if args.compression == "none" else f"{args.compression}, density {args.density}"
        print(f"final test accuracy {acc * 100:.2f}% ({what}, {hvds_callbacks.FLAVOUR}); last epoch: "
              f"sparse_density {h['sparse_density'][-1]:.4f}, sent/step {h['sparse_sent_bytes'][-1] / 1024:.2f} KiB, "
              f"residual norm {h['sparse_residual_norm'][-1]:.4f}; same accuracy on all ranks: "
              f"{bool((accs == accs[0]).all())}", flush=True)
    return acc


if __name__ == "__main__":
    main()
