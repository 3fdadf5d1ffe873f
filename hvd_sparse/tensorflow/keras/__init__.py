"""hvd_sparse for Keras (Keras 3 with the TensorFlow backend, and tf_keras with ``TF_USE_LEGACY_KERAS=1``).

    import horovod.tensorflow as hvd
    import hvd_sparse.tensorflow.keras as hvds

    opt = hvds.DistributedOptimizer(tf.keras.optimizers.SGD(0.05),
                                    compression=hvds.Compression.oktopk(density=0.01))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvds.callbacks.BroadcastGlobalVariablesCallback(0), ...])

Why not Horovod's own: under Keras 3 (the default ``tf.keras`` of TensorFlow >= 2.16) Horovod 0.28.1's Keras
optimizer overrides Keras 2 internals that Keras 3 never calls, so it silently stops averaging gradients
(spec horovod_integration.md §2.3). This optimizer intercepts the public entry point of each flavour --
``apply(grads, variables)`` in Keras 3 (``apply_gradients`` and ``model.fit`` both go through it),
``apply_gradients(grads_and_vars)`` in tf_keras -- and reduces there, with a dense Horovod allreduce for
``Compression.none``/``fp16`` and one engine step (the same engine as PyTorch) for a sparse preset.
"""

from __future__ import annotations

import weakref

from horovod.tensorflow import Average, global_process_set

from ...compression import SparseCompression
from ...core.errors import check_op, check_positive_int
from .. import Compression, _Reduction

_API = "hvd_sparse.tensorflow.keras.DistributedOptimizer"

__all__ = ["Compression", "DistributedOptimizer", "callbacks"]


def _is_tf_keras(optimizer):
    return type(optimizer).__module__.startswith("tf_keras")


class _Keras3Methods:
    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        grads = self._hvds_reduce(list(grads), variables)
        return self._hvds_inner.apply(self, grads, trainable_variables)


class _TFKerasMethods:
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        variables = [v for _, v in grads_and_vars]
        grads = self._hvds_reduce([g for g, _ in grads_and_vars], variables)
        return self._hvds_inner.apply_gradients(self, list(zip(grads, variables)), *args, **kwargs)


class _CommonMethods:
    def sparse_stats(self):
        """Statistics of this rank's last sparse step: ``n, k, selected, density, sent_bytes, recv_bytes,
        sent_words, recv_words, collectives``; empty with a dense compression or before the first step."""
        comp = self._hvds_reduce.compression
        entry = getattr(comp, "_engines", {}).get("model")
        if entry is None or not entry[1].steps:
            return {}
        return {k: v for k, v in entry[1].last.items() if k != "info"}

    def residual_norm(self):
        """L2 norm of this rank's error-feedback residual (0.0 with a dense compression)."""
        comp = self._hvds_reduce.compression
        entry = getattr(comp, "_engines", {}).get("model")
        return 0.0 if entry is None else entry[1].residual_norm()


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer so that every update first averages the gradients over Horovod ranks -- sparsely,
    when ``compression`` is a sparse preset. Horovod's signature (``horovod.tensorflow.keras``), in its order.

    The result is an instance of a subclass of your optimizer's class (same name), rebuilt with
    ``cls.from_config(optimizer.get_config())`` as Horovod does, with ``sparse_stats()`` and ``residual_norm()``.

    Args:
        optimizer: a Keras 3 or tf_keras optimizer (not yet wrapped).
        compression: ``Compression.none`` (dense Horovod allreduce), ``Compression.fp16``, or a sparse preset
            such as ``Compression.oktopk(density=0.01)``.
        op: ``hvd.Average`` (default) or ``hvd.Sum``. ``hvd.Adasum`` is not supported.
        gradient_predivide_factor, process_set, sparse_as_dense: as in Horovod.
        backward_passes_per_step: only 1 is supported yet (ValueError otherwise).
        name, device_dense, device_sparse, average_aggregated_gradients, num_groups, groups,
        scale_local_gradients: accepted for compatibility; the sparse path reduces the model as one unit.

    Raises:
        ValueError: an optimizer that is already distributed (by hvd_sparse or Horovod), or bad arguments.
        NotImplementedError: ``op=hvd.Adasum``.
    """
    if getattr(optimizer, "_hvds_reduce", None) is not None \
            or type(optimizer).__module__.startswith("horovod"):
        raise ValueError(f"{_API}: {type(optimizer).__name__} is already a distributed optimizer (wrapped by "
                         "hvd_sparse or Horovod); wrap the plain Keras optimizer once")
    check_op(op, gradient_predivide_factor, _API)
    owner = getattr(compression, "_hvds_keras_owner", None)
    if owner is not None and owner() is not None:
        raise ValueError(f"{_API}: {compression!r} is already used by another optimizer; a sparse preset keeps "
                         "per-model state (residuals, thresholds): create one per optimizer")
    if check_positive_int(backward_passes_per_step, "backward_passes_per_step", _API) != 1:
        raise ValueError(f"{_API}: backward_passes_per_step > 1 is not supported yet, got "
                         f"{backward_passes_per_step}; accumulate gradients before apply_gradients instead")
    methods = dict(_TFKerasMethods.__dict__ if _is_tf_keras(optimizer) else _Keras3Methods.__dict__)
    methods.update({k: v for k, v in _CommonMethods.__dict__.items() if not k.startswith("__")})
    methods = {k: v for k, v in methods.items() if not k.startswith("__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(methods, _hvds_inner=optimizer.__class__, __module__=optimizer.__class__.__module__))
    new = cls.from_config(optimizer.get_config())
    new._hvds_reduce = _Reduction(compression, op, gradient_predivide_factor, sparse_as_dense, process_set, _API)
    if isinstance(compression, SparseCompression):
        compression._hvds_keras_owner = weakref.ref(new)
    return new


def __getattr__(name):          # ``hvds.callbacks`` without importing Keras callbacks eagerly
    if name == "callbacks":     # (``from . import callbacks`` here would recurse through hasattr)
        import importlib

        return importlib.import_module(__name__ + ".callbacks")
    raise AttributeError(name)
