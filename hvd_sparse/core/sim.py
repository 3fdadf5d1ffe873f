"""P virtual ranks in one process: the test oracle and the volume instrument.

Each virtual rank runs the *same* engine code as a real Horovod rank, in its own thread, with a
:class:`SimulatedCommunicator`. A collective is a rendezvous: every rank deposits its input, a barrier
releases them, each rank computes its output from all inputs in rank order, a second barrier frees the
slots. Outputs are therefore exactly what Horovod returns (allgather concatenates in rank order,
alltoall delivers by source rank), and sums are added in rank order 0..P-1, which makes the simulator
deterministic.

The simulator also checks what Horovod would not: all ranks must issue the same collective (same phase
name and kind) at the same time -- a mismatch raises :class:`CollectiveMismatchError` naming the ranks,
instead of silently pairing different tensors. If one rank raises, the barrier is broken and every
other rank raises too (no hang).

    world = SimulatedWorld(4)
    results = world.run(lambda comm: my_step(comm))   # list of 4 per-rank results
"""

from __future__ import annotations

import threading

import numpy as np

from .comm import (MAX, SUM, VolumeMeter, meter_allgather, meter_allreduce, meter_alltoall, meter_broadcast,
                   meter_parts)
from .xp import backend_of


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives at the same point (a bug in the caller's ordering)."""


class SimulatedWorld:
    """The shared rendezvous of P virtual ranks."""

    def __init__(self, size, timeout=600.0):
        if int(size) < 1:
            raise ValueError(f"SimulatedWorld: size must be >= 1, got {size}")
        self.size = int(size)
        self._timeout = timeout
        self._barrier = threading.Barrier(self.size, timeout=timeout)
        self._slots = [None] * self.size
        self._groups = []

    def communicators(self):
        return [SimulatedCommunicator(self, r) for r in range(self.size)]

    def group(self, size):
        """A world of ``size`` of these ranks (a host's ranks, or the ranks of one local rank across the hosts):
        a rendezvous of its own, met by threads of this world's :meth:`run`, broken with this world's."""
        world = SimulatedWorld(size, self._timeout)
        self._groups.append(world)
        return world

    def two_levels(self, local_size):
        """Per rank r, its ``(local, cross)`` communicators when the ranks sit ``local_size`` to a host, host by
        host (rank r on host r // L as its local rank r % L): the host's L ranks, and the N = P / L ranks of its
        local rank, one per host (cross rank r // L)."""
        L = int(local_size)
        if L < 1 or self.size % L:
            raise ValueError(f"SimulatedWorld: local_size must divide the {self.size} ranks, got {local_size}")
        hosts = [self.group(L) for _ in range(self.size // L)]
        crosses = [self.group(self.size // L) for _ in range(L)]
        return [(SimulatedCommunicator(hosts[r // L], r % L), SimulatedCommunicator(crosses[r % L], r // L))
                for r in range(self.size)]

    def _abort(self):
        self._barrier.abort()
        for world in self._groups:
            world._abort()

    def _reset(self):
        self._barrier.reset()
        for world in self._groups:
            world._reset()

    def exchange(self, rank, item, combine=None):
        """All-to-all of Python objects: every rank gets the list of all ranks' items.

        With ``combine``, rank 0 computes ``combine(items)`` once and every rank gets that same object
        (used for allgather results, which are identical everywhere: P times less memory and work).
        """
        if self.size == 1:
            return combine([item]) if combine else [item]
        self._slots[rank] = item
        self._barrier.wait()
        if combine is None:
            out = list(self._slots)
        elif rank == 0:
            try:
                self._combined = combine(list(self._slots))
            except BaseException:
                self._barrier.abort()
                raise
        self._barrier.wait()
        return out if combine is None else self._combined

    def run(self, fn, comms=None):
        """Run ``fn(comm)`` on every virtual rank in its own thread; returns the per-rank results.

        The first exception of any rank is re-raised here (the others are released, not hung).
        """
        comms = comms or self.communicators()
        if self.size == 1:
            return [fn(comms[0])]
        results = [None] * self.size
        errors = [None] * self.size

        def target(r):
            try:
                results[r] = fn(comms[r])
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
                self._abort()

        threads = [threading.Thread(target=target, args=(r,), name=f"sim-rank-{r}")
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                     None) or next((e for e in errors if e is not None), None)
        if first is not None:
            self._reset()
            raise first
        return results


class SimulatedCommunicator:
    """One virtual rank's view of a :class:`SimulatedWorld` (implements ``Communicator``)."""

    def __init__(self, world, rank):
        self.world = world
        self.rank = rank
        self.size = world.size
        self.meter = VolumeMeter()
        self.num_collectives = 0

    def _gather(self, kind, phase, payload, combine=None):
        def checked(items):
            heads = [(k, p) for k, p, _ in items]
            if any(h != heads[0] for h in heads):
                raise CollectiveMismatchError(
                    "ranks issued different collectives: "
                    + ", ".join(f"rank {r}: {k} {p!r}" for r, (k, p) in enumerate(heads)))
            xs = [x for _, _, x in items]
            return combine(xs) if combine else xs

        self.num_collectives += 1
        if combine is None:
            return checked(self.world.exchange(self.rank, (kind, phase, payload)))
        return self.world.exchange(self.rank, (kind, phase, payload), combine=checked)

    def allreduce(self, x, op, phase, bucket=None):
        xp = backend_of(x)
        name = phase if bucket is None else f"{phase}.{bucket}"     # ranks must meet under one name, as in Horovod
        if op not in (SUM, MAX):
            raise ValueError(f"allreduce: op must be 'sum' or 'max', got {op!r}")

        def combine(xs):
            if any(xp.numel(y) != xp.numel(x) for y in xs):
                raise ValueError(f"allreduce {phase!r}: sizes differ across ranks: {[xp.numel(y) for y in xs]}")
            out = xp.copy(xs[0])
            for y in xs[1:]:                   # rank order 0..P-1: deterministic
                out = out + y if op == SUM else xp.maximum(out, y)
            return xp.freeze(out)

        if xp.freezable:   # identical on every rank: computed once, shared read-only
            out = self._gather("allreduce", name, x, combine=combine)
        else:
            out = combine(self._gather("allreduce", name, x))
        meter_allreduce(self.meter, self.size, xp.numel(x), xp.itemsize(x), phase)
        return out

    def allgather(self, x, phase, calls=1, parts=None):
        xp = backend_of(x)
        if xp.freezable:
            # identical on every rank: built once, shared read-only (an in-place write raises)
            def combine(xs):
                return xp.freeze(xp.concat(xs)), [xp.numel(y) for y in xs]

            out, sizes = self._gather("allgather", phase, x, combine=combine)
        else:
            xs = self._gather("allgather", phase, x)
            out, sizes = xp.concat(xs, like=x), [xp.numel(y) for y in xs]
        if parts is None:
            meter_allgather(self.meter, self.rank, sizes, xp.itemsize(x), phase, calls)
        else:
            meter_parts(self.meter, self.size, parts, xp.itemsize(x))
        return out

    def grouped_allgather(self, xs, phases):
        """The allgathers of ``xs``, metered as one negotiated collective (as Horovod's grouped allgather)."""
        return [self.allgather(x, phase, calls=int(i == 0)) for i, (x, phase) in enumerate(zip(xs, phases))]

    def alltoall(self, x, splits, phase, parts=None):
        xp = backend_of(x)
        splits = [int(s) for s in splits]
        if len(splits) != self.size or sum(splits) > xp.numel(x) or min(splits) < 0:
            raise ValueError(f"alltoall {phase!r}: bad splits {splits} for {xp.numel(x)} rows on "
                             f"rank {self.rank}")
        def combine(xs):            # the P x P split table and its row offsets, once for all ranks
            table = np.array([sp for _, sp in xs], dtype=np.int64).reshape(self.size, self.size)
            starts = np.zeros_like(table)
            np.cumsum(table[:, :-1], axis=1, out=starts[:, 1:])
            return xs, table, starts

        items, table, starts = self._gather("alltoall", phase, (x, splits), combine=combine)
        starts = starts[:, self.rank]
        recv_splits = table[:, self.rank].tolist()
        rows = xp.numel(x) and x.shape[0]
        row_words = xp.numel(x) // rows if rows else 1
        pieces = [items[s][0][int(starts[s]):int(starts[s]) + recv_splits[s]] for s in range(self.size)]
        meter_alltoall(self.meter, self.rank, splits, recv_splits, xp.itemsize(x), phase, row_words=row_words,
                       parts=parts)
        return xp.concat(pieces, like=x), recv_splits

    def broadcast(self, x, root, phase):
        xp = backend_of(x)
        xs = self._gather("broadcast", phase, x)
        meter_broadcast(self.meter, self.rank, root, self.size, xp.numel(x), xp.itemsize(x), phase)
        return xp.copy(xs[root])
