"""``hvd_sparse.torch.DistributedOptimizer``: Horovod's DistributedOptimizer with sparse compression.

Same signature, same contract as ``horovod.torch.DistributedOptimizer``: it returns an instance of a
subclass of your optimizer's class (same name), ``step()`` reduces the gradients first, and
``synchronize()`` / ``skip_synchronize()`` work as in Horovod (e.g. for gradient clipping).

With a Horovod compressor (``Compression.none``, ``Compression.fp16``, or any object that is not a sparse
preset) the optimizer *is* Horovod's, built by Horovod's own factory: bit-identical behaviour.

With a sparse preset the whole model is one sparsification unit (``overlap=True``: buckets exchanged during
backward instead, :mod:`hvd_sparse.torch.buckets`):

1. backward hooks only count passes (no collective is ever issued from a hook);
2. ``synchronize()`` reads which parameters take part *now* -- those of the current ``param_groups`` that require
   grad, so ``add_param_group`` and freezing/unfreezing take effect at the next step -- and runs one engine step
   over their gradients, one flat float32 vector in sorted parameter-name order (a parameter without a gradient
   contributes zeros). The engine's first collective is the agreement (:mod:`hvd_sparse.core.comm`): every rank
   proves it exchanges the same unit, preset, arguments, parameters (names, shapes, dtypes) and step, or every
   rank raises :class:`~hvd_sparse.core.errors.RankDisagreementError`. Then error feedback, the sparsifier, the
   sparse allreduce over ``process_set``; the averaged result is written back into ``p.grad``, in place (for
   Ok-Topk: zeros plus the K reduced values). A changed set of parameters starts the engine afresh, residuals
   carried by parameter name;
3. ``step()`` then runs your optimizer on those gradients.

What the exchange keeps from step to step lives in one object, the optimizer's ``_hvds``
(:class:`~hvd_sparse.torch.job.SparseJob`); the optimizer keeps Horovod's attributes beside it.

Each optimizer names its collectives ``hvd_sparse.model.*``, ``hvd_sparse.model.1.*``, ... (construction order):
two optimizers never consume each other's messages. ``torch.amp.GradScaler`` works with the plain
``scaler.step(optimizer)`` (the skip is agreed by every rank) and with Horovod's recipe; Horovod's
``broadcast_optimizer_state`` creates missing state without an exchange.

Two safety nets, keyword-only options of :func:`DistributedOptimizer`:

* ``nonfinite="skip"`` (default) / ``"raise"``: a NaN or Inf in any rank's gradient is detected on every rank in
  the same step (a word of the agreement); ``"skip"`` leaves all sparse state untouched, writes NaN into every
  ``p.grad`` on every rank (so an AMP-style loss scaler backs off on every rank alike) and makes ``step()`` a
  no-op for this step; ``"raise"`` raises :class:`~hvd_sparse.core.errors.NonFiniteGradientError` on every rank.
* ``consistency_check_every=N`` (default 0: off): every N optimizer steps, one allgather of two 64-bit checksums
  per parameter proves all ranks hold bit-identical parameters, or raises
  :class:`~hvd_sparse.core.errors.ReplicaDivergenceError` on every rank naming the first differing parameter.

The same code runs at every size, P = 1 included (selection and error feedback happen there too, so
results do not depend on how many processes you launch). torch.sparse gradients (embeddings with
``sparse=True``) are reduced by Horovod's own sparse allreduce unless ``sparse_as_dense=True``, which
densifies them into the sparsified buffer.
"""

from __future__ import annotations

import itertools
import warnings
from contextlib import contextmanager

import horovod.torch as hvd
import torch
from horovod.torch.mpi_ops import Average, global_process_set

from ..horovod_comm import in_process_set
from ..core.validate import check_elastic_residuals, check_nonfinite, check_op, check_positive_int, scale_factors
from . import buckets, consistency, recipes
from .base import SparseOptimizer
from .job import SparseJob
from ..compression import check_compression, check_momentum, refuse_unused_options
from ..logs import log_stats
from .compression import Compression, is_sparse

_API = "hvd_sparse.torch.DistributedOptimizer"
_OWNERS = itertools.count()      # the n-th sparse optimizer of this process names its collectives after n


