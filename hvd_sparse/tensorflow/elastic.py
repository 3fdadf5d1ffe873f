"""Elastic Horovod with hvd_sparse for TensorFlow: ``run`` and ``TensorFlowState`` (the tape path).

    import hvd_sparse.tensorflow as hvds
    import hvd_sparse.tensorflow.elastic as elastic

    compression = hvds.Compression.oktopk(0.01)            # one per model, handed to the tape every step
    state = elastic.TensorFlowState(model.trainable_variables, compression=compression, epoch=0)

    @elastic.run
    def train(state):
        while state.epoch < epochs:
            ...  tape = hvds.DistributedGradientTape(tape, compression=compression) ...
            state.epoch += 1
            state.commit()

    train(state)

Keras models and hvd_sparse's Keras ``DistributedOptimizer``: :class:`hvd_sparse.tensorflow.keras.elastic.KerasState`
(same base). Both are ``horovod.common.elastic.ObjectState`` s and behave as Horovod's ``TensorFlowState`` /
``TensorFlowKerasState``, plus the per-rank sparse state:

* ``commit()`` / ``save()``: the variables' values (host copies) and this rank's own sparse state (residual,
  thresholds, partitions, counters) -- per rank, never broadcast;
* ``restore()`` (after a failure): both are rolled back to the last commit, on every surviving rank;
* ``reset()`` (after every reset event, Horovod re-initialised over the new world; Horovod calls it also when it
  skips the next ``sync()``): the sparse engine starts afresh over the new process set at the next step --
  partitions, thresholds and step counters as at step 0 (the first step re-evaluates thresholds exactly) -- and
  this rank's residual is kept (``elastic_residuals="keep"``, default: a surviving process keeps the gradient mass it
  has not sent yet; a joining process starts from zero; the residual of a process that left is lost with it) or
  zeroed (``"drop"``);
* ``sync()`` (at the start and after a reset): rank 0's variable values are broadcast (one broadcast per dtype, no
  ``.ref()``, no ``optimizer.variables()`` call: works under Keras 3) and the other attributes with
  ``broadcast_object``, as Horovod does.

Use :func:`run` (this module's, also ``hvd_sparse.tensorflow.keras.elastic.run``) rather than Horovod 0.28.1's
``horovod.tensorflow.elastic.run``: hvd_sparse's exchange runs inside a ``tf.py_function``, so a peer failure
reaches the training loop as a ``tf.errors.UnknownError`` whose message names hvd_sparse's ``PeerFailureError``;
Horovod's ``run`` recognises only messages naming its own ops, and *returns None* for any other ``UnknownError``
-- the training function silently stops. This ``run`` turns peer failures into ``HorovodInternalError`` (restore,
reset, go on) and re-raises every other error.
"""

from __future__ import annotations

import functools

import tensorflow as tf
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError
from horovod.tensorflow.functions import broadcast_object
from horovod.tensorflow.mpi_ops import init, rank, shutdown

from ..compression import SparseCompression
from ..core.validate import check_elastic_residuals
from ._variables import broadcast_variables, broadcastable, unique_variables

#: what in a ``tf.errors.OpError``'s message means "another rank failed, Horovod shut down": hvd_sparse's
#: PeerFailureError (raised inside a tf.py_function), Horovod's own ops (as Horovod's ``run`` checks), Horovod's
#: shutdown message
_PEER_FAILURE_MARKS = ("PeerFailureError", "Horovod has been shut down", "HorovodAllreduce", "HorovodAllgather",
                       "HorovodBroadcast", "HorovodAlltoall", "HorovodReducescatter")


def _is_peer_failure(error):
    message = getattr(error, "message", None) or str(error)
    return any(mark in message for mark in _PEER_FAILURE_MARKS)


def _reset():
    shutdown()
    init()


