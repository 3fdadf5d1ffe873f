"""The numpy backend (the simulator's arrays)."""

from __future__ import annotations

import numpy as np

from .common import _Indexing
from .kernels import KernelOps


class NumpyBackend(KernelOps, _Indexing):
    """numpy arrays (the simulator's backend)."""

    name = "numpy"
    mutable = True
    freezable = True
    float32 = np.float32
    index_dtype = np.int64
    int32 = np.int32

    # --- creation / conversion -------------------------------------------------------------------
    @staticmethod
    def zeros(n, dtype, like=None):
        return np.zeros(n, dtype=dtype)

    @staticmethod
    def empty(n, dtype, like=None):
        return np.empty(n, dtype=dtype)

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
    def from_numpy(a):
        return a

    @staticmethod
    def host(x):
        """The numpy array of a CPU buffer (``x`` itself)."""
        return x

    @staticmethod
    def stream_buffer(n, like=None):
        """An uninitialised float32 buffer of ``n`` values that is streamed through every step (error
        feedback's): numpy asks the kernel for transparent huge pages on large buffers (``madvise``)."""
        return np.empty(n, np.float32)

    @staticmethod
    def freeze(x):
        x.flags.writeable = False
        return x

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
    def maximum(x, y):
        return np.maximum(x, y)

    @staticmethod
    def add_into(a, b, out):
        """``out[:] = a + b`` (``a`` None: ``out[:] = b``), cast to ``out``'s dtype; one pass, returns ``out``."""
        if a is None:
            np.copyto(out, b, casting="same_kind")
        else:
            np.add(a, b, out=out)
        return out

    @staticmethod
    def mul_into(x, s, out):
        """``out[:] = x * s`` (``s`` a Python scalar, computed in ``x``'s dtype, then cast to ``out``'s)."""
        if out.dtype == x.dtype:
            np.multiply(x, np.asarray(s, dtype=x.dtype), out=out)
        else:
            out[...] = x * np.asarray(s, dtype=x.dtype)
        return out

    @staticmethod
    def fill_(x, value):
        x.fill(value)
        return x

    @staticmethod
    def count_true(masks):
        """int64 array of the number of True entries of each mask."""
        return np.array([np.count_nonzero(m) for m in masks], np.int64)

    @staticmethod
    def all_finite(x):
        # A finite sum proves every entry finite (a NaN or Inf poisons the sum); only a sum that overflowed needs
        # the exact elementwise pass. One streaming read instead of a full boolean mask.
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(x.sum())) or bool(np.isfinite(x).all())

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
    def unique_inverse(x):
        """``(u, slot)``: the distinct values ``u`` of the 1-D int ``x``, ascending, and for every entry its
        position in ``u`` (``u[slot] == x``). A stable sort finds and merges runs, so ``x`` made of P sorted
        pieces costs O(m log P)."""
        m = x.size
        if m == 0:
            return x.astype(np.int64), np.zeros(0, np.int64)
        order = np.argsort(x, kind="stable")
        s = x[order]
        first = np.empty(m, dtype=bool)
        first[0] = True
        np.not_equal(s[1:], s[:-1], out=first[1:])
        slot = np.empty(m, dtype=np.int64)
        slot[order] = np.cumsum(first) - 1
        return s[first].astype(np.int64, copy=False), slot

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


    @staticmethod
    def nan_to_zero(x):
        """A copy of ``x`` with NaN and ±Inf replaced by 0."""
        return np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    @staticmethod
    def mean_std(x):
        """(mean, unbiased std) of a float array as Python floats, computed in float64."""
        a64 = x.astype(np.float64)
        return float(a64.mean()), (float(a64.std(ddof=1)) if x.size > 1 else 0.0)

    @staticmethod
    def argsort_stable(x):
        """Stable ascending argsort of a 1-D array (int64)."""
        return np.argsort(x, kind="stable")

    @staticmethod
    def topk_rows(X, k):
        """Exact top-k of every row of the 2-D float32 ``X`` (m, c): column indices (m, k), int64, ascending.

        Larger |x| first, ties broken by the lower index, NaN counts as +inf, zeros may be chosen: every row
        yields exactly min(k, c) columns (SparDL's block-wise selection). A partial sort picks k candidates
        per row; only rows whose k-th magnitude is tied beyond the slots left are redone with an exact mask
        (lower index wins)."""
        m, c = X.shape
        if k >= c:
            return np.broadcast_to(np.arange(c, dtype=np.int64), (m, c))
        mag = np.abs(X)
        nan = np.isnan(mag)
        if nan.any():
            mag[nan] = np.inf
        part = np.argpartition(mag, c - k, axis=1)
        cols = part[:, c - k:]
        th = np.take_along_axis(mag, cols[:, :1], axis=1)                 # k-th largest per row
        above = (mag > th).sum(axis=1)
        bad = np.flatnonzero((mag == th).sum(axis=1) != k - above)        # ties cut by the k-th slot
        if bad.size:
            sub, tb = mag[bad], th[bad]
            tied = sub == tb
            tied &= np.cumsum(tied, axis=1) <= (k - above[bad])[:, None]
            cols[bad] = np.nonzero((sub > tb) | tied)[1].reshape(bad.size, k)
        return np.sort(cols, axis=1).astype(np.int64, copy=False)
