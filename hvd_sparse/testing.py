"""The public simulator: run a compression on P virtual ranks in one process, exactly as Horovod would.

    import numpy as np, hvd_sparse
    from hvd_sparse.testing import simulate
    grads = np.random.default_rng(0).standard_normal((10, 4, 1000)).astype(np.float32)  # (steps, P, n)
    res = simulate(hvd_sparse.Compression.topka(0.01), grads)
    res.updates      # (steps, P, n): the averaged gradient each rank applies
    res.residuals    # (steps, P, n): each rank's error-feedback residual after each step
    res.volume[t][r] # {"sent_words", "recv_words", "sent_bytes", "recv_bytes", "collectives"}
    res.selected     # (steps, P): how many values each rank selected
    res.phases[t][r] # per-phase counters of the volume meter (words, bytes, calls)
    res.info[t][r]   # what the reducer reported (e.g. Ok-Topk's "K", "threshold", "reeval")
    res.velocities   # (steps, P, n) with momentum_correction: each rank's velocity after each step, else None

Each virtual rank runs the same engine code as a Horovod rank, over a
:class:`~hvd_sparse.core.sim.SimulatedCommunicator` (sums in rank order, so results are deterministic).
Test your own sparsifier with ``simulate(Compression.sparse(MySparsifier(0.01), allreduce=...), grads)``, or any
sparsifier and reducer objects with ``simulate(SparseCompression(sparsifier, reducer), grads)``.

What a test needs per step, it asks for by keyword:

    res = simulate(comp, grads, record=RECORDS)           # also each rank's algorithm state after each step:
    res.sparsifier_states[t][r], res.reducer_states[t][r] #   thresholds, boundaries, counters (deep copies)
    res = simulate(comp, grads, record=("selected",))     # only the counts: no (steps, P, n) arrays
    res = simulate(comp, lambda t, rank: source.grad(t, rank), steps=200, size=8)   # gradients made on demand
    res = simulate(comp, grads, before_step=force, after_step=look)   # your code on each rank around each step;
    res.observed[t][r]                                                #   what look(t, rank, engine) returned
    res = simulate(comp, grads, communicator=Logger)      # the engines talk to Logger(comm) (e.g. to log calls)

The torch optimizer's buckets (``overlap=True``) have their own oracle: :func:`simulate_buckets` runs the bucketed
step -- one unit per bucket, in bucket order, and the budget's split over them (:mod:`hvd_sparse.core.allocation`).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from .core import allocation
from .core.sim import SimulatedWorld
from .core.validate import check_nonfinite

#: every field ``simulate(record=...)`` can fill; "states" fills ``sparsifier_states`` and ``reducer_states``
RECORDS = ("updates", "residuals", "volume", "selected", "phases", "info", "velocities", "states")
#: what ``simulate`` records by default: everything but the algorithm states
DEFAULT_RECORD = RECORDS[:-1]


@dataclasses.dataclass
class SimulationResult:
    """What :func:`simulate` recorded; a field that was not asked for (``record=``) is None."""

    updates: np.ndarray
    residuals: np.ndarray
    volume: list
    selected: np.ndarray
    phases: list
    info: list
    #: (steps, P, n): each rank's momentum-correction velocity after each step (None without momentum correction)
    velocities: np.ndarray = None
    #: [t][r]: a deep copy of rank r's sparsifier state after step t (``record`` with "states")
    sparsifier_states: list = None
    #: [t][r]: a deep copy of rank r's reducer state after step t (``record`` with "states")
    reducer_states: list = None
    #: [t][r]: what ``after_step(t, r, engine)`` returned (with ``after_step``)
    observed: list = None


@dataclasses.dataclass
class BucketSimulation:
    """What :func:`simulate_buckets` returns."""

    #: (steps, P, n): the reduced gradient each rank applies
    updates: np.ndarray
    #: (P, n): each rank's residual after the last step (a two-level rank's at its shards' entries, zeros elsewhere)
    residuals: np.ndarray
    #: [t]: every bucket's share of the density at step t (:meth:`~hvd_sparse.core.engine.Engine.set_share`)
    shares: list


def simulate(compression, gradients, shapes=None, average=True, backend="numpy", nonfinite="skip", *, steps=None,
             size=None, record=DEFAULT_RECORD, before_step=None, after_step=None, communicator=None, device=None,
             dtype=None, local_size=None):
    """Run ``compression`` on ``gradients`` of shape (steps, P, n); see the module docstring.

    Args:
        compression (SparseCompression): a preset, or ``SparseCompression(sparsifier, reducer)`` of any
            sparsifier and reducer objects; its configuration is used, its own state is not touched (every
            virtual rank gets a fresh engine).
        gradients (array-like or callable): float array (steps, P, n), or a function ``(t, rank) -> gradient``
            (a 1-D array of n values) called once per step on each rank, in step order, for data too large to
            hold at once; then ``steps`` and ``size`` are required.
        shapes (list of tuples, optional): split of n into parameter tensors (for per-tensor schemes).
        average (bool): divide by P (``op=hvd.Average``) or not (``hvd.Sum``).
        backend (str): ``"numpy"`` (default), ``"torch"`` or ``"tensorflow"``: the array type the engines
            run on. The results are the same bits except where an algorithm computes float64 statistics
            whose last bit may differ between backends (Gaussiank's mean and std); use ``"torch"`` as the
            oracle of a PyTorch run and ``"tensorflow"`` as the oracle of a TensorFlow run.
        nonfinite (str): the engines' non-finite policy, ``"skip"`` (default) or ``"raise"``
            (:meth:`hvd_sparse.core.engine.Engine.step`).
        steps (int, keyword-only): the number of steps, with ``gradients`` a function.
        size (int, keyword-only): the number of virtual ranks P, with ``gradients`` a function.
        record (iterable of str, keyword-only): the fields to fill, from :data:`RECORDS`; default
            :data:`DEFAULT_RECORD` (all but ``"states"``). Leave out ``"updates"`` and ``"residuals"`` for long
            runs: they take 2 x steps x P x n values.
        before_step (callable, keyword-only): ``before_step(t, rank, engine)``, run on each virtual rank before
            its step t (e.g. to set a state the test wants to force).
        after_step (callable, keyword-only): ``after_step(t, rank, engine)``, run on each virtual rank after its
            step t; its results are ``observed[t][rank]``.
        communicator (callable, keyword-only): ``communicator(comm) -> comm``: each engine talks to what it
            returns for its rank's :class:`~hvd_sparse.core.sim.SimulatedCommunicator` (a wrapper that logs or
            checks the collectives and delegates them).
        device (str, keyword-only): with ``backend="torch"``, the device of the gradients (``"cuda"``: the engines
            run on the GPU); default the CPU.
        dtype (torch.dtype, keyword-only): with ``backend="torch"``, the gradients' dtype (e.g. ``torch.bfloat16``;
            the values given must be representable in it); default the given array's. Updates of a dtype numpy
            lacks (bfloat16) are recorded as float32, which holds them exactly.
        local_size (int, keyword-only): L ranks to a host, host by host (rank r on host r // L): the two-level step
            (:mod:`hvd_sparse.core.hierarchy`) on P / L hosts, unless the preset says ``hierarchical=False`` (the
            ``dense`` preset always does); each rank's residual is recorded at its shard's entries (zeros
            elsewhere), and ``volume`` gets ``across`` and ``inside``. None or 1 (default): flat.
    """
    api = "hvd_sparse.testing.simulate"
    check_nonfinite(nonfinite, api)
    record = _check_options(record, before_step, after_step, communicator, api)
    grad, steps, P, n, rec_dtype = _gradient_source(gradients, steps, size, api)
    if shapes is not None and sum(int(np.prod(s)) for s in shapes) != n:
        raise ValueError(f"{api}: shapes {shapes} do not add up to n={n}")
    convert, to_numpy, rec_dtype = _backend(backend, device, dtype, rec_dtype, api)
    world = SimulatedWorld(P)
    comms = world.communicators()
    engines = _engines(compression, world, comms, communicator, local_size, api)
    if shapes is not None:
        for e in engines:
            e.layout = [int(np.prod(s)) for s in shapes]
    res = _records(record, steps, P, n, rec_dtype, getattr(compression, "momentum_correction", 0), after_step)

    def run_rank(comm):
        r = comm.rank
        eng = engines[r]
        for t in range(steps):
            if before_step is not None:
                before_step(t, r, eng)
            u = eng.step(convert(grad(t, r)), average=average, nonfinite=nonfinite)
            _record_step(res, t, r, eng, u, comm, to_numpy)
            if after_step is not None:
                res.observed[t][r] = after_step(t, r, eng)

    world.run(run_rank, comms)
    return res


def simulate_buckets(compression, gradients, buckets, average=True, backend="numpy", *, budget="magnitude",
                     local_size=None, min_compression_rate=1.0):
    """The torch optimizer's bucketed exchange (``overlap=True``: :mod:`hvd_sparse.torch.buckets`) on P virtual ranks:
    per step, each bucket's unit steps in bucket order (a dense one every step dense), then, with ``budget=
    "magnitude"``, every :data:`~hvd_sparse.core.allocation.EVERY` steps the budget's split over the sparse buckets
    (:func:`~hvd_sparse.core.allocation.rebalance`); ``"size"``: k_b = d·n_b.

    Args:
        gradients: float array (steps, P, n), each rank's flat gradient with the buckets one after another.
        buckets: ``[(shapes, dense)]`` in bucket order: each bucket's tensor shapes (they add up to n over the
            buckets) and whether it goes dense.
        average, backend, local_size: as :func:`simulate`.
        min_compression_rate: the optimizer's: a sparse bucket's share stops where its message would not be that
            many times smaller than dense (:func:`~hvd_sparse.core.allocation.ceiling`).
    Returns:
        :class:`BucketSimulation`.
    """
    api = "hvd_sparse.testing.simulate_buckets"
    grad, steps, P, n, rec_dtype = _gradient_source(gradients, None, None, api)
    sizes = [sum(int(np.prod(s)) for s in shapes) for shapes, _ in buckets]
    if sum(sizes) != n:
        raise ValueError(f"{api}: the buckets hold {sum(sizes)} entries, the gradients {n}")
    convert, to_numpy, rec_dtype = _backend(backend, None, None, rec_dtype, api)
    world = SimulatedWorld(P)
    comms = world.communicators()
    units = list(zip(*[_engines(compression, world, comms, None, local_size, api) for _ in buckets]))
    bounds = np.cumsum([0] + sizes)
    topology = getattr(units[0][0], "topology", None) if buckets else None        # two levels: L ranks a host
    most = allocation.ceiling(compression, P, min_compression_rate, topology.local.size if topology else 1)
    res = BucketSimulation(np.zeros((steps, P, n), rec_dtype), np.zeros((P, n), np.float32), [None] * steps)

    def run_rank(comm):
        engines = units[comm.rank]
        for engine, (shapes, dense) in zip(engines, buckets):
            engine.layout, engine.dense = [int(np.prod(s)) for s in shapes], dense
        for t in range(steps):
            if comm.rank == 0:
                res.shares[t] = [e.share for e in engines]
            tally = budget == "magnitude" and allocation.due(t)
            for b, engine in enumerate(engines):
                engine.tally = tally and not buckets[b][1]
                lo, hi = bounds[b], bounds[b + 1]
                res.updates[t, comm.rank, lo:hi] = to_numpy(engine.step(convert(grad(t, comm.rank)[lo:hi]),
                                                                        average=average))
            if tally and not any(e.last.get("skipped") for e in engines):
                allocation.rebalance([(e, size, most) for e, size, (_, dense) in zip(engines, sizes, buckets)
                                      if not dense], comm)
        for b, engine in enumerate(engines):
            lo, hi = getattr(engine, "shard", (0, bounds[b + 1] - bounds[b]))   # two levels: the rank's shard
            if engine.memory.residual is not None:
                spread = getattr(engine, "spread", lambda flat: flat)     # zeros where dense_share sends dense
                res.residuals[comm.rank, bounds[b] + lo:bounds[b] + hi] = spread(to_numpy(engine.memory.residual))

    world.run(run_rank, comms)
    return res


def _engines(compression, world, comms, communicator, local_size, api):
    """Every virtual rank's engine: flat over its communicator, or two-level over ``local_size`` ranks a host."""
    wrap = communicator if communicator is not None else (lambda c: c)
    if local_size is None or int(local_size) == 1 or compression.hierarchical is False:     # (dense: always flat)
        return [compression.new_engine(wrap(c)) for c in comms]
    if int(local_size) < 1 or world.size % int(local_size):
        raise ValueError(f"{api}: local_size must divide the {world.size} ranks, got {local_size!r}")
    from .core.hierarchy import Topology, TwoLevelEngine
    return [TwoLevelEngine(compression, Topology(wrap(local), wrap(cross)))
            for local, cross in world.two_levels(int(local_size))]


