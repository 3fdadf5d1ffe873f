"""The consistency guard of ``hvd_sparse.torch.DistributedOptimizer`` (``consistency_check_every``,
``check_consistency()``): proves that all ranks hold bit-identical parameters with two 64-bit checksums per
parameter and one allgather, or raises :class:`~hvd_sparse.core.errors.ReplicaDivergenceError` on every rank,
naming the first differing parameter."""

from __future__ import annotations

import horovod.torch as hvd
import torch

from ..core.errors import check_replicas_agree

_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(p):
    """Two int64 checksums of a tensor's bits: the sum of its words and a position-weighted sum (any single
    changed bit changes the first; swapped words change the second). Deterministic, wraps on overflow; the same
    definition as hvd_sparse.tensorflow's."""
    w = p.detach().reshape(-1).contiguous().view(_WORD[p.element_size()]).to(torch.int64)
    weights = torch.arange(w.numel(), dtype=torch.int64, device=w.device) % 65521 + 1
    return torch.stack([w.sum(), (w * weights).sum()]).cpu()


def check_consistency(params, process_set, name, step, api):
    """Collective over ``process_set`` (every rank, same ``params`` names in the same order): raise
    ``ReplicaDivergenceError`` unless every rank holds the same bits in each ``(name, tensor)`` of ``params``.
    ``name`` is the allgather's name, ``step`` and ``api`` go into the message."""
    if not process_set.included() or process_set.size() == 1:
        return
    sums = torch.stack([checksum(p) for _, p in params]) if params else torch.zeros((0, 2), dtype=torch.int64)
    gathered = hvd.allgather(sums.unsqueeze(0), name=name, process_set=process_set)
    per_rank = [[tuple(c) for c in row] for row in gathered.tolist()]
    check_replicas_agree([n for n, _ in params], per_rank, step, api)
