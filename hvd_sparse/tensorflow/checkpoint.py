"""Checkpoints of the per-rank sparse state in TensorFlow: :class:`SparseState` (for ``tf.train.Checkpoint``),
:func:`sparse_state_dict` / :func:`load_sparse_state_dict` (plain dicts), over the preset's
:class:`hvd_sparse.core.state.UnitStates` -- the same format and checks as the torch optimizer's."""

from __future__ import annotations

import pickle

import tensorflow as tf
from horovod.tensorflow import global_process_set

from ..compression import SparseCompression

_Trackable = tf.__internal__.tracking.Trackable


def sparse_state_dict(compression, process_set=global_process_set):
    """This rank's sparsification state of every unit of ``compression`` (numpy arrays and Python values):
    ``{"version", "rank", "size", "compression", "units": {unit: Engine.state_dict()}}`` (see
    :meth:`hvd_sparse.core.state.UnitStates.state_dict`); a state restored but not yet used by a step is included
    as it was restored."""
    return compression.states.state_dict(process_set.rank(), process_set.size())


def load_sparse_state_dict(compression, state, process_set=global_process_set, api="hvd_sparse.tensorflow"):
    """Restore :func:`sparse_state_dict` into ``compression``: at once into the units that exist, at their first
    step into the others. Raises ValueError (and restores nothing) for a state of another rank, another
    number of ranks or another compression."""
    compression.states.load_state_dict(state, process_set.rank(), process_set.size(), api)


def sparse_target(obj, process_set, api):
    """``(compression, process_set)`` of ``obj``: a sparse preset, a :func:`DistributedGradientTape` or a Keras
    ``DistributedOptimizer`` of hvd_sparse that uses one (``process_set`` None: the tape's or optimizer's, else all
    ranks). Raises TypeError naming ``api`` for anything else, a dense one included (no sparse state to save)."""
    reduction = getattr(obj, "_hvds_reduce", None)
    compression = obj if reduction is None else reduction.compression
    if reduction is not None and process_set is None:
        process_set = reduction.process_set
    if not isinstance(compression, SparseCompression):
        raise TypeError(f"{api}: expected a sparse compression preset, or a DistributedGradientTape / Keras "
                        f"DistributedOptimizer of hvd_sparse that uses one, got {obj!r}"
                        + (" (it reduces densely: there is no sparse state to save)" if reduction is not None
                           else ""))
    return compression, process_set or global_process_set


class SparseState(_Trackable):
    """The sparsification state of one rank (residuals, thresholds, partitions, step counters) as an object
    ``tf.train.Checkpoint`` can save and restore::

        ckpt = tf.train.Checkpoint(model=model, optimizer=opt, sparse=hvds.SparseState(opt))
        ckpt.write(f"ckpt/rank{hvd.rank()}")          # EVERY rank writes its own file
        ...
        ckpt.read(f"ckpt/rank{hvd.rank()}")           # each rank reads the file it wrote

    Residuals are per rank (the gradient mass this rank has not sent yet), so unlike model weights the state
    must not be broadcast from rank 0: every rank saves and restores its own checkpoint, with the rank in the
    path. Restoring another rank's file, a file of a job with another number of ranks, or a state of another
    compression (scheme or arguments) raises ValueError from ``read``/``restore``. A state restored before the
    first step is applied at that step, so restore into a freshly built model, optimizer and preset works.

    The state travels as one ``tf.string`` tensor (a pickle of the engines' ``state_dict()``): load checkpoints
    only from sources you trust, as with ``pickle`` or ``torch.load``. Save and restore eagerly
    (``tf.train.Checkpoint.write/read/save/restore``); SparseState is not part of a SavedModel.

    Args:
        obj: a Keras ``DistributedOptimizer`` of hvd_sparse, a ``DistributedGradientTape`` of hvd_sparse, or the
            sparse preset itself (e.g. the ``Compression.oktopk(...)`` object handed to a tape each step, or to
            ``sparse_allreduce``).
        process_set: the ranks taking part. Default: the optimizer's or tape's, else all ranks.
    """

    def __init__(self, obj, process_set=None):
        self._hvds_compression, self._hvds_process_set = sparse_target(obj, process_set, "hvd_sparse.SparseState")

    def state_dict(self):
        """What is saved: :func:`sparse_state_dict` of the compression."""
        return sparse_state_dict(self._hvds_compression, self._hvds_process_set)

    def load_state_dict(self, state):
        load_sparse_state_dict(self._hvds_compression, state, self._hvds_process_set, "hvd_sparse.SparseState")

    def _serialize_to_tensors(self):
        return {"state": tf.constant(pickle.dumps(self.state_dict(), protocol=4), dtype=tf.string)}

    def _restore_from_tensors(self, restored_tensors):
        self.load_state_dict(pickle.loads(restored_tensors["state"].numpy()))
        return tf.no_op()
