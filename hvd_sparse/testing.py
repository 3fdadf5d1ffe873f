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
Test your own sparsifier with ``simulate(Compression.sparse(MySparsifier(0.01), allreduce=...), grads)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .core.sim import SimulatedWorld


@dataclasses.dataclass
class SimulationResult:
    updates: np.ndarray
    residuals: np.ndarray
    volume: list
    selected: np.ndarray
    phases: list
    info: list
    #: (steps, P, n): each rank's momentum-correction velocity after each step (None without momentum correction)
    velocities: np.ndarray = None


def simulate(compression, gradients, shapes=None, average=True, backend="numpy", nonfinite="skip"):
    """Run ``compression`` on ``gradients`` of shape (steps, P, n); see the module docstring.

    Args:
        compression (SparseCompression): a preset; its configuration is used, its own state is not
            touched (every virtual rank gets a fresh engine).
        gradients (array-like): float array (steps, P, n).
        shapes (list of tuples, optional): split of n into parameter tensors (for per-tensor schemes).
        average (bool): divide by P (``op=hvd.Average``) or not (``hvd.Sum``).
        backend (str): ``"numpy"`` (default), ``"torch"`` or ``"tensorflow"``: the array type the engines
            run on. The results are the same bits except where an algorithm computes float64 statistics
            whose last bit may differ between backends (Gaussiank's mean and std); use ``"torch"`` as the
            oracle of a PyTorch run and ``"tensorflow"`` as the oracle of a TensorFlow run.
        nonfinite (str): the engines' non-finite policy, ``"skip"`` (default) or ``"raise"``
            (:meth:`hvd_sparse.core.engine.Engine.step`).
    """
    g = np.asarray(gradients)
    if g.ndim != 3:
        raise ValueError(f"hvd_sparse.testing.simulate: gradients must have shape (steps, P, n), got {g.shape}")
    if shapes is not None and sum(int(np.prod(s)) for s in shapes) != g.shape[2]:
        raise ValueError(f"hvd_sparse.testing.simulate: shapes {shapes} do not add up to n={g.shape[2]}")
    if backend not in ("numpy", "torch", "tensorflow"):
        raise ValueError("hvd_sparse.testing.simulate: backend must be 'numpy', 'torch' or 'tensorflow', "
                         f"got {backend!r}")
    if backend == "torch":
        import torch

        def convert(x):
            return torch.from_numpy(np.array(x))
    elif backend == "tensorflow":
        import tensorflow as tf

        def convert(x):
            return tf.constant(np.array(x))
    else:
        def convert(x):
            return np.ascontiguousarray(x)

    def to_numpy(x):
        return np.asarray(x) if backend == "numpy" else x.numpy()

    steps, P, n = g.shape
    world = SimulatedWorld(P)
    comms = world.communicators()
    engines = [compression.new_engine(c) for c in comms]
    if shapes is not None:
        for e in engines:
            e.layout = [int(np.prod(s)) for s in shapes]
    updates = np.zeros((steps, P, n), dtype=g.dtype)
    residuals = np.zeros((steps, P, n), dtype=np.float32)
    volume = [[None] * P for _ in range(steps)]
    phases = [[None] * P for _ in range(steps)]
    infos = [[None] * P for _ in range(steps)]
    selected = np.zeros((steps, P), dtype=np.int64)
    velocities = np.zeros((steps, P, n), np.float32) if getattr(compression, "momentum_correction", 0) else None

    def run_rank(comm):
        r = comm.rank
        eng = engines[r]
        for t in range(steps):
            updates[t, r] = to_numpy(eng.step(convert(g[t, r]), average=average, nonfinite=nonfinite))
            res = eng.memory.residual
            residuals[t, r] = 0.0 if res is None else to_numpy(res)
            if velocities is not None and eng.memory.velocity is not None:
                velocities[t, r] = to_numpy(eng.memory.velocity)
            last = eng.last
            volume[t][r] = {k: last[k] for k in ("sent_words", "recv_words", "sent_bytes", "recv_bytes",
                                                 "collectives")}
            phases[t][r] = comm.meter.stats()
            selected[t, r] = last["selected"]
            infos[t][r] = {k: v for k, v in last["info"].items() if k != "residual"}

    world.run(run_rank, comms)
    return SimulationResult(updates, residuals, volume, selected, phases, infos, velocities)
