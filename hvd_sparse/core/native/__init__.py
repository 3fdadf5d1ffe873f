"""Fused select-and-compact on the CPU: a small C kernel, compiled on first use, loaded with ctypes.

What it computes (``select.c``): in ONE read pass over a contiguous float32 buffer ``x``, the ascending
int64 indices ``i`` with ``|x[i]| <rule> t`` -- and, on request, the values ``x[i]`` (fused gather) --
where the rule is one of the library's thresholding rules, compared in float32 exactly as the generic
array path (``xp``) compares:

    rule           selects                                used by
    ``ge_nonzero`` |x| >= t and x != 0 (t <= 0: |x| > 0)  ThresholdReuse (default rule)
    ``gt``         |x| > t                                ThresholdReuse (ref rule), Gaussiank
    ``ge``         |x| >= t (t <= 0: every non-NaN)       ExDyna

``t`` is the threshold rounded to the nearest float32 (what numpy and torch do with a Python float
compared against a float32 array). For non-negative floats the IEEE-754 bit patterns order like the
values, so each rule is an integer range ``lo <= bits(|x|) <= hi`` (:func:`bounds`) and the kernel
compares integers: bit-identical to the generic path, including -0.0, subnormals and +-inf.
**NaN is never selected** (as in the generic path, where every comparison with NaN is false): ``hi`` is
the bit pattern of +inf and NaNs lie above it. A NaN threshold selects nothing under ``gt`` and ``ge``;
under ``ge_nonzero`` it acts as ``t <= 0`` (every nonzero), as ``rule_mask`` of ThresholdReuse does.

Why a kernel: ``xp.nonzero(xp.abs(acc) >= t)`` costs an |acc| copy, a boolean mask and a compaction:
four passes over n elements plus two n-sized temporaries; ThresholdReuse's guard adds a count pass per
raise. Measured with torch on 25M values (2-core VM, ``python -m hvd_sparse.bench select``): ThresholdReuse's
reuse step on that path takes about 27x one streaming read (``torch.amax``); with the kernel, about 1x
(docs/benchmarks.md, "Sparsifier cost").

Design decisions:

* **Compiled on first use**, with ``$CC`` (default ``cc``): ``-O3 -march=native -shared -fPIC -pthread``,
  retried without ``-march=native`` if that fails. The shared object is cached as
  ``$XDG_CACHE_HOME/hvd_sparse/native/<hash>.so`` (default ``~/.cache``; a per-user temp directory if that
  is not writable); the hash covers the source, the flags, the machine and the CPU's feature flags, so
  nodes of a cluster that share a home directory never load a build for another CPU. Each build is
  written to a private temporary file and renamed into place (atomic), so ranks of one ``horovodrun``
  job that start compiling at once do not clash. The C source has no torch or Python headers (compiles
  in about a second). AVX2 path when the compiler targets AVX2, else SSE2, else portable C.
* **Plain pthreads, created per call**, not OpenMP: torch and TensorFlow each bundle their own OpenMP
  runtime, and a third one in the process invites oversubscription; and no thread pool is left running
  across ``fork()`` (DataLoader workers). Threads: ``HVD_SPARSE_NATIVE_THREADS``, else torch's
  intra-op thread count when torch is loaded, else the CPUs this process may run on; at most one thread
  per 2^20 elements (smaller buffers are scanned by the calling thread). On the project's 2-core VM one
  thread reads 25M values in 0.038 s against 0.032 s for ``torch.amax`` with two: the pass is memory-bound.
* **Thread-local output, buffers reused across steps**: thread ``t`` of the kernel scans one contiguous
  chunk and writes to its own segment of a workspace that is kept (per Python thread: the simulator runs
  one Python thread per virtual rank) and grown when a segment overflows -- the kernel still counts, the
  call is repeated once with room for the largest segment. A workspace much larger than the last need
  is released. The result is a fresh exact-size array (its segments concatenated in order): callers may
  keep it across steps.
* ctypes releases the GIL during the call.
* **Fallback**: ``HVD_SPARSE_NATIVE=0`` (read at every call), no compiler, or a failed build (one
  ``RuntimeWarning``) -> :func:`f32_view` returns None and callers keep their generic ``xp`` path, with
  identical results (``tests/test_native_select.py`` runs both). Only numpy float32 arrays and CPU torch
  float32 tensors, 1-D and contiguous, take the kernel; CUDA and TensorFlow tensors keep the ``xp`` path.

API (numpy in, numpy out; :func:`f32_view` / :func:`wrap` convert from / to the caller's backend)::

    view = f32_view(xp, acc)                 # numpy float32 view sharing acc's memory, or None
    idx, vals = select(view, t, "gt", base=0, values=True)   # int64 ascending (+ base), float32 or None
    c = count(view, t, "gt")                 # the same pass without output
    idx = wrap(xp, idx)                      # back to a torch tensor when xp is torch
    bad = add(r, g, out, zero_g=True)        # out = r + g (g zeroed), non-finite count, one pass
    bad, idx, vals = add_select(r, g, out, t, "ge_nonzero", base=0, expect=k)   # ... and select from out
    idx, sums = merge_add(idx64, vals, counts)   # P ascending runs -> distinct indexes, rank-order sums (or None)
    both = intersect(a64, b64)               # sorted intersection of two ascending int64 arrays (or None)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np

RULES = ("ge_nonzero", "gt", "ge")

#: bit pattern of +inf: the upper end of every range (NaNs lie above it)
INF_BITS = 0x7F800000
#: elements per kernel thread at least (smaller chunks do not pay for a thread start)
MIN_PER_THREAD = 1 << 20
#: kernel ABI expected from select.c
ABI = 3
#: compiler flag sets tried in order
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))
_COMMON_FLAGS = ("-shared", "-fPIC", "-pthread")
_MAX_THREADS = 256

SOURCE = Path(__file__).with_name("select.c")

_lock = threading.Lock()
_state = {"lib": None, "tried": False, "path": None, "flags": None, "reason": None}
_tls = threading.local()
_calls = [0]


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


# -- build and load ----------------------------------------------------------------------------------------
def enabled():
    """False when ``HVD_SPARSE_NATIVE`` is set to 0 / false / off / no (read at every call)."""
    return os.environ.get("HVD_SPARSE_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir():
    """``$XDG_CACHE_HOME/hvd_sparse/native`` (default ``~/.cache/hvd_sparse/native``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hvd_sparse" / "native"


def _cpu_id():
    """Text that changes with the CPU's instruction set (for the cache key of ``-march=native`` builds)."""
    found = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features", "model name", "CPU part") and key not in found:
                    found[key] = line.strip()
    except OSError:
        pass
    return "\n".join(found[k] for k in sorted(found)) or platform.processor()


def _compiler():
    return os.environ.get("CC") or "cc"


def build(flags, directory=None, force=False):
    """Compile ``select.c`` with ``flags`` (plus ``-shared -fPIC -pthread``) into the cache; return the path.

    Raises ``OSError`` / ``subprocess.CalledProcessError`` when the compiler is missing or fails.
    """
    src = SOURCE.read_bytes()
    cc = _compiler()
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), cc.encode(), platform.machine().encode(),
                                     sys.platform.encode(), _cpu_id().encode()])).hexdigest()[:24]
    dirs = [Path(directory)] if directory else [cache_dir(),
                                                Path(tempfile.gettempdir()) / f"hvd_sparse-native-{os.getuid()}"]
    last = None
    for d in dirs:
        path = d / f"select-{key}.so"
        if path.exists() and not force:
            return path
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".select-", suffix=".so", dir=d)
            os.close(fd)
        except OSError as e:                                  # not writable: try the next directory
            last = e
            continue
        try:
            subprocess.run([cc, *flags, *_COMMON_FLAGS, "-o", tmp, str(SOURCE)], check=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
            os.chmod(tmp, 0o755)
            os.replace(tmp, path)                             # atomic: concurrent builders never clash
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path
    raise last


def load(path):
    """Load a built kernel and declare its signatures (ctypes releases the GIL in every call)."""
    lib = ctypes.CDLL(str(path))
    lib.hvds_abi_version.restype = ctypes.c_int
    if lib.hvds_abi_version() != ABI:
        raise OSError(f"{path}: kernel ABI {lib.hvds_abi_version()} != {ABI}")
    lib.hvds_simd.restype = ctypes.c_char_p
    f = lib.hvds_select_f32
    f.restype = ctypes.c_int64
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    f = lib.hvds_add_f32
    f.restype = ctypes.c_int64
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    f = lib.hvds_merge_add_f32
    f.restype = ctypes.c_int64
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    f = lib.hvds_intersect_i64
    f.restype = ctypes.c_int64
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    f = lib.hvds_add_select_f32
    f.restype = ctypes.c_int64
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                  ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_void_p]
    return lib


