"""The Horovod side of hvd_sparse's communication, shared by the torch and TensorFlow adapters: the
``Communicator`` over Horovod's collectives (:class:`HorovodCommunicator`), whether this process belongs to a process
set (:func:`in_process_set`) and the error a survivor raises when another rank fails (``PeerFailureError``).

The core (:mod:`hvd_sparse.core`) knows only the ``Communicator`` protocol of :mod:`hvd_sparse.core.comm`; this
module is where Horovod comes in.
"""

from __future__ import annotations

import functools
import os
import time

from .core.comm import (MAX, SHARED_NAMES, SUM, VolumeMeter, meter_allgather, meter_allreduce, meter_alltoall,
                        meter_broadcast, meter_parts)
from .core.xp import backend_of

@functools.lru_cache(maxsize=None)
def _peer_failure_type():
    from horovod.common.exceptions import HorovodInternalError

    class PeerFailureError(HorovodInternalError):
        """A collective of hvd_sparse failed because Horovod shut down: another rank failed or was killed.
        A ``HorovodInternalError``, so ``hvd.elastic.run`` recovers from it as from Horovod's own."""

    return PeerFailureError


#: seconds a surviving rank waits before raising :class:`PeerFailureError` outside elastic mode, so that
#: ``horovodrun`` sees the failed rank exit first and names it ("The first process to do so was: ...")
PEER_FAILURE_GRACE = 3.0


def in_process_set(process_set, rank):
    """Whether this process (global ``rank``, the framework's ``hvd.rank()``) belongs to Horovod's ``process_set``.

    Not ``process_set.included()``: Horovod 0.28.1 fills the process sets' rank lists inside ``hvd.init()``
    through the module of whichever framework was imported last. With ``horovod.torch`` and
    ``horovod.tensorflow`` both imported, the global process set's ranks can come from the framework that was not
    initialized: ``[]``, and ``included()`` is False on every rank, which would skip the exchange everywhere and
    let the replicas drift silently. The global set (id 0) holds every rank; another set, the ranks it was built
    with."""
    if process_set.process_set_id == 0:
        return True
    return process_set.ranks is not None and rank in process_set.ranks


#: this process's two-level process sets once registered: (size of the job, the local sets, the cross sets)
_HOST_SETS = []


def host_layout(hvd):
    """Every rank's ``(host, local_rank, local_size, cross_rank)`` in rank order, from one allgather (the host: the
    name horovodrun gave it, ``HOROVOD_HOSTNAME``, else the machine's). Raises ValueError on every rank alike when
    the hosts hold different numbers of ranks, naming each host and its count."""
    import socket

    mine = (os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(), hvd.local_rank(), hvd.local_size(),
            hvd.cross_rank())
    table = [tuple(row) for row in hvd.allgather_object(mine, name="hvd_sparse.topology")]
    counts = {}
    for host, *_ in table:
        counts[host] = counts.get(host, 0) + 1
    if len(set(counts.values())) > 1 or len({row[2] for row in table}) > 1:
        raise ValueError("hvd_sparse: two levels (hierarchical) need the same number of ranks on every host, got "
                         + ", ".join(f"{h}: {c}" for h, c in counts.items())
                         + "; launch as many ranks on each host, or pass hierarchical=False")
    return table


def host_process_sets(hvd, required):
    """``(local, cross)``: Horovod's process sets of this rank's host and of its local rank across the hosts, or None
    where the ranks sit one to a host. Every rank registers every such set, in one order (the hosts' by cross rank,
    then the local ranks'), once per job; sets the job already has (registered at ``hvd.init(process_sets=...)``)
    are used as they are. New sets need ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` at launch: without it, ValueError on
    every rank (``required``), or None (flat)."""
    from horovod.common import process_sets as ps

    if not _HOST_SETS or _HOST_SETS[0][0] != hvd.size():
        table = host_layout(hvd)
        hosts = sorted({row[3] for row in table})
        local_ranks = sorted({row[1] for row in table})
        local = [[r for r, row in enumerate(table) if row[3] == c] for c in hosts]
        cross = [sorted((r for r, row in enumerate(table) if row[1] == j), key=lambda r: table[r][3])
                 for j in local_ranks]
        if len(local_ranks) == 1:
            _HOST_SETS[:] = [(hvd.size(), None, None)]
        else:
            _HOST_SETS[:] = [(hvd.size(), *_register(ps, local + cross, len(local), required))]
    _, local_sets, cross_sets = _HOST_SETS[0]
    if local_sets is None:
        return None
    return local_sets[hvd.cross_rank()], cross_sets[hvd.local_rank()]


