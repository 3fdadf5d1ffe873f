"""The selection sizes the capacities of docs/algorithms.md ("The wire") were chosen from: what each threshold
sparsifier selects when nothing cuts it, on the gradients of a real model as it trains (the digits MLP of
``hvd_sparse.bench.data.MLPGradients``, 301,066 parameters; density 0.01), on simulated ranks.

    python scripts/capacities.py --workers 4 --steps 300

Per preset, the percentiles over steps 10.. and ranks of |S|/k (ExDyna: each rank's k_r over k/P) with the capacity
lifted, and for Ok-Topk with an uncut split and gather (``split_capacity=None``, ``gather_capacity=None``) what each
rank's selection holds in each other owner's region (the capacity of its split) and each owner's share of G on
reuse steps (the capacity of its gather), over k/P.
"""

import argparse
import dataclasses
import warnings

import numpy as np

import hvd_sparse
from hvd_sparse.bench.data import MLPGradients
from hvd_sparse.compression import SparseCompression
from hvd_sparse.testing import simulate

DENSITY, SKIP = 0.01, 10


def uncapped(comp):
    """The preset with its sparsifier's capacity lifted (and Ok-Topk's gather uncut)."""
    sparsifier = comp.sparsifier
    wide = type(type(sparsifier).__name__, (type(sparsifier),), {"capacity_ratio": 1e9})
    sparsifier = wide(**{f.name: getattr(sparsifier, f.name) for f in dataclasses.fields(sparsifier)})
    reducer = comp.reducer
    if reducer.name == "oktopk":
        reducer = dataclasses.replace(reducer, gather_capacity=None, split_capacity=None)
    return SparseCompression(sparsifier, reducer, repr(comp))


class SplitLog:
    """A communicator that keeps, per rank, what each ``split`` alltoall sends each other rank (Ok-Topk's parts)."""

    parts = {}

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def alltoall(self, x, splits, phase, parts=None):
        if phase == "split":
            SplitLog.parts.setdefault(self._comm.rank, []).append(
                [m for q, m in enumerate(splits) if q != self._comm.rank])
        return self._comm.alltoall(x, splits, phase, parts)


def percentiles(ratios, cap=None):
    """The percentiles of ``ratios`` and their mean; with ``cap``, how many exceed it."""
    a = np.asarray(ratios, float)
    out = " ".join(f"p{q} {np.percentile(a, q):.2f}" for q in (50, 90, 99, 100)) + f", mean {a.mean():.2f}"
    return out if cap is None else out + f", over {cap}: {np.mean(a > cap):.2%}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    if args.steps <= SKIP:
        p.error(f"--steps must be more than {SKIP}: the percentiles are over steps {SKIP}..")
    warnings.simplefilter("ignore")
    P, steps = args.workers, args.steps
    src = MLPGradients(P, seed=0)
    k = int(DENSITY * src.n)
    print(f"n = {src.n}, k = {k}, P = {P}, steps {SKIP}..{steps - 1}")
    for name in ("gaussiank", "dct", "exdyna", "oktopk"):
        SplitLog.parts = {}
        res = simulate(uncapped(getattr(hvd_sparse.Compression, name)(DENSITY)), src.grad, steps=steps, size=P,
                       shapes=[(m,) for m in src.layout], record=("selected", "info"), communicator=SplitLog)
        selected = res.selected[SKIP:].ravel()
        unit, what = (k / P, "k_r/(k/P)") if name == "exdyna" else (k, "|S|/k")
        print(f"{name} {what}: {percentiles(selected / unit)}")
        if name == "oktopk":
            owners = [c for t in range(SKIP, steps) if not res.info[t][0]["reeval"]
                      for c in res.info[t][0]["owner_counts"]]
            lib = hvd_sparse.Compression.oktopk(DENSITY).reducer
            print(f"oktopk owners at the rung /(k/P): {percentiles(np.array(owners) / (k / P), lib.gather_capacity)}")
            parts = [m for r in range(P) for row in SplitLog.parts[r][SKIP:] for m in row]
            print(f"oktopk a rank's part of each other owner's region /(k/P): "
                  f"{percentiles(np.array(parts) / (k / P), lib.split_capacity)}")


if __name__ == "__main__":
    main()
