"""The sparse statistics in Python's ``logging``: ``log_stats_every=N`` of the torch and Keras optimizers.

Every N optimizer steps every rank averages the statistics of the exchanges since the last average over the ranks
(``sparse_stats(average=True)``: one small allreduce, so every rank must take the same steps, as for any
collective), and rank 0 of the optimizer's process set logs them at INFO on the logger ``hvd_sparse``, one line::

    hvd_sparse step 200: density 0.0100, sent 1.01 MB, received 3.04 MB per rank and step, residual norm 0.153

(with two levels, also the part of it sent between the hosts). Nothing is printed unless the application configures
logging (``logging.basicConfig(level=logging.INFO)``), as with any library; the numbers are the ones
``sparse_stats(average=True)`` returns, so a ``SummaryWriter`` can take the same.
"""

from __future__ import annotations

import logging

#: the logger of hvd_sparse's statistics
LOGGER = logging.getLogger("hvd_sparse")


def log_stats(step, stats):
    """Log ``stats`` (``sparse_stats(average=True)``'s dict) of optimizer step ``step`` at INFO (module docstring)."""
    if not stats:
        return
    across = ""
    if stats.get("across_sent_bytes", stats["sent_bytes"]) != stats["sent_bytes"]:      # two levels
        across = f", {stats['across_sent_bytes'] / 1e6:.3g} MB of it between hosts"
    LOGGER.info("hvd_sparse step %d: density %.4f, sent %.3g MB, received %.3g MB per rank and step%s, residual norm "
                "%.3g", step, stats["density"], stats["sent_bytes"] / 1e6, stats["recv_bytes"] / 1e6, across,
                stats["residual_norm"])