def _library():
    """The loaded kernel, or None (disabled, or the build failed: then warn once and keep None)."""
    if not enabled():
        return None
    if _state["tried"]:
        return _state["lib"]
    with _lock:
        if _state["tried"]:
            return _state["lib"]
        errors = []
        for flags in FLAG_SETS:
            try:
                path = build(flags)
                try:
                    lib = load(path)
                except OSError:                               # a damaged cached file: rebuild once
                    lib = load(build(flags, force=True))
                _state.update(lib=lib, path=str(path), flags=" ".join(flags), reason=None)
                break
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", b"") or b""
                errors.append(f"{_compiler()} {' '.join(flags)}: {e} {detail.decode(errors='replace')[-300:]}")
        else:
            _state["reason"] = "; ".join(errors)
            warnings.warn("hvd_sparse: the native selection kernel could not be built, using the generic "
                          f"array path (set CC to a C compiler, or HVD_SPARSE_NATIVE=0 to silence): "
                          f"{_state['reason']}", RuntimeWarning, stacklevel=3)
        _state["tried"] = True
        return _state["lib"]


def available():
    """True when the kernel is enabled and built (builds it on the first call)."""
    return _library() is not None


def default_threads():
    """``HVD_SPARSE_NATIVE_THREADS``, else torch's thread count if torch is loaded, else usable CPUs."""
    env = os.environ.get("HVD_SPARSE_NATIVE_THREADS", "").strip()
    if env:
        try:
            v = int(env)
        except ValueError:
            raise ValueError(f"hvd_sparse: HVD_SPARSE_NATIVE_THREADS must be a positive integer, got {env!r}") \
                from None
        if v < 1:
            raise ValueError(f"hvd_sparse: HVD_SPARSE_NATIVE_THREADS must be a positive integer, got {env!r}")
        return min(v, _MAX_THREADS)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return max(1, min(int(torch.get_num_threads()), _MAX_THREADS))
    try:
        return max(1, min(len(os.sched_getaffinity(0)), _MAX_THREADS))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, min(os.cpu_count() or 1, _MAX_THREADS))


