"""Small tensors dense (``dense_share``, ``hvd_sparse/core/recipe.py`` and the engine's ``_step_split``): a unit's
smallest tensors, together at most a share of its entries, are allreduced dense on every step beside the sparse
step of the others. Oracle: the same preset run on the other tensors alone, beside the exact sum of the small ones,
bit for bit; then mass conservation, identical replicas, the statistics, non-finite steps, checkpoints, two levels
and the torch and TensorFlow backends."""

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse.compression import SparseCompression
from hvd_sparse.core.recipe import dense_tensors
from hvd_sparse.core.reducers import Dense
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.testing import simulate

from oracles import assert_mass_conserved, grads

C = hvd_sparse.Compression
#: a bias, a small weight, the large weight, its bias, the output layer and its bias
SHAPES = [(8,), (8, 4), (60, 40), (60,), (10, 60), (10,)]
SIZES = [int(np.prod(s)) for s in SHAPES]
N = sum(SIZES)                     # 3,110
SHARE = 0.25                       # 8 + 10 + 32 + 60 + 600 = 710 entries of 3,110 go dense
DENSE = (0, 1, 3, 4, 5)
CONSERVING = ("oktopk", "topka", "topk_dsa", "gaussiank", "exdyna", "dct", "spardl")


def _columns(indexes):
    offs = np.concatenate([[0], np.cumsum(SIZES)])
    return np.concatenate([np.arange(offs[i], offs[i + 1]) for i in indexes])


DENSE_COLS, SPARSE_COLS = _columns(DENSE), _columns([2])


def test_the_smallest_tensors_go_dense_while_they_fit_the_share():
    assert dense_tensors(SIZES, SHARE) == DENSE
    assert dense_tensors(SIZES, 0.01) == (0, 5)                     # 8 + 10 of 3,110
    assert dense_tensors(SIZES, 0.002) == ()                       # not even the smallest fits
    assert dense_tensors([5, 5, 5], 0.49) == (0,)                   # ties in layout order
    assert dense_tensors([1, 1], 0.49) == ()                        # ... and never every tensor


def test_the_option_is_validated_and_named():
    c = C.topka(0.01, dense_share=0.02)
    assert c.dense_share == 0.02 and repr(c) == "Compression.topka(density=0.01, dense_share=0.02)"
    assert C.oktopk(0.01).dense_share == 0.0
    for bad in (-0.1, 0.5, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="dense_share must be a number in"):
            C.exdyna(0.01, dense_share=bad)
    with pytest.raises(ValueError, match="dense_share does not combine with momentum_correction"):
        C.topka(0.01, dense_share=0.02, momentum_correction=0.9)
    with pytest.raises(ValueError, match="dense_share needs a sparse preset"):
        SparseCompression(None, Dense(), dense_share=0.02)


@pytest.mark.parametrize("name", CONSERVING + ("gtopk",))
def test_it_equals_the_preset_on_the_large_tensors_beside_the_exact_sum_of_the_small(name):
    P, T = 4, 8
    g = grads(T, P, N, seed=3, normal=True, scale=np.linspace(0.1, 3, N))
    res = simulate(getattr(C, name)(0.05, dense_share=SHARE), g, shapes=SHAPES)
    alone = simulate(getattr(C, name)(0.05), np.ascontiguousarray(g[:, :, SPARSE_COLS]), shapes=[SHAPES[2]])
    for r in range(P):
        np.testing.assert_array_equal(res.updates[:, r][:, SPARSE_COLS], alone.updates[:, r])
        np.testing.assert_array_equal(res.residuals[:, r][:, SPARSE_COLS], alone.residuals[:, r])
        np.testing.assert_array_equal(res.updates[:, r][:, DENSE_COLS],
                                      g[:, :, DENSE_COLS].sum(axis=1, dtype=np.float32) / np.float32(P))
    assert not res.residuals[:, :, DENSE_COLS].any()


@pytest.mark.parametrize("name", CONSERVING)
@pytest.mark.parametrize("P", [1, 3])
def test_mass_is_conserved_and_the_replicas_are_identical(name, P):
    g = grads(6, P, N, seed=P)
    res = simulate(getattr(C, name)(0.05, dense_share=SHARE), g, shapes=SHAPES, average=False)
    assert_mass_conserved(g, res)
    for r in range(1, P):
        np.testing.assert_array_equal(res.updates[:, r], res.updates[:, 0])


def test_the_statistics_count_both_parts_and_the_allreduces_bytes():
    P = 4
    g = grads(3, P, N, seed=5)
    res = simulate(C.topka(0.05, dense_share=SHARE), g, shapes=SHAPES, record=("updates", "volume", "selected"))
    alone = simulate(C.topka(0.05), np.ascontiguousarray(g[:, :, SPARSE_COLS]), shapes=[SHAPES[2]],
                     record=("updates", "volume", "selected"))
    nd = len(DENSE_COLS)
    ring = 2 * nd * (P - 1) // P * 4          # a ring allreduce's bytes a rank sends (float32)
    for t in range(3):
        assert res.selected[t, 0] == alone.selected[t, 0] + nd
        assert res.volume[t][0]["sent_bytes"] >= alone.volume[t][0]["sent_bytes"] + ring - 4 * P
        assert res.volume[t][0]["collectives"] == alone.volume[t][0]["collectives"] + 1