class _SparseDistributedOptimizer(torch.optim.Optimizer):
    # Methods of this class are copied into a subclass of the user's optimizer class; ``_hvds_inner`` is
    # that class. We call it explicitly instead of ``super(self.__class__, self)``, which would recurse
    # forever once the result is subclassed. As in Horovod, the inner ``__init__`` runs again with the
    # param groups (which carry every hyper-parameter).
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense, process_set, nonfinite, consistency_check_every,
                 elastic_residuals, overlap, log_stats_every=0):
        self._hvds_inner.__init__(self, params)
        recipes.step_inner_under_broadcast(self)     # Horovod's broadcast_optimizer_state: no exchange (recipes.py)
        self._compression = compression
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
            if any(not isinstance(t, tuple) or len(t) != 2 for t in named_parameters):
                raise ValueError(f"{_API}: named_parameters must be a sequence of (name, parameter) tuples, "
                                 "usually model.named_parameters()")
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(self.param_groups)
                                for j, p in enumerate(group["params"])]
        names = [n for n, _ in named_parameters]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"{_API}: parameter names in named_parameters must be unique, "
                             f"found duplicates: {', '.join(dups)}")
        named_ids = {id(p) for _, p in named_parameters}
        unnamed = [i for i, p in enumerate(all_params) if id(p) not in named_ids]
        if unnamed:
            raise ValueError(f"{_API}: named_parameters was given, but {len(unnamed)} parameter(s) of the "
                             "optimizer are not in it; pass model.named_parameters() of the whole model")
        # Canonical order: sorted by name, the same on every rank. A tensor listed under two names (tied weights,
        # named_parameters(remove_duplicate=False)) is one parameter, named as Horovod names it (the last name).
        names = {id(p): n for n, p in sorted(named_parameters, key=lambda t: t[0])}
        index = next(_OWNERS)
        owner = "model" if index == 0 else f"model.{index}"     # collective prefix, unique per optimizer
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._synchronized = False
        self._should_synchronize = True
        self._hvds = SparseJob(compression, names, owner, process_set, scale_factors(op, gradient_predivide_factor),
                               nonfinite, consistency_check_every, elastic_residuals, overlap)
        self._hvds.log_every = log_stats_every
        self._hvds.plan(self.param_groups)
        self._hvds.hook(self._hvds.params(self.param_groups), self._hvds_passes_allowed)

    def _hvds_passes_allowed(self):
        return self.backward_passes_per_step

    def _hvds_elastic_reset(self):
        """After an elastic reset (hvd_sparse.torch.elastic): :meth:`SparseJob.elastic_reset`."""
        if self._hvds.elastic_reset():
            self._synchronized = False

    # -- the exchange ------------------------------------------------------------------------------------
    @torch.compiler.disable         # an exchange, not a graph: under torch.compile it runs as it is
    def synchronize(self):
        """Reduce the gradients now (sparse exchange over the process set) and write them into ``p.grad``
        (:meth:`SparseJob.exchange <hvd_sparse.torch.job.SparseJob.exchange>`)."""
        if not in_process_set(self.process_set, hvd.rank()):
            self._synchronized = True
            return
        job = self._hvds
        params = job.params(self.param_groups)
        job.plan(self.param_groups)                         # with overlap: buckets for parameters added since
        job.hook(params, self._hvds_passes_allowed)        # parameters added or unfrozen since construction
        job.exchange(params, self.op, self.sparse_as_dense)
        for group in self.param_groups:          # frozen: no gradient, so the optimizer leaves it alone
            for p in group["params"]:
                if not p.requires_grad:
                    p.grad = None
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Make ``step()`` skip the exchange, after an explicit ``synchronize()``:

        .. code-block:: python

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    # torch.amp.GradScaler then calls step() on every rank, overflow or not, with ``grad_scale`` / ``found_inf`` set
    # (the plain ``scaler.step(optimizer)`` pattern): the skip is decided by the exchange, the same on every rank.
    _step_supports_amp_scaling = True

    @torch.compiler.disable
    def step(self, closure=None):
        # torch.amp.GradScaler.step sets grad_scale / found_inf before it calls step(): only then is a scaler needed,
        # hvd_sparse.torch.GradScaler's own (it says so), or torch's found from its frame (recipes.py)
        job = self._hvds
        scaler = None
        if hasattr(self, "grad_scale") or hasattr(self, "found_inf"):
            scaler = job.scaler or recipes.grad_scaler(self, _API)
            if job.overlap is not None and job.overlap.launched_by_hooks:
                job.exchange_buckets()          # let the launched buckets finish on every rank, then refuse alike
                job.reset_passes()
                raise RuntimeError(f"{_API}: overlap=True under torch.amp.GradScaler: the hooks exchanged scaled "
                                   "gradients before the scaler could unscale them; use hvd_sparse.torch.GradScaler "
                                   "(the same arguments), which makes the buckets wait for unscaling")
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            if scaler is not None and getattr(self, "grad_scale", None) is not None:
                scaler.unscale_(self)        # local gradients in true units before error feedback sees them
            self.synchronize()
            if scaler is not None:      # every rank skips or none does: the scale is updated alike everywhere
                recipes.record_skip(scaler, self, job.skip_step)
        self._synchronized = False
        found_inf = getattr(self, "found_inf", None) if scaler is not None else None
        if scaler is not None:
            self.grad_scale = self.found_inf = None      # unscaled already: the inner optimizer must not again
        if job.skip_step or (found_inf is not None and float(found_inf) > 0):
            job.skip_step = False       # non-finite gradient on some rank: no update on any rank
            return None
        out = self._hvds_inner.step(self, closure)
        job.steps += 1
        if job.check_every and job.steps % job.check_every == 0:
            self.check_consistency()
        if job.log_every and job.steps % job.log_every == 0:
            stats = self.sparse_stats(average=True)         # a collective: every rank, at the same step
            if self.process_set.rank() == 0:
                log_stats(job.steps, stats)
        return out

    def check_consistency(self):
        """Collective: raise :class:`~hvd_sparse.core.errors.ReplicaDivergenceError` on every rank unless all
        ranks hold bit-identical parameters (two 64-bit checksums of each parameter's bits, one allgather).
        Runs every ``consistency_check_every`` steps by itself; callable at any point every rank reaches."""
        job = self._hvds
        consistency.check_consistency(job.params(self.param_groups), self.process_set,         # what is trained now
                                      f"hvd_sparse.{job.owner}.consistency", job.steps, _API)

    def zero_grad(self, *args, **kwargs):
        if any(self._hvds.passes.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited: the "
                                 "accumulated gradients would be lost before the exchange.")
        return self._hvds_inner.zero_grad(self, *args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = check_positive_int(passes, "backward_passes_per_step", _API)
        self._hvds.reset_passes()

    def load_state_dict(self, *args, **kwargs):
        self._hvds.reset_passes()
        self._synchronized = False
        self._should_synchronize = True
        return self._hvds_inner.load_state_dict(self, *args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, *, nonfinite="skip", consistency_check_every=0,
                         elastic_residuals="keep", overlap=False, bucket_cap_mb=None, min_compression_rate=None,
                         bucket_budget=None, log_stats_every=0):
    """Wrap a ``torch.optim.Optimizer`` so that ``step()`` first averages the gradients over Horovod
    ranks -- sparsely, when ``compression`` is a sparse preset.

    Arguments are Horovod's, in Horovod's order (``horovod.torch.DistributedOptimizer``):

    Args:
        optimizer: the optimizer to wrap; the result is an instance of a subclass of its class.
        named_parameters: ``model.named_parameters()``; names fix the exchange order on every rank.
            Default: ``allreduce.noname.<group>.<index>`` (the same on every rank if the model is).
        compression: ``Compression.none`` / ``Compression.fp16`` (Horovod's optimizer is returned,
            unchanged), or a sparse preset such as ``Compression.topka(density=0.01)``. Default: none.
        backward_passes_per_step (int): backward passes accumulated locally before each exchange.
        op: ``hvd.Average`` (default) or ``hvd.Sum``; ``hvd.Adasum`` is rejected with sparse compression.
        gradient_predivide_factor (float): with ``op=hvd.Average``, scale by 1/f before the sum and by
            f/size after it (numerically the same for the float32 sparse path).
        num_groups, groups: Horovod's tensor grouping of the dense path. The sparse path always exchanges
            the whole model as one unit (one global top-k), so they are validated and otherwise unused.
        sparse_as_dense (bool): densify torch.sparse gradients into the sparsified buffer.
        process_set: ranks that take part. Default: all ranks.
        nonfinite (str, keyword-only): ``"skip"`` (default) or ``"raise"``: what every rank does when any
            rank's gradient holds a NaN or Inf. Sparse presets only: with ``Compression.none`` or ``fp16``
            (Horovod's dense path passes the NaN on to every rank) another value than the default raises, as
            ``consistency_check_every`` and ``elastic_residuals`` do.
        consistency_check_every (int, keyword-only): every that many steps, check that all ranks hold
            bit-identical parameters (one small allgather); 0 (default) turns it off.
        elastic_residuals (str, keyword-only): under ``hvd.elastic``, what a reset (a rank left or joined) does
            to this rank's residual: ``"keep"`` (default) or ``"drop"``; partitions, thresholds and counters
            always start afresh (see :mod:`hvd_sparse.torch.elastic`).
        overlap (bool, keyword-only): False (default): the whole model is one unit, exchanged after backward.
            True: buckets of parameters, each exchanged (its own error feedback and share of the budget) as soon
            as backward has produced its gradients, on a thread of the optimizer, so that the exchange overlaps backward
            (:mod:`hvd_sparse.torch.buckets`). Under ``torch.amp.GradScaler`` use ``hvd_sparse.torch.GradScaler``.
        bucket_cap_mb (float, keyword-only): with overlap, the largest bucket in MB of float32 gradient (default
            25, as DDP).
        min_compression_rate (float, keyword-only): with overlap, a bucket goes dense unless its sparse message is
            at least this many times smaller than a dense allreduce's (default 1: unless it is smaller at all).
        bucket_budget (str, keyword-only): with overlap, how the budget is split over the sparse buckets:
            ``"magnitude"`` (default): every 10 steps, in proportion to where the whole model's top-k fell
            (:mod:`hvd_sparse.core.allocation`); ``"size"``: k_b = d·n_b, by size alone (layer-wise selection).
        log_stats_every (int, keyword-only): every that many steps, average the statistics over the ranks (a
            collective) and log them on rank 0 at INFO on the logger ``hvd_sparse`` (:mod:`hvd_sparse.logs`);
            0 (default): off.

    Returns:
        an instance of ``type(optimizer)`` (same class name) with ``synchronize()``,
        ``skip_synchronize()``, ``set_backward_passes_per_step()``, and for sparse presets
        ``sparse_stats()`` and ``residual_norm()``.

    Raises:
        NotImplementedError: ``op=hvd.Adasum`` with a sparse preset.
        ValueError: bad ``op``, ``gradient_predivide_factor``, ``backward_passes_per_step``, ``groups``,
            duplicate or missing parameter names.
    """
    if callable(getattr(optimizer, "synchronize", None)) and callable(getattr(optimizer, "skip_synchronize", None)):
        raise ValueError(f"{_API}: optimizer is already a distributed optimizer ({type(optimizer).__name__} returned "
                         "by DistributedOptimizer); wrap the original torch optimizer once")
    check_compression(compression, _API)
    check_nonfinite(nonfinite, _API)
    check_positive_int(consistency_check_every, "consistency_check_every", _API, minimum=0)
    check_positive_int(log_stats_every, "log_stats_every", _API, minimum=0)
    check_elastic_residuals(elastic_residuals, _API)
    refuse_unused_options(compression, _API, nonfinite=nonfinite, elastic_residuals=elastic_residuals,
                          consistency_check_every=consistency_check_every, bucket_cap_mb=bucket_cap_mb,
                          min_compression_rate=min_compression_rate, bucket_budget=bucket_budget,
                          log_stats_every=log_stats_every)
    overlap = check_overlap(overlap, bucket_cap_mb, min_compression_rate, _API, bucket_budget)
    if not is_sparse(compression):
        return hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters, compression=compression,
                                        backward_passes_per_step=backward_passes_per_step, op=op,
                                        gradient_predivide_factor=gradient_predivide_factor,
                                        num_groups=num_groups, groups=groups, sparse_as_dense=sparse_as_dense,
                                        process_set=process_set)
    check_op(op, gradient_predivide_factor, _API)
    check_positive_int(backward_passes_per_step, "backward_passes_per_step", _API)
    check_positive_int(num_groups, "num_groups", _API, minimum=0)
    if groups is not None and not isinstance(groups, list):
        check_positive_int(groups, "groups", _API, minimum=0)
    check_momentum(compression, max(float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups), _API)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, SparseOptimizer),
               dict(_SparseDistributedOptimizer.__dict__, _hvds_inner=optimizer.__class__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, sparse_as_dense, process_set, nonfinite, consistency_check_every,
               elastic_residuals, overlap, log_stats_every)


