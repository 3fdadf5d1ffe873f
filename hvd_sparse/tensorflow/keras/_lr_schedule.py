"""Horovod's learning-rate callbacks (``LearningRateScheduleCallback``, ``LearningRateWarmupCallback``), backend-
agnostic: they touch the optimizer only through ``learning_rate`` (a variable in Keras 3 and tf_keras) and, for
momentum correction, ``momentum`` when it is a variable. The Keras callbacks themselves are in
:mod:`hvd_sparse.tensorflow.keras.callbacks`.
"""

from __future__ import annotations

import warnings

import horovod.tensorflow as hvd
import numpy as np


def _to_numpy(value):
    if hasattr(value, "numpy"):
        value = value.numpy()
    return np.asarray(value)


def _to_float(value):
    return float(_to_numpy(value))


def _set_hparam(optimizer, name, value):
    """Set a hyperparameter so that compiled train functions see it; False when that is impossible.

    A variable (Keras 3 ``learning_rate``, tf_keras ``learning_rate``, legacy tf_keras hypers) is assigned. A Python
    number (e.g. ``momentum`` of Keras 3 and tf_keras ``SGD``) is baked into the traced train function, so changing
    the attribute would only act in eager mode: that is refused (returns False) rather than done inconsistently.
    """
    current = getattr(optimizer, name, None)
    if current is None:
        return False
    if hasattr(current, "assign"):
        current.assign(value)
        return True
    hyper = getattr(optimizer, "_hyper", None)        # tf_keras legacy OptimizerV2: setattr -> _set_hyper
    if isinstance(hyper, dict) and name in hyper:
        setattr(optimizer, name, value)
        return True
    return False


class LearningRateScheduleCallbackImpl:
    """Horovod's schedule: between ``start_epoch`` (inclusive) and ``end_epoch`` (exclusive; None: no end),

        lr = initial_lr * multiplier(epoch)          (a constant multiplier m means m ** epoch)

    set at the first batch of each epoch with the integer epoch (``staircase=True``), or before every batch with
    ``epoch' = epoch + batch / steps_per_epoch`` (``staircase=False``). Outside that range the lr is left alone, so
    several schedules (and a warmup) can follow each other. Momentum correction (momentum * new_lr / old_lr during
    the batch that changes lr, restored after it) is applied when the optimizer's momentum is a variable (tf_keras
    legacy optimizers); Keras 3 and tf_keras ``SGD`` keep ``momentum`` as a Python float compiled into the train
    function, so there it is skipped with a warning instead of acting in eager mode only. The lr at each epoch end
    goes into the logs as ``lr``."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, *args):
        super().__init__(*args)
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** epoch)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.restore_momentum = None
        self.current_epoch = None
        self._warned_momentum = False

    def _autodetect_steps_per_epoch(self):
        params = getattr(self, "params", None) or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch; pass steps_per_epoch to "
                         f"{type(self).__name__}()")

    def _learning_rate(self):
        lr = getattr(self.model.optimizer, "learning_rate", None)
        if not hasattr(lr, "assign"):
            raise ValueError(f"{type(self).__name__} needs an optimizer whose learning_rate is a constant (a "
                             f"variable), not a LearningRateSchedule; got {lr!r}")
        return lr

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        lr = self._learning_rate()
        old_lr = _to_float(lr)
        new_lr = self.initial_lr * self.multiplier(epoch)
        lr.assign(new_lr)
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and momentum is not None and old_lr:
            old_momentum = _to_float(momentum)
            if old_momentum and _set_hparam(optimizer, "momentum", old_momentum * new_lr / old_lr):
                self.restore_momentum = old_momentum
            elif old_momentum and not self._warned_momentum:
                self._warned_momentum = True
                warnings.warn(f"{type(self).__name__}: {type(optimizer).__name__}.momentum is a Python number "
                              "compiled into the train function, so momentum correction is skipped (pass "
                              "momentum_correction=False to silence this)", stacklevel=2)

    def _restore_momentum_if_needed(self):
        if self.restore_momentum:
            _set_hparam(self.model.optimizer, "momentum", self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if self.current_epoch is None or self.current_epoch < self.start_epoch or \
                (self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(self.current_epoch)
        else:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _to_float(self._learning_rate())


class LearningRateWarmupCallbackImpl(LearningRateScheduleCallbackImpl):
    """Horovod's gradual warmup: a per-batch schedule (``staircase=False``) over ``warmup_epochs`` epochs,

        epoch' = epoch + (batch + 1) / steps_per_epoch
        lr     = initial_lr / size * (epoch' * (size - 1) / warmup_epochs + 1)

    i.e. from about ``initial_lr / size`` at the first batch to exactly ``initial_lr`` at the last batch of the
    warmup, then left alone."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0,
                 *args):
        super().__init__(initial_lr, self._warmup, 0, warmup_epochs, False, momentum_correction, steps_per_epoch,
                         *args)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def _warmup(self, epoch):
        epoch += 1. / self.steps_per_epoch
        return 1. / hvd.size() * (epoch * (hvd.size() - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_to_float(self._learning_rate()):g}.")
