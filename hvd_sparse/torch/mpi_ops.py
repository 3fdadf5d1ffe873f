"""``sparse_allreduce``: the custom Horovod operation, shaped like ``hvd.allreduce``."""

from __future__ import annotations

from horovod.torch.mpi_ops import global_process_set

from .comm import HorovodTorchCommunicator
from ..compression import allreduce_op, check_compression
from ..core.validate import check_sparse_allreduce, scale_factors

_API = "hvd_sparse.torch.sparse_allreduce"


def sparse_allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, *, nonfinite="skip"):
    """Average ``tensor`` over ``process_set``, sending only the entries that ``compression`` selects. The
    signature is ``hvd.allreduce``'s, with ``compression=`` (a keyword, required) a sparse preset.

    Collective: every rank calls it in the same order, with the same ``name``, shape and dtype. Entries
    that do not reach the result stay in the residual kept for ``name`` for the next call.

    Args:
        tensor (torch.Tensor): dense tensor of any shape; not modified.
        average (bool): Horovod's deprecated spelling of ``op`` (True: Average, False: Sum); not with ``op``.
        name (str): residual key and base of the op names (``hvd_sparse.allreduce.<name>.<phase>``).
            Default: ``"sparse_allreduce"`` (all unnamed calls share one residual).
        compression: a sparse preset, e.g. ``Compression.topka(density=0.01)``. A preset in the second
            position (where Horovod has ``average``) raises TypeError with the call to make.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        prescale_factor, postscale_factor (float): as in Horovod: ``tensor`` is multiplied by the first before
            the reduction (before error feedback: the residual is kept in its units) and the result by the
            second after it.
        process_set (ProcessSet): ranks taking part. Default: all ranks.
        nonfinite (str): when any rank's ``tensor`` holds a NaN or Inf: ``"skip"`` (default; the result is
            all NaN on every rank and the residual is untouched) or ``"raise"`` (NonFiniteGradientError on
            every rank).

    Returns:
        torch.Tensor: same shape and dtype as ``tensor``, bit-identical on every rank.
    """
    op = allreduce_op(average, op, compression, _API)
    if tensor.is_sparse:
        raise TypeError(f"{_API}: tensor must be dense, got a torch.sparse tensor")
    check_compression(compression, _API, sparse=True)
    check_sparse_allreduce(op, nonfinite, tensor.is_floating_point(), tensor.dtype, _API)
    unit = name or "sparse_allreduce"
    # collectives "hvd_sparse.allreduce.<name>.<phase>": never those of an optimizer or of another name
    engine = compression.shared_state().engine(unit, lambda: HorovodTorchCommunicator(process_set, f"allreduce.{unit}"))
    if engine.comm.process_set is not process_set:
        raise ValueError(f"{_API}: name {unit!r} was first used with another process_set")
    # shape and dtype are agreed on by every rank before any data moves (as Horovod's allreduce checks them);
    # a new shape under the same name starts the name's residual afresh
    engine.declare([(unit, tuple(tensor.shape), tensor.dtype)])
    _, _, average = scale_factors(op, 1.0)
    out = engine.step(tensor.detach().reshape(-1), average=average, prescale=float(prescale_factor),
                      postscale=float(postscale_factor), nonfinite=nonfinite)
    return out.view(tensor.shape)
