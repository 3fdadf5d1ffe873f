import numpy as np
import pytest


def int_grads(steps, P, n, seed=0, scale=2**12, zero_ranks=()):
    """Integer-valued float32 gradients (steps, P, n): every sum is exact in float32 (|values| <= 2^20)."""
    rng = np.random.default_rng(seed)
    g = rng.integers(-scale, scale + 1, size=(steps, P, n)).astype(np.float32)
    for r in zero_ranks:
        g[:, r, :] = 0
    return g


def ref_topk(x, k):
    """Independent reference: min(k, nnz) largest |x|, ties by lower index, as a boolean mask."""
    order = np.lexsort((np.arange(x.size), -np.abs(x)))
    chosen = [i for i in order[:k] if x[i] != 0]
    mask = np.zeros(x.size, dtype=bool)
    mask[chosen] = True
    return mask


@pytest.fixture
def int_grads_fn():
    return int_grads


def mean_density_ratio(compression, data, steps, partitioned=False):
    """Run ``compression`` on ``data.grad(t, r)`` (a benchmark gradient source) for ``steps`` steps on its
    P virtual ranks; returns the achieved density over the target, averaged over steps (and ranks, or summed
    over ranks for partitioned sparsifiers such as ExDyna)."""
    from hvd_sparse.testing import simulate

    sel = simulate(compression, data.grad, steps=steps, size=data.workers, record=("selected",)).selected
    per_step = sel.sum(axis=1) if partitioned else sel.mean(axis=1)
    return per_step.mean() / int(0.01 * data.n)
