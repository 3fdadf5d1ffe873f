"""The torch backend (CPU or CUDA tensors; torch is imported when the first tensor arrives)."""

from __future__ import annotations

import numpy as np

from .common import _Indexing
from .kernels import KernelOps
from .numpy_backend import NumpyBackend


class TorchBackend(KernelOps, _Indexing):
    """torch tensors, CPU or CUDA (the PyTorch adapter's backend)."""

    name = "torch"
    mutable = True

    def __init__(self):
        import torch

        self.torch = torch
        self._dtypes_of(torch)

    def zeros(self, n, dtype, like=None):
        return self.torch.zeros(n, dtype=dtype, device=None if like is None else like.device)

    def empty(self, n, dtype, like=None):
        return self.torch.empty(n, dtype=dtype, device=None if like is None else like.device)

    def arange(self, n, dtype, like=None):
        return self.torch.arange(n, dtype=dtype, device=None if like is None else like.device)

    def full(self, n, value, dtype, like=None):
        return self.torch.full((n,), value, dtype=dtype, device=None if like is None else like.device)

    def asarray(self, values, dtype, like=None):
        return self.torch.as_tensor(values, dtype=dtype, device=None if like is None else like.device)

    @staticmethod
    def astype(x, dtype):
        return x.to(dtype)

    @staticmethod
    def dtype_of(x):
        return x.dtype

    @staticmethod
    def to_numpy(x):
        return x.detach().cpu().numpy()

    def from_numpy(self, a):
        return self.torch.from_numpy(a)

    @staticmethod
    def host(x):
        """The numpy array sharing a CPU tensor's memory, or None (another device)."""
        return x.numpy() if x.device.type == "cpu" else None

    def stream_buffer(self, n, like):
        """An uninitialised float32 buffer of ``n`` values for ``like``'s device that is streamed through every
        step (error feedback's). On the CPU it is numpy's (a tensor sharing it): numpy asks the kernel for
        transparent huge pages on large buffers (``madvise``), torch's allocator does not, and with 4 KiB pages
        the pass costs a third more (measured: error feedback's add pass over 25M values, 32 ms with torch's
        allocation, 21 ms with numpy's)."""
        if like.device.type == "cpu":
            return self.torch.from_numpy(np.empty(n, np.float32))
        return self.torch.empty(n, dtype=self.torch.float32, device=like.device)

    @staticmethod
    def numel(x):
        return int(x.numel())

    @staticmethod
    def itemsize(x):
        return int(x.element_size())

    @staticmethod
    def copy(x):
        return x.clone()

    def concat(self, xs, like=None):
        return self.torch.cat(list(xs))

    def abs(self, x):
        return x.abs()

    @staticmethod
    def mul(x, s):
        return x * s

    def maximum(self, x, y):
        return self.torch.maximum(x, y)

    def add_into(self, a, b, out):
        """``out[:] = a + b`` (``a`` None: ``out[:] = b``), cast to ``out``'s dtype; one pass, returns ``out``."""
        if a is None:
            return out.copy_(b)
        return self.torch.add(a, b, out=out)

    def mul_into(self, x, s, out):
        """``out[:] = x * s`` (``s`` a Python scalar, computed in ``x``'s dtype, then cast to ``out``'s)."""
        if out.dtype == x.dtype:
            return self.torch.mul(x, s, out=out)
        return out.copy_(x * s)

    @staticmethod
    def fill_(x, value):
        return x.fill_(value)

    def count_true(self, masks):
        """int64 tensor of the number of True entries of each mask (on the masks' device; nothing is read)."""
        return self.torch.stack([m.sum() for m in masks])

    def all_finite(self, x):
        # as NumpyBackend.all_finite: the sum first, the elementwise pass only after an overflow
        return bool(self.torch.isfinite(x.sum())) or bool(self.torch.isfinite(x).all())

    def kth_largest(self, x, k):
        # topk's *values* are exact; only the order of tied indices is unspecified, and we do not use it.
        return self.torch.topk(x, k, sorted=False).values.min()

    def nonzero(self, mask):
        host = self.host(mask)              # numpy's is about 5x faster on the CPU (100,000 entries)
        if host is not None:
            return self.torch.from_numpy(NumpyBackend.nonzero(host))
        return self.torch.nonzero(mask, as_tuple=False).reshape(-1)

    def take(self, x, idx):
        """``x[idx]``; a 1-D gather by integer indexes is ``index_select`` (the same values, about 4x faster than
        advanced indexing on the CPU for 100,000 indexes)."""
        if x.dim() == 1 and self._int_index(idx):
            return self.torch.index_select(x, 0, idx)
        return super().take(x, idx)

    def put_(self, dst, idx, value):
        """``dst[idx] = value``; on a 1-D ``dst`` with int64 indexes, ``index_fill_`` / ``index_copy_`` (the same
        writes, about 1.5x faster on the CPU)."""
        if dst.dim() == 1 and self._int_index(idx) and idx.dtype == self.torch.int64:
            if isinstance(value, (int, float)):
                return dst.index_fill_(0, idx, value)
            if isinstance(value, self.torch.Tensor) and value.dtype == dst.dtype and value.shape == idx.shape:
                return dst.index_copy_(0, idx, value)
        return super().put_(dst, idx, value)

    def _int_index(self, idx):
        return isinstance(idx, self.torch.Tensor) and idx.dim() == 1 and idx.dtype in (self.torch.int64,
                                                                                       self.torch.int32)

    @staticmethod
    def scatter_add_(dst, idx, values):
        return dst.index_add_(0, idx, values)

    @staticmethod
    def add_unique_(dst, idx, values):
        return dst.index_add_(0, idx, values)


    @staticmethod
    def sort(x):
        return x.sort().values

    def unique_inverse(self, x):
        if x.device.type == "cpu":          # numpy's stable sort merges the sorted runs (torch's sort does not)
            u, slot = NumpyBackend.unique_inverse(x.numpy())
            return self.torch.from_numpy(u), self.torch.from_numpy(slot)
        return x.unique(sorted=True, return_inverse=True)

    def searchsorted(self, sorted_x, values, right=False):
        return self.torch.searchsorted(sorted_x.contiguous(), values.contiguous(), side="right" if right else "left")

    @staticmethod
    def clamp_max(x, c):
        return x.clamp(max=c)

    @staticmethod
    def bitcast(x, dtype):
        return x.contiguous().view(dtype)


    def nan_to_zero(self, x):
        """A copy of ``x`` with NaN and ±Inf replaced by 0."""
        return self.torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    @staticmethod
    def mean_std(x):
        """(mean, unbiased std) of a float tensor as Python floats, computed in float64."""
        a64 = x.double()
        return float(a64.mean()), (float(a64.std(correction=1)) if x.numel() > 1 else 0.0)

    def argsort_stable(self, x):
        """Stable ascending argsort of a 1-D tensor (int64)."""
        return self.torch.sort(x, stable=True).indices

    def topk_rows(self, X, k):
        """Exact top-k of every row of the 2-D float32 ``X`` (m, c): column indices (m, k), int64, ascending
        (the rule of :meth:`NumpyBackend.topk_rows`)."""
        torch = self.torch
        m, c = X.shape
        if k >= c:
            return torch.arange(c, dtype=torch.int64, device=X.device).expand(m, c)
        mag = X.abs()
        nan = torch.isnan(mag)
        if bool(nan.any()):
            mag = torch.where(nan, torch.full_like(mag, float("inf")), mag)
        vals, cols = torch.topk(mag, k, dim=1, largest=True, sorted=False)  # values exact, tie order not
        th = vals.min(dim=1, keepdim=True).values
        above = (mag > th).sum(dim=1)
        bad = torch.nonzero((mag == th).sum(dim=1) != k - above).reshape(-1)
        if bad.numel():
            sub, tb = mag[bad], th[bad]
            tied = sub == tb
            tied = tied & (tied.cumsum(dim=1) <= (k - above[bad])[:, None])
            cols[bad] = ((sub > tb) | tied).nonzero()[:, 1].reshape(bad.numel(), k)
        return cols.sort(dim=1).values
