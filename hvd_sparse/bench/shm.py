"""The synthetic gradients of the network benchmark, shared through ``/dev/shm``: the parent writes the
rank-independent parts of :class:`~hvd_sparse.bench.data.SyntheticGradients` once
(:func:`write_gradient_data`), every worker maps them read-only (:class:`SharedGradients`), so that 8 workers of
25M parameters fit in memory and do not each spend seconds per step drawing random numbers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from .data import SyntheticGradients
from .netns import pid_alive

DATA_DIR_PREFIX = "hvd_sparse_network_"


def shm_root():
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def data_bytes(n, steps):
    """Bytes of the shared gradient data: noise pool (8 n), scale (n) and one shared component per step."""
    return (8 + 1 + steps) * n * 4


def write_gradient_data(directory, n, workers, steps, seed, progress=None):
    """Write what :class:`SharedGradients` maps: the pieces of ``SyntheticGradients(n, workers, seed)`` that are
    identical on every rank (noise pool, per-layer scale, shared component c[t] for t < steps)."""
    from numpy.lib.format import open_memmap

    src = SyntheticGradients(n, workers, seed=seed)
    d = Path(directory)
    meta = {"n": src.n, "workers": src.workers, "seed": src.seed, "rho": src.rho, "noise": src.noise,
            "layout": list(src.layout), "steps": steps, "pool": len(src._noise_pool)}
    pool = open_memmap(d / "pool.npy", mode="w+", dtype=np.float32, shape=(len(src._noise_pool), n))
    for i, v in enumerate(src._noise_pool):
        pool[i] = v
    del pool
    src._noise_pool = None
    np.save(d / "scale.npy", src.scale)
    common = open_memmap(d / "common.npy", mode="w+", dtype=np.float32, shape=(steps, n))
    for t in range(steps):
        common[t] = src.common(t)
        if progress:
            progress(t + 1, steps)
    del common
    (d / "meta.json").write_text(json.dumps(meta))


def cleanup_stale_data_dirs(root):
    if root is None:
        return
    for p in Path(root).glob(f"{DATA_DIR_PREFIX}*"):
        m = re.match(rf"{DATA_DIR_PREFIX}(\d+)_", p.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


class SharedGradients(SyntheticGradients):
    """``SyntheticGradients`` whose rank-independent parts were computed once by the parent process
    (:func:`write_gradient_data`) and are mapped read-only from ``directory``:
    the noise pool, the per-layer scale and the shared component c[t] of every step. ``grad(t, r)`` is the
    inherited formula, so the values are bit-identical to ``SyntheticGradients(n, workers, seed)``'s."""

    def __init__(self, directory):   # noqa: super().__init__ would draw the 8n-value pool again
        d = Path(directory)
        meta = json.loads((d / "meta.json").read_text())
        self.n, self.workers, self.seed = meta["n"], meta["workers"], meta["seed"]
        self.rho, self.noise, self.layout = meta["rho"], meta["noise"], meta["layout"]
        self.steps = meta["steps"]
        self.scale = np.load(d / "scale.npy", mmap_mode="r")
        pool = np.load(d / "pool.npy", mmap_mode="r")
        self._noise_pool = [pool[i] for i in range(pool.shape[0])]
        self._commons = np.load(d / "common.npy", mmap_mode="r")

    def common(self, t):
        if not 0 <= t < self.steps:
            raise IndexError(f"SharedGradients: step {t} was not precomputed (0 <= t < {self.steps})")
        return self._commons[t]

    def grad(self, t, r, out=None):
        """``SyntheticGradients.grad(t, r)``, bit for bit, computed in place (one buffer instead of four;
        ``out``, if given, is reused: a float32 array of n values whose old content is overwritten)."""
        h = np.random.default_rng([self.seed, 2, t, r]).integers(0, 2**62)
        src = self._noise_pool[h % len(self._noise_pool)]
        s = int(h // 7) % self.n
        e = np.empty(self.n, np.float32) if out is None else out
        e[s:] = src[:self.n - s]                    # np.roll(src, s)
        e[:s] = src[self.n - s:]
        e *= np.float32(self.noise)                 # scale * (c + noise * e): the same float32 operations
        e += self.common(t)
        e *= self.scale
        return e
