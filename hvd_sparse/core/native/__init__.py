"""The fused CPU kernels: a small C file (``kernels.c``), compiled on first use, loaded with ctypes.

Files: ``kernels.c`` (the kernels), ``build.py`` (compile, cache, load, thread count), ``kernels.py`` (the
Python wrappers on numpy arrays and the views of numpy and CPU torch buffers), ``library.py`` (the process's loaded
kernel), this file (what the package offers). The algorithms do not call this package: the numpy and torch array backends do
(:mod:`hvd_sparse.core.xp.kernels`), behind the backend methods ``scan``, ``accumulate_``, ``merge_add``,
``intersect`` and ``members``, and fall back to their generic path when the kernel is not built; so does the
exact top-k of :mod:`hvd_sparse.core.selection` (two passes of ``select``).

What the selection computes: in ONE read pass over a contiguous float32 buffer ``x``, the ascending
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
the bit pattern of +inf and NaNs lie above it; ``select(..., nan=True)`` raises ``hi`` to take every NaN as well
(the exact top-k's candidate pass: it tells whether the buffer holds a NaN without a pass of its own). A NaN
threshold selects nothing under ``gt`` and ``ge``; under ``ge_nonzero`` it acts as ``t <= 0`` (every nonzero), as
the generic ``rule_mask`` (``core/xp/generic.py``) does.

Why a kernel: ``xp.nonzero(xp.abs(acc) >= t)`` costs an |acc| copy, a boolean mask and a compaction:
four passes over n elements plus two n-sized temporaries; ThresholdReuse's guard adds a count pass per
raise. On that path ThresholdReuse's reuse step takes many times one streaming read (``torch.amax``); with the
kernel, about one read (measured with torch, ``python -m hvd_sparse.bench select``: docs/benchmarks.md,
"Sparsifier cost: select").

Design decisions:

* **Compiled on first use**, with ``$CC`` (default ``cc``): ``-O3 -march=native -shared -fPIC -pthread``,
  retried without ``-march=native`` if that fails. The shared object is cached as
  ``$XDG_CACHE_HOME/hvd_sparse/native/<hash>.so`` (default ``~/.cache``; a per-user temp directory if that
  is not writable); the hash covers the source, the flags, the machine and the CPU's feature flags, so
  nodes of a cluster that share a home directory never load a build for another CPU. Each build is
  written to a private temporary file and renamed into place (atomic), so ranks of one ``horovodrun``
  job that start compiling at once do not clash. The C source has no torch or Python headers, so it compiles
  quickly (measured: docs/benchmarks.md, "Measured choices in the code"). AVX2 path when the compiler targets
  AVX2, else SSE2, else portable C.
* **Plain pthreads, created per call**, not OpenMP: torch and TensorFlow each bundle their own OpenMP
  runtime, and a third one in the process invites oversubscription; and no thread pool is left running
  across ``fork()`` (DataLoader workers). Threads: ``HVD_SPARSE_NATIVE_THREADS``, else torch's
  intra-op thread count when torch is loaded, else the CPUs this process may run on; at most one thread
  per 2^20 elements (smaller buffers are scanned by the calling thread). One thread reads nearly as fast as
  ``torch.amax`` with two: the pass is memory-bound (measured: docs/benchmarks.md, "Measured choices in the
  code").
* **Thread-local output, buffers reused across steps**: thread ``t`` of the kernel scans one contiguous
  chunk and writes to its own segment of a workspace that is kept (per Python thread: the simulator runs
  one Python thread per virtual rank) and grown when a segment overflows -- the kernel still counts, the
  call is repeated once with room for the largest segment. A workspace much larger than the last need
  is released. The result is a fresh exact-size array (its segments concatenated in order): callers may
  keep it across steps.
* ctypes releases the GIL during the call.
* **Fallback**: ``HVD_SPARSE_NATIVE=0`` (read at every call), no compiler, or a failed build (one
  ``RuntimeWarning``) -> :func:`f32_view` returns None and callers keep their generic ``xp`` path, with
  identical results (``tests/core/test_native_select.py`` runs both). Only numpy float32 arrays and CPU torch
  float32 tensors, 1-D and contiguous, take the kernel; CUDA and TensorFlow tensors keep the ``xp`` path.

API (``kernels.py``; numpy in, numpy out; :func:`f32_view` / :func:`wrap` convert from / to the caller's backend)::

    view = f32_view(xp, acc)                 # numpy float32 view sharing acc's memory, or None
    idx, vals = select(view, t, "gt", base=0, values=True)   # int64 ascending (+ base), float32 or None
    c = count(view, t, "gt")                 # the same pass without output
    idx = wrap(xp, idx)                      # back to a torch tensor when xp is torch
    bad = add(r, g, out, zero_g=True)        # out = r + g (g zeroed), non-finite count, one pass
    bad, idx, vals = add_select(r, g, out, t, "ge_nonzero", base=0, expect=k)   # ... and select from out
    idx, sums = merge_add(idx64, vals, counts)   # P ascending runs -> distinct indexes, rank-order sums (or None)
    both = intersect(a64, b64)               # sorted intersection of two ascending int64 arrays (or None)
    kept = members(a64, b64, fill)           # a64 with what b64 lacks replaced by fill, in place (or None)
"""

from __future__ import annotations

from .build import (ABI, FLAG_SETS, MIN_PER_THREAD, SOURCE, build, cache_dir, compiler, default_threads, enabled,
                    load, threads_for)
from .kernels import (RULES, add, add_select, bounds, count, f32_view, i64_view, intersect, members, merge_add,
                      select, wrap)
from .library import available, calls, info

__all__ = ["ABI", "FLAG_SETS", "MIN_PER_THREAD", "SOURCE", "RULES", "available", "build", "cache_dir", "calls",
           "count", "default_threads", "enabled", "f32_view", "i64_view", "info", "intersect", "load", "members",
           "merge_add", "select", "add", "add_select", "threads_for", "wrap", "bounds"]
