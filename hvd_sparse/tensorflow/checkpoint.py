"""Checkpoints of the per-rank sparse state in TensorFlow: :class:`SparseState` (for ``tf.train.Checkpoint``),
:func:`sparse_state_dict` / :func:`load_sparse_state_dict` (plain dicts), over a job's
:class:`hvd_sparse.core.state.UnitStates` -- the same format and checks as the torch optimizer's. A Keras optimizer
keeps its own job; a tape and ``sparse_allreduce`` use their preset's (``shared_state()``)."""

from __future__ import annotations

import pickle

import tensorflow as tf
from horovod.tensorflow import global_process_set

from ..compression import SparseCompression

_Trackable = tf.__internal__.tracking.Trackable


def sparse_state_dict(compression, process_set=global_process_set, api="hvd_sparse.tensorflow.sparse_state_dict"):
    """This rank's sparsification state of every unit of the job ``compression`` names (a preset, handed to a tape
    or to ``sparse_allreduce``; or a tape or Keras optimizer of hvd_sparse) in numpy arrays and Python values:
    ``{"version", "rank", "size", "compression", "units": {unit: Engine.state_dict()}}`` (see
    :meth:`hvd_sparse.core.state.UnitStates.state_dict`); a state restored but not yet used by a step is included
    as it was restored."""
    states, ps = sparse_target(compression, process_set, api)
    return states.state_dict(ps.rank(), ps.size())


def load_sparse_state_dict(compression, state, process_set=global_process_set, api="hvd_sparse.tensorflow"):
    """Restore :func:`sparse_state_dict` into the job ``compression`` names: at once into the units that exist, at
    their first step into the others. Raises ValueError (and restores nothing) for a state of another rank, another
    number of ranks or another compression."""
    states, ps = sparse_target(compression, process_set, api)
    states.load_state_dict(state, ps.rank(), ps.size(), api)


def sparse_target(obj, process_set, api):
    """``(states, process_set)`` of ``obj``: the job state of a :func:`DistributedGradientTape` or a Keras
    ``DistributedOptimizer`` of hvd_sparse that uses a sparse preset, or the ``shared_state()`` of a preset
    (``process_set`` None: the tape's or optimizer's, else all ranks). Raises TypeError naming ``api`` for anything
    else, a dense one included (no sparse state to save), and for a preset whose state an optimizer keeps."""
    reduction = getattr(obj, "_hvds_reduce", None)
    compression = obj if reduction is None else reduction.compression
    if reduction is not None and process_set is None:
        process_set = reduction.process_set
    if not isinstance(compression, SparseCompression):
        raise TypeError(f"{api}: expected a sparse compression preset, or a DistributedGradientTape / Keras "
                        f"DistributedOptimizer of hvd_sparse that uses one, got {obj!r}"
                        + (" (it reduces densely: there is no sparse state to save)" if reduction is not None
                           else ""))
    if reduction is None and compression.reified_elsewhere():
        raise TypeError(f"{api}: {compression!r} is used by an optimizer of hvd_sparse, which keeps its own sparse "
                        "state (one preset may serve several optimizers), and by no tape or sparse_allreduce yet: pass "
                        "the optimizer, e.g. SparseState(optimizer)")
    states = compression.shared_state() if reduction is None else reduction.states
    return states, process_set or global_process_set


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
        self._hvds_states, self._hvds_process_set = sparse_target(obj, process_set, "hvd_sparse.SparseState")

    def state_dict(self):
        """What is saved: the job's :meth:`~hvd_sparse.core.state.UnitStates.state_dict`."""
        ps = self._hvds_process_set
        return self._hvds_states.state_dict(ps.rank(), ps.size())

    def load_state_dict(self, state):
        ps = self._hvds_process_set
        self._hvds_states.load_state_dict(state, ps.rank(), ps.size(), "hvd_sparse.SparseState")

    def _serialize_to_tensors(self):
        return {"state": tf.constant(pickle.dumps(self.state_dict(), protocol=4), dtype=tf.string)}

    def _restore_from_tensors(self, restored_tensors):
        self.load_state_dict(pickle.loads(restored_tensors["state"].numpy()))
        return tf.no_op()
