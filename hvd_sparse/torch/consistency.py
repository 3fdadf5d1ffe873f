"""The consistency guard of ``hvd_sparse.torch.DistributedOptimizer`` (``consistency_check_every``,
``check_consistency()``): proves that all ranks hold bit-identical parameters with two 64-bit checksums per
parameter and one allgather, or raises :class:`~hvd_sparse.core.errors.ReplicaDivergenceError` on every rank,
naming the first differing parameter."""

from __future__ import annotations

import horovod.torch as hvd
import torch

from ..horovod_comm import in_process_set
from ..core.errors import check_replicas_agree, checksums

def checksum(p):
    """Two int64 checksums of a tensor's bits (:func:`hvd_sparse.core.errors.checksums` of its raw bytes, the
    definition every adapter uses; bfloat16 has no numpy dtype, hence bytes)."""
    raw = p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
    return torch.tensor(checksums(raw, p.element_size()), dtype=torch.int64)


def check_consistency(params, process_set, name, step, api):
    """Collective over ``process_set`` (every rank, same ``params`` names in the same order): raise
    ``ReplicaDivergenceError`` unless every rank holds the same bits in each ``(name, tensor)`` of ``params``.
    ``name`` is the allgather's name, ``step`` and ``api`` go into the message."""
    if not in_process_set(process_set, hvd.rank()) or process_set.size() == 1:
        return
    sums = torch.stack([checksum(p) for _, p in params]) if params else torch.zeros((0, 2), dtype=torch.int64)
    gathered = hvd.allgather(sums.unsqueeze(0), name=name, process_set=process_set)
    per_rank = [[tuple(c) for c in row] for row in gathered.tolist()]
    check_replicas_agree([n for n, _ in params], per_rank, step, api)
