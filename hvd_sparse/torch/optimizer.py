"""``hvd_sparse.torch.DistributedOptimizer``: Horovod's DistributedOptimizer with sparse compression.

Same signature, same contract as ``horovod.torch.DistributedOptimizer``: it returns an instance of a
subclass of your optimizer's class (same name), ``step()`` reduces the gradients first, and
``synchronize()`` / ``skip_synchronize()`` work as in Horovod (e.g. for gradient clipping).

With a Horovod compressor (``Compression.none``, ``Compression.fp16``, or any object that is not a sparse
preset) the optimizer *is* Horovod's, built by Horovod's own factory: bit-identical behaviour.

With a sparse preset the whole model is one sparsification unit:

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
from ..core.state import SparsityWindow
from ..core.validate import check_elastic_residuals, check_nonfinite, check_op, check_positive_int, scale_factors
from . import consistency, recipes
from .base import SparseOptimizer
from .comm import HorovodTorchCommunicator
from ..compression import check_compression, check_momentum, refuse_unused_options
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
                 elastic_residuals):
        self._hvds_inner.__init__(self, params)
        recipes.step_inner_under_broadcast(self)     # Horovod's broadcast_optimizer_state: no exchange (recipes.py)
        self._compression = compression
        self._hvds_states = compression.reify()      # this optimizer's job: its residual, thresholds, counters
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
        self._hvds_names = {id(p): n for n, p in sorted(named_parameters, key=lambda t: t[0])}
        index = next(_OWNERS)
        self._hvds_owner = "model" if index == 0 else f"model.{index}"   # collective prefix, unique per optimizer
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self._hvds_scale = scale_factors(op, gradient_predivide_factor)    # (prescale, postscale, average?)
        self._hvds_window = SparsityWindow()    # the exchanges since the last sparse_stats(average=True)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._hvds_passes = {}
        self._hvds_grad_accs = []
        self._hvds_sparse_dims = {}           # name -> sparse_dim, of parameters whose gradient was torch.sparse
        self._hvds_seen = set()               # names of parameters some rank has had a gradient of
        self._hvds_unseen_somewhere = True    # ask every rank which kinds it saw (_hvds_agree_gradient_kinds)
        self._synchronized = False
        self._should_synchronize = True
        self._hvds_exchanges = 0
        self._hvds_nonfinite = nonfinite
        self._hvds_skip_step = False
        self._hvds_check_every = consistency_check_every
        self._hvds_elastic_residuals = elastic_residuals
        self._hvds_steps = 0
        self._hvds_hook(self._hvds_params())

    def _hvds_params(self):
        """``[(name, p)]``: the parameters exchanged now -- those of the current ``param_groups`` that require grad
        (Horovod's ``_requires_update``), in name order. Read at every exchange, so a group added with
        ``add_param_group`` or a parameter frozen or unfrozen since construction takes part from the next step on.
        A parameter without a name from ``named_parameters`` is ``allreduce.noname.<group>.<index>``."""
        seen, out = set(), []
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append((self._hvds_names.get(id(p), f"allreduce.noname.{i}.{j}"), p))
        out.sort(key=lambda t: t[0])
        return out

    def _hvds_hook(self, params):
        """Count backward passes of every parameter of ``params`` that has no hook yet."""
        for _, p in params:
            if p not in self._hvds_passes:
                self._hvds_passes[p] = 0
                grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                grad_acc.register_hook(self._hvds_make_hook(p))
                self._hvds_grad_accs.append(grad_acc)

    # -- hooks: count passes only --------------------------------------------------------------------
    def _hvds_make_hook(self, p):
        def hook(*_):
            if self._hvds_passes[p] >= self.backward_passes_per_step:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                     "before call to step(). Increase backward_passes_per_step to "
                                     "accumulate gradients locally.")
            self._hvds_passes[p] += 1
        return hook

    def _hvds_engine(self):
        return self._hvds_states.engine("model", lambda: HorovodTorchCommunicator(self.process_set, self._hvds_owner))

    def _hvds_current_engine(self):
        """The engine, rebuilt first if the world changed without a sync (hvd.elastic skips sync() after a graceful
        host removal)."""
        engine = self._hvds_engine()
        if (engine.comm.rank, engine.comm.size) != (self.process_set.rank(), self.process_set.size()):
            self._hvds_elastic_reset()
            engine = self._hvds_engine()
        return engine

    def _hvds_has_engine(self):
        return self._hvds_states.get("model") is not None

    def _hvds_elastic_reset(self):
        """After an elastic reset (hvd_sparse.torch.elastic): a fresh engine over the current process set --
        partitions, thresholds and counters start afresh on every rank alike -- and this rank's residual kept
        or dropped by the ``elastic_residuals`` policy. The kinds of gradients are learnt again from every rank (a
        joining rank starts knowing none)."""
        self._hvds_unseen_somewhere = True
        if not self._hvds_has_engine():
            return
        self._hvds_states.reset(self._hvds_elastic_residuals == "keep")
        for p in self._hvds_passes:
            self._hvds_passes[p] = 0
        self._synchronized = False
        self._hvds_skip_step = False
        self._hvds_exchanges = 0

    # -- the exchange ------------------------------------------------------------------------------------
    @torch.compiler.disable         # an exchange, not a graph: under torch.compile it runs as it is
    def synchronize(self):
        """Reduce the gradients now (sparse exchange over the process set) and write them into ``p.grad``:

        1. the parameters that take part now, each gradient dense or sparse (:meth:`_hvds_split`);
        2. one engine step over the dense gradients, in place (:meth:`_hvds_exchange_dense`);
        3. Horovod's own sparse allreduce for each torch.sparse gradient.
        """
        if not in_process_set(self.process_set, hvd.rank()):
            self._synchronized = True
            return
        self._hvds_skip_step = False
        params = self._hvds_params()
        self._hvds_hook(params)                 # parameters added or unfrozen since construction
        try:
            dense_params, sparse_params = self._hvds_split(params)
            if dense_params:
                self._hvds_exchange_dense(dense_params, sparse_params)
            for name, p in sparse_params:
                handle = hvd.sparse_allreduce_async(p.grad, name=f"hvd_sparse.{self._hvds_owner}.sparse_grad.{name}",
                                                    op=self.op, process_set=self.process_set)
                p.grad = handle()
        finally:            # also after an error every rank raised (RankDisagreementError): a new backward may start
            for p in self._hvds_passes:
                self._hvds_passes[p] = 0
        for group in self.param_groups:          # frozen: no gradient, so the optimizer leaves it alone
            for p in group["params"]:
                if not p.requires_grad:
                    p.grad = None
        self._hvds_exchanges += 1
        self._synchronized = True

    def _hvds_split(self, params):
        """``(dense, sparse)`` lists of ``(name, p)``: a parameter whose gradient has been a torch.sparse tensor on
        any rank goes through Horovod's sparse allreduce (an empty sparse gradient where it has none), the others
        through the engine (zeros where they have no gradient, as in Horovod)."""
        if self._hvds_unseen_somewhere and params and self.process_set.size() > 1:
            self._hvds_agree_gradient_kinds(params)
        dense_params, sparse_params = [], []
        for name, p in params:
            if p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense:
                self._hvds_sparse_dims[name] = p.grad.sparse_dim()
            if name in self._hvds_sparse_dims:
                dims = self._hvds_sparse_dims[name]
                if p.grad is None:          # unused this step: an empty sparse gradient, so it still takes part
                    p.grad = torch.sparse_coo_tensor(torch.zeros((dims, 0), dtype=torch.int64),
                                                     torch.zeros((0,) + tuple(p.shape[dims:]), dtype=p.dtype),
                                                     p.shape, device=p.device)
                elif not p.grad.is_sparse:
                    p.grad = p.grad.to_sparse(dims)
                sparse_params.append((name, p))
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)     # unused on this rank: contributes zeros, as in Horovod
                dense_params.append((name, p))
        return dense_params, sparse_params

    def _hvds_agree_gradient_kinds(self, params):
        """Which parameters have torch.sparse gradients, learnt from every rank: a rank on which a sparse embedding
        got no gradient cannot tell it from a dense parameter it did not use. The kinds seen here are gathered from
        every rank (``Engine.gather``: protected like the agreement, so ranks stepping different optimizers raise
        instead of hanging), at the first exchange and then as long as some rank has a parameter that no rank has
        seen a gradient of -- a decision taken from the gathered data, so the same on every rank."""
        mine = {"sparse": {n: p.grad.sparse_dim() for n, p in params
                           if p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense},
                "seen": [n for n, p in params if p.grad is not None], "params": [n for n, _ in params]}
        every = self._hvds_current_engine().gather(mine, like=params[0][1].detach())
        for other in every:
            self._hvds_sparse_dims.update(other["sparse"])
            self._hvds_seen.update(other["seen"])
        self._hvds_unseen_somewhere = any(set(other["params"]) - self._hvds_seen for other in every)

    def _hvds_exchange_dense(self, dense_params, sparse_params):
        """One engine step over the dense gradients, read in place and written back into ``p.grad`` (sparse --
        ``sparse_as_dense`` -- and non-contiguous gradients through a dense contiguous copy)."""
        grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad.contiguous() for _, p in dense_params]
        flats = [g.view(-1) for g in grads]
        prescale, postscale, average = self._hvds_scale
        engine = self._hvds_current_engine()
        # What is exchanged, agreed on by every rank at the engine's first collective (a change -- a group added, a
        # parameter frozen or unfrozen -- starts the engine afresh, residuals carried by name).
        engine.declare([(n, tuple(p.shape), p.dtype) for n, p in dense_params],
                       notes=(("sparse gradients", tuple(sorted(n for n, _ in sparse_params))),))
        engine.step(flats, average=average, prescale=prescale, postscale=postscale,
                    nonfinite=self._hvds_nonfinite, out=flats)
        self._hvds_skip_step = engine.last["skipped"]       # the engine warned, naming the ranks
        self._hvds_window.add(engine.last)                  # for sparse_stats(average=True)
        for (_, p), g in zip(dense_params, grads):
            if p.grad.is_sparse:
                p.grad = g.to_sparse()
            elif g is not p.grad:
                p.grad.copy_(g)

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
        # torch.amp.GradScaler.step sets grad_scale / found_inf before it calls step(): only then is its scaler sought
        scaler = recipes.grad_scaler(self, _API) if hasattr(self, "grad_scale") or hasattr(self, "found_inf") else None
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
                recipes.record_skip(scaler, self, self._hvds_skip_step)
        self._synchronized = False
        found_inf = getattr(self, "found_inf", None) if scaler is not None else None
        if scaler is not None:
            self.grad_scale = self.found_inf = None      # unscaled already: the inner optimizer must not again
        if self._hvds_skip_step or (found_inf is not None and float(found_inf) > 0):
            self._hvds_skip_step = False       # non-finite gradient on some rank: no update on any rank
            return None
        out = self._hvds_inner.step(self, closure)
        self._hvds_steps += 1
        if self._hvds_check_every and self._hvds_steps % self._hvds_check_every == 0:
            self.check_consistency()
        return out

    def check_consistency(self):
        """Collective: raise :class:`~hvd_sparse.core.errors.ReplicaDivergenceError` on every rank unless all
        ranks hold bit-identical parameters (two 64-bit checksums of each parameter's bits, one allgather).
        Runs every ``consistency_check_every`` steps by itself; callable at any point every rank reaches."""
        consistency.check_consistency(self._hvds_params(), self.process_set,         # what is trained now
                                      f"hvd_sparse.{self._hvds_owner}.consistency", self._hvds_steps, _API)

    def zero_grad(self, *args, **kwargs):
        if any(self._hvds_passes.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited: the "
                                 "accumulated gradients would be lost before the exchange.")
        return self._hvds_inner.zero_grad(self, *args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = check_positive_int(passes, "backward_passes_per_step", _API)
        for p in self._hvds_passes:
            self._hvds_passes[p] = 0

    def load_state_dict(self, *args, **kwargs):
        for p in self._hvds_passes:
            self._hvds_passes[p] = 0
        self._synchronized = False
        self._should_synchronize = True
        return self._hvds_inner.load_state_dict(self, *args, **kwargs)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, *, nonfinite="skip", consistency_check_every=0,
                         elastic_residuals="keep"):
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
    check_elastic_residuals(elastic_residuals, _API)
    refuse_unused_options(compression, _API, nonfinite=nonfinite, elastic_residuals=elastic_residuals,
                          consistency_check_every=consistency_check_every)
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
               elastic_residuals)
