"""``hvd_sparse.tensorflow.DistributedOptimizer``: Horovod's ``horovod.tensorflow.DistributedOptimizer`` entry
point, which forwards Keras optimizers to :func:`hvd_sparse.tensorflow.keras.DistributedOptimizer`."""

from __future__ import annotations

import tensorflow as tf
from horovod.tensorflow import Average, global_process_set

from .compression import Compression


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True, *,
                         nonfinite="skip", consistency_check_every=0, elastic_residuals="keep"):
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
                            groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
                            nonfinite=nonfinite, consistency_check_every=consistency_check_every,
                            elastic_residuals=elastic_residuals)
