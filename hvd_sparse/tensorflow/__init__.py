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

Status: ``DistributedGradientTape``, ``sparse_allreduce`` and ``Compression``. The Keras optimizer and
callbacks, and ``DistributedOptimizer`` for TensorFlow/Keras optimizers, are not implemented yet.
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow import Average, global_process_set
from horovod.tensorflow.compression import Compression as _HorovodCompression

from ..compression import Compression as _SparsePresets
from ..compression import SparseCompression
from ..core.errors import check_op, scale_factors
from .comm import HorovodTFCommunicator

__all__ = ["Compression", "DistributedGradientTape", "sparse_allreduce"]


class Compression(_SparsePresets):
    """Horovod's ``none`` and ``fp16`` (Horovod's own objects) plus every sparse preset."""

    none = _HorovodCompression.none
    fp16 = _HorovodCompression.fp16


def _flat_step(compression, bucket, owner, process_set, tensors, average, prescale, postscale):
    """One engine step over ``tensors`` (a list of dense tf tensors) inside a tf.py_function."""
    sizes = [int(t.shape.num_elements()) for t in tensors]
    flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], axis=0)

    def step(x):
        engine = compression.engine(bucket, owner, lambda: HorovodTFCommunicator(process_set, bucket))
        engine.layout = sizes
        return engine.step(x.numpy(), average=average, prescale=prescale, postscale=postscale)

    out = tf.py_function(step, [flat], tf.float32)
    out.set_shape(flat.shape)
    pieces = tf.split(out, sizes) if len(sizes) > 1 else [out]
    return [tf.cast(tf.reshape(p, t.shape), t.dtype) for p, t in zip(pieces, tensors)]


class _SparseGradients:
    """Replaces the ``_allreduce_grads(grads, vars, use_generic_names)`` of Horovod's tape."""

    def __init__(self, compression, op, gradient_predivide_factor, sparse_as_dense, process_set):
        self.compression = compression
        self.prescale, self.postscale, self.average = scale_factors(op, gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

    def __call__(self, grads, variables, use_generic_names=False):
        if not grads:
            return grads
        dense = []
        for g, v in zip(grads, variables):
            if g is None:
                g = tf.zeros_like(v)                      # unused on this rank: zeros, as in Horovod
            elif isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError(f"hvd_sparse.tensorflow.DistributedGradientTape: the gradient of {v.name} is "
                                     "a tf.IndexedSlices (an embedding lookup); pass sparse_as_dense=True")
                g = tf.convert_to_tensor(g)
            dense.append(g)
        # A new tape wraps every step, so the state's owner is the preset itself; a preset shared by two
        # models of different sizes is caught by the engine's layout check.
        return _flat_step(self.compression, "model", self.compression, self.process_set, dense, self.average,
                          self.prescale, self.postscale)


def DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` returns gradients averaged over Horovod ranks --
    sparsely, when ``compression`` is a sparse preset. Horovod's signature, in Horovod's order.

    With a Horovod compressor (``Compression.none``/``fp16``) the tape *is* Horovod's. With a sparse preset the
    result is still Horovod's tape class (a subclass of your tape's class: ``register_local_source`` and
    ``scale_local_gradients`` work as in Horovod), whose reduction is replaced by one whole-model engine step
    over the non-local sources, in the order of ``sources`` (identical on every rank).

    Args:
        compression: ``Compression.none``/``fp16`` or a sparse preset, e.g. ``Compression.oktopk(0.01)``.
        sparse_as_dense (bool): densify ``tf.IndexedSlices`` gradients into the sparsified buffer (otherwise
            they raise with a sparse preset).
        op: ``hvd.Average`` (default) or ``hvd.Sum``; ``hvd.Adasum`` is rejected with a sparse preset.
        device_dense, device_sparse, num_groups, groups: Horovod's; unused by the sparse path (one unit).
        gradient_predivide_factor, process_set, scale_local_gradients: as in Horovod.
    """
    sparse = isinstance(compression, SparseCompression)
    if sparse:
        check_op(op, gradient_predivide_factor, "hvd_sparse.tensorflow.DistributedGradientTape")
    tape = hvd.DistributedGradientTape(gradtape, device_dense, device_sparse,
                                       _HorovodCompression.none if sparse else compression, sparse_as_dense,
                                       op, gradient_predivide_factor, num_groups, groups, process_set,
                                       scale_local_gradients)
    if sparse:
        tape._allreduce_grads = _SparseGradients(compression, op, gradient_predivide_factor, sparse_as_dense,
                                                 process_set)
    return tape


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
