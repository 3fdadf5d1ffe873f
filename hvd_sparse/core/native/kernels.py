"""The Python side of the kernels: numpy arrays in, numpy arrays out (API and design: the package docstring).

:func:`f32_view` / :func:`i64_view` give the numpy view of a numpy array or a CPU torch tensor that a kernel can
scan (None otherwise, or when the kernel is not built); :func:`wrap` turns a result back into the caller's array
type. The wrappers check their arguments, size the output, and repeat a call whose output segments overflowed.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from .library import _calls, loaded
from .build import MAX_THREADS, threads_for

RULES = ("ge_nonzero", "gt", "ge")

#: bit pattern of +inf: the upper end of every range (NaNs lie above it)
INF_BITS = 0x7F800000
#: the largest ``bits(|x|)``, a NaN's: the upper end of a range that takes the NaNs too
NAN_BITS = 0x7FFFFFFF

_tls = threading.local()


# -- rules -----------------------------------------------------------------------------------------------
def bounds(th, rule):
    """``(lo, hi)``: the rule's selection as a range of ``bits(|x|)`` (uint32), ``lo > hi`` for none."""
    if rule not in RULES:
        raise ValueError(f"hvd_sparse.core.native: rule must be one of {RULES}, got {rule!r}")
    with np.errstate(over="ignore"):
        t = np.float32(th)
    if rule == "ge_nonzero":                                # rule_mask: "t > 0 ? |x| >= t : |x| > 0"
        return (int(t.view(np.uint32)) if t > 0 else 1), INF_BITS
    if np.isnan(t):
        return INF_BITS + 1, INF_BITS                       # nothing compares true with NaN
    bits = int(np.abs(t).view(np.uint32))
    if rule == "gt":
        lo = bits + 1 if t >= 0 else 0                      # next float up; t < 0: every non-NaN
    else:
        lo = bits if t > 0 else 0                           # t <= 0: every non-NaN, zeros too
    return lo, INF_BITS


# -- views of the callers' buffers -------------------------------------------------------------------------
def f32_view(xp, x):
    """A numpy float32 1-D view sharing ``x``'s memory when the kernel can scan ``x``, else None.

    Takes numpy float32 arrays and CPU torch float32 tensors that are 1-D and contiguous; None for
    everything else (CUDA, TensorFlow, other dtypes, strided views) and when the kernel is unavailable.
    ``xp``: the caller's backend (:func:`wrap` turns results back into its arrays).
    """
    return _view(x, np.float32, "float32")


def i64_view(xp, x):
    """As :func:`f32_view`, for int64 arrays (indexes)."""
    return _view(x, np.int64, "int64")


def _view(x, np_dtype, torch_dtype):
    if isinstance(x, np.ndarray):
        ok = x.dtype == np_dtype and x.ndim == 1 and x.flags.c_contiguous and x.dtype.isnative
        return x if ok and loaded() is not None else None
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return None
    if (x.dtype != getattr(torch, torch_dtype) or x.dim() != 1 or x.device.type != "cpu" or not x.is_contiguous()
            or x.is_conj() or x.is_neg()):
        return None
    if loaded() is None:
        return None
    return x.detach().numpy()


def wrap(xp, a):
    """``a`` (a numpy result of this module) as an array of the backend ``xp``: a torch tensor sharing it for
    torch, ``a`` itself for numpy."""
    return xp.from_numpy(a)


