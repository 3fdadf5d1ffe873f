"""The sparse exchange of one :func:`hvd_sparse.torch.DistributedOptimizer`: one object, :class:`SparseJob`, that
holds what the exchange needs from step to step -- the unit's states (residual, thresholds, counters), the
parameters' names, the backward hooks and their pass counts, the kinds of gradients every rank has seen, the
statistics window, the GradScaler stepping the optimizer -- and runs the exchange. The optimizer keeps Horovod's
attributes (``backward_passes_per_step``, ``op``, ``process_set``, ``sparse_as_dense``, ``_synchronized``, ...) and
one more, ``_hvds``, the job; the code that needs the job takes it as an argument.

An exchange (:meth:`SparseJob.exchange`, from ``optimizer.synchronize()``):

1. the parameters that take part now (:meth:`SparseJob.params`), each gradient dense or torch.sparse
   (:meth:`SparseJob.split`; which parameters have torch.sparse gradients is learnt from every rank);
2. one engine step over the dense gradients, in place (:meth:`SparseJob.exchange_dense`);
3. Horovod's own sparse allreduce for each torch.sparse gradient.

With ``overlap`` (:mod:`hvd_sparse.torch.buckets`) the job holds buckets instead of one unit: the hooks launch each
bucket's engine step as soon as its gradients are in, on the job's thread, and the exchange waits for them
(:meth:`SparseJob.exchange_buckets`); a torch.sparse gradient is densified into its bucket there, as
``sparse_as_dense=True`` does. With ``bucket_budget="magnitude"`` every tenth exchange also moves the budget's
split over the buckets to where the whole model's top-k fell (:meth:`SparseJob.rebalance`,
:mod:`hvd_sparse.core.allocation`).
"""

from __future__ import annotations

import contextlib
import math

import horovod.torch as hvd
import torch

from ..core import allocation
from ..core.context import StepStats
from ..core.state import SparsityWindow
from ..horovod_comm import in_process_set
from . import buckets as _buckets
from .comm import HorovodTorchCommunicator


