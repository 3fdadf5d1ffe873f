"""Keras's dynamic loss scaling (``mixed_float16``) around hvd_sparse's Keras optimizer: every rank takes the same
skip decision and keeps the same loss scale.

A ``LossScaleOptimizer`` decides per step, from the gradients it sees, whether they are finite: if not, it skips
the update and halves the loss scale. Left alone it decides from *this rank's* gradients, before the inner
optimizer runs; an overflow on one rank would make that rank skip the step -- and our exchange -- while the others
enter it, so from then on the ranks would exchange gradients of different steps. The two Keras flavours are made
to agree in two ways:

* tf_keras (``TF_USE_LEGACY_KERAS=1``): its ``LossScaleOptimizer`` first asks the inner optimizer to aggregate
  the gradients (``aggregate_gradients``, the hook meant for cross-replica reduction), then checks them. The
  Keras optimizer of hvd_sparse runs its exchange there, so the loss scaler checks the *reduced* gradients, the
  same on every rank (a non-finite gradient on any rank makes the reduced gradients non-finite on every rank:
  dense allreduce, or the sparse exchange's ``nonfinite="skip"``, whose result is then all NaN). The update that
  follows (``apply_gradients(..., skip_gradients_aggregation=True)``) does not exchange again.
* Keras 3: its ``LossScaleOptimizer`` checks the gradients itself (``check_finite``) before calling the inner
  optimizer at all. :func:`install` wraps that method once (on the class) so that, when the inner optimizer is
  hvd_sparse's, the local answer is agreed across the optimizer's process set by one allreduce of one int32 (the
  count of ranks with a non-finite gradient, under the fixed name ``hvd_sparse.loss_scale.nonfinite``, the same for
  every optimizer so that ranks that built different numbers of optimizers still meet in it); every other
  ``LossScaleOptimizer`` is unchanged. The exchange then runs on every rank or on none.

Either way the scale is halved, or grown, on every rank alike, so it stays identical. Wrapping a
``LossScaleOptimizer`` in hvd_sparse's optimizer (the other way round) is refused with the recipe that works.
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf

from ...horovod_comm import in_process_set
from .._xla import refuse_xla

_LSO_NAMES = ("LossScaleOptimizer", "LossScaleOptimizerV3", "BaseLossScaleOptimizer")


def is_loss_scale_optimizer(optimizer):
    return any(klass.__name__ in _LSO_NAMES for klass in type(optimizer).__mro__)


def refuse_wrapped(optimizer, api):
    """A ``LossScaleOptimizer`` handed to hvd_sparse's DistributedOptimizer: ValueError with the working recipe."""
    if is_loss_scale_optimizer(optimizer):
        raise ValueError(
            f"{api}: got a {type(optimizer).__name__}; wrap the inner optimizer instead and put the loss scaler "
            "around hvd_sparse's optimizer: LossScaleOptimizer(hvds.DistributedOptimizer(opt)), or pass "
            "hvds.DistributedOptimizer(opt) to model.compile under the mixed_float16 policy (Keras adds the "
            "LossScaleOptimizer itself); so every rank takes the same skip decision")


def agree_finite(optimizer, finite):
    """``finite`` (this rank's boolean) -> True on every rank iff it is True on every rank of the optimizer's
    process set (one allreduce of one int32)."""
    reduction = optimizer._hvds_reduce
    ps = reduction.process_set
    if not in_process_set(ps, hvd.rank()) or ps.size() == 1:
        return finite
    refuse_xla(reduction.api)
    bad = hvd.allreduce(tf.cast(tf.logical_not(tf.cast(finite, tf.bool)), tf.int32), op=hvd.Sum,
                        name="hvd_sparse.loss_scale.nonfinite", ignore_name_scope=True, process_set=ps)
    return tf.equal(bad, 0)


def install():
    """Wrap Keras 3's ``LossScaleOptimizer.check_finite`` once (see the module docstring); idempotent."""
    try:
        from keras.optimizers import LossScaleOptimizer
    except ImportError:                     # no Keras 3
        return
    original = LossScaleOptimizer.check_finite
    if getattr(original, "_hvds_agreed", False):
        return

    def check_finite(self, grads):
        finite = original(self, grads)
        inner = getattr(self, "inner_optimizer", None)
        if getattr(inner, "_hvds_reduce", None) is None:
            return finite
        return agree_finite(inner, finite)

    check_finite._hvds_agreed = True
    check_finite.__doc__ = original.__doc__
    LossScaleOptimizer.check_finite = check_finite
