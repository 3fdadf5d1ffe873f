"""hvd_sparse for TensorFlow 2: ``import hvd_sparse.tensorflow as hvds`` next to ``import horovod.tensorflow as hvd``.

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvds.DistributedGradientTape(tape, compression=hvds.Compression.oktopk(density=0.01))
    grads = tape.gradient(loss, model.trainable_variables)

How it runs: the gradients of all sources are concatenated (in the order of ``sources``, which is the same on
every rank) into one float32 buffer, and one engine step -- the same engine code as PyTorch and the simulator:
error feedback, sparsifier, sparse allreduce -- runs on it inside a ``tf.py_function``, eagerly and inside
``tf.function`` alike. Its collectives are Horovod's TensorFlow ops, named ``hvd_sparse.<bucket>.<phase>``.
The engine's state (residuals, thresholds) lives in the compression object, in Python, so it survives
retracing.

Here: ``DistributedGradientTape``, ``sparse_allreduce``, ``Compression``; Keras: ``hvd_sparse.tensorflow.keras``.
Not yet: ``DistributedOptimizer`` for TensorFlow optimizers (use the tape, or the Keras optimizer).
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow import Average, global_process_set
from horovod.tensorflow.compression import Compression as _HorovodCompression

from ..compression import Compression as _SparsePresets
from ..compression import SparseCompression
from ..core.errors import check_op, check_same_layout, scale_factors
from .comm import HorovodTFCommunicator

__all__ = ["Compression", "DistributedGradientTape", "DistributedOptimizer", "sparse_allreduce"]


class Compression(_SparsePresets):
    """Horovod's ``none`` and ``fp16`` (Horovod's own objects) plus every sparse preset."""

    none = _HorovodCompression.none
    fp16 = _HorovodCompression.fp16


def _flat_step(compression, bucket, owner, process_set, tensors, average, prescale, postscale):
    """One engine step over ``tensors`` (a list of dense tf tensors) inside a tf.py_function."""
    sizes = [int(t.shape.num_elements()) for t in tensors]
    # Compared across ranks once: positions and shapes, not names -- Keras names layers from a process-wide
    # counter, so a rank that built one more model earlier has other names for the same variables.
    layout = [(f"variable #{i}", tuple(t.shape.as_list())) for i, t in enumerate(tensors)]
    flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], axis=0)

    def step(x):
        engine = compression.engine(bucket, owner, lambda: HorovodTFCommunicator(process_set, bucket))
        if engine.steps == 0 and process_set.size() > 1:     # once: the same parameters on every rank
            from horovod.tensorflow.functions import allgather_object

            check_same_layout(allgather_object(layout, name=f"hvd_sparse.{bucket}.layout",
                                               process_set=process_set), "hvd_sparse.tensorflow")
        engine.layout = sizes
        return engine.step(x.numpy(), average=average, prescale=prescale, postscale=postscale)

    out = tf.py_function(step, [flat], tf.float32)
    out.set_shape(flat.shape)
    pieces = tf.split(out, sizes) if len(sizes) > 1 else [out]
    return [tf.cast(tf.reshape(p, t.shape), t.dtype) for p, t in zip(pieces, tensors)]


class _Reduction:
    """grads, variables -> reduced grads: Horovod's dense allreduce per tensor (``Compression.none``/``fp16``)
    or one whole-model engine step (a sparse preset). Shared by the tape and the Keras optimizer.

    No ``.ref()`` on variables (Keras 3 variables have none), no Keras-2 internals: works with tf.Variables,
    Keras 3 and tf_keras variables alike."""

    def __init__(self, compression, op, gradient_predivide_factor, sparse_as_dense, process_set, api):
        self.compression = compression
        self.sparse = isinstance(compression, SparseCompression)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.prescale, self.postscale, self.average = scale_factors(op, gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.api = api

    def __call__(self, grads, variables):
        dense = []
        for g, v in zip(grads, variables):
            if g is None:
                g = tf.zeros_like(v)                      # unused on this rank: zeros, as in Horovod
            elif isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError(f"{self.api}: the gradient of {v.name} is a tf.IndexedSlices (an embedding "
                                     "lookup); pass sparse_as_dense=True")
                g = tf.convert_to_tensor(g)
            dense.append(g)
        if not dense or not self.process_set.included():
            return dense
        if self.sparse:
            # The state's owner is the preset itself (a tape is created anew every step); a preset shared by
            # two models of different sizes is caught by the engine's layout check.
            return _flat_step(self.compression, "model", self.compression, self.process_set, dense,
                              self.average, self.prescale, self.postscale)
        if self.process_set.size() == 1:
            return dense
        # Horovod's own dense path: one named allreduce per tensor, in the (rank-consistent) order of sources
        if self.op == Average:
            pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        else:
            pre = post = 1.0
        return [hvd.allreduce(g, op=self.op, compression=self.compression, prescale_factor=pre,
                              postscale_factor=post, name=f"hvd_sparse.dense.{i}", ignore_name_scope=True,
                              process_set=self.process_set) for i, g in enumerate(dense)]


class _DistributedGradientTape(tf.GradientTape):
    # Methods copied into a subclass of the user's tape class (``_hvds_inner``), as Horovod does.
    def __init__(self, tape, reduction, persistent, watch_accessed_variables, scale_local_gradients):
        self._hvds_inner.__init__(self, persistent, watch_accessed_variables)
        self._tape = tape                                # the recording of the user's `with` block
        self._hvds_reduce = reduction
        self.process_set = reduction.process_set
        self.scale_local_gradients = scale_local_gradients
        self._hvds_local = set()

    def register_local_source(self, source):
        """Keep ``source``'s gradient local (not reduced), as Horovod's ``register_local_source``."""
        self._hvds_local.add(id(source))

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        single = not isinstance(sources, (list, tuple))
        srcs = [sources] if single else list(sources)
        grads = list(self._hvds_inner.gradient(self, target, srcs, output_gradients, **kwargs))
        keep = [i for i, s in enumerate(srcs) if id(s) not in self._hvds_local]
        reduced = self._hvds_reduce([grads[i] for i in keep], [srcs[i] for i in keep])
        for i, g in zip(keep, reduced):
            grads[i] = g
        if self.scale_local_gradients and self._hvds_local:      # Horovod's scaling of local gradients
            size = self.process_set.size()
            for i, s in enumerate(srcs):
                if id(s) in self._hvds_local and grads[i] is not None:
                    g = grads[i]
                    grads[i] = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape) \
                        if isinstance(g, tf.IndexedSlices) else g / size
        return grads[0] if single else grads


def DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` returns gradients averaged over Horovod ranks -- sparsely,
    when ``compression`` is a sparse preset. Horovod's signature, in Horovod's order.

    The result is an instance of a subclass of your tape's class. ``register_local_source`` and
    ``scale_local_gradients`` work as in Horovod. Unlike Horovod 0.28.1's tape it also works with Keras 3
    variables (Horovod's calls ``.ref()``, which they lack). With ``Compression.none``/``fp16`` each gradient is
    reduced by a named ``hvd.allreduce``, as Horovod does; with a sparse preset the non-local sources are reduced
    as one unit by one engine step, in the order of ``sources`` (identical on every rank).

    Args:
        compression: ``Compression.none``/``fp16`` or a sparse preset, e.g. ``Compression.oktopk(0.01)``.
        sparse_as_dense (bool): densify ``tf.IndexedSlices`` gradients (otherwise they raise).
        op: ``hvd.Average`` (default) or ``hvd.Sum``; ``hvd.Adasum`` is not supported.
        device_dense, device_sparse, num_groups, groups: accepted for compatibility, unused.
        gradient_predivide_factor, process_set, scale_local_gradients: as in Horovod.
    """
    api = "hvd_sparse.tensorflow.DistributedGradientTape"
    check_op(op, gradient_predivide_factor, api)
    reduction = _Reduction(compression, op, gradient_predivide_factor, sparse_as_dense, process_set, api)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,),
               dict(_DistributedGradientTape.__dict__, _hvds_inner=gradtape.__class__))
    return cls(gradtape._tape, reduction, gradtape._persistent, gradtape._watch_accessed_variables,
               scale_local_gradients)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Horovod's ``horovod.tensorflow.DistributedOptimizer`` signature. Keras optimizers (Keras 3 or tf_keras)
    are forwarded to :func:`hvd_sparse.tensorflow.keras.DistributedOptimizer`, as Horovod does. Legacy
    ``tf.compat.v1.train.Optimizer`` graphs are not supported (NotImplementedError): use
    :func:`DistributedGradientTape` or a Keras optimizer."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise NotImplementedError("hvd_sparse.tensorflow.DistributedOptimizer: tf.compat.v1.train optimizers are "
                                  "not supported; use DistributedGradientTape or a Keras optimizer")
    from .keras import DistributedOptimizer as _keras_optimizer

    return _keras_optimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                            compression=compression, sparse_as_dense=sparse_as_dense,
                            gradient_predivide_factor=gradient_predivide_factor, op=op,
                            backward_passes_per_step=backward_passes_per_step,
                            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
                            groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


