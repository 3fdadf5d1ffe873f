"""The MNIST-1D task of ``bench train``: the ``mnist1d`` package's ten 1D digit templates, padded, dilated, scaled,
translated, noised and sheared into sequences of 40 values (10 classes), generated from a seed (nothing is
downloaded). Harder than scikit-learn's digits (docs/benchmarks.md quotes the test accuracy an MLP and a small CNN
reach on it).

This module imports no framework (numpy and the ``mnist1d`` package only); the PyTorch model and the tensors are in
:mod:`hvd_sparse.bench.mnist1d_torch`.
"""

from __future__ import annotations

import math
import random

import numpy as np

NUM_CLASSES = 10
#: length of every sequence
LENGTH = 40


def load_arrays(seed=42, train_samples=20_000, test_samples=10_000):
    """MNIST-1D generated from ``seed``: the same arrays for the same arguments, on every rank and every run.

    ``mnist1d.data.make_dataset`` generates ``num_samples // 10`` sequences per class and shuffles them; this asks it
    for ``train_samples + test_samples`` rounded up to a multiple of 10 and keeps the first ``train_samples`` for
    training and the next ``test_samples`` for test. Both are standardized with the training set's mean and standard
    deviation (one scalar each). The global ``random`` and ``numpy.random`` states, which ``make_dataset`` seeds,
    are restored afterwards.

    Args:
        seed (int): seed of the generator. Default: 42.
        train_samples (int): training sequences, >= 1. Default: 20,000.
        test_samples (int): test sequences, >= 1. Default: 10,000.
    Returns:
        (x_train, y_train, x_test, y_test): C-contiguous numpy arrays, x float32 of shape (N, 40), y int64 in 0..9.
    """
    if train_samples < 1 or test_samples < 1:
        raise ValueError(f"hvd_sparse.bench.mnist1d.load_arrays: train_samples and test_samples must be >= 1, got "
                         f"{train_samples} and {test_samples}")
    from mnist1d.data import get_dataset_args, make_dataset

    total = NUM_CLASSES * math.ceil((train_samples + test_samples) / NUM_CLASSES)
    args = get_dataset_args()
    args.num_samples, args.train_split, args.seed = total, train_samples / total, int(seed)
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    x = np.concatenate([data["x"], data["x_test"]])
    y = np.concatenate([data["y"], data["y_test"]])
    if len(x) != total or x.shape[1] != LENGTH:
        raise RuntimeError(f"hvd_sparse.bench.mnist1d.load_arrays: mnist1d generated {x.shape}, expected "
                           f"({total}, {LENGTH})")
    x_tr, x_te = x[:train_samples], x[train_samples:train_samples + test_samples]
    mean, std = x_tr.mean(), x_tr.std()
    x_tr, x_te = ((v - mean) / (std if std > 0 else 1.0) for v in (x_tr, x_te))
    y_tr, y_te = y[:train_samples], y[train_samples:train_samples + test_samples]
    return tuple(np.ascontiguousarray(a, dtype=t) for a, t in ((x_tr, np.float32), (y_tr, np.int64),
                                                             (x_te, np.float32), (y_te, np.int64)))
