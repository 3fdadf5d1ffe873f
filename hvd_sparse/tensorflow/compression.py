"""``hvd_sparse.tensorflow.Compression``: Horovod's ``none`` and ``fp16`` (Horovod's own objects, unchanged) plus
the sparse presets of :class:`hvd_sparse.Compression`."""

from __future__ import annotations

from horovod.tensorflow.compression import Compression as _HorovodCompression

from ..compression import Compression as _SparsePresets


class Compression(_SparsePresets):
    """Compression for :func:`hvd_sparse.tensorflow.DistributedGradientTape` and the Keras ``DistributedOptimizer``.

    * ``Compression.none``, ``Compression.fp16``: Horovod's compressors; the gradients are reduced by Horovod's own
      dense allreduce.
    * ``Compression.topka(density)``, ``Compression.oktopk(...)``, ...: sparse presets (a new object per call).
    """

    none = _HorovodCompression.none
    fp16 = _HorovodCompression.fp16