def check_overlap(overlap, bucket_cap_mb, min_compression_rate, api, bucket_budget=None):
    """``None`` (no overlap) or ``(bucket_cap_mb, min_compression_rate, bucket_budget)`` with their defaults;
    ValueError naming the argument for a bad value, or for a bucket option without ``overlap=True``."""
    if not isinstance(overlap, bool):
        raise ValueError(f"{api}: overlap must be True or False, got {overlap!r}")
    if bucket_budget is not None and bucket_budget not in buckets.BUDGETS:
        raise ValueError(f"{api}: bucket_budget must be one of {buckets.BUDGETS}, got {bucket_budget!r}")
    if bucket_budget is not None and not overlap:
        raise ValueError(f"{api}: bucket_budget={bucket_budget!r} works only with overlap=True (without it the whole "
                         "model is one unit)")
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("min_compression_rate", min_compression_rate)):
        if value is None:
            continue
        if not overlap:
            raise ValueError(f"{api}: {name}={value!r} works only with overlap=True (without it the whole model is "
                             "one unit)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{api}: {name} must be a positive number, got {value!r}")
    if not overlap:
        return None
    return (float(bucket_cap_mb if bucket_cap_mb is not None else buckets.BUCKET_CAP_MB),
            float(min_compression_rate if min_compression_rate is not None else buckets.MIN_COMPRESSION_RATE),
            bucket_budget or buckets.BUDGETS[0])
