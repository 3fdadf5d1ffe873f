"""The digits task shared by the demos, the benchmarks and the tests: scikit-learn's digits (1,797 8x8 grey
images, 10 classes, shipped with the package: nothing is downloaded), split 80/20 by a fixed permutation.

This module imports no framework (numpy and scikit-learn only), so a TensorFlow job does not load PyTorch and
vice versa. The model lives next to it, once per framework, with the same layers and the same 38,282 parameters:

    hvd_sparse.bench.digits_torch   Net (torch.nn.Module, channels first) and load_data() as torch tensors
    hvd_sparse.bench.digits_keras   make_model(keras) (channels last), for tf.keras = Keras 3 or tf_keras

    conv 3x3, 16 ch, ReLU -> conv 3x3, 32 ch, ReLU -> max-pool 2 -> dense 64, ReLU -> dense 10 (logits)

The framework modules import this one, never the other way: ``Net`` and ``load_data`` come from
``hvd_sparse.bench.digits_torch``, ``make_model`` from ``hvd_sparse.bench.digits_keras``.
"""

from __future__ import annotations

import numpy as np

NUM_CLASSES = 10
_LAYOUTS = ("channels_first", "channels_last")


def load_arrays(seed=42, layout="channels_first"):
    """Digits split 80/20 with a fixed permutation of ``seed`` (identical on every rank); pixels in [0, 1].

    Args:
        seed (int): seed of the permutation. Default: 42.
        layout (str): ``"channels_first"`` (x of shape (N, 1, 8, 8), PyTorch) or ``"channels_last"``
            ((N, 8, 8, 1), Keras). Default: ``"channels_first"``.
    Returns:
        ((x_train, y_train), (x_test, y_test)): C-contiguous numpy arrays, x float32, y int64;
        1,437 training and 360 test images.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"hvd_sparse.bench.digits.load_arrays: layout must be one of {', '.join(_LAYOUTS)}, "
                         f"got {layout!r}")
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(seed).permutation(len(x))
    shape = (-1, 1, 8, 8) if layout == "channels_first" else (-1, 8, 8, 1)
    x = np.ascontiguousarray((x[perm] / 16.0).astype(np.float32).reshape(shape))
    y = np.ascontiguousarray(y[perm].astype(np.int64))
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])