def threads_for(n):
    """Kernel threads for a buffer of ``n`` elements: at most one per ``MIN_PER_THREAD`` elements."""
    return max(1, min(default_threads(), n // MIN_PER_THREAD))


def info():
    """What the kernel is doing in this process (for benchmark reports): enabled, path, flags, simd, threads,
    calls (kernel calls so far), reason (why it is unavailable)."""
    lib = _library()
    return {"enabled": lib is not None, "path": _state["path"], "flags": _state["flags"],
            "simd": lib.hvds_simd().decode() if lib is not None else None,
            "threads": default_threads(), "min_per_thread": MIN_PER_THREAD, "calls": _calls[0],
            "reason": None if lib is not None else ("HVD_SPARSE_NATIVE=0" if not enabled() else _state["reason"])}


def calls():
    """Number of kernel calls so far in this process (benchmarks read it to tell which path ran)."""
    return _calls[0]


# -- backend adaptation ------------------------------------------------------------------------------------
def f32_view(xp, x):
    """A numpy float32 1-D view sharing ``x``'s memory when the kernel can scan ``x``, else None.

    Takes numpy float32 arrays and CPU torch float32 tensors that are 1-D and contiguous; None for
    everything else (CUDA, TensorFlow, other dtypes, strided views) and when the kernel is unavailable.
    """
    return _view(xp, x, np.float32, "float32")


def i64_view(xp, x):
    """As :func:`f32_view`, for int64 arrays (indexes)."""
    return _view(xp, x, np.int64, "int64")


def _view(xp, x, np_dtype, torch_dtype):
    if isinstance(x, np.ndarray):
        ok = x.dtype == np_dtype and x.ndim == 1 and x.flags.c_contiguous and x.dtype.isnative
        return x if ok and _library() is not None else None
    if getattr(xp, "name", None) != "torch":
        return None
    torch = xp.torch
    if (x.dtype != getattr(torch, torch_dtype) or x.dim() != 1 or x.device.type != "cpu" or not x.is_contiguous()
            or x.is_conj() or x.is_neg()):
        return None
    if _library() is None:
        return None
    return x.detach().numpy()


def wrap(xp, a):
    """``a`` (a numpy result of this module) in ``xp``'s array type: a torch tensor sharing it for torch."""
    if getattr(xp, "name", None) == "torch":
        return xp.torch.from_numpy(a)
    return a


# -- the kernel calls ------------------------------------------------------------------------------------
class _Workspace:
    """Per-Python-thread output segments of the kernel threads, reused across calls."""

    def __init__(self):
        self.cap = 0
        self.idx = None
        self.val = None
        self.counts = np.zeros(_MAX_THREADS, np.int64)

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
    lib = _library()
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


def select(view, th, rule, *, base=0, values=False, expect=0, threads=None):
    """Ascending int64 indices (plus ``base``) of the entries ``rule`` selects at ``th``, in one read pass.

    Args:
        view: 1-D contiguous numpy float32 array (see :func:`f32_view`).
        th (float): the threshold, compared in float32 (rounded to nearest).
        rule (str): one of ``RULES``.
        base (int): added to every index (e.g. the start of a slice). Default 0.
        values (bool): also return the selected values (float32), gathered in the same pass. Default False.
        expect (int): expected count, sizes the first workspace (it grows on demand anyway). Default 0.
        threads (int, optional): kernel threads. Default :func:`threads_for`.
    Returns:
        ``(indices, values or None)``: fresh numpy arrays the caller owns.
    """
    lib, n, lo, hi = _prepare(view, th, rule)
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
    lib = _library()
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
            or not 1 <= counts.size <= _MAX_THREADS):
        raise ValueError("hvd_sparse.core.native.merge_add: counts must split idx and val (same size) into 1..256 runs")
    lib = _library()
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
    lib = _library()
    out = np.empty(min(a.size, b.size), np.int64)
    _calls[0] += 1
    m = lib.hvds_intersect_i64(a.ctypes.data, a.size, b.ctypes.data, b.size, out.ctypes.data)
    return None if m < 0 else out[:m]


def _check_i64(x):
    if not (isinstance(x, np.ndarray) and x.dtype == np.int64 and x.ndim == 1 and x.flags.c_contiguous):
        raise TypeError("hvd_sparse.core.native: expected a 1-D contiguous numpy int64 array (see i64_view), "
                        f"got {type(x).__name__} {getattr(x, 'dtype', '')}")
    if _library() is None:
        raise RuntimeError("hvd_sparse.core.native: the kernel is not available (check available() first)")
