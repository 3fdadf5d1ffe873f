"""The consistency guard of hvd_sparse.tensorflow: proves that all ranks hold bit-identical variables (two 64-bit
checksums per variable, one allgather), eagerly or inside a ``tf.function``. Used by the Keras optimizer
(``consistency_check_every``, ``check_consistency()``) and by :func:`check_consistency` for the tape path."""

from __future__ import annotations

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow import global_process_set

from ..horovod_comm import in_process_set
from ..core.errors import check_replicas_agree, checksums


def variable_name(variable):
    """A variable's name for messages: Keras 3's ``path`` (``"sequential/dense/kernel"``), else ``name``."""
    return getattr(variable, "path", None) or variable.name


def check_now(names, values, process_set, step, name, api):
    """The check, eagerly, on ``values`` (arrays) of the variables called ``names``."""
    if not in_process_set(process_set, hvd.rank()) or process_set.size() == 1:
        return
    sums = np.array([checksums(np.asarray(v)) for v in values], dtype=np.int64).reshape(1, -1, 2)
    gathered = hvd.allgather(tf.constant(sums), name=name, ignore_name_scope=True, process_set=process_set)
    per_rank = [[tuple(c) for c in row] for row in gathered.numpy().tolist()]
    check_replicas_agree(list(names), per_rank, step, api)


def run_check(variables, check, extra_inputs=()):
    """Run ``check(values, *extra)`` on the current values of ``variables``: at once eagerly; inside a ``tf.function``
    in a ``tf.py_function`` (returned) that takes the values as inputs -- reads of the variables, which TensorFlow's
    automatic control dependencies order after every earlier write to them (a py_function without those inputs
    could run before the update: it is ordered with nothing)."""
    n = len(variables)

    def run(*args):
        check([a.numpy() for a in args[:n]], *[a.numpy() for a in args[n:]])
        return tf.constant(0, tf.int32)

    if tf.executing_eagerly():
        check([np.asarray(v.numpy()) for v in variables], *[np.asarray(x) for x in extra_inputs])
        return None
    return tf.py_function(run, [tf.convert_to_tensor(v) for v in variables] + list(extra_inputs), tf.int32)


def check_consistency(variables, process_set=global_process_set, name="hvd_sparse.consistency", step=None):
    """Collective: raise :class:`hvd_sparse.ReplicaDivergenceError` on every rank unless all ranks of
    ``process_set`` hold bit-identical ``variables`` (two 64-bit checksums of each variable's bits, one allgather of
    16 bytes per variable; the message names the first differing variable and the ranks that differ from rank 0).

    For the ``DistributedGradientTape`` path (the Keras ``DistributedOptimizer`` has ``consistency_check_every=N``
    and ``check_consistency()``): call it every N steps with ``model.trainable_variables`` (every rank, same list,
    same order). Eagerly it raises ``ReplicaDivergenceError`` itself; inside a ``tf.function`` it runs eagerly in a
    ``tf.py_function`` (returned) fed with reads of the variables, so that it sees every earlier update of them, and
    the step fails with a ``tf.errors.UnknownError`` carrying the same message.

    Args:
        variables: ``tf.Variable`` s or Keras variables, the same list in the same order on every rank.
        process_set: the ranks that must agree. Default: all ranks.
        name: the allgather's name (the same on every rank).
        step: the step number for the message: an int, or a tensor / variable read when the check runs (e.g.
            ``optimizer.iterations``). Default: unknown (``?``).
    """
    api = "hvd_sparse.tensorflow.check_consistency"
    variables = list(variables)
    names = [variable_name(v) for v in variables]
    # a step given as a tensor or variable (e.g. optimizer.iterations) is read when the check runs
    extra = [tf.convert_to_tensor(step)] if step is not None and not isinstance(step, (int, np.integer)) else []

    def check(values, *at):
        check_now(names, values, process_set, int(at[0]) if at else ("?" if step is None else int(step)), name,
                   api)

    return run_check(variables, check, extra)
