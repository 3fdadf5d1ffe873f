"""The exchange in buckets, launched during backward: ``overlap=True`` of
:func:`hvd_sparse.torch.DistributedOptimizer`.

Without overlap the whole model is one unit, exchanged in ``synchronize()`` after backward, so every millisecond of
the exchange adds to the step. With it, as DDP's reducer and Horovod's hooks do for a dense allreduce:

1. **Buckets** (:func:`plan_buckets`): the parameters in reverse registration order (about the order in which
   backward produces their gradients), cut into buckets of at most ``bucket_cap_mb`` MB of float32 gradient; a
   parameter larger than the cap is a bucket of its own. Unlike DDP's, the first bucket is not smaller: a bucket
   costs a sparse step its own collectives, and measured (docs/benchmarks.md, "Overlap with backward"), a first
   bucket of 1 MB changed nothing on a ResNet-50 layout and cost the digits CNN time and ExDyna's accuracy. Every
   rank plans from its own model; each bucket's agreement covers its parameters, its index and the number of
   buckets, so ranks whose plans differ raise ``RankDisagreementError`` together.
2. Each bucket is a **unit** of the job (``b0``, ``b1``, ...; collectives ``hvd_sparse.<owner>.b<i>.<phase>``, its
   agreement ``hvd_sparse.agree.b<i>``, so that Horovod's response cache keeps one shape per name): its own error
   feedback, thresholds and partitions. Ok-Topk's reused thresholds and ExDyna's partitions are per bucket: one
   threshold over the whole model would need every bucket's gradient before the first could be selected -- the wait
   overlap removes (layer-wise selection, as DGC practises and whose convergence LAGS-SGD proves).
   **The budget** (``bucket_budget``): split by size, k_b = ⌊d·n_b⌋ (``"size"``), it starves small layers, whose
   entries hold far more of the whole model's top-k than their size (docs/algorithms.md, "Buckets"); so by default
   (``"magnitude"``) every 10th exchange counts where the whole model's top-k fell and gives each sparse bucket that
   share of the budget from the next exchange on (:mod:`hvd_sparse.core.allocation`; one small allreduce).
3. **Small buckets dense** (:func:`goes_dense`): a bucket whose sparse message would not be at least
   ``min_compression_rate`` times smaller than a dense allreduce's (PowerSGD's rule, with
   :mod:`hvd_sparse.core.budget`'s model of the bytes) is exchanged dense on every step: its error feedback stays
   empty, momentum correction still applies.
4. **Launch** (:class:`Overlap`): the hook of each parameter's gradient accumulator counts its passes; a bucket is
   ready when every parameter of it that requires grad has had ``backward_passes_per_step`` passes. Ready buckets
   go, in index order, to one thread of the optimizer that runs their engine steps one after another (as Horovod
   runs its collectives on a background thread): every rank issues bucket 0's collectives, then bucket 1's, ...,
   whatever the order in which its gradients arrived, and backward goes on meanwhile. ``synchronize()`` hands over
   the buckets that are not ready (a parameter unused this step never sends its gradient: it contributes zeros, as
   without overlap), waits for every bucket in order and raises the first error. Under
   ``hvd_sparse.torch.GradScaler`` the hooks launch nothing: the buckets go after the step has unscaled them.
5. **Non-finite gradients**: each bucket's agreement finds a NaN or Inf of its own entries on any rank; the step is
   skipped (no update, on every rank alike) when any bucket skipped. A bucket whose gradients were finite has then
   committed its step -- its residual keeps what it did not send, what it sent is dropped with the update, as a
   skipped dense step drops its gradient.
"""

from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

from ..core import allocation, budget
from .amp import scaling

#: the default largest bucket, in MB of float32 gradient (DDP's ``bucket_cap_mb``)
BUCKET_CAP_MB = 25.0
#: the default ``min_compression_rate``: a bucket goes dense unless its sparse message is smaller than dense
MIN_COMPRESSION_RATE = 1.0
#: the values of ``bucket_budget``, the default first: split by where the whole model's top-k falls, or by size
BUDGETS = ("magnitude", "size")


@dataclass(frozen=True)
class Bucket:
    """One bucket: its index, its ``(name, parameter)`` pairs in exchange order, and whether it goes dense."""
    index: int
    params: tuple
    dense: bool

    @property
    def unit(self):
        return f"b{self.index}"


