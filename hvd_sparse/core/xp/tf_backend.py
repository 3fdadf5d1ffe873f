"""The TensorFlow backend (eager tensors; TensorFlow is imported when the first tensor arrives)."""

from __future__ import annotations

import numpy as np

from .generic import GenericOps


class TFBackend(GenericOps):
    """TensorFlow eager tensors (the TensorFlow adapter's backend; the engine runs inside ``tf.py_function``).

    TensorFlow tensors are immutable, so every ``_`` function returns a new tensor (callers use the result)
    and ``copy`` is the identity. Every operation is exact and deterministic: scatters only ever see unique
    indices (or a constant value), ``kth_largest`` reads the exact values of ``tf.math.top_k``, sorts of
    indices are stable. The helpers below ``bitcast`` stand in for what numpy and torch spell with methods
    or slice assignment. What the numpy and torch backends do with the C kernels (``scan``, ``merge_add``,
    ``intersect``) runs the generic path of :class:`~hvd_sparse.core.xp.generic.GenericOps` here.
    """

    name = "tensorflow"
    mutable = False                                  # no in-place writes: every ``_`` function returns a new tensor

    def __init__(self):
        import tensorflow as tf

        self.tf = tf
        self._dtypes_of(tf)

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

    def from_numpy(self, a):
        return self.tf.convert_to_tensor(a)

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
        idx = tf.reshape(idx, [-1])                  # indexes of any shape, as numpy and torch take them
        if tf.is_tensor(value):
            value = tf.reshape(self.astype(value, dst.dtype), [-1])
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
        # faster than count_nonzero (measured: docs/benchmarks.md, "Measured choices in the code")
        return int(tf.reduce_sum(tf.cast(x, tf.int64 if wide else tf.int32)))

    def count_true(self, masks):
        """int64 array of the number of True entries of each mask (on the masks' device; nothing is read)."""
        tf = self.tf
        return tf.stack([tf.reduce_sum(tf.cast(m, tf.int64)) for m in masks])

    # --- math ---------------------------------------------------------------------------------------
    def abs(self, x):
        return self.tf.abs(x)

    def mul(self, x, s):
        return x * self._scalar(s, x.dtype)

    def all_finite(self, x):
        return bool(self.tf.reduce_all(self.tf.math.is_finite(x)))

    def kth_largest(self, x, k):
        """The k-th largest value of a 1-D tensor (1 <= k <= len(x)), as a scalar tensor.

        TensorFlow has no linear-time selection: ``tf.math.top_k`` (exact values) costs O(n log k), several times
        numpy's ``partition`` on the CPU (measured: docs/benchmarks.md, "Measured choices in the code"). So a CPU
        tensor is read through its own buffer (``.numpy()`` of a CPU EagerTensor shares memory) by
        ``np.partition``; other devices use top_k. Both return the same value."""
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
