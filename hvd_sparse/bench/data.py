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

Recorded, larger (``MLPGradients``, ``--data recorded-mlp``): minibatch gradients of a 64-512-512-10 ReLU MLP
(n = 301,066, 7.9x the CNN) on the digits, taken along one real training run (SGD, lr 0.1, batch 128 drawn per
step). Rank r's gradient at step t is the gradient of its own 16-sample batch at the run's weights of step t. The
gradients are regenerated, not stored: a file of them would weigh steps x P x n x 4 bytes (120 MB for 100 steps
at P = 1) while this is a deterministic function of (seed, t, r) in numpy (bit for bit the same on every run of
the same numpy build), computed on demand. The training run is the dense one and does not depend on P or on the
method measured: it is the data a sparse method sees, as a recording is; its volume still depends on that method
through its own error feedback, which the benchmark runs for real.
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

        from .digits_torch import Net, load_data

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


class MLPGradients:
    """Minibatch gradients of a 64-512-512-10 MLP along one training run on the digits (module docstring).

    ``grad(t, r)`` is deterministic in (seed, t, r) and safe to call from many threads; the run's weights are
    kept for the two latest steps asked for (the virtual ranks of the simulator move in lock step)."""

    SIZES = (64, 512, 512, 10)

    def __init__(self, workers, seed=0, batch_size=16, lr=0.1, train_batch=128):
        from .digits import load_arrays

        (x, y), _ = load_arrays(seed=42)
        self.x = np.asarray(x, np.float32).reshape(len(x), -1)
        self.y = np.asarray(y, np.int64).reshape(-1)
        self.workers, self.seed, self.batch_size, self.lr, self.train_batch = workers, seed, batch_size, lr, \
            train_batch
        rng = np.random.default_rng([seed, 10])
        w = []
        for fan_in, fan_out in zip(self.SIZES[:-1], self.SIZES[1:]):
            bound = np.sqrt(6.0 / fan_in)                      # He-uniform (ReLU)
            w += [rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32),
                  np.zeros(fan_out, np.float32)]
        self.layout = [a.size for a in w]
        self.n = sum(self.layout)
        self._weights = {0: w}
        self._lock = threading.Lock()

    def _grad_at(self, w, idx):
        """Flat gradient of the mean cross-entropy of samples ``idx`` at weights ``w`` (float32)."""
        x, y = self.x[idx], self.y[idx]
        acts, h = [x], x
        for j in range(0, len(w) - 2, 2):
            h = np.maximum(h @ w[j] + w[j + 1], 0.0)
            acts.append(h)
        z = h @ w[-2] + w[-1]
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        d = p / len(y)                                          # dL/dz
        grads = []
        for j in range(len(w) - 2, -1, -2):
            a = acts[j // 2]
            grads = [a.T @ d, d.sum(axis=0)] + grads
            if j:
                d = (d @ w[j].T) * (acts[j // 2] > 0)
        return np.concatenate([g.astype(np.float32).reshape(-1) for g in grads])

    def weights(self, t):
        """The training run's weights at step t."""
        with self._lock:
            if t not in self._weights:
                last = max(s for s in self._weights if s < t) if any(s < t for s in self._weights) else None
                if last is None:                                # older than what is kept: run from the start
                    self._weights = {0: self.__class__(self.workers, self.seed)._weights[0]}
                    last = 0
                w = self._weights[last]
                for s in range(last, t):
                    idx = np.random.default_rng([self.seed, 11, s]).integers(0, len(self.y), self.train_batch)
                    g = self._grad_at(w, idx)
                    off, nw = 0, []
                    for a in w:
                        nw.append((a - np.float32(self.lr) * g[off:off + a.size].reshape(a.shape)).astype(np.float32))
                        off += a.size
                    w = nw
                self._weights = {s: v for s, v in self._weights.items() if s >= t - 1}
                self._weights[t] = w
            return self._weights[t]

    def grad(self, t, r):
        idx = np.random.default_rng([self.seed, 12, t, r]).integers(0, len(self.y), self.batch_size)
        return self._grad_at(self.weights(t), idx)
