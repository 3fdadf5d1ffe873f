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
from .core.reducers import Dense, ExDynaReducer, GTopk, OkTopk, Reducer, SparDL, TopkA, TopkDSA
from .core.reducers.oktopk import OKTOPK_PRESETS
from .core.sparsifiers import DCT, ExDyna, GaussianK, Sparsifier, ThresholdReuse, TopK

#: Reducers by name (``Compression.sparse(..., allreduce=<name>)``).
REDUCERS = {
    "oktopk": OkTopk,
    "dense": Dense,
    "topka": TopkA,
    "topk_dsa": TopkDSA,
    "gtopk": GTopk,
    "exdyna": ExDynaReducer,
    "spardl": SparDL,
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
    def oktopk(density, threshold_period=32, repartition_period=64, balance="auto", *, variant="library",
               boundaries=None):
        """Ok-Topk (Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning", PPoPP'22;
        spec oktopk.md §3.6): the O(k) sparse allreduce. Each rank selects with a local threshold that is
        exact every ``threshold_period`` steps and reused in between (``ThresholdReuse``); the index space is
        split into P regions re-balanced every ``repartition_period`` steps; each region's owner reduces what
        falls in it (one alltoall), keeps the values above a global threshold (exact every
        ``threshold_period`` steps) and the results are balanced and allgathered. Error feedback keeps
        S \\ G. Cost: at most 6k(P-1)/P words per rank on threshold-reuse steps of balanced input.

        Args:
            density (float): k = max(1, floor(density·n)), in (0, 1].
            threshold_period (int): tau', steps between exact local and global threshold evaluations (32).
            repartition_period (int): tau, steps between region repartitions (64).
            balance (str): "auto" (balance before the allgather iff the largest owner holds > 4x the mean,
                the paper's rule), "always" or "never".
            variant (str): the threshold controllers, one of ``OKTOPK_PRESETS``. "library" (default): exact-k
                selection, a guard that brings the local count back to <= k in one step and a ladder that keeps
                the global count K <= k (see ThresholdReuse.guard_target and OkTopk.global_control); "paper"
                (no controllers), "ref_lstm", "ref_vgg", "ref_bert" (the authors' code, per model). For the
                "paper"/"ref_*" variants the variant fixes the three knobs above.
            boundaries (str or None): how the regions follow the selection (``OkTopk.boundaries``): None takes
                the variant's ("load" for "library": rebalanced every step from the split loads the owners
                report in the count allgather; "periodic" for the others: only every ``repartition_period``
                steps, as the paper), or "periodic", "result", "load".
        """
        if variant not in OKTOPK_PRESETS:
            raise ValueError(f"hvd_sparse.Compression.oktopk: variant must be one of {sorted(OKTOPK_PRESETS)}, "
                             f"got {variant!r}")
        kw = OKTOPK_PRESETS[variant]
        sp, rd = dict(kw["sparsifier"]), dict(kw["reducer"])
        if variant == "library":
            sp["threshold_period"] = rd["threshold_period"] = threshold_period
            rd.update(repartition_period=repartition_period, balance=balance)
        if boundaries is not None:
            rd["boundaries"] = boundaries
        name = f"oktopk(density={density!r})" if variant == "library" else \
            f"oktopk(density={density!r}, variant={variant!r})"
        if boundaries is not None:
            name = f"{name[:-1]}, boundaries={boundaries!r})"
        return SparseCompression(ThresholdReuse(density, **sp), OkTopk(**rd), preset=name)

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
    def topk_dsa(density):
        """TopkDSA (SparCML's dynamic sparse allreduce as benchmarked by Li & Hoefler, PPoPP'22; spec
        oktopk.md §3.3): exact local top-k, sparse reduce-scatter over P equal regions (one alltoall), then
        an allgather of the reduced regions -- sparse, or dense when the reduced nonzeros N reach n/3.
        Same result as TopkA. Cost: between 4k(P-1)/P and (2k+n)(P-1)/P words per rank.

        Args:
            density (float): fraction of entries each rank sends, in (0, 1].
        """
        return SparseCompression(TopK(density), TopkDSA(), preset=f"topk_dsa(density={density!r})")

    @staticmethod
    def gtopk(density):
        """gTopk (Shi et al., ICDCS'19, as benchmarked by Li & Hoefler; spec oktopk.md §3.4): exact local
        top-k, then a reduction tree of log2 P rounds, each merging two lists and keeping the top k, and a
        broadcast of the final k entries. Any P (fold-in pre-round when P is not a power of two). Error
        feedback keeps S \\ G; not mass-conserving (values pruned in a subtree are lost). Cost 4k log2 P words.

        Args:
            density (float): k = max(1, floor(density·n)) entries in the global result, in (0, 1].
        """
        return SparseCompression(TopK(density), GTopk(), preset=f"gtopk(density={density!r})")

    @staticmethod
    def gaussiank(density, adjust="lstm"):
        """Gaussiank (Shi et al., 2019, as benchmarked by Li & Hoefler; spec oktopk.md §3.5): threshold
        mu + z·sigma from a Gaussian fit of the accumulator (z = Phi^-1(1 - density/2)), scaled down until at
        least 3k/4 entries pass, then the TopkA exchange (counts + allgatherv). Cost about 2k(P-1) words.

        Args:
            density (float): target fraction of entries, in (0, 1].
            adjust (str): the threshold adjustment loop of the reference code: "lstm" (default), "bert", "vgg".
        """
        return SparseCompression(GaussianK(density, adjust=adjust), TopkA(),
                                 preset=f"gaussiank(density={density!r})")

    @staticmethod
    def exdyna(density, threshold_rule="proportional", init_threshold="topk_once"):
        """ExDyna (Yoon & Oh, CCGrid'24; spec exdyna.md): the flat gradient is cut into blocks grouped in P
        exclusive partitions that rotate over the ranks every step; each rank selects |acc| >= tau inside its
        partition only (no index is ever selected twice), the indices are allgathered and every rank's values
        at the union are allreduced. Between steps partitions trade blocks with their neighbours (balance) and
        tau is scaled toward k. Cost about 3k(P-1)/P words.

        Args:
            density (float): target global fraction of entries, in (0, 1].
            threshold_rule (str): "proportional" (default here: tau *= exp(0.2 (|S|/k - 1)) each step, on the
                mean of the last two counts, clipped to [0.8, 2]; within 10% of k on average over 200 steps,
                docs/benchmarks.md), "reference" (the
                authors' code: +-0.5% a step; settles near 0.94k on stationary data, but takes hundreds of
                steps to follow an error-fed gradient whose right threshold grows tens of times) or "symmetric".
            init_threshold: "topk_once" (default here: tau0 from one top-k at the first step, so the target is
                reached at once) or None for the reference tau0 = 1/(2 sqrt(k)), which needs hundreds of steps
                when the gradient scale is far from it, or a positive float.
        """
        return SparseCompression(ExDyna(density, threshold_rule=threshold_rule, init_threshold=init_threshold),
                                 ExDynaReducer(), preset=f"exdyna(density={density!r})")

    @staticmethod
    def dct(density, lifespan=1000):
        """DCT-DP (Gupta et al., KDD'21, "Dynamic Communication Thresholding"; spec dct.md part A): a hard
        threshold per parameter tensor, the K-th largest |acc| of the tensor (K = ceil(density·n_l)),
        recomputed only every ``lifespan`` steps and reused in between; the selections are allgathered.

        Args:
            density (float): fraction of each tensor sent on recompute steps, in (0, 1].
            lifespan (int): steps between threshold recomputations (default 1000, the paper's value).
        """
        return SparseCompression(DCT(density, lifespan), TopkA(),
                                 preset=f"dct(density={density!r}, lifespan={lifespan!r})")

    @staticmethod
    def spardl(density, groups=1):
        """SparDL (ICDE'24; spec spardl.md): Spar-Reduce-Scatter (block-wise top-k/P at every hop, dropped
        values kept as residuals where they fall -- global residual collection), then, with ``groups=d > 1``,
        Spar-All-Gather across d teams, then an all-gather inside each team. SparDL picks its own entries
        inside the exchange; ``density`` sets the budget k. Cost about 4k(P-1)/P words for groups=1.

        Args:
            density (float): budget k = max(1, floor(density·n)), in (0, 1].
            groups (int): number of teams d; must divide the number of ranks (default 1).
        """
        return SparseCompression(TopK(density), SparDL(groups=groups),
                                 preset=f"spardl(density={density!r}, groups={groups!r})")

    @staticmethod
    def dense():
        """Dense allreduce through the engine (spec oktopk.md §3.1): the baseline, no selection, no residual.
        Use it to compare schemes on the same run; for plain training prefer Horovod's own ``Compression.none``.
        """
        return SparseCompression(None, Dense(), preset="dense()")

    @staticmethod
    def sparse(sparsifier, allreduce="oktopk"):
        """Any pairing of a sparsifier and a sparse allreduce, e.g. ``sparse(GaussianK(0.01))`` (Gaussiank
        selection, Ok-Topk's O(k) allreduce) or ``sparse(TopK(0.01), allreduce="topka")``.

        Args:
            sparsifier (Sparsifier): how each rank chooses its entries (carries the density).
            allreduce (str): one of ``REDUCERS``: how the choices are combined. Default: "oktopk".
        """
        return SparseCompression(sparsifier, _reducer(allreduce))
