"""The MNIST-1D task in PyTorch: :class:`WideNet1D` and the data of :func:`hvd_sparse.bench.mnist1d.load_arrays` as
torch tensors (``bench train --task mnist1d``)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mnist1d import LENGTH, NUM_CLASSES, load_arrays


class WideNet1D(nn.Module):
    """conv1d 5 (32) -> conv1d 5 (64) -> max-pool 2 -> conv1d 3 (128) -> dense ``hidden`` -> dense 10 (logits), ReLU
    after every layer but the last; input (N, 1, 40). Parameters: 35,210 + 2,571·hidden (2,667,914 at the default
    hidden 1024), nearly all in the first dense layer, so that communication matters on a shaped link.
    docs/benchmarks.md ("Time to accuracy of real training") has the test accuracy it reaches after a few epochs
    when trained in one process."""

    def __init__(self, hidden=1024):
        super().__init__()
        if hidden < 1:
            raise ValueError(f"WideNet1D: hidden must be >= 1, got {hidden}")
        self.conv1 = nn.Conv1d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv1d(32, 64, 5, padding=2)
        self.conv3 = nn.Conv1d(64, 128, 3, padding=1)
        self.fc1 = nn.Linear(128 * (LENGTH // 2), hidden)
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x):
        x = F.max_pool1d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.conv3(x))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data(seed=42, train_samples=20_000, test_samples=10_000):
    """MNIST-1D generated from ``seed`` (:func:`hvd_sparse.bench.mnist1d.load_arrays`, identical on every rank).

    Returns ((x_train, y_train), (x_test, y_test)) as torch tensors: x float32 of shape (N, 1, 40), y int64
    (``torch.long``).
    """
    x_tr, y_tr, x_te, y_te = load_arrays(seed, train_samples, test_samples)
    return ((torch.from_numpy(x_tr[:, None]).contiguous(), torch.from_numpy(y_tr)),
            (torch.from_numpy(x_te[:, None]).contiguous(), torch.from_numpy(y_te)))
