"""The Communicator of the PyTorch adapter: Horovod's torch collectives, named and process-set aware.

Every collective is named ``hvd_sparse.<unit>.<phase>``: the same on every rank and stable across steps
(Horovod's response cache hits), never the order-dependent ``noname`` Horovod would pick. ``alltoall``
splits go as int32 tensors, which Horovod requires. Volume is counted as in ``hvd_sparse.core.comm``.

Waiting: Horovod's ``synchronize(handle)`` spins (``WaitAndClear``: poll, ``std::this_thread::yield()``, poll,
...) until the background thread has finished the collective. With a core per rank that is the fastest wait;
with more ranks than cores (CPU training, several workers per host, a shared machine) the spinning ranks take the
cores from the ranks that still compute, and every collective waits for the slowest of them. There this
communicator waits politely: it polls the handle and sleeps in between, 20 us at first and doubling up to
``HVD_SPARSE_WAIT_MAX_US`` (default 500 us), then takes the result with ``synchronize`` (which returns at once).

``HVD_SPARSE_WAIT`` chooses (:func:`wait_max_seconds`): ``auto`` (default) spins when this host runs no more ranks
than it has cores for this process, and polls otherwise; ``spin`` and ``poll`` force one. With a core per rank
spinning is faster (measured on one small allreduce of 2 ranks: docs/gpu.md, "Measured", *One small collective*,
and docs/benchmarks.md, "Measured choices in the code"); with more ranks than cores polling is (measured on
Ok-Topk's CPU time per rank and step, 4 ranks on 2 cores: docs/benchmarks.md, "What the Ok-Topk step costs (P = 4,
25M)", *Spinning*).
"""

from __future__ import annotations

import os
import pickle
import time

import torch

from ..horovod_comm import HorovodCommunicator

#: first sleep between two polls of a pending collective (seconds); it doubles up to wait_max_seconds()
WAIT_FIRST_SLEEP = 20e-6


def wait_max_seconds(local_ranks=None):
    """The longest sleep between two polls of a pending collective: ``HVD_SPARSE_WAIT_MAX_US`` microseconds
    (default 500), or None for Horovod's own spinning ``synchronize``: with ``HVD_SPARSE_WAIT=spin``, and with
    ``auto`` (the default) when ``local_ranks`` (the ranks on this host) fit the cores this process may use."""
    mode = os.environ.get("HVD_SPARSE_WAIT", "auto").strip().lower()
    if mode == "auto":
        mode = "spin" if local_ranks is not None and local_ranks <= _cores() else "poll"
    if mode == "spin":
        return None
    if mode != "poll":
        raise ValueError(f"hvd_sparse: HVD_SPARSE_WAIT must be 'auto' (default), 'poll' or 'spin', got {mode!r}")
    raw = os.environ.get("HVD_SPARSE_WAIT_MAX_US", "500").strip()
    try:
        us = float(raw)
    except ValueError:
        us = -1.0
    if not 0 < us <= 1e6:
        raise ValueError(f"hvd_sparse: HVD_SPARSE_WAIT_MAX_US must be a number of microseconds in (0, 1e6], "
                         f"got {raw!r}")
    return us * 1e-6


def _cores():
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def wait(handle, max_sleep=500e-6):
    """The result of the asynchronous Horovod torch collective ``handle``, waiting without spinning: poll,
    sleep (20 us, doubling up to ``max_sleep`` seconds), poll, ...; ``max_sleep=None``: Horovod's spinning
    ``synchronize``. Errors are Horovod's (``synchronize`` raises them)."""
    import horovod.torch as hvd

    if max_sleep is not None and not hvd.poll(handle):
        delay = WAIT_FIRST_SLEEP
        while not hvd.poll(handle):
            time.sleep(delay)
            delay = min(2 * delay, max_sleep)
    return hvd.synchronize(handle)


class HorovodTorchCommunicator(HorovodCommunicator):
    def __init__(self, process_set, unit, shared_tag=None):
        import horovod.torch as hvd

        super().__init__(hvd, process_set, unit, shared_tag)
        self._max_sleep = wait_max_seconds(hvd.local_size())

    def _allreduce(self, x, op, kw):
        return wait(self._hvd.allreduce_async(x, op=op, **kw), self._max_sleep)

    def _allgather(self, x, kw):
        return wait(self._hvd.allgather_async(x, **kw), self._max_sleep)

    def _grouped_allgather(self, xs, kw):
        return wait(self._hvd.grouped_allgather_async(xs, **kw), self._max_sleep)

    def _alltoall(self, x, splits, kw):
        out, recv = wait(self._hvd.alltoall_async(x, splits=torch.tensor(splits, dtype=torch.int32), **kw),
                         self._max_sleep)
        return out, [int(s) for s in recv.tolist()]

    def _broadcast(self, x, root, kw):
        return wait(self._hvd.broadcast_async(x, root_rank=root, **kw), self._max_sleep)


def allgather_object(obj, name, process_set):
    """Every rank's picklable ``obj``, in rank order (Horovod 0.28.1's torch version takes no process set)."""
    import horovod.torch as hvd

    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = hvd.allgather(torch.tensor([data.numel()]), name=f"{name}.sizes", process_set=process_set)
    blob = hvd.allgather(data, name=f"{name}.data", process_set=process_set)
    out, off = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(blob[off:off + n].numpy().tobytes()))
        off += n
    return out
