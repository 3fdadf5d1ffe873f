"""The process's kernel: built and loaded once, on first use (:func:`loaded`), and how many kernel calls ran."""

from __future__ import annotations

import subprocess
import threading
import warnings

from .build import FLAG_SETS, MIN_PER_THREAD, build, compiler, default_threads, enabled, load

_lock = threading.Lock()
#: the process's kernel: loaded once (``tried``), or the reason it is not
_state = {"lib": None, "tried": False, "path": None, "flags": None, "reason": None}
#: kernel calls so far in this process
_calls = [0]


def loaded():
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
                errors.append(f"{compiler()} {' '.join(flags)}: {e} {detail.decode(errors='replace')[-300:]}")
        else:
            _state["reason"] = "; ".join(errors)
            warnings.warn("hvd_sparse: the native selection kernel could not be built, using the generic "
                          f"array path (set CC to a C compiler, or HVD_SPARSE_NATIVE=0 to silence): "
                          f"{_state['reason']}", RuntimeWarning, stacklevel=3)
        _state["tried"] = True
        return _state["lib"]


def available():
    """True when the kernel is enabled and built (builds it on the first call)."""
    return loaded() is not None


def info():
    """What the kernel is doing in this process (for benchmark reports): enabled, path, flags, simd, threads,
    calls (kernel calls so far), reason (why it is unavailable)."""
    lib = loaded()
    return {"enabled": lib is not None, "path": _state["path"], "flags": _state["flags"],
            "simd": lib.hvds_simd().decode() if lib is not None else None,
            "threads": default_threads(), "min_per_thread": MIN_PER_THREAD, "calls": _calls[0],
            "reason": None if lib is not None else ("HVD_SPARSE_NATIVE=0" if not enabled() else _state["reason"])}


def calls():
    """Number of kernel calls so far in this process (benchmarks read it to tell which path ran)."""
    return _calls[0]
