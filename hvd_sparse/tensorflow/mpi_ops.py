"""``sparse_allreduce``: the custom Horovod operation, shaped like ``hvd.allreduce``."""

from __future__ import annotations

import tensorflow as tf
from horovod.tensorflow import global_process_set

from ..compression import allreduce_op, check_compression
from ..core.validate import check_sparse_allreduce, scale_factors
from ._xla import refuse_xla
from .reduction import engine_step

_API = "hvd_sparse.tensorflow.sparse_allreduce"


def sparse_allreduce(tensor, average=None, device_dense='', device_sparse='', compression=None, op=None,
                     prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
                     ignore_name_scope=False, *, nonfinite="skip"):
    """Average ``tensor`` over ``process_set``, sending only the entries that ``compression`` selects. The
    signature is ``hvd.allreduce``'s, with ``compression=`` (a keyword, required) a sparse preset.

    Collective: every rank calls it in the same order, with the same ``name``, shape and dtype (agreed on by every
    rank before any data moves); works eagerly and inside ``tf.function``. Entries that do not reach the result
    stay in the residual kept for ``name``, so a name keeps its shape: another shape under the same name raises.

    Args:
        tensor (tf.Tensor): dense tensor of any shape; not modified.
        average (bool): Horovod's deprecated spelling of ``op`` (True: Average, False: Sum); not with ``op``.
        compression: a sparse preset, e.g. ``Compression.topka(density=0.01)``. A preset in the second
            position (where Horovod has ``average``) raises TypeError with the call to make.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        prescale_factor, postscale_factor (float): as in Horovod: ``tensor`` is multiplied by the first before
            the reduction (before error feedback) and the result by the second after it.
        name (str): residual key and base of the op names. Default: ``"sparse_allreduce"``.
        process_set: ranks taking part. Default: all ranks.
        device_dense, device_sparse, ignore_name_scope: accepted for compatibility, unused.
        nonfinite (str): when any rank's ``tensor`` holds a NaN or Inf: ``"skip"`` (default; the result is all
            NaN on every rank and the residual untouched) or ``"raise"``.

    Returns:
        tf.Tensor: same shape and dtype as ``tensor``, bit-identical on every rank.
    """
    op = allreduce_op(average, op, compression, _API)
    tensor = tf.convert_to_tensor(tensor)
    check_compression(compression, _API, sparse=True)
    check_sparse_allreduce(op, nonfinite, tensor.dtype.is_floating, tensor.dtype.name, _API)
    refuse_xla(_API)
    unit = name or "sparse_allreduce"
    prescale, postscale, average = scale_factors(op, 1.0)
    return engine_step(compression.shared_state(), unit, process_set, [tensor], average,
                       prescale * float(prescale_factor), postscale * float(postscale_factor), nonfinite,
                       names=[unit])[0][0]
