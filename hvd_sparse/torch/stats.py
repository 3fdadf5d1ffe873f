"""``optimizer.sparse_stats(average=True)`` of ``hvd_sparse.torch.DistributedOptimizer``: the sparse exchange's
statistics averaged over ranks, as a dict of floats that fits ``torch.utils.tensorboard.SummaryWriter``:

    stats = optimizer.sparse_stats(average=True)     # every rank, at the same point of the loop
    if hvd.rank() == 0:
        writer.add_scalars("sparse", stats, global_step)
        # or, one chart per value: for key, value in stats.items(): writer.add_scalar(f"sparse/{key}", value, step)

Keys (the numbers Keras' ``SparsityCallback`` logs, computed by the same code, :mod:`hvd_sparse.core.state`):
``density``, ``sent_bytes`` and ``recv_bytes`` (per step and rank), ``across_sent_bytes`` and ``across_recv_bytes``
(what of them crossed between hosts in a two-level step, ``hierarchical``; a flat step counts all its bytes), each
the mean over the exchanges since the
previous ``sparse_stats(average=True)`` call (or since the start) and over the ranks, and ``residual_norm`` (the
error-feedback residual's L2 norm now, mean over the ranks). The values are identical on every rank; ``{}`` when no
rank exchanged since the previous call.

It is a collective, like ``hvd.allreduce``: one float64 sum-allreduce over the optimizer's process set. Call it on
every rank of the process set, at the same point of the training loop, between steps (not inside backward), the
same number of times -- e.g. every N steps, or at the end of each epoch, on all ranks; only the writing to
TensorBoard is rank 0's. Called on some ranks only, it waits for the others as any Horovod collective does.
``sparse_stats()`` (no argument) stays local: this rank's last exchange, no communication.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch

from ..horovod_comm import in_process_set
from ..core.state import STATS_NAME


def averaged_stats(optimizer):
    """Collective: the window's statistics averaged over the process set's ranks; the window starts afresh.
    ``{}`` on a rank outside the optimizer's process set."""
    ps = optimizer.process_set
    if not in_process_set(ps, hvd.rank()):
        return {}
    job = optimizer._hvds
    norm = job.residual_norm() if job.exchanges else 0.0

    def sum_over_ranks(local):
        return hvd.allreduce(torch.tensor(local, dtype=torch.float64), op=hvd.Sum, name=STATS_NAME,
                             process_set=ps).tolist()

    return job.window.average(norm, ps.size(), sum_over_ranks)     # filled by every exchange
