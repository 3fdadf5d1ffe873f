"""Horovod's Keras callbacks, rebuilt so that they work under Keras 3 *and* tf_keras, plus ``SparsityCallback``.

    import horovod.tensorflow as hvd
    import hvd_sparse.tensorflow.keras as hvds

    callbacks = [
        hvds.callbacks.BroadcastGlobalVariablesCallback(0),     # same weights everywhere after the 1st batch
        hvds.callbacks.MetricAverageCallback(),                 # epoch logs averaged over ranks
        hvds.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=3),
        hvds.callbacks.LearningRateScheduleCallback(initial_lr=0.05, multiplier=lambda epoch: 0.1, start_epoch=30),
        hvds.callbacks.SparsityCallback(),                      # sparse_density / _sent_bytes / _residual_norm
        tf.keras.callbacks.TensorBoard(...),                    # after them: sees the averaged values
    ]
    model.fit(x, y, callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)

Why not Horovod's own (``horovod.tensorflow.keras.callbacks``, 0.28.1): under Keras 3 they call ``.ref()`` on
Keras variables, ``keras.backend.constant`` / ``get_value`` (gone in Keras 3) and ``optimizer.lr``; under tf_keras
they import ``keras.backend``, which is Keras 3. These versions keep Horovod's
structure (backend-agnostic ``*Impl`` mixins + thin subclasses of ``Callback``) but touch Keras only through
what both flavours share: ``variable.assign`` / ``.numpy()``, ``optimizer.learning_rate``, ``model.variables``.

Which Keras: the callbacks subclass ``tf.keras.callbacks.Callback`` as resolved **when this module is first
imported**, i.e. Keras 3 unless ``TF_USE_LEGACY_KERAS=1`` is set (then tf_keras) -- the same rule that decides what
``tf.keras`` is, so a script that builds its model with ``tf.keras`` always matches. ``KERAS`` is that module and
``FLAVOUR`` is ``"keras"`` or ``"tf_keras"``. Set ``TF_USE_LEGACY_KERAS`` before importing this module; a model of
the other flavour (``type(model).__module__`` starts with the other prefix, e.g. ``import tf_keras`` without the
variable) is rejected with a ``TypeError`` when ``fit`` attaches the callback, instead of failing obscurely inside
Keras.

Collectives: all through ``horovod.tensorflow``, eager, on the global process set, with fixed names
``hvd_sparse.keras.<Callback>.<what>`` that are the same on every rank. Every rank must therefore run the same
callbacks in the same order, as with Horovod.
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from ...core.state import SparsityWindow, averaged
from .._variables import broadcast_variables, broadcastable, keras_flavour, optimizer_variables, same_variable
from ._lr_schedule import LearningRateScheduleCallbackImpl, LearningRateWarmupCallbackImpl, _to_numpy

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "SparsityCallback", "KERAS", "FLAVOUR"]

#: The Keras module whose ``callbacks.Callback`` these classes subclass (``tf.keras`` at import time).
KERAS = tf.keras
_Callback = KERAS.callbacks.Callback


#: ``"keras"`` (Keras 3) or ``"tf_keras"``: the flavour of ``KERAS``.
FLAVOUR = keras_flavour(_Callback)

_PREFIX = "hvd_sparse.keras"
_optimizer_variables = optimizer_variables
_same_variable = same_variable


# -- helpers (no Keras API) ------------------------------------------------------------------------------------
def _allreduce_vector(values, name, op, device=""):
    """Eager allreduce of a float64 vector (possibly empty) under a fixed name; numpy result."""
    with tf.device(device):
        out = hvd.allreduce(tf.constant(np.asarray(values, dtype=np.float64).reshape(-1), dtype=tf.float64),
                            op=op, name=name, ignore_name_scope=True)
    return out.numpy()


class _FlavourCheck:
    """Rejects a model of the other Keras flavour when Keras attaches the callback (``set_model``)."""

    def set_model(self, model):
        flavour = keras_flavour(model)
        if flavour is not None and FLAVOUR is not None and flavour != FLAVOUR:
            raise TypeError(
                f"hvd_sparse.tensorflow.keras.callbacks.{type(self).__name__} was built for "
                f"{'tf_keras' if FLAVOUR == 'tf_keras' else 'Keras 3'} (tf.keras when the module was imported: "
                f"TF_USE_LEGACY_KERAS={'1' if FLAVOUR == 'tf_keras' else 'unset'}), but the model is a "
                f"{type(model).__module__}.{type(model).__name__}; set TF_USE_LEGACY_KERAS=1 before importing "
                "TensorFlow to use tf_keras, or leave it unset for Keras 3, and build the model with tf.keras")
        super().set_model(model)


# -- backend-agnostic implementations --------------------------------------------------------------------------
class BroadcastGlobalVariablesCallbackImpl:
    """Broadcast ``model.variables`` (minus registered local ones) and the optimizer's variables from
    ``root_rank`` once, at the end of the first batch (optimizer slots only exist after the first update)."""

    def __init__(self, root_rank, device='', local_variables=None, *args):
        super().__init__(*args)
        self.root_rank = int(root_rank)
        self.device = device
        self.broadcast_done = False
        self._local_vars = []
        if local_variables is not None:
            for var in (local_variables if isinstance(local_variables, (list, tuple)) else [local_variables]):
                self.register_local_var(var)

    def register_local_var(self, var):
        """Exclude ``var`` (a Keras or tf variable) from the broadcast: it stays worker-local."""
        if not any(v is var for v in self._local_vars):
            self._local_vars.append(var)

    def _variables(self):
        seen = []
        candidates = list(self.model.variables) + _optimizer_variables(getattr(self.model, "optimizer", None))
        for var in candidates:
            if any(_same_variable(var, s) for s in seen) or any(_same_variable(var, lv) for lv in self._local_vars):
                continue
            seen.append(var)
        return broadcastable(seen)

    def broadcast(self):
        """Broadcast now (collective: every rank calls it)."""
        # Same variable list everywhere (checked first), one broadcast per dtype
        broadcast_variables(self._variables(), self.root_rank, f"{_PREFIX}.BroadcastGlobalVariablesCallback",
                            "hvd_sparse BroadcastGlobalVariablesCallback", device=self.device)

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        self.broadcast()
        self.broadcast_done = True


class MetricAverageCallbackImpl:
    """At every epoch end, replace each numeric entry of ``logs`` by its average over ranks, in place, so that
    History, the progress bar and later callbacks (TensorBoard, checkpoints) see averaged values, identical on
    all ranks. Scalars go in one float64 allreduce, in sorted key order; non-scalar entries one allreduce each."""

    def __init__(self, device='', *args):
        super().__init__(*args)
        self.device = device

    def _average_metrics_in_place(self, logs):
        if logs is None:
            logs = {}
        scalars, arrays = [], []
        for key in sorted(logs):
            try:
                value = _to_numpy(logs[key]).astype(np.float64)
            except (TypeError, ValueError):
                continue                    # not numeric: left as is
            (scalars if value.ndim == 0 else arrays).append((key, value))
        tag = f"{_PREFIX}.MetricAverageCallback"
        # Always issued, even empty: ranks with different metric counts then fail on the shape, not hang.
        reduced = _allreduce_vector([v for _, v in scalars], f"{tag}.scalars", hvd.Average, self.device)
        for (key, _), value in zip(scalars, reduced):
            logs[key] = float(value)
        for i, (key, value) in enumerate(arrays):
            with tf.device(self.device):
                logs[key] = hvd.allreduce(tf.constant(value), op=hvd.Average, name=f"{tag}.array{i}",
                                          ignore_name_scope=True).numpy()
        return logs

    def on_epoch_end(self, epoch, logs=None):
        self._average_metrics_in_place(logs)


class SparsityCallbackImpl:
    """Puts the sparse exchange's statistics into the logs, averaged over ranks (identical on every rank):

    * ``sparse_density``: selected / n of the exchanged gradient, averaged over the epoch's steps and the ranks;
    * ``sparse_sent_bytes``: bytes sent per step by a rank, same averaging;
    * ``sparse_residual_norm``: L2 norm of the error-feedback residual at the end of the epoch, rank average.

    They come from ``model.optimizer.sparse_stats()`` (read after every training batch; with
    ``steps_per_execution > 1`` only the last step of each execution is seen) and ``.residual_norm()``. When the
    optimizer made no sparse step (``Compression.none``/``fp16``, or a plain Keras optimizer), the values describe
    Horovod's dense ring allreduce: density 1.0, ``2 n (P - 1) / P * 4`` bytes (float32 gradients of the n
    trainable weights), residual 0 -- so dense and sparse runs can be compared on the same plots.

    ``every_n_batches > 0`` also averages the statistics of the last ``every_n_batches`` batches (counted as
    ``on_train_batch_end`` calls) over ranks and puts them into the batch logs (progress bar, TensorBoard with
    ``update_freq``), repeated in the batch logs until the next update. Put this callback before TensorBoard.
    """

    KEYS = ("sparse_density", "sparse_sent_bytes", "sparse_residual_norm")

    def __init__(self, every_n_batches=0, *args):
        super().__init__(*args)
        if int(every_n_batches) < 0:
            raise ValueError(f"every_n_batches must be >= 0, got {every_n_batches}")
        self.every_n_batches = int(every_n_batches)
        self._epoch = SparsityWindow()
        self._window = SparsityWindow()
        self._calls = 0
        self._latest = None

    def _optimizer(self):
        return getattr(self.model, "optimizer", None)

    def on_train_begin(self, logs=None):
        self._calls, self._latest = 0, None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch.clear()

    def on_train_batch_end(self, batch, logs=None):
        stats_fn = getattr(self._optimizer(), "sparse_stats", None)
        stats = stats_fn() if stats_fn is not None else {}
        self._epoch.add(stats)
        self._window.add(stats)
        self._calls += 1
        if self.every_n_batches and self._calls % self.every_n_batches == 0:
            self._latest = self._reduce(self._window, "batch")
            self._window.clear()
        if self._latest is not None and logs is not None:
            logs.update(self._latest)

    def _reduce(self, window, tag):
        """Collective: the window's statistics averaged over ranks (hvd_sparse.core.state)."""
        norm_fn = getattr(self._optimizer(), "residual_norm", None)
        local = window.local(float(norm_fn()) if norm_fn is not None else 0.0)
        total = _allreduce_vector(local, f"{_PREFIX}.SparsityCallback.{tag}", hvd.Sum)
        avg = averaged(total, hvd.size(),
                       lambda: sum(int(np.prod(v.shape)) for v in self.model.trainable_variables))
        return {"sparse_density": avg["density"], "sparse_sent_bytes": avg["sent_bytes"],
                "sparse_residual_norm": avg["residual_norm"]}

    def on_epoch_end(self, epoch, logs=None):
        values = self._reduce(self._epoch, "epoch")
        if logs is not None:
            logs.update(values)


