"""float32, bfloat16, float16, float64 and mixed-dtype models through real `horovodrun -np 2`, on the CPU (CI) and on CUDA (the GPU
check, ``-m cuda``; skipped without a GPU): they start with ``hvds.broadcast_parameters`` /
``hvds.broadcast_optimizer_state`` (Horovod's own raise for bfloat16) and train with every preset, bit-identical on
every rank and equal to the simulator. One job per device runs every scenario of hvd_workers/dtypes_worker.py."""

import numpy as np
import pytest
import torch

from hvd_sparse.bench import presets
from hvd_sparse.testing import simulate

from horovod_helpers import horovodrun, load_ranks, requires_horovod

pytestmark = [pytest.mark.horovod, requires_horovod]

MODELS = ["float32", "bfloat16", "float16", "float64", "mixed"]
RUNS = presets.names() + ["oktopk.warmup"]
DENSITY = 0.05
NP = 2


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def job(request, tmp_path_factory):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    out = tmp_path_factory.mktemp(f"dtypes_{request.param}")
    horovodrun(NP, "dtypes_worker.py", out, request.param, timeout=600)
    return load_ranks(out, "dtypes", NP)


def _oracle(model, compression, grads, ranks):
    """The simulator's updates for ``grads`` (steps, P, n) of the model dtype ``model``, in ``grads``' dtype (float32,
    or float64 for a float64 model): on gradients of that dtype, or for the mixed model in float32 (which holds every
    value of its layers exactly), each parameter's slice then rounded to its own dtype."""
    r0 = ranks[0]
    shapes = [(int(m),) for m in r0[f"{model}/layout"]]
    if model != "mixed":
        dtype = getattr(torch, model)
        return simulate(compression, grads, shapes=shapes, backend="torch", dtype=dtype).updates.astype(grads.dtype)
    upd = simulate(compression, grads, shapes=shapes, backend="torch").updates
    out, off = upd.copy(), 0
    for (m,), dtype in zip(shapes, r0[f"{model}/piece_dtypes"]):
        piece = torch.from_numpy(np.ascontiguousarray(upd[..., off:off + m]))
        out[..., off:off + m] = piece.to(getattr(torch, str(dtype))).float().numpy()
        off += m
    return out


def _grads(ranks, key):
    return np.stack([r[key] for r in ranks], axis=1)           # (steps, P, n)


def test_broadcast_parameters_carries_the_bits_of_dtypes_horovod_lacks(job):
    r0 = job[0]
    kinds = [k.rsplit(".", 1)[1] for k in r0 if k.startswith("wire.before.")]
    assert sorted(kinds) == ["bfloat16", "bool", "complex128", "complex64", "float8", "int16"]
    for kind in kinds:
        assert r0[f"wire.before.{kind}"].tobytes() != job[1][f"wire.before.{kind}"].tobytes()   # they did differ
        for r in job:
            assert r[f"wire.after.{kind}"].tobytes() == r0[f"wire.before.{kind}"].tobytes(), kind
    # what hvds.broadcast_parameters is for: Horovod 0.28.1's own refuses bfloat16
    assert "BFloat16Tensor is not supported" in str(r0["wire.horovod_error"])


@pytest.mark.parametrize("model", MODELS)
def test_a_model_starts_from_rank_0s_parameters_and_optimizer_state(job, model):
    r0 = job[0]
    assert r0[f"{model}/start.before"].tobytes() != job[1][f"{model}/start.before"].tobytes()   # they did differ
    expected = {"float32": ["torch.float32"], "bfloat16": ["torch.bfloat16"], "float16": ["torch.float16"],
                "float64": ["torch.float64"], "mixed": ["torch.bfloat16", "torch.float16", "torch.float32"]}[model]
    for r in job:
        assert r[f"{model}/start.params"].tobytes() == r0[f"{model}/start.before"].tobytes()
        assert r[f"{model}/start.state"].tobytes() == r0[f"{model}/start.state"].tobytes()
        assert float(r[f"{model}/start.lr"]) == 0.01                     # rank 0's learning rate
        assert r[f"{model}/start.dtypes"].tolist() == expected
    assert np.abs(r0[f"{model}/start.state"]).max() > 0                  # rank 0's Adam state, not fresh zeros


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("model", MODELS)
def test_every_preset_trains_bit_identical_replicas_equal_to_the_simulator(job, model, run):
    grads = _grads(job, f"{model}/{run}.raw")
    assert np.isfinite(grads).all() and np.abs(grads).max() > 0
    preset, options = (run.split(".")[0], {"warmup_dense_steps": 2}) if "." in run else (run, {})
    want = _oracle(model, presets.make(preset, DENSITY, **options), grads, job)
    for r, rank in enumerate(job):
        assert rank[f"{model}/{run}.params"].tobytes() == job[0][f"{model}/{run}.params"].tobytes()
        assert rank[f"{model}/{run}.red"].tobytes() == want[:, r].tobytes(), f"rank {r} differs from the simulator"


@pytest.mark.parametrize("model", MODELS)
def test_horovods_own_optimizer_with_a_preset(job, model):
    want = _oracle(model, presets.make("topka", DENSITY), _grads(job, f"{model}/horovod.raw"), job)
    for r, rank in enumerate(job):
        assert rank[f"{model}/horovod.params"].tobytes() == job[0][f"{model}/horovod.params"].tobytes()
        assert rank[f"{model}/horovod.red"].tobytes() == want[:, r].tobytes()


@pytest.mark.parametrize("model", MODELS)
def test_sparse_allreduce_guard_stats_and_checkpoint(job, model):
    first = "bfloat16" if model == "mixed" else model
    ins = _grads(job, f"{model}/op.ins")
    want = simulate(presets.make("topka", 0.1), ins, backend="torch", dtype=getattr(torch, first)).updates
    want = want.astype(ins.dtype)
    for r, rank in enumerate(job):
        assert rank[f"{model}/op.outs"].tobytes() == want[:, r].tobytes()
        stats = rank[f"{model}/guard.stats"]
        assert stats.tobytes() == job[0][f"{model}/guard.stats"].tobytes() and np.isfinite(stats).all()
        assert stats[0] > 0 and stats[2] > 0                            # density, received bytes
        assert rank[f"{model}/resume.resumed"].tobytes() == rank[f"{model}/resume.straight"].tobytes()
