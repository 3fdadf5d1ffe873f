"""What the horovodrun worker scripts of this folder share.

A worker runs as a script (``horovodrun ... python tests/hvd_workers/<worker>.py``), so this folder is sys.path[0]
and ``from worker_helpers import ...`` finds this module. It imports neither torch nor TensorFlow at the top (a
TensorFlow job imports no torch, a torch job no TensorFlow): the helpers of each framework import it when called.
"""

import os
import sys

import numpy as np

#: the Keras flavour of this job: tf_keras when TF_USE_LEGACY_KERAS=1 (set by the test's job), else Keras 3
KERAS_FLAVOUR = "tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else "keras3"


def run_scenarios(hvd, prefix, namespace, run=None):
    """A worker's main for ``<worker> <outdir> <name>...``: ``hvd.init()``, then for every name the function
    ``namespace["scenario_<name>"]`` with the file it writes, ``<outdir>/<prefix><name>.rank<r>.npz``: called as
    ``scenario(path)``, or ``run(scenario, path)`` when ``run`` is given."""
    hvd.init()
    outdir, names = sys.argv[1], sys.argv[2:]
    for name in names:
        scenario = namespace[f"scenario_{name}"]
        path = os.path.join(outdir, f"{prefix}{name}.rank{hvd.rank()}.npz")
        if run is None:
            scenario(path)
        else:
            run(scenario, path)


# -- torch workers (horovod.torch) ------------------------------------------------------------------------------
def save(outdir, scenario, **arrays):
    """Write this rank's ``arrays`` to ``<outdir>/<scenario>.rank<r>.npz``."""
    import horovod.torch as hvd

    np.savez(os.path.join(outdir, f"{scenario}.rank{hvd.rank()}.npz"), **arrays)


def flat(model):
    """The model's parameters, in ``model.parameters()`` order, as one float32 numpy vector (a copy)."""
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def data(step, rank=None, n=20):
    """A batch (8, n) of this rank's (or ``rank``'s) inputs at ``step``: other data on every rank and step."""
    import horovod.torch as hvd
    import torch

    g = torch.Generator().manual_seed(100 * step + (hvd.rank() if rank is None else rank))
    return torch.randn(8, n, generator=g)


def mlp(seed=0):
    """A small MLP (20 -> 16 -> 4), the same initial weights on every rank (rank 0's, broadcast)."""
    import horovod.torch as hvd
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


def wrap(model, compression, params=None, **kw):
    """hvd_sparse's DistributedOptimizer around SGD(lr 0.1, momentum 0.9) over ``params`` (default: the model's)."""
    import torch

    import hvd_sparse.torch as hvds

    opt = torch.optim.SGD(model.parameters() if params is None else params, lr=0.1, momentum=0.9)
    return hvds.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression, **kw)


# -- TensorFlow / Keras workers (horovod.tensorflow) ----------------------------------------------------------------
def keras_digits(hvd, rows):
    """This rank's share of the digits training set (every size-th example), the first ``rows``: (x float32 (rows,
    64), y). numpy only: no torch in a TensorFlow job."""
    from hvd_sparse.bench.digits import load_arrays

    (x, y), _ = load_arrays(0)
    x = x.reshape(len(x), -1)[hvd.rank()::hvd.size()][:rows]
    return x.astype(np.float32), y[hvd.rank()::hvd.size()][:rows]


def keras_mlp(seed=0):
    """The digits MLP (64 -> 16 relu -> 10), the same initial weights on every rank (seeded)."""
    import tensorflow as tf

    keras = tf.keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])


def keras_weights(m):
    """The model's weights as one float32 numpy vector."""
    return np.concatenate([np.asarray(w, dtype=np.float32).reshape(-1) for w in m.get_weights()])
