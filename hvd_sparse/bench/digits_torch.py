"""The digits CNN in PyTorch (38,282 parameters) and the digits split as torch tensors.

The data is :func:`hvd_sparse.bench.digits.load_arrays` (framework-free); the same network in Keras is
:func:`hvd_sparse.bench.digits_keras.make_model`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from .digits import load_arrays


class Net(nn.Module):
    """conv 3x3 (16) -> conv 3x3 (32) -> max-pool 2 -> dense 64 -> dense 10 (logits); input (N, 1, 8, 8)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data(seed=42):
    """Digits split 80/20 with a fixed permutation (identical on every rank); pixels scaled to [0, 1].

    Returns ((x_train, y_train), (x_test, y_test)) as torch tensors: x float32 of shape (N, 1, 8, 8),
    y int64 (``torch.long``).
    """
    (x_tr, y_tr), (x_te, y_te) = load_arrays(seed, layout="channels_first")
    return ((torch.from_numpy(x_tr), torch.from_numpy(y_tr)),
            (torch.from_numpy(x_te), torch.from_numpy(y_te)))
