"""The sparse exchange's statistics over a window of steps, averaged over ranks: what Keras'
``SparsityCallback`` logs and what ``hvd_sparse.torch.DistributedOptimizer.sparse_stats(average=True)`` returns.

Every rank adds the statistics of each of its exchanges (``Engine.last``) to a :class:`SparsityWindow`. A report is
one collective: every rank contributes :meth:`SparsityWindow.local` (five float64 numbers) to a *sum* allreduce,
and :func:`averaged` turns the sum into

    density        selected / n of the exchanged gradient: mean over the window's steps, then over the ranks
    sent_bytes     bytes a rank sent per step, same averaging
    recv_bytes     bytes a rank received per step, same averaging
    residual_norm  L2 norm of the error-feedback residual at the time of the report, mean over the ranks

identical on every rank. A window without any sparse step on any rank (Horovod's dense optimizer) reports Horovod's
ring allreduce instead: density 1 and ``2 n (P - 1) / P * 4`` bytes each way (float32 gradients of n weights), so
that dense and sparse runs plot on the same axes.
"""

from __future__ import annotations

FIELDS = ("density", "sent_bytes", "recv_bytes")
KEYS = FIELDS + ("residual_norm",)


def dense_bytes(n, size):
    """Bytes a rank sends (and receives) per step in Horovod's ring allreduce of n float32 values."""
    return 2.0 * n * (size - 1) / size * 4 if size > 1 else 0.0


class SparsityWindow:
    """This rank's running sums of :data:`FIELDS` since the last :meth:`clear`."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.steps = 0
        self.sums = [0.0] * len(FIELDS)

    def add(self, stats):
        """Add one step's statistics (a dict with :data:`FIELDS`; empty: no sparse step, ignored)."""
        if not stats:
            return
        self.steps += 1
        for i, key in enumerate(FIELDS):
            self.sums[i] += float(stats.get(key, 0.0))

    def local(self, residual_norm=0.0):
        """This rank's contribution to the sum allreduce: [1 if it made a sparse step else 0, the means of
        :data:`FIELDS` over its steps, its residual norm]."""
        s = self.steps
        return [1.0 if s else 0.0] + [v / s if s else 0.0 for v in self.sums] + [float(residual_norm)]


def averaged(total, size, numel=None):
    """The report (a dict of :data:`KEYS` -> float) from the sum over ``size`` ranks of their :meth:`local`
    vectors; ``numel`` (an int, or a callable returning it) is only needed when no rank made a sparse step."""
    total = [float(v) for v in total]
    ranks = total[0]
    if ranks > 0:
        out = {key: total[1 + i] / ranks for i, key in enumerate(FIELDS)}
    else:
        n = numel() if callable(numel) else (numel or 0)
        out = {"density": 1.0, "sent_bytes": dense_bytes(n, size), "recv_bytes": dense_bytes(n, size)}
    out["residual_norm"] = total[1 + len(FIELDS)] / size
    return out
