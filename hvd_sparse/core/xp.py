"""The array shim: the few array operations the engine needs, for numpy arrays and torch tensors.

Every algorithm in ``hvd_sparse.core`` is written once against this module, so the same code runs on
numpy (the simulator), on torch tensors (CPU or CUDA, the PyTorch adapter) and -- with the TensorFlow
backend that arrives with the TensorFlow adapter -- on TensorFlow tensors.

Why not only ``array-api-compat``: it does not cover TensorFlow tensors, and what the engine needs beyond
the standard (exact top-k with deterministic ties, scatter-add, in-place masked writes, bit-exact dtype
casts) is most of what it uses. So this is one small table of functions per backend, picked by
:func:`backend_of` from the array type. No framework is imported at load time.

Conventions (all backends):

* indices are int64 (``index_dtype``), values of the engine are float32 (``float32``);
* functions never modify their arguments unless their name ends in ``_`` (then they return the argument);
* ``topk_indices`` is exact and deterministic: largest ``|x|`` first, ties broken by the lower index,
  zeros never selected (spec oktopk.md §2.1, rule ``ge_nonzero`` made exact-k).
"""

from __future__ import annotations

import numpy as np


class _Indexing:
    """Operations spelled the same for numpy arrays and torch tensors."""

    @staticmethod
    def add(x, y):
        return x + y

    @staticmethod
    def take(x, idx):
        return x[idx]

    @staticmethod
    def put_(dst, idx, value):
        dst[idx] = value
        return dst

    @staticmethod
    def gt(x, th):
        return x > th

    @staticmethod
    def eq(x, th):
        return x == th

    @staticmethod
    def logical_and(a, b):
        return a & b

    @staticmethod
    def sum_int(x):
        return int(x.sum())


class NumpyBackend(_Indexing):
    """numpy arrays (the simulator's backend)."""

    name = "numpy"
    float32 = np.float32
    index_dtype = np.int64
    int32 = np.int32

    # --- creation / conversion -------------------------------------------------------------------
    @staticmethod
    def zeros(n, dtype, like=None):
        return np.zeros(n, dtype=dtype)

    @staticmethod
    def arange(n, dtype, like=None):
        return np.arange(n, dtype=dtype)

    @staticmethod
    def full(n, value, dtype, like=None):
        return np.full(n, value, dtype=dtype)

    @staticmethod
    def asarray(values, dtype, like=None):
        return np.asarray(values, dtype=dtype)

    @staticmethod
    def astype(x, dtype):
        return x.astype(dtype, copy=False)

    @staticmethod
    def dtype_of(x):
        return x.dtype

    @staticmethod
    def to_numpy(x):
        return np.asarray(x)

    @staticmethod
    def numel(x):
        return int(x.size)

    @staticmethod
    def itemsize(x):
        return int(x.dtype.itemsize)

    @staticmethod
    def copy(x):
        return x.copy()

    @staticmethod
    def concat(xs, like=None):
        return np.concatenate(xs)

    # --- math ---------------------------------------------------------------------------------------
    @staticmethod
    def abs(x):
        return np.abs(x)

    @staticmethod
    def mul(x, s):
        return x * np.asarray(s, dtype=x.dtype)

    @staticmethod
    def all_finite(x):
        return bool(np.isfinite(x).all())

    @staticmethod
    def kth_largest(x, k):
        """The k-th largest value of a 1-D array (1 <= k <= len(x))."""
        return x[np.argpartition(x, x.size - k)[x.size - k]]

    @staticmethod
    def nonzero(mask):
        return np.flatnonzero(mask).astype(np.int64, copy=False)

    @staticmethod
    def scatter_add_(dst, idx, values):
        np.add.at(dst, idx, values)
        return dst

    @staticmethod
    def add_unique_(dst, idx, values):
        """``dst[idx] += values`` where ``idx`` has no duplicates (much faster than scatter_add_)."""
        dst[idx] += values
        return dst


    @staticmethod
    def sort(x):
        return np.sort(x)

    @staticmethod
    def searchsorted(sorted_x, values, right=False):
        """Insertion points (int64) of ``values`` in the ascending 1-D ``sorted_x``."""
        return np.searchsorted(sorted_x, values, side="right" if right else "left").astype(np.int64, copy=False)

    @staticmethod
    def clamp_max(x, c):
        """Elementwise ``min(x, c)`` with a Python scalar ``c``."""
        return np.minimum(x, c)

    @staticmethod
    def bitcast(x, dtype):
        """The bits of ``x`` reinterpreted as ``dtype`` (a contiguous copy first when needed)."""
        return np.ascontiguousarray(x).view(dtype)


class TorchBackend(_Indexing):
    """torch tensors, CPU or CUDA (the PyTorch adapter's backend)."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch
        self.float32 = torch.float32
        self.index_dtype = torch.int64
        self.int32 = torch.int32

    def zeros(self, n, dtype, like=None):
        return self.torch.zeros(n, dtype=dtype, device=None if like is None else like.device)

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

    def all_finite(self, x):
        return bool(self.torch.isfinite(x).all())

    def kth_largest(self, x, k):
        # topk's *values* are exact; only the order of tied indices is unspecified, and we do not use it.
        return self.torch.topk(x, k, sorted=False).values.min()

    def nonzero(self, mask):
        return self.torch.nonzero(mask, as_tuple=False).reshape(-1)

    @staticmethod
    def scatter_add_(dst, idx, values):
        return dst.index_add_(0, idx, values)

    @staticmethod
    def add_unique_(dst, idx, values):
        return dst.index_add_(0, idx, values)


    @staticmethod
    def sort(x):
        return x.sort().values

    def searchsorted(self, sorted_x, values, right=False):
        return self.torch.searchsorted(sorted_x.contiguous(), values.contiguous(), side="right" if right else "left")

    @staticmethod
    def clamp_max(x, c):
        return x.clamp(max=c)

    @staticmethod
    def bitcast(x, dtype):
        return x.contiguous().view(dtype)


_NUMPY = NumpyBackend()
_TORCH = None


def backend_of(x):
    """The backend for array ``x`` (numpy array or torch tensor)."""
    global _TORCH
    if isinstance(x, np.ndarray):
        return _NUMPY
    mod = type(x).__module__
    if mod.startswith("torch"):
        if _TORCH is None:
            _TORCH = TorchBackend()
        return _TORCH
    raise TypeError(f"hvd_sparse: arrays of type {type(x).__name__} are not supported "
                    "(expected a numpy array or a torch tensor)")


def topk_indices(xp, acc, k):
    """Exact top-k of ``|acc|``: sorted int64 indices of the min(k, nnz) largest magnitudes.

    Deterministic: ties at the k-th magnitude are broken by the lower index, zeros are never selected
    (spec oktopk.md §2.1). Returns ``(indices, threshold)`` where ``threshold`` is the k-th largest |acc|
    as a Python float (0.0 when fewer than k entries are nonzero).
    """
    n = xp.numel(acc)
    mag = xp.abs(acc)
    if k >= n:
        return xp.nonzero(xp.gt(mag, 0)), 0.0
    th = xp.kth_largest(mag, k)
    th_f = float(th)
    if th_f == 0.0:                          # fewer than k nonzeros: take them all
        return xp.nonzero(xp.gt(mag, 0)), 0.0
    above = xp.nonzero(xp.gt(mag, th))
    need = k - xp.numel(above)
    if need == 0:
        return above, th_f
    tied = xp.nonzero(xp.eq(mag, th))[:need]  # ascending index: lower index wins
    idx = xp.concat([above, tied], like=acc)
    return xp.sort(idx), th_f
