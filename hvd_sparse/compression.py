"""Sparse compression presets: a sparsifier (how each rank chooses) paired with a reducer (how the
choices are combined), usable wherever Horovod takes ``compression=``.

    import hvd_sparse.torch as hvds
    compression = hvds.Compression.topka(density=0.01)
    optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                          compression=compression)

A :class:`SparseCompression` is frozen configuration, shareable as Horovod's compressors are: any number of
optimizers, tapes and ``sparse_allreduce`` calls may use one object. The state of one training job (residuals,
thresholds, partitions, counters: :class:`hvd_sparse.core.state.UnitStates`) is made from it by the adapter that
owns the job (:meth:`SparseCompression.reify`). A preset also speaks Horovod's compressor protocol
(``compress``/``decompress``) so that the unmodified ``horovod.torch.DistributedOptimizer(..., compression=...)``
runs the same whole-model exchange (see ``hvd_sparse/torch/stash.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import math
import numbers
import os
import warnings
import weakref

from .core import budget, recipe
from .core.engine import Engine
from .core.oktopk import FEW_COLLECTIVES_FROM, OkTopk
from .core.oktopk.variants import pair as oktopk_pair
from .core.reducers import Dense, ExDynaReducer, GTopk, Reducer, SparDL, TopkA, TopkDSA
from .core.sparsifiers import DCT, ExDyna, GaussianK, Sparsifier, TopK
from .core.state import UnitStates
from .core.validate import HVD_AVERAGE, HVD_SUM, check_positive_int

#: the training options every sparse preset takes, and their defaults
TRAINING_OPTIONS = {"warmup_dense_steps": 0, "momentum_correction": 0.0, "warmup_density": None,
                    "warmup_stage_steps": 0, "warmup_factor": 4.0, "local_clip_norm": None, "dense_share": 0.0,
                    "hierarchical": None}

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


_API = "hvd_sparse.Compression"


def _check_warmup(start, stage_steps, factor, sparsifier, budgeted):
    """``(warmup_density, warmup_stage_steps, warmup_factor)`` checked (a ValueError naming the argument): a density
    in (0, 1] above the preset's (unless a byte budget sets it per P), with stages of >= 1 step and a factor > 1; or
    None, 0 and the default factor (off)."""
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not (math.isfinite(factor) and factor > 1):
        raise ValueError(f"{_API}: warmup_factor must be a number > 1 (what each stage of the density warm-up divides "
                         f"the density by), got {factor!r}")
    if start is None:
        given = [f"{name}={value!r}" for name, value, off in (("warmup_stage_steps", stage_steps, 0),
                                                              ("warmup_factor", factor, 4.0)) if value != off]
        if given:
            raise ValueError(f"{_API}: {', '.join(given)} needs warmup_density (the density of the warm-up's "
                             "first stage)")
        return None, 0, float(factor)
    if isinstance(start, bool) or not isinstance(start, numbers.Real) or not 0.0 < float(start) <= 1.0:
        raise ValueError(f"{_API}: warmup_density must be a number in (0, 1] (the density of the warm-up's first "
                         f"stage) or None, got {start!r}")
    if sparsifier is None:
        raise ValueError(f"{_API}: warmup_density needs a sparse preset (the dense reducer has no density)")
    if not budgeted and not float(start) > sparsifier.density:
        raise ValueError(f"{_API}: warmup_density must be above the preset's density, {sparsifier.density:g} (the "
                         f"warm-up comes down to it), got {start!r}")
    stage_steps = check_positive_int(stage_steps, "warmup_stage_steps", _API)
    return float(start), stage_steps, float(factor)


def _check_dense_share(value, reducer, momentum):
    """``dense_share`` checked: 0 (off), or a number in (0, 0.5) with a sparse reducer and without momentum
    correction."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 0.5:
        raise ValueError(f"{_API}: dense_share must be a number in [0, 0.5) (the largest fraction of a unit's entries "
                         f"that its smallest tensors, exchanged dense, may hold; 0 = off), got {value!r}")
    if not value:
        return 0.0
    if not reducer.sparse:
        raise ValueError(f"{_API}: dense_share needs a sparse preset (the dense reducer sends every tensor dense)")
    if momentum:
        raise ValueError(f"{_API}: dense_share does not combine with momentum_correction (the tensors exchanged "
                         "dense would need a velocity of their own): set one of them")
    return float(value)