def _merged(*stats):
    """Per-phase counters (``VolumeMeter.stats``) of several meters as one (their phases are apart)."""
    return {key: {phase: v for st in stats for phase, v in st[key].items()} for key in stats[0]}


def _check_options(record, before_step, after_step, communicator, api):
    """``record`` as a tuple of known fields; the hooks callable (or None)."""
    record = (record,) if isinstance(record, str) else tuple(record)
    unknown = [f for f in record if f not in RECORDS]
    if unknown:
        raise ValueError(f"{api}: record takes fields of {RECORDS}, got unknown {unknown}")
    for name, hook in (("before_step", before_step), ("after_step", after_step), ("communicator", communicator)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{api}: {name} must be callable, got {hook!r}")
    return record


def _gradient_source(gradients, steps, size, api):
    """``(grad(t, rank), steps, P, n, dtype)`` of the gradients: an array (steps, P, n) or a function (the first
    call sizes the records, and is step 0 of rank 0)."""
    if not callable(gradients):
        g = np.asarray(gradients)
        if g.ndim != 3:
            raise ValueError(f"{api}: gradients must have shape (steps, P, n), got {g.shape}")
        if (steps is not None and steps != g.shape[0]) or (size is not None and size != g.shape[1]):
            raise ValueError(f"{api}: steps={steps!r}, size={size!r} contradict the gradients' shape {g.shape}")
        return (lambda t, r: g[t, r]), *g.shape, g.dtype
    if steps is None or size is None or int(steps) < 1 or int(size) < 1:
        raise ValueError(f"{api}: gradients given as a function (t, rank) -> gradient need steps >= 1 and "
                         f"size >= 1, got steps={steps!r}, size={size!r}")
    first = [gradients(0, 0)]
    if len(np.shape(first[0])) != 1:
        raise ValueError(f"{api}: gradients(t, rank) must return a 1-D gradient, got shape "
                         f"{tuple(np.shape(first[0]))} at t=0, rank=0")

    def grad(t, r):
        return first.pop() if first and t == 0 and r == 0 else gradients(t, r)

    return grad, int(steps), int(size), int(np.shape(first[0])[0]), np.asarray(first[0]).dtype


def _backend(backend, device, dtype, rec_dtype, api):
    """``(convert, to_numpy, updates' dtype)``: numpy -> the backend's array (on ``device``, of ``dtype``) and
    back (bfloat16 as float32, which holds it exactly)."""
    if backend not in ("numpy", "torch", "tensorflow"):
        raise ValueError(f"{api}: backend must be 'numpy', 'torch' or 'tensorflow', got {backend!r}")
    if (device is not None or dtype is not None) and backend != "torch":
        raise ValueError(f"{api}: device= and dtype= go with backend='torch', got backend={backend!r}")
    if backend == "numpy":
        return np.ascontiguousarray, np.asarray, rec_dtype
    if backend == "tensorflow":
        import tensorflow as tf

        return (lambda x: tf.constant(np.array(x))), (lambda x: x.numpy()), rec_dtype
    import torch

    def to_numpy(x):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()

    if dtype is not None:                   # the updates' dtype: the gradients' (float32 for bfloat16)
        rec_dtype = np.float32 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
    return (lambda x: torch.from_numpy(np.array(x)).to(device=device, dtype=dtype)), to_numpy, rec_dtype


def _records(record, steps, P, n, dtype, momentum, after_step):
    """An empty :class:`SimulationResult` with the fields of ``record`` allocated."""
    def per_step(field):
        return [[None] * P for _ in range(steps)] if field in record else None

    return SimulationResult(
        updates=np.zeros((steps, P, n), dtype=dtype) if "updates" in record else None,
        residuals=np.zeros((steps, P, n), dtype=np.float32) if "residuals" in record else None,
        volume=per_step("volume"), selected=np.zeros((steps, P), dtype=np.int64) if "selected" in record else None,
        phases=per_step("phases"), info=per_step("info"),
        velocities=np.zeros((steps, P, n), np.float32) if "velocities" in record and momentum else None,
        sparsifier_states=per_step("states"), reducer_states=per_step("states"),
        observed=[[None] * P for _ in range(steps)] if after_step is not None else None)


def _record_step(res, t, r, eng, u, comm, to_numpy):
    """What rank ``r``'s step ``t`` left, into the fields of ``res`` that are recorded."""
    last = eng.last
    if res.updates is not None:
        res.updates[t, r] = to_numpy(u)
    lo, hi = getattr(eng, "shard", (0, None))               # a two-level rank holds its shard's error feedback
    spread = getattr(eng, "spread", lambda flat: flat)      # zeros at the tensors sent dense (dense_share)
    if res.residuals is not None:
        res.residuals[t, r] = 0.0
        if eng.memory.residual is not None:
            res.residuals[t, r, lo:hi] = spread(to_numpy(eng.memory.residual))
    if res.velocities is not None and eng.memory.velocity is not None:
        res.velocities[t, r, lo:hi] = spread(to_numpy(eng.memory.velocity))
    if res.volume is not None:
        res.volume[t][r] = {k: last[k] for k in ("sent_words", "recv_words", "sent_bytes", "recv_bytes",
                                                 "collectives", "across", "inside") if k in last}
    if res.phases is not None:
        topology = getattr(eng, "topology", None)           # two levels: the host's phases beside the hosts'
        res.phases[t][r] = _merged(*(m.meter.stats() for m in topology)) if topology else comm.meter.stats()
    if res.selected is not None:
        res.selected[t, r] = last["selected"]
    if res.info is not None:
        res.info[t][r] = {k: v for k, v in last["info"].items() if k != "residual"}
    if res.sparsifier_states is not None:
        res.sparsifier_states[t][r] = copy.deepcopy(eng.sparsifier_state)
        res.reducer_states[t][r] = copy.deepcopy(eng.reducer_state)
