"""The TensorFlow backend of the array shim: every preset's engine on TensorFlow eager tensors equals the numpy
engine bit for bit (updates, residuals, volume, selections), at P = 1..4, in one process (no Horovod).

The simulator is the oracle of every Horovod run; with ``backend="tensorflow"`` its virtual ranks run the very
code a TensorFlow rank runs (``tf.py_function`` hands the engine an EagerTensor), so these tests pin that the
TensorFlow path computes what the numpy path computes."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")

import hvd_sparse  # noqa: E402
from hvd_sparse import Compression  # noqa: E402
from hvd_sparse.bench import presets  # noqa: E402
from hvd_sparse.core.oktopk import OKTOPK_PRESETS, OkTopk, ThresholdReuse  # noqa: E402
from hvd_sparse.core.sparsifiers import GaussianK, TopK  # noqa: E402
from hvd_sparse.core.sim import SimulatedWorld  # noqa: E402
from hvd_sparse.core.selection import topk_indices  # noqa: E402
from hvd_sparse.core.xp import TFBackend, backend_of  # noqa: E402
from hvd_sparse.core.reducers import SparDL  # noqa: E402
from hvd_sparse.compression import SparseCompression  # noqa: E402
from hvd_sparse.testing import simulate  # noqa: E402

from oracles import int_grads  # noqa: E402

SHAPES = [(12, 20), (20,), (20, 14), (128,)]            # n = 668, several tensors (DCT is per tensor)
N = sum(int(np.prod(s)) for s in SHAPES)


def grads(steps, P, seed):
    """Heavy-tailed float gradients with exact zeros and repeated magnitudes (ties), (steps, P, N)."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal((steps, P, N)) * rng.lognormal(0, 1.5, size=N)).astype(np.float32)
    g[:, :, 200:230] = 0.0                                        # zeros are never selected
    g[:, :, 300:340] = np.float32(0.75) * np.sign(g[:, :, 300:340])  # ties at one magnitude
    return g


def assert_same(a, b, where):
    assert a.updates.tobytes() == b.updates.tobytes(), f"{where}: updates differ"
    assert a.residuals.tobytes() == b.residuals.tobytes(), f"{where}: residuals differ"
    assert np.array_equal(a.selected, b.selected), f"{where}: selections differ"
    assert a.volume == b.volume, f"{where}: volume differs"
    assert a.phases == b.phases, f"{where}: per-phase counters differ"


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("preset", presets.names())
def test_every_preset_on_tensorflow_equals_numpy_bit_for_bit(preset, P):
    g = grads(5, P, seed=P)
    a = simulate(presets.make(preset, 0.05), g, shapes=SHAPES)
    b = simulate(presets.make(preset, 0.05), g, shapes=SHAPES, backend="tensorflow")
    assert_same(a, b, f"{preset} P={P}")
    assert np.abs(a.updates).sum() > 0                            # something was exchanged


@pytest.mark.parametrize("name, make, P", [
    # branches the presets at density 0.05 do not reach
    ("topk_dsa dense switch", lambda: Compression.topk_dsa(0.4), 3),
    ("oktopk paper, uncut gather, tau'=2", lambda: SparseCompression(
        dataclasses.replace(OKTOPK_PRESETS["paper"].sparsifier, density=0.05, threshold_period=2),
        dataclasses.replace(OKTOPK_PRESETS["paper"].reducer, threshold_period=2, repartition_period=3,
                            gather_capacity=None)), 4),
    ("oktopk gt + hard cap", lambda: SparseCompression(
        ThresholdReuse(0.05, 2, select_rule="gt", max_select_ratio=1.5),
        OkTopk(2, 2, select_rule="gt", max_select_ratio=1.5)), 3),
    ("gtopk fold-in (P=3)", lambda: Compression.gtopk(0.1), 3),
    ("spardl 2 teams, bruck", lambda: Compression.spardl(0.05, groups=2), 4),
    ("spardl recursive eager", lambda: SparseCompression(
        TopK(0.05), SparDL(2, sag="recursive", selection="eager", pack="two")), 4),
    ("gaussiank vgg", lambda: SparseCompression(GaussianK(0.05, adjust="vgg"), hvd_sparse.core.reducers.TopkA()),
     3),
    ("density 1 equals dense", lambda: Compression.topka(1.0), 2),
])
def test_other_configurations_on_tensorflow_equal_numpy(name, make, P):
    g = grads(6, P, seed=11)
    assert_same(simulate(make(), g, shapes=SHAPES), simulate(make(), g, shapes=SHAPES, backend="tensorflow"), name)


def test_integer_gradients_mass_conservation_on_tensorflow():
    """Mass conservation on the TensorFlow path itself: P·Σ updates + Σ residuals == Σ grads (exact on integers)."""
    g = int_grads(6, 3, N, seed=5, scale=64)
    res = simulate(Compression.oktopk(0.05), g, backend="tensorflow", average=False)
    assert np.array_equal(res.updates.sum(axis=0)[0] + res.residuals[-1].sum(axis=0), g.sum(axis=(0, 1)))


