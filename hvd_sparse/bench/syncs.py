"""The fixed costs of a sparse step, counted on the CPU: host reads, negotiated collectives and operations.

On a CUDA tensor every read of a value by the host -- ``float(t)``, ``int(t)``, ``bool(t)``, ``t.item()``,
``t.tolist()``, a copy to numpy -- and every operation whose output size depends on the data (``nonzero``,
boolean-mask indexing, ``unique``, ``masked_select``) makes the host wait until the GPU has finished the work
queued before it (one ``cudaStreamSynchronize``). :class:`HostReads` is a ``torch`` function mode that counts these
calls on any device, so the engine's syncs per step can be counted -- and guarded by a test -- on a machine without a
GPU. :class:`AtenOps` counts the ``aten`` operations a step dispatches (each one Python and dispatch work, and on
a GPU a kernel launch). :func:`count` runs P simulated ranks with CPU torch tensors on the paths of CUDA tensors
(no C kernel, no numpy view of a buffer) and counts each rank's reads and operations per step, outside the
collectives (a collective's own copies are Horovod's, not the engine's; what the engine reads from its result is
counted), and the step's negotiated collectives (the agreement's included).

    python -m hvd_sparse.bench.syncs --size 4     # the table of docs/algorithms.md ("The fixed costs of a step")
"""

from __future__ import annotations

import collections
import contextlib
import os
import traceback
from typing import NamedTuple

#: calls that read a value on the host (``numpy``: a copy to the host; ``.cpu()`` before it is not counted again)
READS = frozenset({"__float__", "__int__", "__bool__", "__index__", "item", "tolist", "numpy"})
#: operations whose output size depends on the data (the host must learn it before it allocates the result);
#: ``bincount`` reads its largest and smallest input on the host on a GPU (two reads, counted as one here)
SIZED = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"})
#: operations that read on the host unless told what they would learn: ``isin`` sorts the unique values of both
#: inputs (``unique``) unless ``assume_unique``; ``repeat_interleave`` sums the repeats unless given ``output_size``
UNLESS = {"isin": "assume_unique", "repeat_interleave": "output_size"}


def _bool_index(index):
    import torch

    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _torch_function_mode():
    from torch.overrides import TorchFunctionMode

    return TorchFunctionMode


def _torch_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class _Pausable:
    """A counter that :meth:`paused` stops counting (nested: counting resumes when the outermost pause ends)."""

    _paused = 0

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1


