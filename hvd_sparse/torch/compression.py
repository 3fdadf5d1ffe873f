"""``hvd_sparse.torch.Compression``: Horovod's ``none`` and ``fp16`` (Horovod's own objects, unchanged)
plus the sparse presets of :class:`hvd_sparse.Compression`."""

from __future__ import annotations

from horovod.torch.compression import Compression as _HorovodCompression

from ..compression import Compression as _SparsePresets


class Compression(_SparsePresets):
    """Compression for ``hvd_sparse.torch.DistributedOptimizer`` (and Horovod's own).

    * ``Compression.none``, ``Compression.fp16``: Horovod's compressors; the optimizer then *is* Horovod's.
    * ``Compression.topka(density)``, ``Compression.sparse(...)``, ...: sparse presets (new object per call).
    """

    none = _HorovodCompression.none
    fp16 = _HorovodCompression.fp16


def is_sparse(compression):
    from ..compression import SparseCompression

    return isinstance(compression, SparseCompression)
