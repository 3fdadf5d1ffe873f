"""The engine on CUDA tensors (``-m cuda``; skipped without a GPU): every preset on P simulated ranks whose gradients
live on the GPU gives the same bits as the numpy simulator, identical on every rank and from run to run, and half
precision gives the same bits as on the CPU. Through real horovodrun: tests/torch/test_dtypes_horovod.py (its cuda job)."""

import numpy as np
import pytest
import torch

from hvd_sparse.bench import presets
from hvd_sparse.bench.data import SyntheticGradients
from hvd_sparse.testing import simulate

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device (torch.cuda.is_available() is False)")]

P, STEPS, N = 4, 8, 6000
DENSITY = 0.01


@pytest.fixture(scope="module")
def data():
    source = SyntheticGradients(N, P, seed=3)
    grads = np.stack([np.stack([source.grad(t, r) for r in range(P)]) for t in range(STEPS)])
    return grads, [(m,) for m in source.layout]


@pytest.mark.parametrize("preset", presets.names())
def test_every_preset_on_cuda_equals_the_numpy_simulator_bit_for_bit(data, preset):
    grads, shapes = data
    want = simulate(presets.make(preset, DENSITY), grads, shapes=shapes)
    runs = [simulate(presets.make(preset, DENSITY), grads, shapes=shapes, backend="torch", device="cuda")
            for _ in range(2)]
    for got in runs:
        assert got.updates.tobytes() == want.updates.tobytes()
        assert got.residuals.tobytes() == want.residuals.tobytes()
        assert got.selected.tolist() == want.selected.tolist()
    for r in range(1, P):
        assert runs[0].updates[:, r].tobytes() == runs[0].updates[:, 0].tobytes()
    assert np.count_nonzero(want.updates[-1, 0]) > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("preset", presets.names())
def test_half_precision_gradients_on_cuda_equal_the_cpu_run(data, preset, dtype):
    grads, shapes = data
    grads = torch.from_numpy(grads).to(dtype).float().numpy()        # values the half dtype holds
    cpu = simulate(presets.make(preset, DENSITY), grads, shapes=shapes, backend="torch", dtype=dtype)
    gpu = simulate(presets.make(preset, DENSITY), grads, shapes=shapes, backend="torch", device="cuda", dtype=dtype)
    assert gpu.updates.tobytes() == cpu.updates.tobytes()
    assert gpu.residuals.tobytes() == cpu.residuals.tobytes()
    assert np.isfinite(gpu.updates).all() and np.count_nonzero(gpu.updates[-1, 0]) > 0