# -- the kernel calls ------------------------------------------------------------------------------------
class _Workspace:
    """Per-Python-thread output segments of the kernel threads, reused across calls."""

    def __init__(self):
        self.cap = 0
        self.idx = None
        self.val = None
        self.counts = np.zeros(MAX_THREADS, np.int64)

    def ensure(self, cap, threads, values):
        """Room for ``threads`` segments of at least ``cap`` entries (``self.cap`` never shrinks here)."""
        cap = max(cap, self.cap)
        if self.idx is None or self.idx.size < cap * threads:
            self.idx = np.empty(cap * threads, np.int64)
            self.val = None
        self.cap = cap
        if values and (self.val is None or self.val.size < cap * threads):
            self.val = np.empty(cap * threads, np.uint32)

    def collect(self, cap, threads, values):
        """The kernel's output, its ``threads`` segments of ``cap`` entries concatenated in order (``counts[t]``
        entries each): ``(int64 indices, float32 values or None)``, fresh arrays."""
        if threads == 1:
            c = int(self.counts[0])
            return self.idx[:c].copy(), (self.val[:c].view(np.float32).copy() if values else None)
        parts = [(t * cap, t * cap + int(self.counts[t])) for t in range(threads)]
        idx = np.concatenate([self.idx[a:b] for a, b in parts])
        return idx, (np.concatenate([self.val[a:b] for a, b in parts]).view(np.float32) if values else None)

    def trim(self, need):
        """Release segments far larger than the last need (a spike must not pin memory for good)."""
        if self.cap > (1 << 16) and self.cap > 8 * need:
            self.cap, self.idx, self.val = 0, None, None