def _register(ps, groups, hosts, required):
    """The process sets of ``groups`` (rank lists; the first ``hosts`` of them the hosts'): those Horovod already
    has, the others added (``HOROVOD_DYNAMIC_PROCESS_SETS=1``), in order; ``(local sets, cross sets)``, or
    ``(None, None)`` where they cannot be added and are not ``required``."""
    known = {tuple(ranks): pid for pid, ranks in ps._basics._get_process_set_ids_and_ranks().items()}
    missing = [g for g in groups if tuple(g) not in known]
    dynamic = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0").strip().lower() not in ("", "0", "false")
    if missing and not dynamic:
        if not required:
            return None, None
        raise ValueError("hvd_sparse: two levels (hierarchical=True) need Horovod process sets of each host's ranks "
                         "and of each local rank's across the hosts; launch with HOROVOD_DYNAMIC_PROCESS_SETS=1 (e.g. "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 horovodrun ...) so that hvd_sparse can add them, or pass "
                         f"hierarchical=False. Missing: {missing}")
    sets = []
    for g in groups:
        if tuple(g) in known:
            s = ps._temp_process_set_object(known[tuple(g)])
            s.ranks = list(g)
        else:
            s = ps.add_process_set(list(g))
        sets.append(s)
    return sets[:hosts], sets[hosts:]


