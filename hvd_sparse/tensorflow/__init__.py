"""hvd_sparse for TensorFlow 2: ``import hvd_sparse.tensorflow as hvds`` next to ``import horovod.tensorflow as hvd``.

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvds.DistributedGradientTape(tape, compression=hvds.Compression.oktopk(density=0.01))
    grads = tape.gradient(loss, model.trainable_variables)

How it runs: the gradients of all sources are concatenated (in the order of ``sources``, which is the same on
every rank) into one float32 buffer, and one engine step -- the same engine code as PyTorch and the simulator:
agreement, error feedback, sparsifier, sparse allreduce -- runs on it inside a ``tf.py_function``, eagerly and
inside ``tf.function`` alike, on the TensorFlow eager tensor itself; its collectives are Horovod's TensorFlow ops,
named ``hvd_sparse.<unit>.<phase>``. The engine's state (residuals, thresholds) lives in the compression object,
in Python, so it survives retracing; :class:`SparseState` puts it into a ``tf.train.Checkpoint``.

The package, a file per role:

* ``tape.py`` -- :func:`DistributedGradientTape`; ``optimizer.py`` -- :func:`DistributedOptimizer` (forwards Keras
  optimizers to ``hvd_sparse.tensorflow.keras``); ``mpi_ops.py`` -- :func:`sparse_allreduce`;
* ``reduction.py`` -- where the gradients are handed to the engine (``engine_step``, ``Reduction``), for the tape,
  the Keras optimizer and ``sparse_allreduce`` alike; ``comm.py`` -- the engine's Horovod collectives;
* ``checkpoint.py`` -- :class:`SparseState`, ``sparse_state_dict`` / ``load_sparse_state_dict``;
* ``_consistency.py`` -- :func:`check_consistency`, the consistency guard; ``elastic.py`` -- elastic Horovod
  (``TensorFlowState``, ``run``); ``_variables.py``, ``_xla.py`` -- Keras variables and their broadcast, the XLA
  refusal; ``compression.py`` -- :class:`Compression`;
* ``keras/`` -- ``hvd_sparse.tensorflow.keras``: the Keras ``DistributedOptimizer``, callbacks, ``KerasState``.
"""

from __future__ import annotations

from horovod.tensorflow import global_process_set

from ..core.validate import ELASTIC_RESIDUALS
from ._consistency import check_consistency, variable_name
from ._variables import broadcast_variables as _broadcast_variables
from .checkpoint import SparseState, load_sparse_state_dict, sparse_state_dict
from .compression import Compression
from .mpi_ops import sparse_allreduce
from .optimizer import DistributedOptimizer
from .tape import DistributedGradientTape

__all__ = ["Compression", "DistributedGradientTape", "DistributedOptimizer", "SparseState", "broadcast_variables",
           "check_consistency", "sparse_allreduce"]


def broadcast_variables(variables, root_rank, process_set=global_process_set):
    """Assign ``root_rank``'s values of ``variables`` on every rank, as Horovod's ``hvd.broadcast_variables``, for
    every dtype: a dtype Horovod lacks (bfloat16) travels as its bits (int16). Eager, collective; also takes Keras 3
    variables (Horovod's calls ``.ref()``, which they lack). One broadcast per dtype, after one allgather that proves
    every rank holds the same number and total size of variables (ValueError on every rank otherwise)."""
    _broadcast_variables(variables, root_rank, "hvd_sparse.broadcast_variables",
                         "hvd_sparse.tensorflow.broadcast_variables", process_set=process_set)
