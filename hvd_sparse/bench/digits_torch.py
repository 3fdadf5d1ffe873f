"""The digits CNNs in PyTorch and the digits split as torch tensors.

    Net       38,282 parameters, 8x8 input (the demos, ``bench convergence``); the same network in Keras is
              :func:`hvd_sparse.bench.digits_keras.make_model`
    WideNet   the same shape of network, wider, on digits upsampled to ``image_size`` (``bench train``): 4.2M
              parameters at the default 16x16 / 1024 hidden, so that communication matters on a shaped link

The data is :func:`hvd_sparse.bench.digits.load_arrays` (framework-free).
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


class WideNet(nn.Module):
    """conv 3x3 (32) -> conv 3x3 (64) -> max-pool 2 -> dense ``hidden`` -> dense 10 (logits); input
    (N, 1, image_size, image_size), ``image_size`` even. Parameters: 18,816 + 16·image_size²·hidden + 11·hidden
    + 10 (4,224,394 at image_size 16, hidden 1024)."""

    def __init__(self, image_size=16, hidden=1024):
        super().__init__()
        if image_size < 2 or image_size % 2:
            raise ValueError(f"WideNet: image_size must be an even number >= 2, got {image_size}")
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * (image_size // 2) ** 2, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    forward = Net.forward


def load_data(seed=42, image_size=8):
    """Digits split 80/20 with a fixed permutation (identical on every rank); pixels scaled to [0, 1].

    Args:
        seed (int): seed of the permutation.
        image_size (int): 8 (the data as shipped) or larger: bilinear upsampling to image_size x image_size.
    Returns ((x_train, y_train), (x_test, y_test)) as torch tensors: x float32 of shape (N, 1, S, S),
    y int64 (``torch.long``).
    """
    (x_tr, y_tr), (x_te, y_te) = load_arrays(seed, layout="channels_first")
    x_tr, x_te = torch.from_numpy(x_tr), torch.from_numpy(x_te)
    if image_size != 8:
        x_tr, x_te = (F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
                      .contiguous() for x in (x_tr, x_te))
    return (x_tr, torch.from_numpy(y_tr)), (x_te, torch.from_numpy(y_te))
