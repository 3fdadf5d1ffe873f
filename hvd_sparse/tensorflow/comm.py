"""The Communicator of the TensorFlow adapter: Horovod's TensorFlow collectives, called eagerly.

The engine runs on numpy arrays inside a ``tf.py_function`` (so it behaves the same eagerly and inside
``tf.function`` / ``model.fit``); each collective converts its numpy input to a tensor, runs the named
Horovod op (``hvd_sparse.<bucket>.<phase>``, ``ignore_name_scope=True``: the same name on every rank
whatever the calling name scope) and returns numpy. Volume is counted as in ``hvd_sparse.core.comm``.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..core.comm import HorovodCommunicator


class HorovodTFCommunicator(HorovodCommunicator):
    def __init__(self, process_set, bucket):
        import horovod.tensorflow as hvd

        super().__init__(hvd, process_set, bucket)

    def _kw(self, phase):
        return dict(super()._kw(phase), ignore_name_scope=True)

    def _allreduce(self, x, op, kw):
        return self._hvd.allreduce(tf.convert_to_tensor(x), op=op, **kw).numpy()

    def _allgather(self, x, kw):
        return self._hvd.allgather(tf.convert_to_tensor(x), **kw).numpy()

    def _alltoall(self, x, splits, kw):
        out, recv = self._hvd.alltoall(tf.convert_to_tensor(x), splits=tf.constant(splits, dtype=tf.int32), **kw)
        return out.numpy(), [int(s) for s in recv.numpy()]

    def _broadcast(self, x, root, kw):
        return np.asarray(self._hvd.broadcast(tf.convert_to_tensor(x), root, **kw).numpy())
