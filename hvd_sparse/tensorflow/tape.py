"""``hvd_sparse.tensorflow.DistributedGradientTape``: Horovod's tape with sparse compression, for Keras 3 variables
too. ``gradient()`` hands the gradients of the non-local sources to :class:`hvd_sparse.tensorflow.reduction.Reduction`
(one engine step for a sparse preset, one named ``hvd.allreduce`` per tensor otherwise)."""

from __future__ import annotations

import tensorflow as tf
from horovod.tensorflow import Average, global_process_set

from ..core.validate import check_op
from .compression import Compression
from .reduction import Reduction


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
                            groups=None, process_set=global_process_set, scale_local_gradients=True, *,
                            nonfinite="skip"):
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
        nonfinite (str, keyword-only): when any rank's gradient holds a NaN or Inf (sparse presets): ``"skip"``
            (default: sparse state untouched on every rank and every returned gradient all NaN on every rank, so
            a loss scaler, or ``tf.math.is_finite``, skips the update everywhere alike) or ``"raise"``. With
            ``Compression.none`` or ``fp16`` another value than the default raises (the dense path passes it on).
    """
    api = "hvd_sparse.tensorflow.DistributedGradientTape"
    check_op(op, gradient_predivide_factor, api)
    reduction = Reduction(compression, op, gradient_predivide_factor, sparse_as_dense, process_set, api, nonfinite)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,),
               dict(_DistributedGradientTape.__dict__, _hvds_inner=gradtape.__class__))
    return cls(gradtape._tape, reduction, gradtape._persistent, gradtape._watch_accessed_variables,
               scale_local_gradients)
