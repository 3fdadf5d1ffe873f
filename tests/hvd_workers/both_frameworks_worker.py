"""A training script that imports both Horovod frameworks before ``hvd.init()`` (argv: the framework it trains
with, ``torch`` or ``tensorflow``; the output directory). Horovod 0.28.1 then fills the global process set's rank
list from the other framework's uninitialized module: ``global_process_set.ranks == []`` and ``included()`` is
False on every rank. Three sparse steps on per-rank data; writes the parameters, the last step's statistics and
the process set's ranks as Horovod left them."""

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
framework, out = sys.argv[1], sys.argv[2]
if framework == "torch":
    import horovod.torch as hvd
    import horovod.tensorflow  # noqa: F401  (imported after horovod.torch, before init)
else:
    import horovod.tensorflow as hvd
    import horovod.torch  # noqa: F401
hvd.init()
rank = hvd.rank()
rng = np.random.default_rng(rank)                        # other data on every rank
x = rng.standard_normal((8, 6)).astype(np.float32)
y = rng.standard_normal((8, 2)).astype(np.float32)

if framework == "torch":
    import torch

    import hvd_sparse.torch as hvds

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.topka(0.5))
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    params = np.concatenate([p.detach().numpy().reshape(-1) for p in model.parameters()])
else:
    import tensorflow as tf

    import hvd_sparse.tensorflow as hvds

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(2)])
    opt = hvds.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=hvds.Compression.topka(0.5))
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    params = np.concatenate([v.numpy().reshape(-1) for v in model.trainable_variables])
stats = opt.sparse_stats()
np.savez(os.path.join(out, f"both.rank{rank}.npz"), params=params, collectives=stats.get("collectives", 0),
         ranks=np.array(hvd.global_process_set.ranks, np.int64))
