"""Build, cache and load the C kernels (``kernels.c``), and the kernel thread count.

``build`` compiles the source with the system C compiler into a per-machine cache, ``load`` opens the shared
object with ctypes and declares its signatures; the package (:mod:`hvd_sparse.core.native`) builds and loads
once per process on first use. Design: the package docstring.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

#: elements per kernel thread at least (smaller chunks do not pay for a thread start)
MIN_PER_THREAD = 1 << 20
#: kernel ABI expected from kernels.c
ABI = 6
#: compiler flag sets tried in order
FLAG_SETS = (("-O3", "-march=native"), ("-O3",))
COMMON_FLAGS = ("-shared", "-fPIC", "-pthread")
#: the most kernel threads (and merge runs) one call takes
MAX_THREADS = 256

SOURCE = Path(__file__).with_name("kernels.c")


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


def compiler():
    """``$CC``, default ``cc``."""
    return os.environ.get("CC") or "cc"


def build(flags, directory=None, force=False):
    """Compile ``kernels.c`` with ``flags`` (plus ``-shared -fPIC -pthread``) into the cache; return the path.

    The file is ``kernels-<key>.so``, the key a hash of the source, the flags, the compiler, the machine and the
    CPU's feature flags. Raises ``OSError`` / ``subprocess.CalledProcessError`` when the compiler is missing or
    fails.
    """
    src = SOURCE.read_bytes()
    cc = compiler()
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), cc.encode(), platform.machine().encode(),
                                     sys.platform.encode(), _cpu_id().encode()])).hexdigest()[:24]
    dirs = [Path(directory)] if directory else [cache_dir(),
                                                Path(tempfile.gettempdir()) / f"hvd_sparse-native-{os.getuid()}"]
    last = None
    for d in dirs:
        path = d / f"kernels-{key}.so"
        if path.exists() and not force:
            return path
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=d)
            os.close(fd)
        except OSError as e:                                  # not writable: try the next directory
            last = e
            continue
        try:
            subprocess.run([cc, *flags, *COMMON_FLAGS, "-o", tmp, str(SOURCE)], check=True,
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
    f = lib.hvds_members_i64
    f.restype = ctypes.c_int64
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    f = lib.hvds_add_select_f32
    f.restype = ctypes.c_int64
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                  ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_void_p]
    return lib


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
        return min(v, MAX_THREADS)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return max(1, min(int(torch.get_num_threads()), MAX_THREADS))
    try:
        return max(1, min(len(os.sched_getaffinity(0)), MAX_THREADS))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, min(os.cpu_count() or 1, MAX_THREADS))


def threads_for(n):
    """Kernel threads for a buffer of ``n`` elements: at most one per ``MIN_PER_THREAD`` elements."""
    return max(1, min(default_threads(), n // MIN_PER_THREAD))
