"""A sparse preset as ``compression=`` of the *unmodified* ``horovod.torch.DistributedOptimizer``.

Horovod calls ``compress(p.grad)`` per parameter (from backward hooks or ``synchronize()``), allreduces what
it returns, then calls ``decompress(output, ctx)`` per parameter in ``synchronize()``. On each rank every
compress of a step precedes the first decompress (Horovod 0.28.1's optimizer.py). So:

* ``compress`` stashes the gradient and returns a 1-element placeholder; it never communicates (the
  order of compress calls differs across ranks when some parameters are unused);
* the stash and the sparse state belong to the calling Horovod optimizer (a :class:`StashAdapter` kept on it,
  with its own ``compression.reify()``), so one preset may serve several optimizers;
* the first ``decompress`` of a step runs one whole-model engine step over the stashed gradients in
  sorted parameter-name order, with explicit collective names, then every ``decompress`` returns its
  parameter's slice.

Horovod passes the compressor neither parameter names, nor ``op``, nor the process set. We read them from
the calling optimizer, found by :func:`hvd_sparse.torch.recipes.compressing_optimizer` (the frame of Horovod's
``_allreduce_grad_async`` whose ``self._compression`` is this preset): Horovod 0.28.1 is its last release, so these
attributes are fixed. Configurations in which the
exchange cannot be correct raise a clear error: ``op=hvd.Adasum`` (Horovod then compresses parameter
deltas, not gradients) and ``sparse_as_dense=True`` (Horovod compresses a densified copy it does not
name). At ``np=1`` Horovod registers no hooks and never calls the compressor: nothing is sparsified --
use ``hvd_sparse.torch.DistributedOptimizer`` for the same semantics at every size.
"""

from __future__ import annotations

import torch
from horovod.torch.mpi_ops import Adasum

from . import recipes
from .comm import HorovodTorchCommunicator
from .functions import HOROVOD_DTYPES
from ..compression import HOROVOD_CTX
from ..core.validate import check_op, scale_factors

_API = "horovod.torch.DistributedOptimizer(compression=<hvd_sparse preset>)"


def compress(compression, tensor):
    """``compression.compress(tensor)`` called by a Horovod optimizer: the gradient stashed in that optimizer's
    :class:`StashAdapter` (made at its first call), a placeholder and the ``ctx`` that leads ``decompress`` there."""
    opt, p = recipes.compressing_optimizer(compression, tensor)
    if opt is None:
        raise RuntimeError(f"{compression!r}: compress() was called outside "
                           "horovod.torch.DistributedOptimizer; for a single tensor use "
                           "hvd_sparse.torch.sparse_allreduce(tensor, compression=..., name=...)")
    if p is None:
        raise RuntimeError(f"{_API}: compress() received a tensor that is no parameter's gradient")
    adapter = getattr(opt, "_hvds_stash", None)
    if adapter is None or adapter.compression is not compression:
        adapter = opt._hvds_stash = StashAdapter(compression, opt)
    return adapter.compress(p, tensor)


class StashAdapter:
    """One Horovod optimizer's sparse exchange: its stash of the step's gradients and its sparse state."""

    def __init__(self, compression, optimizer):
        if getattr(optimizer, "op", None) is None:        # _DistributedAdasumOptimizer has no `op`
            check_op(Adasum, 1.0, _API)
        check_op(optimizer.op, optimizer.gradient_predivide_factor, _API)
        if optimizer.sparse_as_dense:
            raise ValueError(f"{_API}: sparse_as_dense=True hands the compressor unnamed dense copies; "
                             "use hvd_sparse.torch.DistributedOptimizer(..., sparse_as_dense=True)")
        self.compression = compression
        self.optimizer = optimizer
        self.states = compression.reify()
        self.stash = {}       # name -> (param, gradient tensor)
        self.results = None   # name -> reduced slice, after the exchange of this step

    def compress(self, p, tensor):
        opt = self.optimizer
        if self.results is not None:
            raise RuntimeError(f"{_API}: compress() after the exchange of this step started; this happens "
                               "only if a step was left unfinished (an exception inside synchronize())")
        name = opt._parameter_names[p]
        self.stash[name] = (p, tensor)
        # Horovod allreduces the placeholder: in the gradient's dtype where Horovod has it (not bfloat16)
        dtype = tensor.dtype if tensor.dtype in HOROVOD_DTYPES else torch.float32
        return torch.ones(1, dtype=dtype, device=tensor.device), (HOROVOD_CTX, name, self)

    def decompress(self, output, ctx):
        name = ctx[1]
        if self.results is None:
            self._exchange()
        out = self.results.pop(name)
        if not self.results:
            self.results = None
            self.stash = {}
        return out

    def _exchange(self):
        opt = self.optimizer
        expected = sorted(opt._parameter_names[p] for p in opt._requires_update)
        names = sorted(self.stash)
        if names != expected:
            missing = sorted(set(expected) - set(names))
            raise RuntimeError(f"{_API}: the step's first decompress() came before the gradients of "
                               f"{missing[:5]} were compressed")
        flat = torch.cat([self.stash[n][1].reshape(-1).to(torch.float32) for n in names])
        prescale, postscale, average = scale_factors(opt.op, opt.gradient_predivide_factor)
        engine = self.states.engine("model", lambda: HorovodTorchCommunicator(opt.process_set, "model"))
        engine.declare([(n, tuple(self.stash[n][1].shape), self.stash[n][1].dtype) for n in names])
        out = engine.step(flat, average=average, prescale=prescale, postscale=postscale)
        self.results = {}
        offset = 0
        for n in names:
            t = self.stash[n][1]
            m = t.numel()
            self.results[n] = out[offset:offset + m].view(t.shape).to(t.dtype)
            offset += m
