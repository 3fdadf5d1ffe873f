"""The Communicator of the TensorFlow adapter: Horovod's TensorFlow collectives, called eagerly.

The engine runs on numpy arrays inside a ``tf.py_function`` (so it behaves the same eagerly and inside
``tf.function`` / ``model.fit``); each collective converts its numpy input to a tensor, runs the named
Horovod op (``hvd_sparse.<bucket>.<phase>``, ``ignore_name_scope=True``: the same name on every rank
whatever the calling name scope) and returns numpy. Volume is counted as in ``hvd_sparse.core.comm``.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..core.comm import MAX, SUM, VolumeMeter, meter_allgather, meter_allreduce, meter_alltoall, \
    meter_broadcast


class HorovodTFCommunicator:
    def __init__(self, process_set, bucket):
        import horovod.tensorflow as hvd

        self._hvd = hvd
        self.process_set = process_set
        self.bucket = bucket
        self.rank = process_set.rank()
        self.size = process_set.size()
        self.meter = VolumeMeter()

    def _kw(self, phase):
        return dict(name=f"hvd_sparse.{self.bucket}.{phase}", ignore_name_scope=True, process_set=self.process_set)

    def allreduce(self, x, op, phase):
        hop = {SUM: self._hvd.Sum, MAX: self._hvd.Max}[op]
        out = self._hvd.allreduce(tf.convert_to_tensor(x), op=hop, **self._kw(phase)).numpy()
        meter_allreduce(self.meter, self.size, x.size, x.dtype.itemsize, phase)
        return out

    def allgather(self, x, phase):
        out = self._hvd.allgather(tf.convert_to_tensor(x), **self._kw(phase)).numpy()
        sizes = [0] * self.size
        sizes[self.rank] = x.size
        sizes[(self.rank + 1) % self.size] += out.size - x.size
        meter_allgather(self.meter, self.rank, sizes, x.dtype.itemsize, phase)
        return out

    def alltoall(self, x, splits, phase):
        sp = tf.constant([int(s) for s in splits], dtype=tf.int32)
        out, recv = self._hvd.alltoall(tf.convert_to_tensor(x), splits=sp, **self._kw(phase))
        out, recv_splits = out.numpy(), [int(s) for s in recv.numpy()]
        row_words = x.size // x.shape[0] if x.size else 1
        meter_alltoall(self.meter, self.rank, [int(s) for s in splits], recv_splits, x.dtype.itemsize, phase,
                       row_words=row_words)
        return out, recv_splits

    def broadcast(self, x, root, phase):
        out = self._hvd.broadcast(tf.convert_to_tensor(x), root, **self._kw(phase)).numpy()
        meter_broadcast(self.meter, self.rank, root, self.size, x.size, x.dtype.itemsize, phase)
        return np.asarray(out)