class HorovodCommunicator:
    """The ``Communicator`` over Horovod's collectives, shared by the framework adapters.

    It names every collective ``hvd_sparse.<unit>.<phase>`` (the same on every rank, stable across steps, unique
    per unit; the agreement step's ``hvd_sparse.agree`` is shared by every unit), passes the process set, and
    meters what moved. A framework subclass only runs the five Horovod calls on its own tensors:
    ``_allreduce(x, hvd_op, kw)``, ``_allgather(x, kw)``, ``_grouped_allgather(xs, kw) -> outs``,
    ``_alltoall(x, splits, kw) -> (out, recv_splits)``, ``_broadcast(x, root, kw)``, where ``kw`` holds ``name`` and
    ``process_set``.

    Failures: when another rank dies or raises, Horovod shuts down and the pending collective fails on the
    survivors (Gloo notices the closed connection within seconds: no hang). The survivors raise
    ``PeerFailureError`` (a ``HorovodInternalError``, which ``hvd.elastic.run`` handles) naming the collective,
    after a short grace (:data:`PEER_FAILURE_GRACE`, not under elastic) so that horovodrun reports the rank
    that failed first rather than a survivor.
    """

    def __init__(self, hvd, process_set, unit, shared_tag=None):
        self._hvd = hvd
        self.process_set = process_set
        self.unit = unit
        self.shared_tag = shared_tag
        self.rank = process_set.rank()
        self.size = process_set.size()
        self.meter = VolumeMeter()

    def _kw(self, phase, bucket=None):
        return {"name": self.name(phase, bucket), "process_set": self.process_set}

    def two_levels(self, required=False):
        """The :class:`~hvd_sparse.core.hierarchy.Topology` of this unit's ranks grouped by host
        (:func:`host_process_sets`: communicators of the same framework over the host's and the local rank's process
        sets), or None (flat): one rank a host, or (not ``required``) no way to register the sets. Only over all
        ranks (the global set)."""
        from .core.hierarchy import Topology

        if self.process_set.process_set_id != 0:
            if required:
                raise ValueError(f"hvd_sparse: two levels (hierarchical=True) run over all ranks; unit {self.unit!r} "
                                 "runs over a process set of some of them: pass hierarchical=False")
            return None
        sets = host_process_sets(self._hvd, required)
        if sets is None:
            return None
        return Topology(type(self)(sets[0], self.unit, shared_tag=self.shared_tag),
                        type(self)(sets[1], self.unit, shared_tag=self.shared_tag))

    def name(self, phase, bucket=None):
        """The Horovod name of ``phase``'s collective: ``hvd_sparse.<unit>.<phase>``, unique per unit, except for
        the agreement step's phases, which every unit of the process set shares (``hvd_sparse.agree``, ...: see
        the agreement below; a communicator with a ``shared_tag``, a bucket's, shares them with the units of its
        tag only: ``hvd_sparse.agree.b0``); a collective of one of a ladder of sizes adds its rung
        (``.<bucket>``), since Horovod's response cache holds one shape per name."""
        shared = SHARED_NAMES.get(phase)
        if shared and self.shared_tag:
            shared = f"{shared}.{self.shared_tag}"
        name = f"hvd_sparse.{shared}" if shared else f"hvd_sparse.{self.unit}.{phase}"
        return name if bucket is None else f"{name}.{bucket}"

    def _guarded(self, fn, *args):
        """``fn(*args)``, whose last argument is the collective's ``kw``, its wall time added to the meter's
        ``seconds``; Horovod's shutdown becomes ``PeerFailureError`` naming the collective as Horovod knows it."""
        start = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:      # noqa: BLE001 - only Horovod's shutdown is translated, the rest re-raised
            from horovod.common.exceptions import HorovodInternalError

            if not isinstance(e, HorovodInternalError) and "Horovod has been shut down" not in str(e):
                raise
            if os.environ.get("HOROVOD_ELASTIC") != "1":
                time.sleep(PEER_FAILURE_GRACE)
            raise _peer_failure_type()(
                f"hvd_sparse: collective '{args[-1]['name']}' failed on rank {self.rank}: Horovod "
                "shut down because another rank failed or was killed (its own error comes first in the log, and "
                "horovodrun names it), or called hvd.join(), which a sparse exchange does not support (give every "
                f"rank the same number of steps); this rank stops too. Horovod said: {e}") from e
        finally:
            self.meter.seconds += time.perf_counter() - start

    def allreduce(self, x, op, phase, bucket=None):
        xp = backend_of(x)
        out = self._guarded(self._allreduce, x, {SUM: self._hvd.Sum, MAX: self._hvd.Max}[op],
                            self._kw(phase, bucket))
        meter_allreduce(self.meter, self.size, xp.numel(x), xp.itemsize(x), phase)
        return out

    def allgather(self, x, phase, parts=None):
        out = self._guarded(self._allgather, x, self._kw(phase))
        if parts is None:
            self._meter_allgather(x, out, phase)
        else:
            meter_parts(self.meter, self.size, parts, backend_of(x).itemsize(x))
        return out

    def grouped_allgather(self, xs, phases):
        """The allgathers of ``xs`` in one Horovod negotiation (``hvd.grouped_allgather``, named after the phases
        joined by ``+``)."""
        outs = self._guarded(self._grouped_allgather, list(xs), self._kw("+".join(phases)))
        for i, (x, out, phase) in enumerate(zip(xs, outs, phases)):
            self._meter_allgather(x, out, phase, calls=int(i == 0))
        return list(outs)

    def _meter_allgather(self, x, out, phase, calls=1):
        # Horovod does not return the per-rank sizes; only ours and the total matter for the meter.
        xp = backend_of(x)
        mine = xp.numel(x)
        sizes = [0] * self.size
        sizes[self.rank] = mine
        sizes[(self.rank + 1) % self.size] += backend_of(out).numel(out) - mine
        meter_allgather(self.meter, self.rank, sizes, xp.itemsize(x), phase, calls)

    def alltoall(self, x, splits, phase, parts=None):
        xp = backend_of(x)
        splits = [int(s) for s in splits]
        out, recv_splits = self._guarded(self._alltoall, x, splits, self._kw(phase))
        n = xp.numel(x)
        row_words = n // x.shape[0] if n else 1
        meter_alltoall(self.meter, self.rank, splits, recv_splits, xp.itemsize(x), phase, row_words=row_words,
                       parts=parts)
        return out, recv_splits

    def broadcast(self, x, root, phase):
        xp = backend_of(x)
        # Horovod names the root by its rank in the job, the protocol by its rank in the process set
        ranks = self.process_set.ranks if self.process_set.process_set_id != 0 else None
        out = self._guarded(self._broadcast, x, root if not ranks else ranks[root], self._kw(phase))
        meter_broadcast(self.meter, self.rank, root, self.size, xp.numel(x), xp.itemsize(x), phase)
        return out
