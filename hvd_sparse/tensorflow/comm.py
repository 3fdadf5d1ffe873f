"""The Communicator of the TensorFlow adapter: Horovod's TensorFlow collectives, called eagerly.

The engine runs on TensorFlow eager tensors inside a ``tf.py_function`` (so it behaves the same eagerly and
inside ``tf.function`` / ``model.fit``); each collective hands its tensor straight to the named Horovod op
(``hvd_sparse.<unit>.<phase>``, ``ignore_name_scope=True``: the same name on every rank whatever the calling
name scope) and returns Horovod's tensor. ``alltoall`` splits go as int32 tensors, which Horovod requires; a grouped
allgather moves its tensors as int32 words (Horovod's TensorFlow op takes one dtype per group).
Volume is counted as in ``hvd_sparse.core.comm``.
"""

from __future__ import annotations

import tensorflow as tf

from ..horovod_comm import HorovodCommunicator


class HorovodTFCommunicator(HorovodCommunicator):
    def __init__(self, process_set, unit, shared_tag=None):
        import horovod.tensorflow as hvd

        super().__init__(hvd, process_set, unit, shared_tag)

    def _kw(self, phase, bucket=None):
        return dict(super()._kw(phase, bucket), ignore_name_scope=True)

    def _allreduce(self, x, op, kw):
        return self._hvd.allreduce(x, op=op, **kw)

    def _allgather(self, x, kw):
        return self._hvd.allgather(x, **kw)

    def _grouped_allgather(self, xs, kw):
        """Horovod's TensorFlow grouped allgather takes tensors of one dtype: each tensor (of a 4- or 8-byte dtype:
        indices, counts, float32 values) travels as its int32 words (``tf.bitcast``, exact) and is bit-cast back."""
        words = [x if x.dtype == tf.int32 else tf.reshape(tf.bitcast(x, tf.int32), [-1]) for x in xs]
        outs = self._hvd.grouped_allgather(words, **kw)
        return [out if x.dtype == tf.int32 else
                tf.bitcast(out if x.dtype.size == 4 else tf.reshape(out, [-1, 2]), x.dtype) for out, x in zip(outs, xs)]

    def _alltoall(self, x, splits, kw):
        out, recv = self._hvd.alltoall(x, splits=tf.constant(splits, dtype=tf.int32), **kw)
        return out, [int(s) for s in recv.numpy()]

    def _broadcast(self, x, root, kw):
        return self._hvd.broadcast(x, root, **kw)
