"""The digits task shared by the demo, the benchmarks and the tests: scikit-learn's digits (1,797 8x8 grey
images, 10 classes, shipped with the package: nothing is downloaded) and a small CNN (38,282 parameters)."""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
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

    Returns ((x_train, y_train), (x_test, y_test)) as torch tensors, x of shape (N, 1, 8, 8).
    """
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(seed).permutation(len(x))
    x = torch.tensor(x[perm] / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(y[perm], dtype=torch.long)
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])