def sparse_allreduce(tensor, compression, name=None, op=Average, process_set=global_process_set):
    """Average ``tensor`` over ``process_set``, sending only the entries that ``compression`` selects.

    Collective: every rank calls it in the same order, with the same ``name``, shape and dtype; works eagerly and
    inside ``tf.function``. Entries that do not reach the result stay in the residual kept for ``name``.

    Args:
        tensor (tf.Tensor): dense tensor of any shape; not modified.
        compression: a sparse preset, e.g. ``Compression.topka(density=0.01)``.
        name (str): residual key and base of the op names. Default: ``"sparse_allreduce"``.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        process_set: ranks taking part. Default: all ranks.

    Returns:
        tf.Tensor: same shape and dtype as ``tensor``, bit-identical on every rank.
    """
    api = "hvd_sparse.tensorflow.sparse_allreduce"
    if not isinstance(compression, SparseCompression):
        raise TypeError(f"{api}: compression must be a sparse preset such as Compression.topka(0.01), got "
                        f"{compression!r}; for dense tensors use hvd.allreduce")
    check_op(op, 1.0, api)
    bucket = name or "sparse_allreduce"
    prescale, postscale, average = scale_factors(op, 1.0)
    return _flat_step(compression, bucket, bucket, process_set, [tf.convert_to_tensor(tensor)], average,
                      prescale, postscale)[0]