# -- the Keras callbacks ---------------------------------------------------------------------------------------
class BroadcastGlobalVariablesCallback(_FlavourCheck, BroadcastGlobalVariablesCallbackImpl, _Callback):
    """Broadcast all global variables (model and optimizer) from ``root_rank`` at the end of the first batch, so
    that ranks started from different initial weights (or a checkpoint on one rank) train the same model.

    Args:
        root_rank (int): rank whose values everybody receives.
        device (str): device for the broadcasts (``tf.device``); default: Horovod's choice.
        local_variables: a variable or list of variables left worker-local (not broadcast).
    """

    def __init__(self, root_rank, device='', local_variables=None):
        super().__init__(root_rank, device, local_variables)


class MetricAverageCallback(_FlavourCheck, MetricAverageCallbackImpl, _Callback):
    """Average the epoch's metrics (``logs``) over ranks, in place; put it before callbacks that read metrics
    (TensorBoard, ModelCheckpoint, EarlyStopping, ReduceLROnPlateau).

    Args:
        device (str): device for the allreduce.
    """

    def __init__(self, device=''):
        super().__init__(device)


class LearningRateScheduleCallback(_FlavourCheck, LearningRateScheduleCallbackImpl, _Callback):
    """Horovod's ``LearningRateScheduleCallback``: ``lr = initial_lr * multiplier(epoch)`` between ``start_epoch`` and
    ``end_epoch`` (see ``LearningRateScheduleCallbackImpl``).

    Args:
        initial_lr (float): the learning rate the multiplier scales.
        multiplier: a constant ``m`` (``lr = initial_lr * m ** epoch``) or a function ``f(epoch)``.
        start_epoch (int), end_epoch (int or None): the epochs it acts on, ``[start_epoch, end_epoch)``.
        staircase (bool): True: set once per epoch (integer epoch); False: before every batch (fractional epoch).
        momentum_correction (bool): scale momentum with the lr change during a batch (when possible).
        steps_per_epoch (int): batches per epoch (``staircase=False``); default: from ``fit``'s parameters.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__(initial_lr, multiplier, start_epoch, end_epoch, staircase, momentum_correction,
                         steps_per_epoch)


class LearningRateWarmupCallback(_FlavourCheck, LearningRateWarmupCallbackImpl, _Callback):
    """Gradual learning-rate warmup from ``initial_lr / hvd.size()`` to ``initial_lr`` over ``warmup_epochs``
    (Goyal et al., 2017), adjusted every batch; Horovod's semantics (see ``LearningRateWarmupCallbackImpl``).

    Args:
        initial_lr (float): the target learning rate (usually the single-worker lr times ``hvd.size()``).
        warmup_epochs (int): length of the warmup. Default 5.
        momentum_correction (bool): scale momentum with the lr change during a batch (when possible).
        steps_per_epoch (int): batches per epoch; default: from ``fit``'s parameters.
        verbose (int): 1 prints a line on rank 0 when the warmup ends.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__(initial_lr, warmup_epochs, momentum_correction, steps_per_epoch, verbose)


class SparsityCallback(_FlavourCheck, SparsityCallbackImpl, _Callback):
    """Log ``sparse_density``, ``sparse_sent_bytes`` (per step) and ``sparse_residual_norm`` averaged over ranks
    at every epoch end (and every ``every_n_batches`` batches if > 0); see ``SparsityCallbackImpl``.

    Args:
        every_n_batches (int): 0 (default): epoch logs only.
    """

    def __init__(self, every_n_batches=0):
        super().__init__(every_n_batches)
