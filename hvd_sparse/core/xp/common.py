"""Array operations that numpy arrays and torch tensors spell the same way (shared by both backends)."""

from __future__ import annotations

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