def test_state_dict_round_trip_continues_bit_for_bit_on_tensorflow():
    """A numpy state (what a checkpoint holds) loaded into a fresh engine continues on TF tensors exactly as an
    uninterrupted engine: the first step moves the restored residual to the TensorFlow backend."""
    P = 2
    g = grads(8, P, seed=3)
    world = SimulatedWorld(P)
    comms = world.communicators()
    comp = Compression.oktopk(0.05, threshold_period=3)
    straight = [comp.new_engine(c) for c in comms]
    resumed = [comp.new_engine(c) for c in comms]
    out = {}

    def body(comm):
        r = comm.rank
        a, b = straight[r], resumed[r]
        for t in range(8):
            ua = a.step(tf.constant(g[t, r]))
            if t < 4:
                b.step(tf.constant(g[t, r]))
                if t == 3:                                            # "checkpoint" and fresh engine
                    state = b.state_dict()
                    assert isinstance(state["residual"], np.ndarray)
                    b = comp.new_engine(comm)
                    b.load_state_dict(state)
            else:
                ub = b.step(tf.constant(g[t, r]))
                assert ua.numpy().tobytes() == ub.numpy().tobytes(), f"rank {r} step {t}"
                assert isinstance(b.memory.residual, tf.Tensor)
        out[r] = a.memory.residual.numpy()

    world.run(body, comms)
    assert any(np.abs(v).sum() > 0 for v in out.values())


# -- the shim's functions against the numpy backend -------------------------------------------------------
def test_backend_of_imports_tensorflow_only_for_tensorflow_arrays():
    code = ("import sys, numpy as np\nfrom hvd_sparse.core.xp import backend_of\n"
            "assert backend_of(np.zeros(3)).name == 'numpy'\nassert 'tensorflow' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert backend_of(tf.zeros(3)).name == "tensorflow" and isinstance(backend_of(tf.zeros(3)), TFBackend)
    with pytest.raises(TypeError, match="TensorFlow tensor"):
        backend_of([1.0, 2.0])


def test_topk_indices_exact_with_ties_and_zeros():
    x = np.array([0, 3, -3, 1, 3, 0, -2, 3, 0.5], np.float32)
    xp = backend_of(tf.constant(x))
    npx = backend_of(x)
    for k in range(1, 11):
        ti, tth = topk_indices(xp, tf.constant(x), k)
        ni, nth = topk_indices(npx, x, k)
        assert ti.dtype == tf.int64 and ti.numpy().tolist() == ni.tolist() and tth == nth, k


def test_underscore_functions_return_the_result_and_leave_the_argument():
    xp = backend_of(tf.zeros(1))
    x = tf.constant([1.0, 2.0, 3.0, 4.0])
    y = xp.put_(x, tf.constant([1, 3], tf.int64), 0.0)
    assert y.numpy().tolist() == [1, 0, 3, 0] and x.numpy().tolist() == [1, 2, 3, 4]
    z = xp.scatter_add_(x, tf.constant([0, 0, 2], tf.int32), tf.constant([1.0, 1.0, 5.0]))
    assert z.numpy().tolist() == [3, 2, 8, 4]
    assert xp.set_slice_(x, 1, 3, 9.0).numpy().tolist() == [1, 9, 9, 4]
    assert xp.add_slice_(x, 2, 4, tf.constant([1.0, 1.0])).numpy().tolist() == [1, 2, 4, 5]


def test_bitcast_interleave_and_search_match_numpy():
    xp = backend_of(tf.zeros(1))
    v = np.array([1.5, -0.0, np.inf, 3e-39], np.float32)
    bits = xp.bitcast(tf.constant(v), tf.int32)
    assert bits.numpy().tolist() == v.view(np.int32).tolist()
    i64 = np.array([5, -7, 2**40], np.int64)
    as_f32 = xp.bitcast(tf.constant(i64), tf.float32)              # int64 -> 2x float32, as numpy's view
    assert as_f32.numpy().tobytes() == i64.view(np.float32).tobytes()
    assert xp.bitcast(as_f32, tf.int64).numpy().tolist() == i64.tolist()
    assert xp.interleave(tf.constant([1, 2]), tf.constant([7, 8])).numpy().tolist() == [1, 7, 2, 8]
    s = np.array([1, 3, 3, 9], np.int64)
    q = np.array([0, 3, 4, 10], np.int64)
    for right in (False, True):
        got = xp.searchsorted(tf.constant(s), tf.constant(q), right=right).numpy()
        assert got.tolist() == np.searchsorted(s, q, side="right" if right else "left").tolist()
    assert xp.sum_int(tf.constant([True, False, True])) == 2
    assert xp.gt(tf.constant([1, 2], tf.int64), 1.5).numpy().tolist() == [False, True]


def test_topk_rows_matches_numpy_helper():
    rng = np.random.default_rng(0)
    X = rng.integers(-3, 4, size=(7, 13)).astype(np.float32)      # many ties
    X[2, 5] = np.nan
    npx, xp = backend_of(X), backend_of(tf.constant(X))
    for k in (1, 3, 6, 13, 20):
        assert xp.topk_rows(tf.constant(X), k).numpy().tolist() == npx.topk_rows(X, k).tolist(), k