class HostReads(_Pausable, _torch_function_mode()):
    """Counts the host reads (:data:`READS`, :data:`SIZED`, :data:`UNLESS`, boolean-mask indexing) while active and not
    :meth:`paused`; ``where`` counts them by the library line that made them (the caller of the array backend)."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.where = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            name = getattr(func, "__name__", "")
            if (name in READS or name in SIZED or (name in UNLESS and not kwargs.get(UNLESS[name]))
                    or (name in ("__getitem__", "__setitem__") and _bool_index(args[1]))):
                self.reads += 1
                self.where[f"{name} at {_library_line()}"] += 1
        return func(*args, **kwargs)


class AtenOps(_Pausable, _torch_dispatch_mode()):
    """Counts the ``aten`` operations dispatched while active and not :meth:`paused` (``by_name``: per operation)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.by_name = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused:
            self.ops += 1
            self.by_name[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _library_line():
    for fs in reversed(traceback.extract_stack(limit=12)):
        if "/hvd_sparse/" in fs.filename and "/core/xp/" not in fs.filename and not fs.filename.endswith("/syncs.py"):
            return f"{fs.filename.split('/hvd_sparse/', 1)[1]}:{fs.lineno}"
    return "?"


class _Unmetered:
    """A communicator whose collectives run with the ``counters`` paused (everything else passes through)."""

    def __init__(self, comm, *counters):
        self._comm, self._counters = comm, counters

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not callable(attr) or name.startswith("__"):
            return attr

        def collective(*args, **kwargs):
            with contextlib.ExitStack() as stack:
                for counter in self._counters:
                    stack.enter_context(counter.paused())
                return attr(*args, **kwargs)
        return collective


class StepCosts(NamedTuple):
    """Per step of rank 0: ``reads``, ``collectives`` (negotiated, the agreement's included) and ``ops`` (aten
    operations of its engine step); ``where``: the library lines that made the last step's reads."""

    reads: list
    collectives: list
    ops: list
    where: collections.Counter


def count(compression, size, n, steps, seed=0):
    """The :class:`StepCosts` of rank 0's engine steps: ``compression`` (its configuration; fresh engines) on P =
    ``size`` simulated ranks, gradient-like data of ``n`` entries, CPU tensors on the paths of CUDA tensors."""
    import torch

    from ..core.sim import SimulatedWorld
    from .data import SyntheticGradients

    source = SyntheticGradients(n, size, seed=seed)
    counters = [(HostReads(), AtenOps()) for _ in range(size)]

    def rank_loop(comm):
        reads, ops = counters[comm.rank]
        engine = compression.new_engine(_Unmetered(comm, reads, ops), "model")
        out = StepCosts([], [], [], reads.where)
        for t in range(steps):
            grad = torch.from_numpy(source.grad(t, comm.rank))
            before, ops.ops = reads.reads, 0
            if t == steps - 1:
                reads.where.clear()
            with reads, ops:
                engine.step(grad)
            out.reads.append(reads.reads - before)
            out.ops.append(ops.ops)
            out.collectives.append(engine.last["collectives"] + engine.last["control_collectives"])
        return out

    with as_if_on_a_device():
        return SimulatedWorld(size).run(rank_loop)[0]


@contextlib.contextmanager
def as_if_on_a_device():
    """CPU tensors take the paths of CUDA tensors: no C kernel (``HVD_SPARSE_NATIVE=0``) and no numpy view of a
    buffer (``TorchBackend.host`` answers None, as for device memory). The float copy of the rungs that the CPU's
    ``torch.histc`` needs (CUDA's takes them as they are) is made unseen by the counters."""
    from torch.utils._python_dispatch import _disable_current_modes

    from ..core.xp.torch_backend import TorchBackend

    def histc_keys(rungs):
        with _disable_current_modes():
            return rungs.double()

    old_env, old_host = os.environ.get("HVD_SPARSE_NATIVE"), TorchBackend.__dict__["host"]
    old_keys = TorchBackend.__dict__["_histc_keys"]
    os.environ["HVD_SPARSE_NATIVE"] = "0"
    TorchBackend.host = staticmethod(lambda x: None)
    TorchBackend._histc_keys = staticmethod(histc_keys)
    try:
        yield
    finally:
        TorchBackend.host, TorchBackend._histc_keys = old_host, old_keys
        if old_env is None:
            del os.environ["HVD_SPARSE_NATIVE"]
        else:
            os.environ["HVD_SPARSE_NATIVE"] = old_env


#: the first steady step: the first two allocate error feedback's two buffers
STEADY_FROM = 2


def table(size, n=20_000, steps=10, density=0.01, names=None):
    """Markdown: per preset, the host reads of the first step and of a steady step (the most over the steps from
    :data:`STEADY_FROM` on), the steady step's negotiated collectives (the agreement's included) and aten
    operations, and where the steady step makes its reads."""
    from . import presets

    lines = [f"| preset | host reads, first step | steady step (P = {size}): host reads | collectives | aten ops "
             "| where the reads are |", "|---|---|---|---|---|---|"]
    for name in names or presets.names():
        c = count(presets.make(name, density), size, n, steps)
        places = ", ".join(f"{v}x {k}" if v > 1 else k for k, v in sorted(c.where.items(), key=lambda kv: kv[0]))
        s = STEADY_FROM
        lines.append(f"| {name} | {c.reads[0]} | {max(c.reads[s:])} | {max(c.collectives[s:])} | {max(c.ops[s:])} "
                     f"| {places} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4, help="simulated ranks P (default 4)")
    parser.add_argument("--n", type=int, default=20_000, help="gradient entries (default 20000)")
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    print(table(args.size, args.n, density=args.density))
