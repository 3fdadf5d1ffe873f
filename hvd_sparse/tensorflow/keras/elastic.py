"""Elastic Horovod for Keras models with hvd_sparse's Keras ``DistributedOptimizer`` (Keras 3 and tf_keras).

    import hvd_sparse.tensorflow.keras as hvdk
    from hvd_sparse.tensorflow.keras import elastic

    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=hvdk.Compression.oktopk(0.01),
                                    elastic_residuals="keep")
    state = elastic.KerasState(model, opt, step=0)          # as horovod's TensorFlowKerasState

    @elastic.run                                            # Horovod's run, made safe for hvd_sparse (below)
    def train(state):
        while state.step < steps:
            train_step(x, y)                                # e.g. a tf.function: tape, opt.apply_gradients
            state.step += 1
            state.commit()

    train(state)

Why not Horovod's own ``hvd.elastic.TensorFlowKerasState``: in 0.28.1 it calls ``optimizer.variables()`` (a list,
not callable, in Keras 3) and ``broadcast_variables`` (``.ref()``, which Keras 3 variables lack), so it fails under
Keras 3; and it knows nothing of the per-rank sparse state. :class:`KerasState` is its drop-in replacement
(``commit()``, ``restore()``, ``sync()``, ``save()``, extra attributes as keyword arguments), built on
:class:`hvd_sparse.tensorflow.elastic.TensorFlowState`'s base -- see :mod:`hvd_sparse.tensorflow.elastic` for what
each call does with the sparse state (commit/restore per rank, reset: engine afresh over the new world, residual kept
or dropped by the optimizer's ``elastic_residuals``). It also works with a plain Keras optimizer, or with
``Compression.none`` (then only the variables).

Use :func:`run` (also ``hvd_sparse.tensorflow.elastic.run``), not ``horovod.tensorflow.elastic.run``: Horovod's
swallows the error by which a peer failure reaches hvd_sparse's exchange inside a ``tf.py_function`` and returns
None. With ``model.fit``, Horovod's ``horovod.tensorflow.keras.elastic.CommitStateCallback`` /
``UpdateEpochStateCallback`` only call ``state.commit()`` and set attributes; the tested recipe here is a custom loop.
"""

from __future__ import annotations

import tensorflow as tf

from ...core.validate import ELASTIC_RESIDUALS
from .._variables import optimizer_variables, unique_variables
from ..elastic import _SparseElasticState, run

__all__ = ["KerasState", "run", "ELASTIC_RESIDUALS"]


def _build_optimizer(optimizer, variables):
    """Create the optimizer's slots now (Keras builds them at the first update), so that every rank -- a process
    that joins included -- has the same optimizer variables when ``sync()`` broadcasts them."""
    if type(optimizer).__module__.startswith("tf_keras"):
        create = getattr(optimizer, "_create_all_weights", None) or optimizer.build
        with tf.init_scope():
            create(variables)
    elif not getattr(optimizer, "built", True):
        import keras

        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True


class KerasState(_SparseElasticState):
    """Elastic state of a Keras model and its optimizer (hvd_sparse's Keras ``DistributedOptimizer`` or any Keras
    optimizer), Keras 3 or tf_keras. Drop-in for Horovod's ``TensorFlowKerasState`` (TF2, eager).

    ``commit()`` keeps host copies of ``model.variables`` and the optimizer's variables and this rank's sparse state;
    ``restore()`` rolls both back; ``reset()`` restarts the sparse engine over the new world (residual per
    ``elastic_residuals``; gradients accumulated locally with ``backward_passes_per_step > 1`` are dropped);
    ``sync()`` broadcasts rank 0's variables (and the keyword attributes) to every rank.

    Args:
        model: a built Keras model.
        optimizer: the optimizer; default ``model.optimizer``. Its slots are created here if they do not exist yet.
        backend: accepted for compatibility with Horovod's signature, unused (TF2 eager only).
        kwargs: further attributes (Python objects, e.g. ``epoch=0``) kept and broadcast as by ``ObjectState``.

    Raises:
        ValueError: an unbuilt model, or no optimizer.
    """

    _api = "hvd_sparse.tensorflow.keras.elastic.KerasState"

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not getattr(model, "built", True):
            raise ValueError(f"{self._api}: the model must be built first: call model.build(input_shape) or run "
                             "one batch through it")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError(f"{self._api}: no optimizer: pass optimizer= or compile the model first")
        self.model = model
        self.optimizer = optimizer
        self.backend = backend
        _build_optimizer(optimizer, list(model.trainable_variables))
        super().__init__(**kwargs)

    def _tracked(self):
        return unique_variables(list(self.model.variables) + optimizer_variables(self.optimizer))

    def _sparse(self):
        reduction = getattr(self.optimizer, "_hvds_reduce", None)
        if reduction is None or not reduction.sparse:
            return None, None
        return reduction.states, self.optimizer._hvds_elastic_residuals == "keep"

    def _reset_sparse(self):
        if getattr(self.optimizer, "_hvds_reduce", None) is not None:
            self.optimizer._hvds_elastic_reset()
