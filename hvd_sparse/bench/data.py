"""Gradient sources for the benchmarks: synthetic gradient-like data and gradients recorded from the digits CNN.

Both are deterministic functions of (seed, step, rank), so every algorithm of one benchmark run sees exactly
the same gradients, and a run can be repeated bit for bit.

Synthetic (``SyntheticGradients``): real gradients are (a) heavy-tailed in magnitude, (b) clustered by layer
(each layer has its own scale, spanning orders of magnitude), (c) correlated across workers (they all compute
the gradient of the same loss at the same weights: the large coordinates are mostly the same everywhere,
which is what makes Ok-Topk's averaged region boundaries work) and (d) slowly drifting from step to step.
The model here:

    g[t, r, j] = s_l(j) * ( c[t, j] + noise * e[t, r, j] )   (e: a pooled N(0,1) vector, rotated per t, r)
    c[t]       = rho * c[t-1] + sqrt(1 - rho^2) * h        (AR(1) drift of the shared component)
    s_l        = exp(U(-4, 0))   per layer, layer sizes geometric (a few big layers, many small ones)
    h, c[0]    ~ Student-t with 3 degrees of freedom (heavy tails);  e ~ N(0, 1) per worker

Recorded (``RecordedGradients``): per-worker gradients of the digits CNN of ``examples/pytorch_digits.py``,
trained in one process with a dense average of the workers' gradients (what Horovod would do); n is the
model's size (38,282).
"""

from __future__ import annotations

import threading

import numpy as np


def layer_sizes(n, layers, seed=0):
    """Split n into ``layers`` sizes with geometric weights (largest first), each >= 1."""
    layers = max(1, min(layers, n))
    w = 0.6 ** np.arange(layers)
    sizes = np.maximum(1, np.floor(w / w.sum() * n)).astype(np.int64)
    sizes[0] += n - sizes.sum()
    return [int(s) for s in sizes]


class SyntheticGradients:
    """Gradient-like float32 data, see the module docstring. ``grad(t, r)`` is deterministic."""

    def __init__(self, n, workers, seed=0, layers=16, rho=0.99, noise=1.0):
        self.n, self.workers, self.seed, self.rho, self.noise = int(n), int(workers), seed, rho, noise
        rng = np.random.default_rng(seed)
        self.layout = layer_sizes(self.n, layers)
        self.scale = np.repeat(np.exp(rng.uniform(-4, 0, len(self.layout))), self.layout).astype(np.float32)
        self._common = {}
        self._lock = threading.Lock()
        self._noise_pool = [np.random.default_rng([seed, 3, i]).standard_normal(self.n, dtype=np.float32)
                            for i in range(8)]

    def common(self, t):
        """The shared component c[t] (computed once per step, whichever worker asks first)."""
        with self._lock:
            if t not in self._common:
                if t == 0:
                    c = np.random.default_rng([self.seed, 0]).standard_t(3, self.n).astype(np.float32)
                else:
                    prev = self._common.get(t - 1)
                    if prev is None:
                        prev = self._common_uncached(t - 1)
                    h = np.random.default_rng([self.seed, 1, t]).standard_t(3, self.n).astype(np.float32)
                    c = (self.rho * prev + np.sqrt(1 - self.rho ** 2) * h).astype(np.float32)
                self._common = {k: v for k, v in self._common.items() if k >= t - 1}
                self._common[t] = c
            return self._common[t]

    def _common_uncached(self, t):
        c = np.random.default_rng([self.seed, 0]).standard_t(3, self.n).astype(np.float32)
        for s in range(1, t + 1):
            h = np.random.default_rng([self.seed, 1, s]).standard_t(3, self.n).astype(np.float32)
            c = (self.rho * c + np.sqrt(1 - self.rho ** 2) * h).astype(np.float32)
        return c

    def grad(self, t, r):
        # worker noise: one of a small pool of N(0,1) vectors, rotated by a (t, r)-dependent offset --
        # independent-looking per worker and step at the cost of a copy (drawing n normals per worker and
        # step would dominate a P = 256 run)
        h = np.random.default_rng([self.seed, 2, t, r]).integers(0, 2**62)
        e = np.roll(self._noise_pool[h % len(self._noise_pool)], int(h // 7) % self.n)
        return self.scale * (self.common(t) + np.float32(self.noise) * e)


class RecordedGradients:
    """Per-worker gradients of the digits CNN, recorded once for ``steps`` steps of dense data-parallel SGD."""

    def __init__(self, workers, steps, seed=0, batch_size=16, lr=0.05):
        import torch
        import torch.nn.functional as F

        from .digits import Net, load_data

        torch.manual_seed(seed)
        (x, y), _ = load_data(seed)
        model = Net()
        params = [p for _, p in sorted(model.named_parameters())]
        self.layout = [p.numel() for p in params]
        self.n = sum(self.layout)
        self.workers = workers
        g = torch.Generator().manual_seed(seed)
        self._grads = np.zeros((steps, workers, self.n), np.float32)
        for t in range(steps):
            mean = None
            for r in range(workers):
                idx = torch.randint(0, len(x), (batch_size,), generator=g)
                model.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                self._grads[t, r] = flat.numpy()
                mean = flat.clone() if mean is None else mean + flat
            with torch.no_grad():
                off = 0
                for p in params:
                    p -= lr * (mean[off:off + p.numel()] / workers).view(p.shape)
                    off += p.numel()

    def grad(self, t, r):
        return self._grads[t, r]
