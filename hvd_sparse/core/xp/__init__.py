"""The array shim: the few array operations the engine needs, for numpy arrays, torch tensors and
TensorFlow tensors.

Every algorithm in ``hvd_sparse.core`` is written once against this module, so the same code runs on
numpy (the simulator), on torch tensors (CPU or CUDA, the PyTorch adapter) and on TensorFlow eager tensors
(the TensorFlow adapter, inside ``tf.py_function``).

Why not only ``array-api-compat``: it does not cover TensorFlow tensors, and what the engine needs beyond
the standard (exact top-k with deterministic ties, scatter-add, in-place masked writes, bit-exact dtype
casts) is most of what it uses. So this is one small table of functions per backend, picked by
:func:`backend_of` from the array type. No framework is imported at load time.

Layout: ``numpy_backend.py``, ``torch_backend.py``, ``tf_backend.py`` (one class per array type; what numpy and
torch spell alike is in ``common.py``); ``generic.py`` (operations written once on the elementary ones, for every
backend: ``scan`` -- counts and selections by a thresholding rule on ``|x|`` --, ``topk``, ``merge_add``,
``add_runs_``, ``intersect``); ``kernels.py`` (the same operations, and ``accumulate_``, on the C kernels of
:mod:`hvd_sparse.core.native` for numpy arrays and CPU torch tensors, with the generic path as fallback).
Algorithms call these methods and never ask which backend they run on.

Conventions (all backends):

* indices are int64 (``index_dtype``), values of the engine are float32 (``float32``);
* functions never modify their arguments unless their name ends in ``_``; those write into ``dst`` where the
  array type allows it and *return the result*, which callers must use: TensorFlow tensors are immutable, so
  there the result is a new tensor (``x = xp.put_(x, idx, 0.0)``);
* ``topk`` (``selection.topk_indices``) is exact and deterministic: largest ``|x|`` first, ties broken by the
  lower index, zeros never selected (rule ``ge_nonzero`` made exact-k: docs/algorithms.md#exact-top-k).
"""

from __future__ import annotations

import numpy as np

from .numpy_backend import NumpyBackend
from .tf_backend import TFBackend
from .torch_backend import TorchBackend

__all__ = ["NumpyBackend", "TorchBackend", "TFBackend", "backend_of"]

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