class SparseJob:
    """The sparse exchange of one optimizer and everything it keeps (module docstring).

    Args:
        compression: the sparse preset.
        names: ``{id(p): name}`` of the named parameters (the exchange's order is by name).
        owner: the prefix of the collectives' names (``model``, ``model.1``, ...: unique per optimizer).
        process_set: the ranks that take part.
        scale: ``(prescale, postscale, average)`` of the reduction (``core.validate.scale_factors``).
        nonfinite: ``"skip"`` or ``"raise"``; check_every: the consistency check's period (0: off);
        elastic_residuals: ``"keep"`` or ``"drop"`` at an elastic reset.
        overlap: None (one unit, after backward), or ``(bucket_cap_mb, min_compression_rate, bucket_budget)``:
            buckets launched from the hooks (:meth:`plan`).
    """

    def __init__(self, compression, names, owner, process_set, scale, nonfinite, check_every, elastic_residuals,
                 overlap=None):
        self.compression = compression
        self.states = compression.reify()        # the unit's residual, thresholds, counters
        self.names = names
        self.owner = owner
        self.process_set = process_set
        self.scale = scale
        self.nonfinite = nonfinite
        self.check_every = check_every
        self.elastic_residuals = elastic_residuals
        self.window = SparsityWindow()           # the exchanges since the last sparse_stats(average=True)
        self.passes = {}                         # parameter -> backward passes since the last exchange
        self.grad_accs = []                      # the hooked gradient accumulators (kept alive)
        self.sparse_dims = {}                    # name -> sparse_dim, of parameters whose gradient was torch.sparse
        self.seen = set()                        # names of parameters some rank has had a gradient of
        self.unseen_somewhere = True             # ask every rank which kinds it saw (agree_gradient_kinds)
        self.exchanges = 0
        self.steps = 0                           # optimizer steps taken (the consistency check's clock)
        self.log_every = 0                       # log the averaged statistics every that many steps (logs.py)
        self.skip_step = False                   # the last exchange skipped a non-finite step on every rank
        self.scaler = None                       # the hvd_sparse.torch.GradScaler stepping the optimizer now
        self.overlap_options = overlap
        self.overlap = None                      # buckets.Overlap, once planned (plan)
        self.last = StepStats()                  # the last exchange's statistics (every bucket's, summed)
        self.skipped = 0                         # with buckets: the steps a bucket skipped (skipped_steps)
        self.clock = 0                           # with buckets: exchanges since the start or an elastic reset
        self._budget_comm = None                 # with buckets: the communicator of the budget's split

    # -- buckets ---------------------------------------------------------------------------------------
    def plan(self, param_groups):
        """With overlap: cut the parameters of ``param_groups`` (all of them, frozen ones too: freezing changes what a
        bucket declares, not the plan) into buckets (:func:`buckets.plan_buckets`); parameters added since the last
        plan go into buckets of their own after the others, on every rank alike."""
        if self.overlap_options is None or not in_process_set(self.process_set, hvd.rank()):
            return          # a rank outside the process set exchanges nothing, from its hooks neither
        cap_mb, min_rate, _ = self.overlap_options
        named = [(n, p) for n, p in self.registered(param_groups) if self.overlap is None or not self.overlap.covers(p)]
        if not named:
            return
        start = len(self.overlap.buckets) if self.overlap is not None else 0
        size, per_host = self.process_set.size(), self.ranks_per_host()
        new = [_buckets.Bucket(start + i, tuple(part), _buckets.goes_dense(
                   self.compression, sum(p.numel() for _, p in part), size, min_rate, per_host))
               for i, part in enumerate(_buckets.plan_buckets(named, cap_mb))]
        if self.overlap is None:
            self.overlap = _buckets.Overlap(new, self.exchange_bucket, f"hvd_sparse.{self.owner}")
        else:
            self.overlap.extend(new)

    def ranks_per_host(self):
        """L of the two levels the buckets' engines run on (``compression.two_levels``), 1 where they run flat."""
        topology = self.compression.two_levels(HorovodTorchCommunicator(self.process_set, self.owner))
        return topology.local.size if topology is not None else 1

    # -- parameters and hooks ------------------------------------------------------------------------
    def params(self, param_groups):
        """``[(name, p)]``: the parameters exchanged now -- those of ``param_groups`` that require grad (Horovod's
        ``_requires_update``), in name order. Read at every exchange, so a group added with ``add_param_group`` or
        a parameter frozen or unfrozen since construction takes part from the next step on. A parameter without a
        name from ``named_parameters`` is ``allreduce.noname.<group>.<index>``."""
        return sorted(((n, p) for n, p in self.registered(param_groups) if p.requires_grad), key=lambda t: t[0])

    def registered(self, param_groups):
        """``[(name, p)]`` of every parameter of ``param_groups``, each once, in registration order (:meth:`params`
        names them)."""
        seen, out = set(), []
        for i, group in enumerate(param_groups):
            for j, p in enumerate(group["params"]):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((self.names.get(id(p), f"allreduce.noname.{i}.{j}"), p))
        return out

    def hook(self, params, limit):
        """Count the backward passes of every parameter of ``params`` that has no hook yet; ``limit()``: the
        passes allowed before an exchange (the optimizer's ``backward_passes_per_step``, read at each pass)."""
        for _, p in params:
            if p not in self.passes:
                self.passes[p] = 0
                grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                grad_acc.register_hook(self._counter(p, limit))
                self.grad_accs.append(grad_acc)

    def _counter(self, p, limit):
        def hook(*_):
            if self.passes[p] >= limit():
                raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                     "before call to step(). Increase backward_passes_per_step to "
                                     "accumulate gradients locally.")
            self.passes[p] += 1
            if self.overlap is not None and self.passes[p] == limit():
                self.overlap.arrived(p)
        return hook

    def reset_passes(self):
        for p in self.passes:
            self.passes[p] = 0

    # -- the engine ----------------------------------------------------------------------------------
    def engine(self, bucket=None):
        """The engine of the whole model, or of ``bucket`` (its collectives ``hvd_sparse.<owner>.b<i>.*``, its
        agreement ``hvd_sparse.agree.b<i>``; a dense bucket's runs every step dense)."""
        if bucket is None:
            return self.states.engine("model", lambda: HorovodTorchCommunicator(self.process_set, self.owner))
        engine = self.states.engine(bucket.unit, lambda: HorovodTorchCommunicator(
            self.process_set, f"{self.owner}.{bucket.unit}", shared_tag=bucket.unit))
        engine.dense = bucket.dense
        return engine

    def engines(self):
        """Every engine of the job (made now if missing): the model's, or one per bucket."""
        if self.overlap is None:
            return [self.engine()]
        return [self.engine(b) for b in self.overlap.buckets]

    def current_engine(self, bucket=None):
        """The engine (:meth:`engine`), rebuilt first if the world changed without a sync (hvd.elastic skips sync()
        after a graceful host removal)."""
        engine = self.engine(bucket)
        if (engine.comm.rank, engine.comm.size) != (self.process_set.rank(), self.process_set.size()):
            self.elastic_reset()
            engine = self.engine(bucket)
        return engine

    def has_engine(self):
        units = ["model"] if self.overlap is None else [b.unit for b in self.overlap.buckets]
        return any(self.states.get(unit) is not None for unit in units)

    def residual_norm(self):
        """L2 norm of this rank's residual, over every unit of the job."""
        return math.sqrt(sum(e.residual_norm() ** 2 for e in self.engines()))

    def skipped_steps(self):
        """Steps skipped on every rank for a non-finite gradient: the engine's count, or with buckets the steps in
        which a bucket skipped, since construction."""
        return self.engine().skipped_steps if self.overlap is None else self.skipped

    def elastic_reset(self):
        """After an elastic reset (hvd_sparse.torch.elastic): a fresh engine over the current process set --
        partitions, thresholds and counters start afresh on every rank alike -- and this rank's residual kept
        or dropped by the ``elastic_residuals`` policy. The kinds of gradients are learnt again from every rank (a
        joining rank starts knowing none). Returns whether there was an engine to reset."""
        self.unseen_somewhere = True
        if not self.has_engine():
            return False
        self.states.reset(self.elastic_residuals == "keep")
        self.reset_passes()
        self.skip_step = False
        self.exchanges = 0
        self.clock = 0
        return True

    def loaded(self, units):
        """A restored state (a checkpoint, an elastic rollback) counts as an exchange when it has taken a step."""
        self.exchanges = max(self.exchanges, 1 if any(u.get("steps") for u in units.values()) else 0)

    def check_units(self, saved, api):
        """Raise ValueError unless the units of a checkpoint (``saved``: their names) are this job's: a state saved
        without buckets does not fit buckets (nor the reverse, nor another cut), since a residual belongs to its
        unit's thresholds and partitions."""
        mine = {"model"} if self.overlap is None else {b.unit for b in self.overlap.buckets}
        saved = set(saved)
        if not saved or saved == mine:
            return
        def what(units):
            return "the whole model as one unit (overlap=False)" if units == {"model"} else \
                f"{len(units)} buckets (overlap=True)"
        raise ValueError(f"{api}: this sparse state was saved with {what(saved)}, but this optimizer exchanges "
                         f"{what(mine)}; build the optimizer with the same overlap and bucket_cap_mb as the run "
                         "that saved it")

    # -- the exchange --------------------------------------------------------------------------------
    def exchange(self, params, op, sparse_as_dense):
        """Reduce the gradients of ``params`` (:meth:`params`: those that take part now) and write them into
        ``p.grad`` (module docstring, steps 1-3); the pass counts start again, also after an error every rank
        raised."""
        self.skip_step = False
        try:
            if self.overlap is not None:
                self.exchange_buckets()
            else:
                dense_params, sparse_params = self.split(params, sparse_as_dense)
                if dense_params:
                    self.exchange_dense(dense_params, sparse_params)
                for name, p in sparse_params:
                    handle = hvd.sparse_allreduce_async(p.grad, name=f"hvd_sparse.{self.owner}.sparse_grad.{name}",
                                                        op=op, process_set=self.process_set)
                    p.grad = handle()
        finally:            # also after an error every rank raised (RankDisagreementError): a new backward may start
            self.reset_passes()
        self.exchanges += 1

    def split(self, params, sparse_as_dense):
        """``(dense, sparse)`` lists of ``(name, p)``: a parameter whose gradient has been a torch.sparse tensor on
        any rank goes through Horovod's sparse allreduce (an empty sparse gradient where it has none), the others
        through the engine (zeros where they have no gradient, as in Horovod)."""
        if self.unseen_somewhere and params and self.process_set.size() > 1:
            self.agree_gradient_kinds(params, sparse_as_dense)
        dense_params, sparse_params = [], []
        for name, p in params:
            if p.grad is not None and p.grad.is_sparse and not sparse_as_dense:
                self.sparse_dims[name] = p.grad.sparse_dim()
            if name in self.sparse_dims:
                dims = self.sparse_dims[name]
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

    def agree_gradient_kinds(self, params, sparse_as_dense):
        """Which parameters have torch.sparse gradients, learnt from every rank: a rank on which a sparse embedding
        got no gradient cannot tell it from a dense parameter it did not use. The kinds seen here are gathered from
        every rank (``Engine.gather``: protected like the agreement, so ranks stepping different optimizers raise
        instead of hanging), at the first exchange and then as long as some rank has a parameter that no rank has
        seen a gradient of -- a decision taken from the gathered data, so the same on every rank."""
        mine = {"sparse": {n: p.grad.sparse_dim() for n, p in params
                           if p.grad is not None and p.grad.is_sparse and not sparse_as_dense},
                "seen": [n for n, p in params if p.grad is not None], "params": [n for n, _ in params]}
        every = self.current_engine().gather(mine, like=params[0][1].detach())
        for other in every:
            self.sparse_dims.update(other["sparse"])
            self.seen.update(other["seen"])
        self.unseen_somewhere = any(set(other["params"]) - self.seen for other in every)

    def exchange_buckets(self):
        """With overlap: wait for every bucket (those the hooks did not launch are launched now), then the step's
        statistics are the buckets' summed, and the step is skipped when a bucket skipped it (on every rank alike:
        each bucket's skip is agreed)."""
        lasts = self.overlap.finish()
        self.last = combine(lasts)
        self.skip_step = self.last["skipped"]
        self.skipped += int(self.skip_step)
        self.window.add(self.last)
        if self.tallying() and not self.skip_step:
            self.rebalance()
        self.clock += 1

    def tallying(self):
        """Whether this exchange's sparse buckets count their accumulators for the budget's split."""
        return self.overlap_options[2] == "magnitude" and allocation.due(self.clock)

    def rebalance(self):
        """The budget's split over the sparse buckets from this exchange's tallies (core.allocation, steps 2-4):
        one allreduce, the same shares on every rank, from the next exchange on."""
        if self._budget_comm is None:
            self._budget_comm = HorovodTorchCommunicator(self.process_set, self.owner)
        most = allocation.ceiling(self.compression, self.process_set.size(), self.overlap_options[1],
                                  self.ranks_per_host())
        allocation.rebalance([(self.engine(b), sum(p.numel() for _, p in b.params if p.requires_grad), most)
                              for b in self.overlap.buckets if not b.dense], self._budget_comm)

    def exchange_bucket(self, bucket):
        """One bucket's engine step (on the job's thread): the gradients of its parameters that require grad, zeros
        for one that has none, a torch.sparse one densified; every rank declares the bucket's index and count."""
        params = [(n, p) for n, p in bucket.params if p.requires_grad]
        device = bucket.params[0][1].device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # this thread's GPU
            for _, p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            notes = (("bucket", (bucket.index, len(self.overlap.buckets), bucket.dense)),)
            engine = self.current_engine(bucket)
            engine.tally = not bucket.dense and self.tallying()
            if not params:      # every parameter frozen: the agreement alone, so that every rank still meets it
                engine.declare((), notes=notes)
                engine.step([torch.zeros(0, device=device)], average=self.scale[2], nonfinite=self.nonfinite)
            else:
                self._engine_step(engine, params, notes)
        return engine.last

    def exchange_dense(self, dense_params, sparse_params):
        """One engine step over the dense gradients of the whole model (module docstring, step 2)."""
        engine = self.current_engine()
        self._engine_step(engine, dense_params, (("sparse gradients", tuple(sorted(n for n, _ in sparse_params))),))
        self.last = engine.last
        self.skip_step = engine.last["skipped"]       # the engine warned, naming the ranks
        self.window.add(engine.last)                  # for sparse_stats(average=True)

    def _engine_step(self, engine, params, notes):
        """``engine``'s step over the gradients of ``params``, read in place and written back into ``p.grad`` (sparse
        -- ``sparse_as_dense`` -- and non-contiguous gradients through a dense contiguous copy)."""
        grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad.contiguous() for _, p in params]
        flats = [g.view(-1) for g in grads]
        prescale, postscale, average = self.scale
        # What is exchanged, agreed on by every rank at the engine's first collective (a change -- a group added, a
        # parameter frozen or unfrozen -- starts the engine afresh, residuals carried by name).
        engine.declare([(n, tuple(p.shape), p.dtype) for n, p in params], notes=notes)
        engine.step(flats, average=average, prescale=prescale, postscale=postscale, nonfinite=self.nonfinite,
                    out=flats)
        for (_, p), g in zip(params, grads):
            if p.grad.is_sparse:
                p.grad = g.to_sparse()
            elif g is not p.grad:
                p.grad.copy_(g)


def combine(lasts):
    """One step's statistics from its buckets' (:class:`~hvd_sparse.core.context.StepStats` each): counts, words,
    bytes and seconds summed, the density of the sum, skipped where any bucket skipped; each bucket's own under
    ``buckets`` (its tally for the budget's split left out)."""
    out = StepStats()
    for key in ("n", "k", "selected", "sent_words", "recv_words", "sent_bytes", "recv_bytes", "collectives",
                "control_bytes", "control_collectives", "across_sent_bytes", "across_recv_bytes"):
        if any(key in last for last in lasts):
            out[key] = sum(last.get(key, 0) for last in lasts)
    out["density"] = out.get("selected", 0) / out["n"] if out.get("n") else 0.0
    out["skipped"] = any(last.get("skipped", False) for last in lasts)
    out["nonfinite_ranks"] = sorted({r for last in lasts for r in last.get("nonfinite_ranks", ())})
    seconds = {}
    for last in lasts:
        for key, value in last.get("seconds", {}).items():
            seconds[key] = seconds.get(key, 0.0) + value
    out["seconds"] = seconds
    out["buckets"] = [{key: value for key, value in last.items() if key != "tally"} for last in lasts]
    return out