def run(func):
    """Decorator of the elastic training function, as ``horovod.tensorflow.elastic.run``: ``func(state, ...)`` is
    re-run after every reset, with ``state`` restored (after a failure) and synchronised.

    Differences from Horovod 0.28.1's: a ``tf.errors.OpError`` raised by a failed collective -- Horovod's own ops,
    or hvd_sparse's exchange inside a ``tf.py_function`` (``PeerFailureError``) -- becomes ``HorovodInternalError``
    (restore and reset); any other error propagates (Horovod's swallows every other ``UnknownError`` and returns
    None)."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as e:
            if _is_peer_failure(e):
                raise HorovodInternalError(e) from e
            raise

    return run_fn(wrapper, _reset)


class _SparseElasticState(ObjectState):
    """Common base: the tracked variables (:meth:`_tracked`), the sparse compression and its residual policy
    (:meth:`_sparse`), and the hooks Horovod's ``run_fn`` calls. Subclasses set ``_api`` and the two methods."""

    _api = "hvd_sparse.tensorflow.elastic"

    def __init__(self, **kwargs):
        self._save_variables()
        self._save_sparse()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    # -- what is tracked -----------------------------------------------------------------------------------
    def _tracked(self):
        """The variables to save, restore and broadcast (the same list, in the same order, on every rank)."""
        raise NotImplementedError

    def _sparse(self):
        """``(states, keep_residuals)``: the sparse job's :class:`~hvd_sparse.core.state.UnitStates`, or
        ``(None, None)`` without sparse state."""
        raise NotImplementedError

    def _reset_sparse(self):
        states, keep = self._sparse()
        if states is not None:
            states.reset(keep)

    # -- Horovod's State protocol ------------------------------------------------------------------------------
    def save(self):
        self._save_variables()
        self._save_sparse()
        super().save()

    def restore(self):
        for var, value in self._saved_values:
            var.assign(value)
        states, _ = self._sparse()
        if states is not None:
            states.restore(self._saved_sparse)
        super().restore()

    def reset(self):
        """After a reset event (Horovod re-initialised; before ``sync()``, which Horovod skips when hosts were only
        removed): the sparse state starts afresh over the new world, residuals kept or dropped by policy."""
        self._reset_sparse()
        self._save_sparse()            # a later restore() must not bring back the old world's thresholds

    def sync(self):
        broadcast_variables(broadcastable(self._tracked()), 0, "hvd_sparse.elastic.sync", self._api)
        self._save_variables()
        self._save_sparse()
        super().sync()

    # -- host copies -------------------------------------------------------------------------------------------
    def _save_variables(self):
        self._saved_values = [(v, v.numpy().copy()) for v in self._tracked()]

    def _save_sparse(self):
        states, _ = self._sparse()
        self._saved_sparse = states.snapshot() if states is not None else None


class TensorFlowState(_SparseElasticState):
    """Elastic state of a list of variables trained through :func:`hvd_sparse.tensorflow.DistributedGradientTape`
    (or ``sparse_allreduce``) with a sparse ``compression`` (Horovod's ``TensorFlowState``, TF2 eager, plus the
    sparse state; see the module docstring).

    Args:
        variables: the variables to save, restore and broadcast (e.g. ``model.variables`` plus the optimizer's),
            the same list in the same order on every rank.
        compression: the sparse preset handed to the tape every step (``None``: no sparse state).
        elastic_residuals (str): ``"keep"`` (default) or ``"drop"``: this rank's residual across a reset.
        kwargs: further attributes (Python objects) kept and broadcast as by Horovod's ``ObjectState``.
    """

    _api = "hvd_sparse.tensorflow.elastic.TensorFlowState"

    def __init__(self, variables, compression=None, elastic_residuals="keep", **kwargs):
        if compression is not None and not isinstance(compression, SparseCompression):
            raise TypeError(f"{self._api}: compression must be a sparse preset (e.g. Compression.oktopk(0.01)) or "
                            f"None, got {compression!r}")
        self.variables = unique_variables(variables)
        self.compression = compression
        self._keep = check_elastic_residuals(elastic_residuals, self._api) == "keep"
        super().__init__(**kwargs)

    def _tracked(self):
        return self.variables

    def _sparse(self):
        return (self.compression.shared_state(), self._keep) if self.compression is not None else (None, None)