def _check_clip(value, sparse):
    """``local_clip_norm`` checked: None (off), or a finite number > 0 with a sparse reducer."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{_API}: local_clip_norm must be a number > 0 (the global clipping threshold c: each rank "
                         f"clips its gradient to c / sqrt(P)) or None, got {value!r}")
    if not sparse:
        raise ValueError(f"{_API}: local_clip_norm needs a sparse preset; with a dense exchange clip the gradient "
                         "yourself (torch.nn.utils.clip_grad_norm_)")
    return float(value)


class SparseCompression:
    """A sparsifier/reducer pair and its options: configuration, frozen once built (set nothing on it; build
    another preset instead). The state of a job that uses it comes from :meth:`reify`.

    Args:
        sparsifier (Sparsifier or None): chooses local entries; ``None`` only for the dense reducer.
        reducer (Reducer): combines the selections of all ranks.
        preset (str): the preset's name, for ``repr`` and logs (default: ``sparse(...)`` of the arguments).
        warmup_dense_steps, momentum_correction, warmup_density, warmup_stage_steps, warmup_factor, local_clip_norm,
        dense_share: the training options (see ``Compression.topka``).
        byte_budget (float or None): the fraction of a dense allreduce's bytes each rank may send: the sparsifier then
            has the density for P = 1, each engine the one for its P (:meth:`for_size`, :mod:`hvd_sparse.core.budget`).
    """

    def __init__(self, sparsifier, reducer, preset=None, *, warmup_dense_steps=0, momentum_correction=0.0,
                 warmup_density=None, warmup_stage_steps=0, warmup_factor=4.0, local_clip_norm=None,
                 dense_share=0.0, byte_budget=None, hierarchical=None):
        if isinstance(warmup_dense_steps, bool) or not isinstance(warmup_dense_steps, int) or warmup_dense_steps < 0:
            raise ValueError(f"hvd_sparse.Compression: warmup_dense_steps must be an integer >= 0, "
                             f"got {warmup_dense_steps!r}")
        if not 0.0 <= float(momentum_correction) < 1.0:
            raise ValueError(f"hvd_sparse.Compression: momentum_correction must be in [0, 1) (the momentum m; "
                             f"0 = off), got {momentum_correction!r}")
        if momentum_correction and getattr(reducer, "name", None) == "spardl":
            raise ValueError("hvd_sparse.Compression: momentum_correction does not apply to SparDL, whose residual "
                             "is collected in the exchange, not the accumulator minus what this rank sent")
        if hierarchical not in (None, True, False):
            raise ValueError(f"hvd_sparse.Compression: hierarchical must be None (Horovod's "
                             f"HOROVOD_HIERARCHICAL_ALLREDUCE decides), True or False, got {hierarchical!r}")
        if not isinstance(reducer, Reducer):
            raise TypeError(f"hvd_sparse.Compression: reducer must be a Reducer, got {reducer!r}")
        if reducer.sparse and not isinstance(sparsifier, Sparsifier):
            raise TypeError(f"hvd_sparse.Compression: reducer {reducer.name!r} needs a Sparsifier, "
                            f"got {sparsifier!r}")
        self.sparsifier = sparsifier if reducer.sparse else None
        self.reducer = reducer
        #: the density warm-up (core/recipe.py): the first stage's density (None: off), each stage's steps, and
        #: what each stage divides the density by
        self.warmup_density, self.warmup_stage_steps, self.warmup_factor = _check_warmup(
            warmup_density, warmup_stage_steps, warmup_factor, self.sparsifier, byte_budget is not None)
        #: DGC's local gradient clipping (core/recipe.py): the global threshold c (each rank: c / sqrt(P)); None: off
        self.local_clip_norm = _check_clip(local_clip_norm, reducer.sparse)
        #: the largest fraction of a unit's entries that its smallest tensors may hold to be allreduced dense on every
        #: step, beside the sparse step of the others (core/recipe.py, dense_tensors); 0.0: off
        self.dense_share = _check_dense_share(dense_share, reducer, momentum_correction)
        #: dense allreduce for the first N steps (Engine.step); the sparse schemes start at their step 0 after
        self.warmup_dense_steps = int(warmup_dense_steps)
        #: momentum m of DGC's momentum correction and factor masking (core/state.py); 0.0: off
        self.momentum_correction = float(momentum_correction)
        #: two levels (dense inside a host, sparse across the hosts: core/hierarchy.py): True, False, or None for
        #: Horovod's own switch, HOROVOD_HIERARCHICAL_ALLREDUCE (``horovodrun --hierarchical-allreduce``)
        self.hierarchical = hierarchical if reducer.sparse else False
        #: the fraction of a dense ring allreduce's bytes each rank may send per step, or None (a fixed density)
        self.byte_budget = budget.check_byte_budget(byte_budget, "hvd_sparse.Compression", reducer)
        if self.byte_budget is not None:        # the density for P = 1 until an engine sets its own (for_size)
            self.sparsifier = budget.sparsifier_for(self.byte_budget, sparsifier, reducer, 1, "hvd_sparse.Compression")
        self.size = None        # the number of ranks a byte budget's density was derived for (an engine's twin)
        self.preset = preset or call_text("sparse", {
            "sparsifier": sparsifier, "allreduce": reducer.name,
            **{name: getattr(self, name) for name in TRAINING_OPTIONS if name != "hierarchical"},
            "byte_budget": self.byte_budget, "hierarchical": self.hierarchical},
            {**TRAINING_OPTIONS, "byte_budget": None})
        self._shared = None                   # the job of the call sites without an object of their own
        self._reified = weakref.WeakSet()     # the live states made by reify(), for shared_state()'s checks
        self._frozen = True

    def __getstate__(self):             # copies and pickles carry the configuration, never a job's state
        return {**self.__dict__, "_shared": None, "_reified": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _reified=weakref.WeakSet())

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"{self!r} is frozen configuration, shared by every optimizer, tape and "
                                 f"sparse_allreduce that uses it: build another preset instead of setting {name!r}")
        object.__setattr__(self, name, value)

    def reify(self):
        """A new, empty state of one training job over this configuration
        (:class:`~hvd_sparse.core.state.UnitStates`: per unit an engine with its residual, thresholds, partitions
        and counters, made at the unit's first step).
        Every optimizer of hvd_sparse reifies its own at construction, so that one preset can serve several."""
        states = UnitStates(self)
        self._reified.add(states)
        return states

    def shared_state(self):
        """The state of the job this preset itself names: for the call sites that keep no object of their own
        from one step to the next (a TensorFlow ``DistributedGradientTape``, built anew every step;
        ``sparse_allreduce``, whose units are its names; ``hvd_sparse.tensorflow.SparseState(preset)``). Made at the
        first call, then the same object; it lives as long as the preset."""
        if self._shared is None:
            object.__setattr__(self, "_shared", UnitStates(self))
        return self._shared

    def sparse_stats(self):
        """Statistics of this rank's last step of :meth:`shared_state` (a TensorFlow ``DistributedGradientTape``'s:
        ``n, k, selected, density, sent_bytes, recv_bytes, sent_words, recv_words, collectives``, as an optimizer's
        ``sparse_stats()``); empty before the first step."""
        return self.shared_state().last_stats("model")

    def reified_elsewhere(self):
        """Whether a live optimizer reified its own state from this preset while the shared one is still empty
        (then the preset does not name that optimizer's state: checkpoint the optimizer instead)."""
        shared = self._shared
        return len(self._reified) > 0 and (shared is None or shared.empty())

    @property
    def density(self):
        """The sparsifier's density (dense: 1.0); None for a byte budget, unless bound to a :attr:`size`."""
        unbound = self.byte_budget is not None and self.size is None
        return 1.0 if self.sparsifier is None else None if unbound else self.sparsifier.density

    def density_for(self, size):
        """The density over ``size`` ranks: :attr:`density`, or the byte budget's (:mod:`hvd_sparse.core.budget`)."""
        return self.density if self.byte_budget is None else \
            budget.density_for(self.byte_budget, self.sparsifier, self.reducer, size)

    def for_size(self, size):
        """What an engine over ``size`` ranks runs: this preset, or for a byte budget a twin (same name and options)
        whose sparsifier has :meth:`density_for` ``size`` (``core.budget.sparsifier_for``: may warn)."""
        if self.byte_budget is None:
            return self
        twin = copy.copy(self)
        object.__setattr__(twin, "sparsifier", budget.sparsifier_for(self.byte_budget, self.sparsifier, self.reducer,
                                                                     size, repr(self)))
        object.__setattr__(twin, "size", int(size))
        return twin

    def stage_sparsifiers(self):
        """The sparsifiers of the density warm-up's stages, in order (core/recipe.py): this preset's, each with a
        stage's density, down to (not including) its own; empty without a warm-up. For a byte budget, call it on
        :meth:`for_size`'s twin (the budget's density for its P ends the warm-up; where it is not below
        ``warmup_density`` there is no stage, with a warning)."""
        if self.warmup_density is None or self.sparsifier is None:
            return ()
        densities = recipe.stage_densities(self.warmup_density, self.sparsifier.density, self.warmup_factor)
        if not densities:
            warnings.warn(f"{self!r}: the density warm-up has no stage: the byte budget's density over "
                          f"{self.size} ranks, {self.sparsifier.density:g}, is not below warmup_density="
                          f"{self.warmup_density:g}", RuntimeWarning, stacklevel=3)
        return tuple(dataclasses.replace(self.sparsifier, density=d) for d in densities)

    def density_at(self, step, size=1):
        """The density that step ``step`` (0-based, counted over the run as the engine counts it) runs at over
        ``size`` ranks: 1.0 on the dense warm-up steps, then the density warm-up's stages, then :meth:`density_for`
        ``size``."""
        if self.sparsifier is None or step < self.warmup_dense_steps:
            return 1.0
        bound = self.for_size(size)
        stages = bound.stage_sparsifiers()
        index, _ = recipe.stage_at(step, self.warmup_dense_steps, self.warmup_stage_steps, len(stages))
        return (stages[index] if index < len(stages) else bound.sparsifier).density

    def new_engine(self, comm, unit="model"):
        """A fresh per-rank :class:`Engine` of one unit over ``comm``, running :meth:`for_size` ``comm.size``; two
        levels (:meth:`two_levels`): a :class:`~hvd_sparse.core.hierarchy.TwoLevelEngine` over its hosts."""
        topology = self.two_levels(comm)
        if topology is not None:
            from .core.hierarchy import TwoLevelEngine
            return TwoLevelEngine(self, topology, unit, comm=comm)
        return Engine(self.for_size(1 if comm is None else comm.size), comm, unit)

    def two_levels(self, comm):
        """The :class:`~hvd_sparse.core.hierarchy.Topology` a job over ``comm`` runs on, or None (flat): where
        :attr:`hierarchical` (or for None, ``HOROVOD_HIERARCHICAL_ALLREDUCE``) asks for two levels and the ranks sit
        more than one to a host (``comm.two_levels()``, which Horovod's communicators have)."""
        wanted = self.hierarchical
        if wanted is None:
            wanted = os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE", "0").strip().lower() not in ("", "0", "false")
        if not wanted or comm is None:
            return None
        if not hasattr(comm, "two_levels"):
            if self.hierarchical:
                raise ValueError(f"hvd_sparse.Compression: hierarchical=True needs Horovod's communicators (the "
                                 f"hosts come from hvd.local_size()), not {type(comm).__name__}; the simulator takes "
                                 "local_size= (hvd_sparse.testing.simulate)")
            return None
        return comm.two_levels(required=bool(self.hierarchical))

    # -- Horovod's compressor protocol (for the unmodified hvd.DistributedOptimizer) -------------------
    def compress(self, tensor):
        mod = type(tensor).__module__
        if not mod.startswith("torch"):
            raise TypeError(f"{self!r}: as a Horovod `compression=` argument a sparse preset works only "
                            "with horovod.torch.DistributedOptimizer; for TensorFlow use "
                            "hvd_sparse.tensorflow.DistributedGradientTape / DistributedOptimizer")
        return _horovod_adapter(mod.split(".")[0])(self, tensor)

    def decompress(self, tensor, ctx):
        if not (isinstance(ctx, tuple) and ctx[:1] == (HOROVOD_CTX,)):
            return tensor          # Horovod's own paths (e.g. torch.sparse gradients) pass through
        return ctx[2].decompress(tensor, ctx)

    def __repr__(self):
        return f"Compression.{self.preset}"


def check_compression(compression, api, *, sparse=False):
    """``compression=`` as an adapter takes it: a sparse preset, or (unless ``sparse``) a compressor of Horovod's
    protocol (``compress`` and ``decompress``: ``Compression.none``, ``Compression.fp16``, a user's own). Refused
    with a TypeError naming the argument and the fix: a preset's factory not called (``Compression.topka``, an
    easy slip beside Horovod's attributes ``Compression.none``: Horovod would train it densely at one rank and fail
    inside its optimizer at two), and anything else."""
    if isinstance(compression, SparseCompression):
        return compression
    name = getattr(compression, "__name__", None)
    if callable(compression) and name and getattr(Compression, name, None) is compression:
        example = {"dense": "", "sparse": "sparsifier, allreduce='topka'"}.get(name, "0.01")
        raise TypeError(f"{api}: compression=Compression.{name} is the preset's factory, not a preset: call it, "
                        f"e.g. compression=Compression.{name}({example})")
    if not sparse and callable(getattr(compression, "compress", None)) \
            and callable(getattr(compression, "decompress", None)):
        return compression
    if sparse:
        raise TypeError(f"{api}: compression must be a sparse preset such as Compression.topka(0.01), got "
                        f"{compression!r}; for dense tensors use hvd.allreduce")
    raise TypeError(f"{api}: compression must be a sparse preset such as Compression.topka(0.01), or a Horovod "
                    f"compressor (Compression.none, Compression.fp16), got {compression!r}")


def allreduce_op(average, op, compression, api):
    """The reduce op of a ``sparse_allreduce`` called as ``hvd.allreduce`` is: ``average`` (Horovod's deprecated
    bool) or ``op`` (default ``hvd.Average``), never both; ``compression=`` is a keyword, and a preset in the
    second position (the signature hvd_sparse had before, where Horovod has ``average``) is refused with the call
    to make."""
    if isinstance(average, SparseCompression) or callable(average):
        raise TypeError(f"{api}: the second positional argument is Horovod's average, as in hvd.allreduce; pass the "
                        f"preset as a keyword: {api.rsplit('.', 1)[-1]}(tensor, compression=..., name=...)")
    if compression is None:
        raise TypeError(f"{api}: compression= is required: a sparse preset such as Compression.topka(0.01)")
    if average is None:
        return HVD_AVERAGE if op is None else op
    if op is not None:
        raise ValueError(f"{api}: average and op are exclusive (average is Horovod's deprecated spelling of op): "
                         "pass op=hvd.Average or op=hvd.Sum")
    if not isinstance(average, bool):
        raise TypeError(f"{api}: average must be True or False (or left out for op=), got {average!r}")
    return HVD_AVERAGE if average else HVD_SUM


#: options that only a sparse preset honours: their default, and why another value cannot take effect on the dense
#: path (Horovod's own allreduce); :func:`refuse_unused_options`
SPARSE_ONLY = {
    "nonfinite": ("skip", "the dense allreduce passes a NaN or Inf on to every rank; no step is skipped or raised"),
    "elastic_residuals": ("keep", "the dense path keeps no residual"),
    "consistency_check_every": (0, "the result is Horovod's own optimizer, which has no such check"),
    "bucket_cap_mb": (None, "Horovod's optimizer launches each gradient from its hook and fuses what is ready up to "
                            "HOROVOD_FUSION_THRESHOLD"),
    "min_compression_rate": (None, "nothing is compressed"),
    "bucket_budget": (None, "nothing is selected"),
    "log_stats_every": (0, "there are no sparse statistics to log"),
}


def refuse_unused_options(compression, api, **given):
    """The one rule for options that cannot take effect: given another value than their default (:data:`SPARSE_ONLY`)
    with a compression that is not a sparse preset, a ValueError naming the option and why."""
    if isinstance(compression, SparseCompression):
        return
    for name, value in given.items():
        default, why = SPARSE_ONLY[name]
        if value != default:
            raise ValueError(f"{api}: {name}={value!r} works only with a sparse preset: with compression="
                             f"{compression!r} {why}. Leave it at {default!r}, or choose a sparse preset")


def check_momentum(compression, momentum, api):
    """DGC's momentum correction (``momentum_correction=m``) takes the place of the optimizer's momentum: with both,
    the momentum is applied twice. ``momentum``: the optimizer's (0 when it has none)."""
    m = getattr(compression, "momentum_correction", 0.0)
    if m and momentum:
        raise ValueError(f"{api}: the preset's momentum_correction={m:g} replaces the optimizer's momentum "
                         f"(DGC: the velocity is kept before sparsification), and the optimizer has momentum="
                         f"{momentum:g}: the momentum would be applied twice. Set momentum=0 in the optimizer, "
                         "or leave momentum_correction at 0")


#: framework -> ``compress(compression, tensor)`` serving a preset in Horovod's optimizer, registered by the
#: framework's package
_HOROVOD_ADAPTERS = {}
#: the first word of the ``ctx`` a preset's ``compress`` returns: ``(HOROVOD_CTX, name, adapter)``, and
#: ``decompress`` hands the output to ``adapter.decompress(output, ctx)``
HOROVOD_CTX = "hvd_sparse"


def register_horovod_adapter(framework, compress):
    """Make ``compress(compression, tensor) -> (tensor, ctx)`` serve a preset's ``compress`` of tensors of
    ``framework`` (the top-level module of the tensor's type, e.g. ``"torch"``); ``hvd_sparse.torch`` registers
    its stash (``hvd_sparse/torch/stash.py``)."""
    _HOROVOD_ADAPTERS[framework] = compress


def _horovod_adapter(framework):
    if framework not in _HOROVOD_ADAPTERS:
        importlib.import_module(f"hvd_sparse.{framework}")      # the framework's package registers its adapter
    return _HOROVOD_ADAPTERS[framework]


def _reducer(name):
    try:
        return REDUCERS[name]()
    except (KeyError, TypeError):
        raise ValueError(f"hvd_sparse.Compression.sparse: allreduce must be one of "
                         f"{sorted(REDUCERS)}, got {name!r}") from None


_OPTIONS_DOC = """
        Training options (keyword-only, every sparse preset):
            warmup_dense_steps (int): the first N steps exchange the whole gradient (a dense allreduce, no
                residual); the scheme starts at its own step 0 after them. Default 0.
            momentum_correction (float): m > 0 turns on Deep Gradient Compression's momentum correction and
                momentum factor masking: error feedback accumulates the velocity u = m·u + grad and zeroes u
                where entries were sent; wrap an optimizer *without* momentum (e.g. SGD(momentum=0)). Default 0.0.
            warmup_density (float or None): DGC's density warm-up: the sparse steps start at this density, in
                (0, 1] and above the preset's, and divide it by ``warmup_factor`` every ``warmup_stage_steps``
                steps while it stays above the preset's density, which then holds (after ``warmup_dense_steps``);
                each stage starts the scheme afresh at its density, the residual kept (docs/algorithms.md, "The
                training recipe"). With a byte budget the budget is the last stage's. Default None (off).
            warmup_stage_steps (int): the steps of each stage of the density warm-up (>= 1 with ``warmup_density``).
            warmup_factor (float): what each stage divides the density by, > 1. Default 4.0 (DGC's 25%, 6.25%, ...).
            local_clip_norm (float or None): DGC's local gradient clipping: each rank scales its gradient g by
                min(1, c / (sqrt(P)·||g||)) before it enters the velocity and the residual, c this threshold (> 0),
                on every step, dense warm-up included. Default None (off).
            dense_share (float): the smallest tensors of a unit (biases, normalisations, small convolutions and
                output layers), taken smallest first while together they hold at most this fraction of its entries,
                are allreduced dense on every step beside the sparse step of the others, which selects k =
                max(1, floor(density·n_sparse)) from them (docs/algorithms.md, "The training recipe"); a byte budget
                covers both parts. In [0, 0.5); not with momentum_correction. Default 0.0 (off).

        Topology (keyword-only, every sparse preset):
            hierarchical (bool or None): two levels where the ranks sit several to a host: the gradient is summed
                densely inside each host (a reduce-scatter), the preset runs on each shard across the hosts, and the
                result is gathered inside the host (docs/algorithms.md, "Two levels"). True, False, or None: as
                Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE (``horovodrun --hierarchical-allreduce``). Default None.

        Byte budget (keyword-only, every sparse preset):
            byte_budget (float): instead of ``density`` (exactly one of them; ``sparse``: of the sparsifier's): the
                fraction, in (0, 1], of the bytes a dense ring allreduce of the gradient sends per rank and step,
                8·n·(P-1)/P; each engine derives the density from it and P, alike on every rank
                (``hvd_sparse.core.budget``, ``SparseCompression.density_for(P)``). Default None.
"""


def _documents_training_options(factory):
    """Append the training options' documentation to ``factory``'s docstring."""
    factory.__doc__ = (factory.__doc__ or "").rstrip() + "\n" + _OPTIONS_DOC
    return factory


def call_text(name, args, defaults):
    """``name(k=v, ...)`` of the arguments ``args`` that have no default in ``defaults`` or differ from it."""
    shown = [f"{k}={v!r}" for k, v in args.items() if k not in defaults or v != defaults[k]]
    return f"{name}({', '.join(shown)})"


def _density(name, args):
    """The density of the sparsifier of ``Compression.<name>(**args)`` (``core.budget.template_density``)."""
    return budget.template_density(args["density"], args["byte_budget"], f"hvd_sparse.Compression.{name}")


def _preset(factory, args, sparsifier, reducer):
    """The preset ``factory`` called with ``args`` (its arguments, by name): named after the arguments that differ
    from the factory's defaults, with the training options and the byte budget set."""
    params = inspect.signature(factory).parameters
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    return SparseCompression(sparsifier, reducer, call_text(factory.__name__, args, defaults),
                             byte_budget=args["byte_budget"], **{name: args[name] for name in TRAINING_OPTIONS})


def _oktopk_pair(args):
    """The sparsifier and reducer of ``Compression.oktopk(**args)``: the variant's, with the call's options
    (:func:`hvd_sparse.core.oktopk.variants.pair`)."""
    if args["balance"] != "auto":
        raise ValueError(f"hvd_sparse.Compression.oktopk: balance={args['balance']!r} does not apply any more: each "
                         "owner sends a fixed number of pairs in the gather (a message of one shape every step), so "
                         "nothing is left to balance; leave balance at 'auto' (it changes nothing)")
    api, period = "hvd_sparse.Compression.oktopk", args["global_threshold_period"]
    if period is not None:
        check_positive_int(period, "global_threshold_period", api)
    return oktopk_pair(args["variant"], _density("oktopk", args), args["threshold_period"],
                       args["repartition_period"], args["max_select_ratio"], args["boundaries"],
                       args["few_collectives_from"], args["global_fill"], api, period)


class Compression:
    """Sparse presets, one factory per scheme. Every call returns a new preset (frozen configuration)."""

    @staticmethod
    @_documents_training_options
    def oktopk(density=None, threshold_period=32, repartition_period=64, balance="auto", *, variant="library",
               max_select_ratio=None, boundaries=None, few_collectives_from=FEW_COLLECTIVES_FROM, byte_budget=None,
               warmup_dense_steps=0, momentum_correction=0.0, warmup_density=None, warmup_stage_steps=0,
               warmup_factor=4.0, local_clip_norm=None, dense_share=0.0, global_threshold_period=None,
               global_fill=False, hierarchical=None):
        """Ok-Topk (Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning", PPoPP'22;
        docs/algorithms.md#oktopk): the O(k) sparse allreduce. Each rank selects with a local threshold that is
        exact every ``threshold_period`` steps and reused in between (``ThresholdReuse``); the index space is
        split into P regions re-balanced every ``repartition_period`` steps; each region's owner reduces what
        falls in it (one alltoall), and its largest sums travel in one allgather of a fixed size, where every rank
        keeps the exact top-k of them (the "library" variant; the paper: those above a global threshold, exact every
        ``threshold_period`` steps; ``global_threshold_period``). Error feedback keeps
        S \\ G. Three collectives per step, each of one shape (Horovod's response cache serves them). Cost: at
        most 6k(P-1)/P words per rank on every step of the library variant wherever k/P >= 6 (its capacities bound
        it at 5k(P-1)/P + 6(P-1)), on the threshold-reuse steps of balanced input in the others.

        Args:
            density (float): k = max(1, floor(density·n)), in (0, 1].
            threshold_period (int): tau', steps between exact local threshold evaluations (32), and global ones
                unless ``global_threshold_period`` says otherwise.
            repartition_period (int): tau, steps between region repartitions (64).
            balance (str): "auto", the only value: the paper's balancing step has nothing to do when every owner
                sends a fixed number of pairs (kept so that existing calls run).
            variant (str): the threshold controllers, one of ``hvd_sparse.core.oktopk.VARIANTS``. "library"
                (default): exact-k selection, a guard that brings the local count back to <= k in one step and the
                global selection exact on every step (K = k; see ThresholdReuse.guard_target and
                ``global_threshold_period``); "paper" (no controllers), "ref_lstm", "ref_vgg", "ref_bert" (the
                authors' code, per model). For the
                "paper"/"ref_*" variants the variant fixes the two periods above and the global one (other values
                raise).
            max_select_ratio (float >= 1 or None): a hard cap on reuse steps, for every variant (default None:
                off, as in the paper and the authors' code). A rank's selection is cut to ratio·k entries (its
                threshold climbs until they fit: the largest stay); when the global count K exceeds ratio·k
                (every rank knows it from the gathered counts), every rank keeps the exact top-k of the gathered
                values and re-evaluates the global threshold from them. It bounds the volume of a gradient
                spike; the "library" variant's controllers already keep both counts near k.
            boundaries (str or None): how the regions follow the selection (``OkTopk.boundaries``): None takes
                the variant's ("measured" for "library": every step splits its own load, counted in 2P bins in
                the step's opening; "periodic" for the others: only every ``repartition_period`` steps, as the
                paper), or "periodic", "result", "load", "measured".
            few_collectives_from (int or None): at k >= this·P (many entries per region), "measured" boundaries
                count no histogram and follow the load of the past steps (``OkTopk.few_collectives_from``). None:
                never. Default 1024.
            global_threshold_period (int or None): steps between exact global threshold evaluations ("library"
                variant). None (default): the variant's, 1 for "library": every step keeps the exact top-k of the
                owners' largest sums, so the step applies k entries; ``threshold_period`` restores the paper's
                reuse of the global threshold, where a ladder keeps K <= k on reuse steps (it applied 0.42k a step
                on average while the digits CNN trained: docs/benchmarks.md, "Ok-Topk's global selection on every
                step").
            global_fill (bool): on reuse steps of the global threshold, fill the global count K up to k (within
                P) from the candidates just below the ladder's rung ("library" variant; ``OkTopk.global_fill``);
                with it the global threshold is reused for ``threshold_period`` steps unless
                ``global_threshold_period`` says otherwise (1 raises: no reuse step to fill). Default False.
        """
        args = dict(locals())
        return _preset(Compression.oktopk, args, *_oktopk_pair(args))

    @staticmethod
    @_documents_training_options
    def topka(density=None, *, byte_budget=None, warmup_dense_steps=0, momentum_correction=0.0,
              warmup_density=None, warmup_stage_steps=0, warmup_factor=4.0, local_clip_norm=None, dense_share=0.0,
              hierarchical=None):
        """TopkA (Li & Hoefler, PPoPP'22, §5 baseline; docs/algorithms.md#topka): exact local top-k on every
        rank, allgather of the k (index, value) pairs, sum in rank order. Error feedback keeps what was not
        sent. Cost: 2k(P-1) words received per rank per step, growing linearly with P.

        Args:
            density (float): fraction of entries each rank sends, in (0, 1]; k = max(1, floor(density·n)).
        """
        return _preset(Compression.topka, locals(), TopK(_density("topka", locals())), TopkA())

    @staticmethod
    @_documents_training_options
    def topk_dsa(density=None, *, byte_budget=None, warmup_dense_steps=0, momentum_correction=0.0,
                 warmup_density=None, warmup_stage_steps=0, warmup_factor=4.0, local_clip_norm=None, dense_share=0.0,
                 hierarchical=None):
        """TopkDSA (SparCML's dynamic sparse allreduce as benchmarked by Li & Hoefler, PPoPP'22;
        docs/algorithms.md#topk_dsa): exact local top-k, sparse reduce-scatter over P equal regions (one
        alltoall), then an allgather of the reduced regions -- sparse, or dense when the reduced nonzeros N reach n/3.
        Same result as TopkA. Cost: between 4k(P-1)/P and (2k+n)(P-1)/P words per rank.

        Args:
            density (float): fraction of entries each rank sends, in (0, 1].
        """
        return _preset(Compression.topk_dsa, locals(), TopK(_density("topk_dsa", locals())), TopkDSA())

    @staticmethod
    @_documents_training_options
    def gtopk(density=None, *, byte_budget=None, warmup_dense_steps=0, momentum_correction=0.0,
              warmup_density=None, warmup_stage_steps=0, warmup_factor=4.0, local_clip_norm=None, dense_share=0.0,
              hierarchical=None):
        """gTopk (Shi et al., ICDCS'19, as benchmarked by Li & Hoefler; docs/algorithms.md#gtopk): exact local
        top-k, then a reduction tree of log2 P rounds, each merging two lists and keeping the top k, and a
        broadcast of the final k entries. Any P (fold-in pre-round when P is not a power of two). Error
        feedback keeps S \\ G; not mass-conserving (values pruned in a subtree are lost). Cost 4k log2 P words.

        Args:
            density (float): k = max(1, floor(density·n)) entries in the global result, in (0, 1].
        """
        return _preset(Compression.gtopk, locals(), TopK(_density("gtopk", locals())), GTopk())

    @staticmethod
    @_documents_training_options
    def gaussiank(density=None, adjust="lstm", *, byte_budget=None, warmup_dense_steps=0, momentum_correction=0.0,
                  warmup_density=None, warmup_stage_steps=0, warmup_factor=4.0, local_clip_norm=None, dense_share=0.0,
                  hierarchical=None):
        """Gaussiank (Shi et al., 2019, as benchmarked by Li & Hoefler; docs/algorithms.md#gaussiank): threshold
        mu + z·sigma from a Gaussian fit of the accumulator (z = Phi^-1(1 - density/2)), scaled down until at
        least 3k/4 entries pass, then the TopkA exchange (counts + allgatherv). Cost about 2k(P-1) words.

        Args:
            density (float): target fraction of entries, in (0, 1].
            adjust (str): the threshold adjustment loop of the reference code: "lstm" (default), "bert", "vgg".
        """
        return _preset(Compression.gaussiank, locals(), GaussianK(_density("gaussiank", locals()), adjust=adjust),
                       TopkA())

    @staticmethod
    @_documents_training_options
    def exdyna(density=None, threshold_rule="proportional", init_threshold="topk_once", *, byte_budget=None,
               warmup_dense_steps=0, momentum_correction=0.0, warmup_density=None, warmup_stage_steps=0,
               warmup_factor=4.0, local_clip_norm=None, dense_share=0.0, hierarchical=None):
        """ExDyna (Yoon & Oh, CCGrid'24; docs/algorithms.md#exdyna): the flat gradient is cut into blocks grouped in P
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
        return _preset(Compression.exdyna, locals(), ExDyna(_density("exdyna", locals()), threshold_rule=threshold_rule,
                                                            init_threshold=init_threshold), ExDynaReducer())

    @staticmethod
    @_documents_training_options
    def dct(density=None, lifespan=1000, *, drift=2.0, byte_budget=None, warmup_dense_steps=0,
            momentum_correction=0.0, warmup_density=None, warmup_stage_steps=0, warmup_factor=4.0,
            local_clip_norm=None, dense_share=0.0, hierarchical=None):
        """DCT-DP (Gupta et al., KDD'21, "Dynamic Communication Thresholding"; docs/algorithms.md#dct): a hard
        threshold per parameter tensor, the K-th largest |acc| of the tensor (K = ceil(density·n_l)),
        recomputed every ``lifespan`` steps, and sooner when the count it passes drifts, and reused in between;
        the selections are allgathered.

        Args:
            density (float): fraction of each tensor sent on recompute steps, in (0, 1].
            lifespan (int): steps between threshold recomputations (default 1000, the paper's value).
            drift (float or None): the thresholds are also recomputed at the next step when the entries they pass
                leave [c / drift, c · drift], c the count of the last recompute step (default 2); None: only every
                ``lifespan`` steps, as in the paper (the count then drifts as error feedback grows).
        """
        return _preset(Compression.dct, locals(), DCT(_density("dct", locals()), lifespan, drift=drift), TopkA())

    @staticmethod
    @_documents_training_options
    def spardl(density=None, groups=1, *, sag="bruck", selection="lazy", h_mode="adaptive", pack="bitcast",
               byte_budget=None, warmup_dense_steps=0, momentum_correction=0.0, warmup_density=None,
               warmup_stage_steps=0, warmup_factor=4.0, local_clip_norm=None, dense_share=0.0, hierarchical=None):
        """SparDL (ICDE'24; docs/algorithms.md#spardl): Spar-Reduce-Scatter (block-wise top-k/P at every hop, dropped
        values kept as residuals where they fall -- global residual collection), then, with ``groups=d > 1``,
        Spar-All-Gather across d teams, then an all-gather inside each team. SparDL picks its own entries
        inside the exchange; ``density`` sets the budget k. Cost about 4k(P-1)/P words for groups=1.

        Args:
            density (float): budget k = max(1, floor(density·n)), in (0, 1].
            groups (int): number of teams d; must divide the number of ranks (default 1).
            sag (str): how the d teams combine their blocks (d > 1 only): "bruck" (default; Bruck all-gather,
                then a top-k_b of the sum) or "recursive" (recursive doubling, d a power of two; the dropped
                part of every sum stays in the residuals).
            selection (str): "lazy" (default, the authors' code: each block is cut to its top-k_b once, just
                before it is sent) or "eager" (the paper: every block first, and again after every receive).
            h_mode (str): entries of its own block a rank contributes to the Bruck SAG: "adaptive" (default,
                the authors' controller, from k_b/d toward the size whose union fills k_b) or "fixed" (k_b/d).
            pack (str): "bitcast" (default: indices bit-cast to float32 ahead of the values, one collective
                per hop) or "two" (separate index and value collectives).
        """
        return _preset(Compression.spardl, locals(), TopK(_density("spardl", locals())),
                       SparDL(groups, sag=sag, selection=selection, h_mode=h_mode, pack=pack))

    @staticmethod
    def dense():
        """Dense allreduce through the engine (docs/algorithms.md#dense): the baseline, no selection, no residual.
        Use it to compare schemes on the same run; for plain training prefer Horovod's own ``Compression.none``.
        """
        return SparseCompression(None, Dense(), preset="dense()")

    @staticmethod
    @_documents_training_options
    def sparse(sparsifier, allreduce="oktopk", *, byte_budget=None, warmup_dense_steps=0, momentum_correction=0.0,
               warmup_density=None, warmup_stage_steps=0, warmup_factor=4.0, local_clip_norm=None, dense_share=0.0,
               hierarchical=None):
        """Any pairing of a sparsifier and a sparse allreduce, e.g. ``sparse(GaussianK(0.01))`` (Gaussiank
        selection, Ok-Topk's O(k) allreduce) or ``sparse(TopK(0.01), allreduce="topka")``.

        Args:
            sparsifier (Sparsifier): how each rank chooses its entries (carries the density).
            allreduce (str): one of ``REDUCERS``: how the choices are combined. Default: "oktopk".
        """
        return _preset(Compression.sparse, locals(), sparsifier, _reducer(allreduce))
