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

``backward_passes_per_step=N`` accumulates the gradients of N calls locally (in ``tf.Variable`` s) and reduces
and applies them on the N-th, as Horovod does; ``sparse_state_dict()`` / ``load_sparse_state_dict()`` and
:class:`hvd_sparse.tensorflow.SparseState` checkpoint the per-rank sparse state.
"""

from __future__ import annotations

import weakref

import tensorflow as tf
from horovod.tensorflow import Average, global_process_set

from ...compression import SparseCompression
from ...core.errors import check_op, check_positive_int
from .. import Compression, SparseState, _Reduction, load_sparse_state_dict, sparse_state_dict

_API = "hvd_sparse.tensorflow.keras.DistributedOptimizer"

__all__ = ["Compression", "DistributedOptimizer", "SparseState", "callbacks"]


def _is_tf_keras(optimizer):
    return type(optimizer).__module__.startswith("tf_keras")


class _LocalAggregation:
    """Horovod's local gradient aggregation (``backward_passes_per_step``, ``horovod/tensorflow/
    gradient_aggregation_eager.py``), eager and inside ``tf.function`` alike.

    Per call of the optimizer, on every rank:
        1. sums[i] += grad[i];  counter += 1                        (tf.Variables: they survive retracing)
        2. if counter == passes:  g = reduce(sums)  (one engine step, or Horovod's dense allreduce)
                                  g /= passes if average_aggregated_gradients
                                  apply g (the optimizer's own update; it counts one iteration)
                                  sums = 0;  counter = 0
           else:                  optimizer.iterations += 1          (no variable changes, as Horovod)
    The branch is a ``tf.cond`` on the counter, so one traced function serves every call. The variables are
    created once, outside any trace (``tf.init_scope``), from the model variables' shapes; they are not part of
    the optimizer's variables (not broadcast, not checkpointed: a checkpoint taken between two reductions loses
    the passes accumulated since the last one, as in Horovod).
    """

    def __init__(self, passes, average):
        self.passes = passes
        self.average = average
        self.counter = None
        self.sums = None

    def accumulate(self, grads, variables, api):
        """Step 1; returns the predicate of step 2 (a boolean tensor)."""
        if self.sums is None:
            with tf.init_scope():
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_sparse_passes")
                self.sums = [tf.Variable(tf.zeros(tuple(v.shape), dtype=g.dtype), trainable=False,
                                         name="hvd_sparse_grad_sum") for g, v in zip(grads, variables)]
        if len(grads) != len(self.sums) or any(tuple(s.shape) != tuple(g.shape) for s, g in zip(self.sums, grads)):
            raise ValueError(f"{api}: with backward_passes_per_step > 1 every call must update the same variables "
                             f"(the accumulators hold {len(self.sums)} gradients, got {len(grads)} of other shapes); "
                             "use one DistributedOptimizer per model")
        for s, g in zip(self.sums, grads):
            s.assign_add(g)
        self.counter.assign_add(1)
        return tf.equal(self.counter, self.passes)

    def reduced(self, reduce, variables):
        """Step 2, first half: the reduced (and, by option, averaged) sums, and the engine's skip flag."""
        out, skipped = reduce.reduce_flagged([s.read_value() for s in self.sums], variables)
        if self.average:
            out = [g / tf.cast(self.passes, g.dtype) for g in out]
        return out, skipped

    def clear(self):
        for s in self.sums:
            s.assign(tf.zeros_like(s))
        self.counter.assign(0)


def _count_iteration(optimizer):
    """A call that only accumulates: the optimizer counts it (Horovod's ``increment_optimizer_iteration``)."""
    optimizer.iterations.assign_add(1)


def _unless(skipped, apply):
    """Run ``apply()`` unless ``skipped`` (the engine's non-finite flag, the same on every rank): a skipped step
    changes no variable, not even ``iterations`` (as hvd_sparse.torch's ``step()``). ``skipped is None``: the
    dense path, apply."""
    if skipped is None:
        apply()
        return

    def run():
        apply()
        return tf.constant(True)

    tf.cond(skipped, lambda: tf.constant(False), run)


class _Keras3Methods:
    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        agg = self._hvds_agg
        if agg is None:
            grads, skipped = self._hvds_reduce.reduce_flagged(list(grads), variables)
            if skipped is None:
                return self._hvds_inner.apply(self, grads, trainable_variables)
        if not self.built:                    # create the slots here, not inside a branch of a tf.cond
            import keras

            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        if agg is None:
            _unless(skipped, lambda: self._hvds_inner.apply(self, grads, trainable_variables))
            return
        ready = agg.accumulate(self._hvds_reduce.densify(list(grads), variables), variables, _API)

        def reduce_and_apply():
            grads, skipped = agg.reduced(self._hvds_reduce, variables)
            _unless(skipped, lambda: self._hvds_inner.apply(self, grads, variables))
            agg.clear()

        tf.cond(ready, reduce_and_apply, lambda: _count_iteration(self))


class _TFKerasMethods:
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        variables = [v for _, v in grads_and_vars]
        agg = self._hvds_agg
        if agg is None:
            grads, skipped = self._hvds_reduce.reduce_flagged([g for g, _ in grads_and_vars], variables)
            if skipped is None:
                return self._hvds_inner.apply_gradients(self, list(zip(grads, variables)), *args, **kwargs)
        with tf.init_scope():                 # the slots: here, not inside a branch of a tf.cond
            create = getattr(self, "_create_all_weights", None) or self.build
            create(variables)
        if agg is None:
            _unless(skipped, lambda: self._hvds_inner.apply_gradients(self, list(zip(grads, variables)), *args,
                                                                       **kwargs))
            return self.iterations
        ready = agg.accumulate(self._hvds_reduce.densify([g for g, _ in grads_and_vars], variables), variables,
                               _API)

        def reduce_and_apply():
            grads, skipped = agg.reduced(self._hvds_reduce, variables)
            _unless(skipped, lambda: self._hvds_inner.apply_gradients(self, list(zip(grads, variables)), *args,
                                                                       **kwargs))
            agg.clear()

        tf.cond(ready, reduce_and_apply, lambda: _count_iteration(self))
        return self.iterations


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

    def sparse_state_dict(self):
        """This rank's sparsification state (residual, thresholds, partitions, counters) for a checkpoint: a dict
        of numpy arrays and Python values (see :func:`hvd_sparse.tensorflow.sparse_state_dict`).

        Per rank: save it on *every* rank, next to the model and optimizer, and load each rank's own. It is not
        among the optimizer's variables (``BroadcastGlobalVariablesCallback`` would overwrite it with rank 0's);
        :class:`hvd_sparse.tensorflow.SparseState` (``SparseState(optimizer)``) puts it into a
        ``tf.train.Checkpoint``. Raises TypeError with a dense compression (nothing to save)."""
        from .. import _sparse_target

        comp, ps = _sparse_target(self, None, f"{_API}.sparse_state_dict")
        return sparse_state_dict(comp, ps)

    def load_sparse_state_dict(self, state):
        """Restore :meth:`sparse_state_dict` (of this rank); the run then continues bit for bit as if never
        interrupted. Works before the first step too (the state is applied at that step). Raises ValueError for
        a state of another rank, another number of ranks or another compression."""
        from .. import _sparse_target

        comp, ps = _sparse_target(self, None, f"{_API}.load_sparse_state_dict")
        load_sparse_state_dict(comp, state, ps, f"{_API}.load_sparse_state_dict")


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True, *,
                         nonfinite="skip"):
    """Wrap a Keras optimizer so that every update first averages the gradients over Horovod ranks -- sparsely,
    when ``compression`` is a sparse preset. Horovod's signature (``horovod.tensorflow.keras``), in its order.

    The result is an instance of a subclass of your optimizer's class (same name), rebuilt with
    ``cls.from_config(optimizer.get_config())`` as Horovod does, with ``sparse_stats()``, ``residual_norm()``,
    ``sparse_state_dict()`` and ``load_sparse_state_dict()`` (checkpoints: also ``SparseState(optimizer)``).

    Args:
        optimizer: a Keras 3 or tf_keras optimizer (not yet wrapped).
        compression: ``Compression.none`` (dense Horovod allreduce), ``Compression.fp16``, or a sparse preset
            such as ``Compression.oktopk(density=0.01)``.
        op: ``hvd.Average`` (default) or ``hvd.Sum``. ``hvd.Adasum`` is not supported.
        gradient_predivide_factor, process_set, sparse_as_dense: as in Horovod.
        backward_passes_per_step (int): as in Horovod: the gradients of this many calls (``apply`` in Keras 3,
            ``apply_gradients`` in tf_keras; one per batch in ``model.fit``) are summed locally, and only every
            ``backward_passes_per_step``-th call reduces the sum (one engine step for a sparse preset: the
            residual, threshold and step counter advance once per reduction) and applies it. The other calls
            change no variable and only count ``optimizer.iterations``. Default 1.
        average_aggregated_gradients (bool): with ``backward_passes_per_step > 1``, divide the reduced sum by
            ``backward_passes_per_step`` (Horovod's option). Default False (the sum, as in Horovod).
        name, device_dense, device_sparse, num_groups, groups, scale_local_gradients: accepted for
            compatibility; the sparse path reduces the model as one unit.
        nonfinite (str, keyword-only): when any rank's gradient holds a NaN or Inf (sparse presets):
            ``"skip"`` (default: on every rank the update is skipped -- no variable changes, not even
            ``iterations`` -- and the sparse state is untouched) or ``"raise"`` (the step fails on every rank
            with hvd_sparse.NonFiniteGradientError's message).

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
    passes = check_positive_int(backward_passes_per_step, "backward_passes_per_step", _API)
    methods = dict(_TFKerasMethods.__dict__ if _is_tf_keras(optimizer) else _Keras3Methods.__dict__)
    methods.update({k: v for k, v in _CommonMethods.__dict__.items() if not k.startswith("__")})
    methods = {k: v for k, v in methods.items() if not k.startswith("__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(methods, _hvds_inner=optimizer.__class__, __module__=optimizer.__class__.__module__))
    new = cls.from_config(optimizer.get_config())
    new._hvds_reduce = _Reduction(compression, op, gradient_predivide_factor, sparse_as_dense, process_set, _API,
                                  nonfinite)
    new._hvds_agg = _LocalAggregation(passes, bool(average_aggregated_gradients)) if passes > 1 else None
    if isinstance(compression, SparseCompression):
        compression._hvds_keras_owner = weakref.ref(new)
    return new


def __getattr__(name):          # ``hvds.callbacks`` without importing Keras callbacks eagerly
    if name == "callbacks":     # (``from . import callbacks`` here would recurse through hasattr)
        import importlib

        return importlib.import_module(__name__ + ".callbacks")
    raise AttributeError(name)