def plan_buckets(named, cap_mb):
    """``named`` (``(name, p)`` in registration order) cut, in reverse order, into lists of at most ``cap_mb`` MB of
    float32 gradient each (a parameter larger than that alone)."""
    cap = cap_mb * 2 ** 20
    out, current, size = [], [], 0
    for name, p in reversed(named):
        nbytes = 4 * p.numel()
        if current and size + nbytes > cap:
            out.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nbytes
    if current:
        out.append(current)
    return out


def goes_dense(compression, numel, size, min_rate, local_size=1):
    """Whether a bucket of ``numel`` entries over ``size`` ranks goes dense: its sparse message (core.budget's model
    of the preset's bytes at k = max(1, ⌊d·n⌋)) is not ``min_rate`` times smaller than a dense allreduce's. On two
    levels (``local_size`` L > 1 ranks a host) what the preset changes is the exchange among the size / L hosts of a
    host's shard, ⌈n / L⌉ entries: the rule compares that with the shard's dense allreduce among the hosts."""
    size, numel = allocation.across(size, local_size), -(-numel // local_size)
    if size <= 1 or numel == 0 or compression.sparsifier is None:
        return False
    density = compression.density_for(size)
    k = max(1, int(density * numel))
    return budget.fraction(compression.sparsifier, compression.reducer, k / numel, size) * min_rate >= 1.0


class Overlap:
    """The buckets of one optimizer and the thread that exchanges them (module docstring, step 4).

    Args:
        buckets: the :class:`Bucket` s, in index order.
        run: ``run(bucket)``, the exchange of one bucket, called on the optimizer's thread.
        name: the thread's name.
    """

    def __init__(self, buckets, run, name):
        self.buckets = list(buckets)
        self._run = run
        self._name = name
        self._where = {id(p): b.index for b in self.buckets for _, p in b.params}
        self._lock = threading.Lock()
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._new_step()

    def _new_step(self):
        self._waiting = None            # per bucket: gradients still to arrive, counted at the first arrival
        self._futures = []
        self.launched_by_hooks = 0

    def extend(self, buckets):
        """Buckets of parameters added since the plan (``add_param_group``), numbered after the others."""
        self.buckets.extend(buckets)
        self._where.update({id(p): b.index for b in buckets for _, p in b.params})

    def covers(self, p):
        return id(p) in self._where

    def arrived(self, p):
        """From the gradient hook: ``p`` has had its last pass of the step; launch the buckets now ready, in order."""
        if scaling():               # scaled gradients: launched after the step has unscaled them (amp.py)
            return
        with self._lock:
            if self._waiting is None:       # requires_grad read now: a freeze between steps counts
                self._waiting = [sum(q.requires_grad for _, q in b.params) for b in self.buckets]
            index = self._where.get(id(p))
            if index is not None:
                self._waiting[index] -= 1
            before = len(self._futures)
            self._advance(everything=False)
            self.launched_by_hooks += len(self._futures) - before

    def _advance(self, everything):
        while len(self._futures) < len(self.buckets) and \
                (everything or self._waiting[len(self._futures)] <= 0):
            self._futures.append(self._submit(self.buckets[len(self._futures)]))

    def _submit(self, bucket):
        if self._thread is None:        # it holds the queue only: the job goes when its optimizer goes (finalize)
            self._thread = threading.Thread(target=_serve, args=(self._queue,), name=self._name, daemon=True)
            self._thread.start()
            weakref.finalize(self, self._queue.put, None)
        future = Future()
        self._queue.put((self._run, bucket, future))
        return future

    def finish(self):
        """Launch the buckets not launched yet, wait for every bucket in order; ``[result of run(bucket)]``. Raises
        the first bucket's error (after every bucket has finished); the next step starts afresh either way."""
        with self._lock:
            self._advance(everything=True)
            futures = self._futures
        try:
            errors = [f.exception() for f in futures]
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
            return [f.result() for f in futures]
        finally:
            with self._lock:
                self._new_step()


def _serve(work):
    """The optimizer's thread: ``run(bucket)`` of each item of ``work`` in order, its result or error into the item's
    future, until None."""
    while True:
        item = work.get()
        if item is None:
            return
        run, bucket, future = item
        try:
            future.set_result(run(bucket))
        except BaseException as e:      # noqa: BLE001 - handed to finish(), which raises it on the caller
            future.set_exception(e)
        del item, run, bucket, future   # nothing of the job stays referenced between items
