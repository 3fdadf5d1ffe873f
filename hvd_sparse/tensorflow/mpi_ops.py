"""``sparse_allreduce``: the custom Horovod operation, shaped like ``hvd.allreduce``."""

from __future__ import annotations

import tensorflow as tf
from horovod.tensorflow import Average, global_process_set

from ..compression import SparseCompression, check_compression
from ..core.validate import check_sparse_allreduce, scale_factors
from ._xla import refuse_xla
from .reduction import engine_step

_API = "hvd_sparse.tensorflow.sparse_allreduce"


def sparse_allreduce(tensor, compression, name=None, op=Average, process_set=global_process_set, *,
                     nonfinite="skip"):
    """Average ``tensor`` over ``process_set``, sending only the entries that ``compression`` selects.

    Collective: every rank calls it in the same order, with the same ``name``, shape and dtype (agreed on by every
    rank before any data moves); works eagerly and inside ``tf.function``. Entries that do not reach the result
    stay in the residual kept for ``name``, so a name keeps its shape: another shape under the same name raises.

    Args:
        tensor (tf.Tensor): dense tensor of any shape; not modified.
        compression: a sparse preset, e.g. ``Compression.topka(density=0.01)``.
        name (str): residual key and base of the op names. Default: ``"sparse_allreduce"``.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        process_set: ranks taking part. Default: all ranks.
        nonfinite (str): when any rank's ``tensor`` holds a NaN or Inf: ``"skip"`` (default; the result is all
            NaN on every rank and the residual untouched) or ``"raise"``.

    Returns:
        tf.Tensor: same shape and dtype as ``tensor``, bit-identical on every rank.
    """
    tensor = tf.convert_to_tensor(tensor)
    check_compression(compression, _API, sparse=True)
    check_sparse_allreduce(isinstance(compression, SparseCompression), op, nonfinite, tensor.dtype.is_floating,
                           tensor.dtype.name, compression, _API)
    refuse_xla(_API)
    unit = name or "sparse_allreduce"
    prescale, postscale, average = scale_factors(op, 1.0)
    return engine_step(compression, unit, unit, process_set, [tensor], average, prescale, postscale,
                       nonfinite, names=[unit])[0][0]
