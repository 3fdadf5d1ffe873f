"""The array shim: the few array operations the engine needs, for numpy arrays, torch tensors and
TensorFlow tensors.

Every algorithm in ``hvd_sparse.core`` is written once against this module, so the same code runs on
numpy (the simulator), on torch tensors (CPU or CUDA, the PyTorch adapter) and on TensorFlow eager tensors
(the TensorFlow adapter, inside ``tf.py_function``).

Why not only ``array-api-compat``: it does not cover TensorFlow tensors, and what the engine needs beyond
the standard (exact top-k with deterministic ties, scatter-add, in-place masked writes, bit-exact dtype
casts) is most of what it uses. So this is one small table of functions per backend, picked by
:func:`backend_of` from the array type. No framework is imported at load time.

Conventions (all backends):

* indices are int64 (``index_dtype``), values of the engine are float32 (``float32``);
* functions never modify their arguments unless their name ends in ``_``; those write into ``dst`` where the
  array type allows it and *return the result*, which callers must use: TensorFlow tensors are immutable, so
  there the result is a new tensor (``x = xp.put_(x, idx, 0.0)``);
* ``topk_indices`` is exact and deterministic: largest ``|x|`` first, ties broken by the lower index,
  zeros never selected (rule ``ge_nonzero`` made exact-k: docs/algorithms.md#exact-top-k).
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
    def ge(x, th):
        return x >= th

    @staticmethod
    def eq(x, th):
        return x == th

    @staticmethod
    def logical_and(a, b):
        return a & b

    @staticmethod
    def sum_int(x):
        return int(x.sum())

    @staticmethod
    def reshape(x, shape):
        return x.reshape(*shape)

    @staticmethod
    def set_slice_(x, lo, hi, value):
        """``x[lo:hi] = value``; returns x."""
        x[lo:hi] = value
        return x

    @staticmethod
    def add_slice_(x, lo, hi, y):
        """``x[lo:hi] += y``; returns x."""
        x[lo:hi] += y
        return x

    def interleave(self, a, b, like=None):
        """``a[0], b[0], a[1], b[1], ...`` (``a`` and ``b`` of one dtype and length; ``like``: device)."""
        out = self.zeros(2 * self.numel(a), self.dtype_of(a), like=like)
        out[0::2] = a
        out[1::2] = b
        return out


class NumpyBackend(_Indexing):
    """numpy arrays (the simulator's backend)."""

    name = "numpy"
    mutable = True
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


class TorchBackend(_Indexing):
    """torch tensors, CPU or CUDA (the PyTorch adapter's backend)."""

    name = "torch"
    mutable = True

    def __init__(self):
        import torch

        self.torch = torch
        self.float32 = torch.float32
        self.index_dtype = torch.int64
        self.int32 = torch.int32

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

    def all_finite(self, x):
        # as NumpyBackend.all_finite: the sum first, the elementwise pass only after an overflow
        return bool(self.torch.isfinite(x.sum())) or bool(self.torch.isfinite(x).all())

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


class TFBackend:
    """TensorFlow eager tensors (the TensorFlow adapter's backend; the engine runs inside ``tf.py_function``).

    TensorFlow tensors are immutable, so every ``_`` function returns a new tensor (callers use the result)
    and ``copy`` is the identity. Every operation is exact and deterministic: scatters only ever see unique
    indices (or a constant value), ``kth_largest`` reads the exact values of ``tf.math.top_k``, sorts of
    indices are stable. The helpers below ``bitcast`` stand in for what numpy and torch spell with methods
    or slice assignment (the core calls them only for backends other than numpy and torch).
    """

    name = "tensorflow"
    mutable = False                                  # no in-place writes: every ``_`` function returns a new tensor

    def __init__(self):
        import tensorflow as tf

        self.tf = tf
        self.float32 = tf.float32
        self.index_dtype = tf.int64
        self.int32 = tf.int32

    # --- creation / conversion -------------------------------------------------------------------
    def zeros(self, n, dtype, like=None):
        return self.tf.zeros([int(n)], dtype=dtype)

    def arange(self, n, dtype, like=None):
        return self.tf.range(int(n), dtype=dtype)

    def full(self, n, value, dtype, like=None):
        return self.tf.fill([int(n)], self._scalar(value, dtype))

    def asarray(self, values, dtype, like=None):
        tf = self.tf
        if tf.is_tensor(values):
            return tf.cast(values, dtype)
        # through numpy: Python floats are rounded to ``dtype`` exactly as the numpy backend rounds them
        return tf.convert_to_tensor(np.asarray(values, dtype=dtype.as_numpy_dtype))

    def astype(self, x, dtype):
        return x if x.dtype == dtype else self.tf.cast(x, dtype)

    @staticmethod
    def dtype_of(x):
        return x.dtype

    @staticmethod
    def to_numpy(x):
        return x.numpy()

    @staticmethod
    def numel(x):
        return int(x.shape.num_elements())

    @staticmethod
    def itemsize(x):
        return int(x.dtype.size)

    @staticmethod
    def copy(x):
        return x                                     # immutable: no write can alias it

    def concat(self, xs, like=None):
        return self.tf.concat(list(xs), axis=0)

    def _scalar(self, value, dtype):
        return self.tf.constant(np.asarray(value, dtype=dtype.as_numpy_dtype))

    # --- indexing ----------------------------------------------------------------------------------
    @staticmethod
    def add(x, y):
        return x + y

    def take(self, x, idx):
        return self.tf.gather(x, idx)

    def put_(self, dst, idx, value):
        tf = self.tf
        if tf.is_tensor(value):
            value = self.astype(value, dst.dtype)
        else:
            value = tf.fill([self.numel(idx)], self._scalar(value, dst.dtype))
        return tf.tensor_scatter_nd_update(dst, tf.expand_dims(idx, 1), value)

    def _cmp_operand(self, x, th):
        """Operands of a comparison with a Python scalar ``th``: compared in ``x``'s dtype (as numpy's and
        torch's weak scalars), except a fractional ``th`` against integers (compared exactly, in float64)."""
        if not self.tf.is_tensor(th) and x.dtype.is_integer and not float(th).is_integer():
            return self.tf.cast(x, self.tf.float64), self._scalar(th, self.tf.float64)
        return x, th

    def gt(self, x, th):
        return self.tf.greater(*self._cmp_operand(x, th))

    def ge(self, x, th):
        return self.tf.greater_equal(*self._cmp_operand(x, th))

    def eq(self, x, th):
        return self.tf.equal(*self._cmp_operand(x, th))

    def logical_and(self, a, b):
        return self.tf.logical_and(a, b)

    def sum_int(self, x):
        tf = self.tf
        wide = x.dtype != tf.bool or self.numel(x) >= 2**31
        return int(tf.reduce_sum(tf.cast(x, tf.int64 if wide else tf.int32)))   # 2x faster than count_nonzero

    # --- math ---------------------------------------------------------------------------------------
    def abs(self, x):
        return self.tf.abs(x)

    def mul(self, x, s):
        return x * self._scalar(s, x.dtype)

    def all_finite(self, x):
        return bool(self.tf.reduce_all(self.tf.math.is_finite(x)))

    def kth_largest(self, x, k):
        """The k-th largest value of a 1-D tensor (1 <= k <= len(x)), as a scalar tensor.

        TensorFlow has no linear-time selection: ``tf.math.top_k`` (exact values) costs O(n log k), measured
        4x numpy's ``partition`` for n = 10^6, k = 10^4 on CPU. So a CPU tensor is read through its own buffer
        (``.numpy()`` of a CPU EagerTensor shares memory) by ``np.partition``; other devices use top_k. Both
        return the same value."""
        k = int(k)
        if "GPU" not in x.device:
            a = x.numpy()
            return self.tf.constant(np.partition(a, a.size - k)[a.size - k])
        return self.tf.reduce_min(self.tf.math.top_k(x, k=k, sorted=False).values)

    def nonzero(self, mask):
        return self.tf.reshape(self.tf.where(mask), [-1])      # int64, ascending

    def scatter_add_(self, dst, idx, values):
        return self.tf.tensor_scatter_nd_add(dst, self.tf.expand_dims(idx, 1), self.astype(values, dst.dtype))

    def add_unique_(self, dst, idx, values):
        """``dst[idx] += values`` where ``idx`` has no duplicates."""
        return self.scatter_add_(dst, idx, values)

    def sort(self, x):
        return self.tf.sort(x)

    def unique_inverse(self, x):
        u = self.tf.unique(self.tf.sort(x)).y
        return u, self.searchsorted(u, x)

    def searchsorted(self, sorted_x, values, right=False):
        """Insertion points (int64) of ``values`` in the ascending 1-D ``sorted_x``."""
        tf = self.tf
        return tf.searchsorted(sorted_x, tf.cast(values, sorted_x.dtype), side="right" if right else "left",
                               out_type=tf.int64)

    def clamp_max(self, x, c):
        return self.tf.minimum(x, self._scalar(c, x.dtype))

    def bitcast(self, x, dtype):
        """The bits of the 1-D ``x`` reinterpreted as ``dtype`` (a length change as numpy's ``view``)."""
        tf = self.tf
        a, b = x.dtype.size, dtype.size
        if a == b:
            return tf.bitcast(x, dtype)
        if a > b:
            return tf.reshape(tf.bitcast(x, dtype), [-1])
        return tf.bitcast(tf.reshape(x, [-1, b // a]), dtype)

    # --- what numpy and torch spell with methods or slice assignment --------------------------------
    def reshape(self, x, shape):
        return self.tf.reshape(x, shape)

    def maximum(self, x, y):
        return self.tf.maximum(x, y)

    def interleave(self, a, b, like=None):
        """``a[0], b[0], a[1], b[1], ...`` (numpy: ``out[0::2] = a; out[1::2] = b``)."""
        tf = self.tf
        return tf.reshape(tf.stack([a, b], axis=1), [-1])

    def set_slice_(self, x, lo, hi, value):
        """``x[lo:hi] = value`` (a scalar or a tensor of length hi - lo)."""
        tf = self.tf
        mid = tf.fill([hi - lo], self._scalar(value, x.dtype)) if not tf.is_tensor(value) else value
        return tf.concat([x[:lo], tf.cast(mid, x.dtype), x[hi:]], axis=0)

    def add_slice_(self, x, lo, hi, y):
        """``x[lo:hi] += y``."""
        return self.tf.concat([x[:lo], x[lo:hi] + y, x[hi:]], axis=0)

    def nan_to_zero(self, x):
        """A copy of ``x`` with NaN and ±Inf replaced by 0."""
        tf = self.tf
        return tf.where(tf.math.is_finite(x), x, tf.zeros_like(x))

    def mean_std(self, x):
        """(mean, unbiased std) of a float tensor as Python floats, computed in float64 (Gaussiank).

        numpy sums pairwise and TensorFlow in Eigen's tree order, so the last float64 bit may differ from
        the numpy backend (as for torch); the float32 threshold derived from it almost never does."""
        tf = self.tf
        n = self.numel(x)
        a64 = tf.cast(x, tf.float64)
        mu = tf.reduce_sum(a64) / n
        sd = float(tf.sqrt(tf.reduce_sum(tf.square(a64 - mu)) / (n - 1))) if n > 1 else 0.0
        return float(mu), sd

    def argsort_stable(self, x):
        """Stable ascending argsort of a 1-D tensor (int64)."""
        tf = self.tf
        return tf.cast(tf.argsort(x, stable=True), tf.int64)

    def topk_rows(self, X, k):
        """Exact top-k of every row of the 2-D float32 ``X`` (m, c): column indices (m, k), int64, ascending.

        Larger |x| first, ties broken by the lower index, NaN counts as +inf, zeros may be chosen (SparDL's
        block-wise selection; the same rule as its numpy and torch helpers)."""
        tf = self.tf
        m, c = X.shape
        if k >= c:
            return tf.broadcast_to(tf.range(c, dtype=tf.int64), [m, c])
        mag = tf.abs(X)
        mag = tf.where(tf.math.is_nan(mag), tf.constant(np.inf, mag.dtype), mag)
        vals, cols = tf.math.top_k(mag, k=k, sorted=False)               # values exact, tie order not
        cols = tf.cast(cols, tf.int64)
        th = tf.reduce_min(vals, axis=1, keepdims=True)
        above = tf.reduce_sum(tf.cast(mag > th, tf.int64), axis=1)
        ties = tf.reduce_sum(tf.cast(tf.equal(mag, th), tf.int64), axis=1)
        bad = tf.reshape(tf.where(tf.not_equal(ties, k - above)), [-1])
        if int(tf.size(bad)):
            sub, tb = tf.gather(mag, bad), tf.gather(th, bad)
            tied = tf.equal(sub, tb)
            room = tf.gather(k - above, bad)[:, None]
            tied = tf.logical_and(tied, tf.cumsum(tf.cast(tied, tf.int64), axis=1) <= room)
            fixed = tf.reshape(tf.where(tf.logical_or(sub > tb, tied))[:, 1], [-1, k])
            cols = tf.tensor_scatter_nd_update(cols, bad[:, None], fixed)
        return tf.sort(cols, axis=1)


_NUMPY = NumpyBackend()
_TORCH = None
_TF = None


def backend_of(x):
    """The backend for array ``x`` (numpy array, torch tensor or TensorFlow eager tensor).

    A framework is imported only when an array of that framework is passed."""
    global _TORCH, _TF
    if isinstance(x, np.ndarray):
        return _NUMPY
    mod = type(x).__module__
    if mod.startswith("torch"):
        if _TORCH is None:
            _TORCH = TorchBackend()
        return _TORCH
    if mod.startswith("tensorflow"):
        if _TF is None:
            _TF = TFBackend()
        return _TF
    raise TypeError(f"hvd_sparse: arrays of type {type(x).__name__} are not supported "
                    "(expected a numpy array, a torch tensor or a TensorFlow tensor)")


def topk_indices(xp, acc, k):
    """Exact top-k of ``|acc|``: sorted int64 indices of the min(k, nnz) largest magnitudes.

    Deterministic: ties at the k-th magnitude are broken by the lower index, zeros are never selected
    (docs/algorithms.md#exact-top-k). Returns ``(indices, threshold)`` where ``threshold`` is the k-th largest |acc|
    as a Python float (0.0 when fewer than k entries are nonzero).
    """
    n = xp.numel(acc)
    if 0 < k < n:
        fast = _topk_native(xp, acc, k)
        if fast is not None:
            return fast
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


#: topk_indices takes the native path from this many values on (below, a full selection is as quick)
TOPK_NATIVE_MIN = 1 << 16
#: values sampled (evenly strided) to place the native path's candidate threshold
TOPK_SAMPLE = 1 << 18


def _topk_native(xp, acc, k):
    """:func:`topk_indices` in two read passes of the fused kernel, for numpy / CPU torch float32 (else None).

    1. a threshold ``lo`` a little below the k-th largest ``|acc|``, placed from an evenly strided sample (so that
       about 1.25k values reach it); 2. one pass selects the candidates ``|acc| >= lo`` with their values (ascending
       indexes); 3. the exact k-th largest magnitude of the candidates is the k-th largest of ``acc``, and the same
       rule as the generic path (everything above it, ties by the lower index) picks the result from them. A
       sample that places ``lo`` too high (fewer than k candidates) lowers it and selects again. Returns exactly what
       the generic path returns (indexes and threshold), or None when it cannot tell cheaply: a NaN anywhere (one
       ``max`` pass checks), fewer than k nonzeros, small inputs. ``torch.topk`` needs 0.46 s for k = 250,000 of
       n = 25M on one core here; this about 0.03 s."""
    from . import native

    n = xp.numel(acc)
    if n < TOPK_NATIVE_MIN:
        return None
    view = native.f32_view(xp, acc)
    if view is None or np.isnan(view.max()):
        return None
    stride = max(1, n // TOPK_SAMPLE)
    sample = np.abs(view[::stride])
    s = sample.size
    expect = k * s / n
    want = min(s, int(1.25 * expect + 3.0 * expect ** 0.5 + 16))
    lo = float(np.partition(sample, s - want)[s - want])
    for _ in range(4):
        if not lo > 0.0:
            return None                                         # (nearly) all zeros: the generic path decides
        cand, vals = native.select(view, lo, "ge", values=True, expect=int(1.25 * k))
        if cand.size >= k:
            break
        lo /= 4.0
    else:
        return None
    mag = np.abs(vals)
    th = mag[np.argpartition(mag, mag.size - k)[mag.size - k]]
    if not th > 0:
        return None                                             # fewer than k nonzeros
    keep = mag > th
    need = k - int(np.count_nonzero(keep))
    if need:
        keep[np.flatnonzero(mag == th)[:need]] = True           # ties: the lower indexes
    return native.wrap(xp, cand[keep]), float(th)


def intersect_sorted(xp, a, b):
    """The elements of the sorted unique int ``a`` that occur in the sorted unique ``b`` (exact, ascending).

    numpy and CPU torch int64 arrays take the native merge kernel when it is built, else merge the two runs with
    one stable sort (O(|a| + |b|)); other backends binary-search ``a`` in ``b``."""
    if xp.numel(a) == 0 or xp.numel(b) == 0:
        return a[:0]
    from . import native

    av, bv = native.i64_view(xp, a), native.i64_view(xp, b)
    if av is not None and bv is not None:
        both = native.intersect(av, bv)
        if both is not None:
            return native.wrap(xp, both)
    if xp.name == "numpy" or (xp.name == "torch" and a.device.type == "cpu" and b.device.type == "cpu"):
        an, bn = (a, b) if xp.name == "numpy" else (a.numpy(), b.numpy())
        c = np.concatenate([an, bn.astype(an.dtype, copy=False)])
        c.sort(kind="stable")
        both = c[:-1][c[1:] == c[:-1]]
        return both if xp.name == "numpy" else xp.torch.from_numpy(both)
    pos = xp.clamp_max(xp.searchsorted(b, a), xp.numel(b) - 1)
    return xp.take(a, xp.nonzero(xp.eq(xp.take(b, pos), a)))