def _chunk(n, threads):
    """Elements per kernel thread: n split in ``threads``, rounded up to a multiple of 64 (as the kernel does)."""
    return (-(-n // threads) + 63) // 64 * 64


def _workspace():
    ws = getattr(_tls, "ws", None)
    if ws is None:
        ws = _tls.ws = _Workspace()
    return ws


def _check_view(view):
    if not (isinstance(view, np.ndarray) and view.dtype == np.float32 and view.ndim == 1
            and view.flags.c_contiguous):
        raise TypeError("hvd_sparse.core.native: expected a 1-D contiguous numpy float32 array (see f32_view), "
                        f"got {type(view).__name__} {getattr(view, 'dtype', '')}")


def _prepare(view, th, rule):
    """The checks and bounds shared by :func:`count` and :func:`select`: ``(library, n, lo, hi)``."""
    _check_view(view)
    lib = loaded()
    if lib is None:
        raise RuntimeError("hvd_sparse.core.native: the kernel is not available (check available() first)")
    lo, hi = bounds(th, rule)
    return lib, view.size, lo, hi


def count(view, th, rule, threads=None):
    """Number of entries of ``view`` that ``rule`` selects at threshold ``th`` (one read pass)."""
    lib, n, lo, hi = _prepare(view, th, rule)
    if n == 0 or lo > hi:
        return 0
    T = threads or threads_for(n)
    ws = _workspace()
    _calls[0] += 1
    total = lib.hvds_select_f32(view.ctypes.data, n, lo, hi, 0, None, None, 0, T, ws.counts.ctypes.data)
    if total < 0:  # pragma: no cover - arguments are checked above
        raise RuntimeError("hvd_sparse.core.native: kernel rejected its arguments")
    return int(total)


def select(view, th, rule, *, base=0, values=False, expect=0, threads=None, nan=False):
    """Ascending int64 indices (plus ``base``) of the entries ``rule`` selects at ``th``, in one read pass.

    Args:
        view: 1-D contiguous numpy float32 array (see :func:`f32_view`).
        th (float): the threshold, compared in float32 (rounded to nearest).
        rule (str): one of ``RULES``.
        base (int): added to every index (e.g. the start of a slice). Default 0.
        values (bool): also return the selected values (float32), gathered in the same pass. Default False.
        expect (int): expected count, sizes the first workspace (it grows on demand anyway). Default 0.
        threads (int, optional): kernel threads. Default :func:`threads_for`.
        nan (bool): also select every NaN (no rule does), in the same pass. Default False.
    Returns:
        ``(indices, values or None)``: fresh numpy arrays the caller owns.
    """
    lib, n, lo, hi = _prepare(view, th, rule)
    if nan:
        hi = NAN_BITS                                       # lo <= INF_BITS + 1 always: every NaN
    if n == 0 or lo > hi:
        return np.zeros(0, np.int64), (np.zeros(0, np.float32) if values else None)
    T = threads or threads_for(n)
    chunk = _chunk(n, T)
    ws = _workspace()
    cap = min(chunk, max(4096, 2 * int(expect) // T + 1024))
    ws.ensure(cap, T, values)
    counts = ws.counts
    while True:
        cap = min(ws.cap, chunk)
        _calls[0] += 1
        total = lib.hvds_select_f32(view.ctypes.data, n, lo, hi, int(base), ws.idx.ctypes.data,
                                    ws.val.ctypes.data if values else None, cap, T, counts.ctypes.data)
        if total < 0:  # pragma: no cover - arguments are checked above
            raise RuntimeError("hvd_sparse.core.native: kernel rejected its arguments")
        worst = int(counts[:T].max())
        if worst <= cap:
            break
        ws.ensure(min(chunk, worst + worst // 4 + 1024), T, values)    # overflow: room for the largest
    idx, val = ws.collect(cap, T, values)
    ws.trim(worst)
    return idx, val


def _check_add(r, g, out, zero_g):
    for a in (g, out) if r is None else (r, g, out):
        _check_view(a)
        if a.size != out.size:
            raise ValueError("hvd_sparse.core.native.add: the arrays differ in size")
    if zero_g and (g.ctypes.data == out.ctypes.data or np.shares_memory(g, out)):
        raise ValueError("hvd_sparse.core.native.add: zero_g needs an out that is not g")
    lib = loaded()
    if lib is None:
        raise RuntimeError("hvd_sparse.core.native: the kernel is not available (check available() first)")
    return lib


def add(r, g, out, threads=None, zero_g=False):
    """``out[:] = r + g`` (``r`` None: ``out[:] = g``) over 1-D contiguous float32 numpy arrays of one size, in
    one pass; returns how many results are not finite (NaN or +-inf). ``out`` may be ``r``. With ``zero_g``, ``g``
    is zeroed in the same pass (it is the caller's output buffer, to be filled later; then ``out`` is not ``g``).
    A separate ``out`` is written with non-temporal stores (AVX2 builds): no read of it before the write."""
    lib = _check_add(r, g, out, zero_g)
    n = out.size
    _calls[0] += 1
    bad = lib.hvds_add_f32(None if r is None else r.ctypes.data, g.ctypes.data, out.ctypes.data, n,
                           threads or threads_for(n), int(bool(zero_g)))
    if bad < 0:  # pragma: no cover - arguments are checked above
        raise RuntimeError("hvd_sparse.core.native: kernel rejected its arguments")
    return int(bad)


def add_select(r, g, out, th, rule, *, base=0, expect=0, threads=None, zero_g=False):
    """:func:`add` and ``select(out, th, rule, base=base, values=True)`` in the same single pass: the sum's
    entries the rule selects are collected while the sum is written (no second read of ``out``).

    Returns ``(bad, indices, values)``: the non-finite count of :func:`add`, and exactly what :func:`select`
    would return on ``out`` afterwards (ascending int64 indices plus ``base``, float32 values; fresh arrays).
    ``expect`` sizes the output segments (about 2·expect entries in all, kept for the next call, never grown
    here: the room stays proportional to what callers expect); when a segment overflows (more matches than
    room, e.g. a gradient spike), the kernel still finishes the sum and this function selects from ``out`` with
    :func:`select` (one extra read, only then)."""
    lib = _check_add(r, g, out, zero_g)
    lo, hi = bounds(th, rule)
    n = out.size
    T = threads or threads_for(n)
    chunk = _chunk(n, T)
    ws = _workspace()
    cap = min(chunk, max(4096, 2 * int(expect) // T + 1024)) if n else 0
    ws.ensure(cap, T, True)
    cap = min(ws.cap, chunk)
    counts = ws.counts
    _calls[0] += 1
    bad = lib.hvds_add_select_f32(None if r is None else r.ctypes.data, g.ctypes.data, out.ctypes.data, n, T,
                                  int(bool(zero_g)), lo, hi, int(base), ws.idx.ctypes.data, ws.val.ctypes.data,
                                  cap, counts.ctypes.data)
    if bad < 0:  # pragma: no cover - arguments are checked above
        raise RuntimeError("hvd_sparse.core.native: kernel rejected its arguments")
    if n == 0 or lo > hi:
        return int(bad), np.zeros(0, np.int64), np.zeros(0, np.float32)
    worst = int(counts[:T].max())
    if worst > cap:                                     # a segment overflowed: the sum is done, select from it
        idx, val = select(out, th, rule, base=base, values=True, expect=worst * T, threads=T)
        return int(bad), idx, val
    return (int(bad), *ws.collect(cap, T, True))


def merge_add(idx, val, counts):
    """Merge P runs of (index, value) pairs into their distinct indexes and sums, in one pass (k-sized).

    ``idx`` (int64) and ``val`` (float32) are 1-D contiguous numpy arrays holding the runs one after the other,
    ``counts[s]`` pairs for run s; every run is strictly ascending in index. Each sum is ``0.0 + v_s1 + v_s2 +
    ...`` over the runs s1 < s2 < ... that hold the index, in that order: the additions of ``dst = 0; dst[idx_s] +=
    val_s for s = 0..P-1``, bit for bit. Returns ``(indexes, sums)`` (ascending, fresh arrays), or None when a run
    is not strictly ascending (the caller takes its general path)."""
    _check_i64(idx)
    _check_view(val)
    counts = np.asarray(counts, np.int64)
    if (idx.size != val.size or counts.ndim != 1 or int(counts.sum()) != idx.size
            or not 1 <= counts.size <= MAX_THREADS):
        raise ValueError("hvd_sparse.core.native.merge_add: counts must split idx and val (same size) into 1..256 runs")
    lib = loaded()
    out_idx = np.empty(idx.size, np.int64)
    out_val = np.empty(idx.size, np.float32)
    _calls[0] += 1
    m = lib.hvds_merge_add_f32(idx.ctypes.data, val.ctypes.data, counts.ctypes.data, counts.size,
                               out_idx.ctypes.data, out_val.ctypes.data)
    if m < 0:
        return None
    return out_idx[:m], out_val[:m]


def intersect(a, b):
    """The elements of the strictly ascending int64 ``a`` that occur in the strictly ascending ``b``, ascending (one
    merge pass); None when an input is not strictly ascending."""
    _check_i64(a)
    _check_i64(b)
    lib = loaded()
    out = np.empty(min(a.size, b.size), np.int64)
    _calls[0] += 1
    m = lib.hvds_intersect_i64(a.ctypes.data, a.size, b.ctypes.data, b.size, out.ctypes.data)
    return None if m < 0 else out[:m]


def members(a, b, fill):
    """``a`` with every entry that does not occur in ``b`` replaced by ``fill`` (int64, the length of ``a``), in one
    merge pass; both ascending (repeats allowed, e.g. trailing ``fill`` padding; ``fill`` never matches); None
    when an input is not ascending."""
    _check_i64(a)
    _check_i64(b)
    lib = loaded()
    out = np.empty(a.size, np.int64)
    _calls[0] += 1
    m = lib.hvds_members_i64(a.ctypes.data, a.size, b.ctypes.data, b.size, int(fill), out.ctypes.data)
    return None if m < 0 else out


def _check_i64(x):
    if not (isinstance(x, np.ndarray) and x.dtype == np.int64 and x.ndim == 1 and x.flags.c_contiguous):
        raise TypeError("hvd_sparse.core.native: expected a 1-D contiguous numpy int64 array (see i64_view), "
                        f"got {type(x).__name__} {getattr(x, 'dtype', '')}")
    if loaded() is None:
        raise RuntimeError("hvd_sparse.core.native: the kernel is not available (check available() first)")
