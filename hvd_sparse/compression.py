"""Sparse compression presets: a sparsifier (how each rank chooses) paired with a reducer (how the
choices are combined), usable wherever Horovod takes ``compression=``.

    import hvd_sparse.torch as hvds
    compression = hvds.Compression.topka(density=0.01)
    optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                          compression=compression)

A :class:`SparseCompression` is configuration plus, once bound, the per-rank state of the units it
serves (residuals, thresholds). It is hashable (by identity) like Horovod's compressors, and it also
speaks Horovod's compressor protocol (``compress``/``decompress``) so that the unmodified
``horovod.torch.DistributedOptimizer(..., compression=...)`` runs the same whole-model exchange
(see ``hvd_sparse/torch/stash.py``).
"""

from __future__ import annotations

from .core.engine import Engine
from .core.reducers import Dense, Reducer, TopkA
from .core.sparsifiers import Sparsifier, TopK

#: Reducers by name (``Compression.sparse(..., allreduce=<name>)``).
REDUCERS = {
    "dense": Dense,
    "topka": TopkA,
}


class SparseCompression:
    """A sparsifier/reducer pair plus the per-rank state of the units it serves.

    Args:
        sparsifier (Sparsifier or None): chooses local entries; ``None`` only for the dense reducer.
        reducer (Reducer): combines the selections of all ranks.
        preset (str): the preset's name, for ``repr`` and logs.
    """

    def __init__(self, sparsifier, reducer, preset=None):
        if not isinstance(reducer, Reducer):
            raise TypeError(f"hvd_sparse.Compression: reducer must be a Reducer, got {reducer!r}")
        if reducer.sparse and not isinstance(sparsifier, Sparsifier):
            raise TypeError(f"hvd_sparse.Compression: reducer {reducer.name!r} needs a Sparsifier, "
                            f"got {sparsifier!r}")
        self.sparsifier = sparsifier if reducer.sparse else None
        self.reducer = reducer
        self.preset = preset or (f"sparse({sparsifier!r}, allreduce={reducer.name!r})")
        self._engines = {}        # bucket -> (owner token, Engine): the state of this rank
        self._horovod_adapter = None

    @property
    def density(self):
        return self.sparsifier.density if self.sparsifier is not None else 1.0

    def new_engine(self, comm, bucket="model"):
        """A fresh per-rank :class:`Engine` (state and step) for one unit, over ``comm``."""
        return Engine(self, comm, bucket)

    def engine(self, bucket, owner, make_comm):
        """The engine of ``bucket`` for ``owner``, created on first use with ``make_comm()``.

        Raises ValueError when a second owner (another optimizer or model) claims the same bucket: its
        residuals and thresholds would mix with the first one's.
        """
        entry = self._engines.get(bucket)
        if entry is None:
            entry = self._engines[bucket] = (owner, self.new_engine(make_comm(), bucket))
        elif entry[0] is not owner:
            raise ValueError(f"{self!r} is already used by another optimizer or model (unit '{bucket}'); "
                             "a compression object keeps per-model state: create one per model, e.g. "
                             f"Compression.{self.preset.split('(')[0]}(...) again")
        return entry[1]

    # -- Horovod's compressor protocol (for the unmodified hvd.DistributedOptimizer) -------------------
    def compress(self, tensor):
        if self._horovod_adapter is None:
            mod = type(tensor).__module__
            if not mod.startswith("torch"):
                raise TypeError(f"{self!r}: as a Horovod `compression=` argument a sparse preset works only "
                                "with horovod.torch.DistributedOptimizer; for TensorFlow use "
                                "hvd_sparse.tensorflow.DistributedGradientTape / DistributedOptimizer")
            from .torch.stash import StashAdapter
            self._horovod_adapter = StashAdapter(self)
        return self._horovod_adapter.compress(tensor)

    def decompress(self, tensor, ctx):
        if ctx is None or self._horovod_adapter is None:
            return tensor          # Horovod's own paths (e.g. torch.sparse gradients) pass through
        return self._horovod_adapter.decompress(tensor, ctx)

    def __repr__(self):
        return f"Compression.{self.preset}"


def _reducer(name):
    try:
        return REDUCERS[name]()
    except (KeyError, TypeError):
        raise ValueError(f"hvd_sparse.Compression.sparse: allreduce must be one of "
                         f"{sorted(REDUCERS)}, got {name!r}") from None


class Compression:
    """Sparse presets, one factory per scheme. Every call returns a new object with fresh state."""

    @staticmethod
    def topka(density):
        """TopkA (Li & Hoefler, PPoPP'22, §5 baseline; spec oktopk.md §3.2): exact local top-k on every
        rank, allgather of the k (index, value) pairs, sum in rank order. Error feedback keeps what was not
        sent. Cost: 2k(P-1) words received per rank per step, growing linearly with P.

        Args:
            density (float): fraction of entries each rank sends, in (0, 1]; k = max(1, floor(density·n)).
        """
        return SparseCompression(TopK(density), TopkA(), preset=f"topka(density={density!r})")

    @staticmethod
    def dense():
        """Dense allreduce through the engine (spec oktopk.md §3.1): the baseline, no selection, no residual.
        Use it to compare schemes on the same run; for plain training prefer Horovod's own ``Compression.none``.
        """
        return SparseCompression(None, Dense(), preset="dense()")

    @staticmethod
    def sparse(sparsifier, allreduce="topka"):
        """Any pairing of a sparsifier and a sparse allreduce, e.g. ``sparse(TopK(0.01), allreduce="topka")``.

        Args:
            sparsifier (Sparsifier): how each rank chooses its entries (carries the density).
            allreduce (str): one of ``REDUCERS``: how the choices are combined.
        """
        return SparseCompression(sparsifier, _reducer(allreduce))