def test_a_nonfinite_small_tensor_skips_both_parts_on_every_rank():
    P = 3
    g = grads(4, P, N, seed=7, normal=True)
    g[2, 1, DENSE_COLS[3]] = np.nan
    with pytest.warns(RuntimeWarning, match="non-finite"):
        res = simulate(C.oktopk(0.05, dense_share=SHARE), g, shapes=SHAPES)
    assert np.isnan(res.updates[2]).all()
    np.testing.assert_array_equal(res.residuals[2], res.residuals[1])
    assert np.isfinite(res.updates[3]).all()


def _run(comp, g, states, steps, P):
    world = SimulatedWorld(P)
    comms = world.communicators()
    engines = [comp.new_engine(c) for c in comms]
    for e, state in zip(engines, states):
        e.layout = list(SIZES)
        if state is not None:
            e.load_state_dict(state)
    out = world.run(lambda c: [engines[c.rank].step(g[t, c.rank]) for t in steps], comms)
    return out, [e.state_dict() for e in engines]


def test_a_checkpoint_resumes_bit_for_bit_and_one_of_another_share_is_refused():
    P, T, cut = 3, 8, 5
    g = grads(T, P, N, seed=8, normal=True)
    comp = C.exdyna(0.05, dense_share=SHARE)
    full = simulate(comp, g, shapes=SHAPES)
    _, states = _run(comp, g, [None] * P, range(cut), P)
    out, _ = _run(comp, g, states, range(cut, T), P)
    for r in range(P):
        np.testing.assert_array_equal(np.stack(out[r]), full.updates[cut:, r])
    with pytest.raises(ValueError, match="dense_share"):
        C.exdyna(0.05).new_engine(None).load_state_dict(states[0])


def test_two_levels_are_refused_naming_the_options():
    with pytest.raises(ValueError, match="dense_share does not apply to the two-level step.*hierarchical=False"):
        simulate(C.topka(0.05, dense_share=SHARE, hierarchical=True), grads(2, 4, N), shapes=SHAPES, local_size=2)


@pytest.mark.parametrize("backend", ("torch", "tensorflow"))
def test_torch_and_tensorflow_backends_give_the_same_bits(backend):
    pytest.importorskip(backend)
    g = grads(5, 3, N, seed=10, normal=True)
    a = simulate(C.oktopk(0.05, dense_share=SHARE), g, shapes=SHAPES)
    b = simulate(C.oktopk(0.05, dense_share=SHARE), g, shapes=SHAPES, backend=backend)
    np.testing.assert_array_equal(a.updates, b.updates)
    np.testing.assert_array_equal(a.residuals, b.residuals)


def test_clipping_scales_the_whole_gradient_before_the_split():
    P = 2
    g = grads(3, P, N, seed=11, normal=True)
    limit = 0.5 * np.sqrt(P) * np.linalg.norm(g[0, 0].astype(np.float64))
    clipped = simulate(C.topka(0.05, dense_share=SHARE, local_clip_norm=limit), g, shapes=SHAPES)
    scaled = g.copy()
    for t in range(3):
        for r in range(P):
            norm = np.linalg.norm(g[t, r].astype(np.float64))
            scaled[t, r] *= np.float32(min(1.0, limit / np.sqrt(P) / norm))
    plain = simulate(C.topka(0.05, dense_share=SHARE), scaled, shapes=SHAPES)
    np.testing.assert_allclose(clipped.updates, plain.updates, rtol=1e-6, atol=1e-7)
    assert not np.allclose(clipped.updates, simulate(C.topka(0.05, dense_share=SHARE), g, shapes=SHAPES).updates)


def test_each_bucket_of_overlap_splits_its_own_tensors_and_conserves_mass():
    from hvd_sparse.testing import simulate_buckets

    P = 3
    g = grads(12, P, N, seed=12)
    res = simulate_buckets(C.topka(0.05, dense_share=SHARE), g, [(SHAPES[:3], False), (SHAPES[3:], False)],
                           average=False)
    np.testing.assert_array_equal(res.updates.sum(axis=0)[0] + res.residuals.sum(axis=0), g.sum(axis=(0, 1)))
    assert not res.residuals[:, _columns([0, 1])].any() and res.residuals[:, _columns([2])].any()
    for r in range(1, P):
        np.testing.assert_array_equal(res.updates[:, r], res.updates[:, 0])


def test_a_byte_budget_covers_both_parts_or_raises_when_the_dense_tensors_exceed_it():
    from hvd_sparse.core.budget import dense_bytes

    P = 4
    g = grads(6, P, N, seed=13, normal=True)
    for share in (0.0, SHARE):                  # TopkA's bytes follow the budget's model exactly
        res = simulate(C.topka(byte_budget=0.4, dense_share=share), g, shapes=SHAPES, record=("updates", "volume"))
        sent = np.mean([res.volume[t][0]["sent_bytes"] for t in range(1, 6)])
        assert sent / dense_bytes(N, P) == pytest.approx(0.4, rel=0.02)
    with pytest.raises(ValueError, match="byte_budget=0.2 does not cover the 710 entries that dense_share=0.25"):
        simulate(C.topka(byte_budget=0.2, dense_share=SHARE), g, shapes=SHAPES)
