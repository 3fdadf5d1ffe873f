"""The torch backend's indexing (hvd_sparse/core/xp/torch_backend.py): its fast paths (``index_select``,
``index_fill_``/``index_copy_``, numpy's nonzero for CPU masks) give what advanced indexing gives, and every other
kind of index takes the general path."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_sparse.core.xp import backend_of  # noqa: E402
from hvd_sparse.core.xp.torch_backend import TorchBackend  # noqa: E402

RNG = np.random.default_rng(3)
X1 = torch.from_numpy(RNG.standard_normal(1000).astype(np.float32))
X2 = X1.reshape(100, 10)
IDX = torch.from_numpy(np.sort(RNG.choice(1000, 120, replace=False)))


@pytest.mark.parametrize("x, idx", [
    (X1, IDX), (X1, IDX.to(torch.int32)), (X1, IDX.flip(0)), (X1, X1 > 0), (X1, IDX[:0]),
    (X2, IDX[:5] // 10), (X2, torch.tensor(3)),
])
def test_take_equals_advanced_indexing(x, idx):
    got = backend_of(x).take(x, idx)
    assert got.dtype == x.dtype and torch.equal(got, x[idx])


@pytest.mark.parametrize("idx", [IDX, IDX.to(torch.int32), X1 > 0.5])
@pytest.mark.parametrize("value", ["scalar", "same dtype", "0-d tensor"])
def test_put_equals_advanced_assignment(idx, value):
    m = int(idx.sum()) if idx.dtype == torch.bool else idx.numel()
    v = {"scalar": 0.0, "same dtype": torch.arange(m, dtype=torch.float32),
         "0-d tensor": torch.tensor(2.5)}[value]
    want, got = X1.clone(), X1.clone()
    want[idx] = v
    out = backend_of(got).put_(got, idx, v)
    assert out is got and torch.equal(got, want)


def test_put_of_another_dtype_raises_as_advanced_assignment_does():
    with pytest.raises(RuntimeError, match="dtype"):
        backend_of(X1).put_(X1.clone(), IDX, torch.ones(IDX.numel(), dtype=torch.float64))


@pytest.mark.parametrize("device_path", [False, True])
def test_nonzero_is_ascending_int64_on_both_paths(device_path, monkeypatch):
    if device_path:          # CUDA tensors have no numpy view: torch.nonzero
        monkeypatch.setattr(TorchBackend, "host", staticmethod(lambda x: None))
    for mask in (X1 > 0.3, torch.zeros(7, dtype=torch.bool), torch.ones(5, dtype=torch.bool)):
        got = backend_of(mask).nonzero(mask)
        assert got.dtype == torch.int64
        assert torch.equal(got, torch.nonzero(mask).reshape(-1))
