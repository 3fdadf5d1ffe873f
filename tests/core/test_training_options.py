"""The presets' training options on the simulator: ``warmup_dense_steps`` (dense allreduce for the first N steps,
then the scheme from its own step 0) and ``momentum_correction`` (Deep Gradient Compression's momentum correction
and momentum factor masking in error feedback). Replica consistency, mass conservation, the exact dense warm-up,
the torch and TensorFlow backends' bits, non-finite skips and resume."""

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.testing import simulate

from oracles import grads

C = hvd_sparse.Compression
# schemes whose error feedback keeps "acc minus what was sent" (gTopk loses pruned values by design)
CONSERVING = ("oktopk", "topka", "topk_dsa", "gaussiank", "exdyna", "dct")
# small integers: every sum and every product with m = 0.5 is exact in float32; a few large entries, as real
# gradients have
SMALL_INTS = dict(scale=64, boost=(8, 8))


def _make(name, density=0.05, **options):
    return getattr(C, name)(density, **options)


def test_options_are_validated_and_named():
    c = C.oktopk(0.01, warmup_dense_steps=5, momentum_correction=0.9)
    assert (c.warmup_dense_steps, c.momentum_correction) == (5, 0.9)
    assert repr(c) == "Compression.oktopk(density=0.01, warmup_dense_steps=5, momentum_correction=0.9)"
    assert (C.topka(0.01).warmup_dense_steps, C.topka(0.01).momentum_correction) == (0, 0.0)
    with pytest.raises(ValueError, match="warmup_dense_steps must be an integer >= 0"):
        C.topka(0.01, warmup_dense_steps=-1)
    with pytest.raises(ValueError, match="warmup_dense_steps"):
        C.topka(0.01, warmup_dense_steps=2.5)
    with pytest.raises(ValueError, match=r"momentum_correction must be in \[0, 1\)"):
        C.topka(0.01, momentum_correction=1.0)
    with pytest.raises(ValueError, match="does not apply to SparDL"):
        C.spardl(0.01, momentum_correction=0.9)


@pytest.mark.parametrize("name", CONSERVING + ("gtopk",))
def test_warmup_steps_are_the_exact_dense_average_then_the_scheme_starts_at_its_step_0(name):
    P, n, T, W = 4, 600, 10, 3
    g = grads(T, P, n, seed=1, **SMALL_INTS)
    res = simulate(_make(name, warmup_dense_steps=W), g)
    mean = g.sum(axis=1, dtype=np.float32) / np.float32(P)           # rank-order float32 sum, then / P
    for t in range(W):
        for r in range(P):
            np.testing.assert_array_equal(res.updates[t, r], mean[t])
        assert not res.residuals[t].any() and res.info[t][0].get("warmup") is True
    # the residual is empty after the warm-up and the scheme's state untouched: the rest is a fresh run
    fresh = simulate(_make(name), g[W:])
    np.testing.assert_array_equal(res.updates[W:], fresh.updates)
    np.testing.assert_array_equal(res.residuals[W:], fresh.residuals)
    np.testing.assert_array_equal(res.selected[W:], fresh.selected)
    for t in range(T):                                                  # replica consistency
        for r in range(1, P):
            np.testing.assert_array_equal(res.updates[t, r], res.updates[t, 0])


def test_warmup_steps_send_the_dense_volume():
    P, n = 4, 1000
    res = simulate(C.topka(0.01, warmup_dense_steps=2), grads(4, P, n, **SMALL_INTS))
    assert [res.volume[t][0]["collectives"] for t in range(2)] == [1, 1] and res.selected[:2].min() == n
    assert res.selected[2:].max() == 10                                 # then TopkA's k = 1% of n


def _fed_velocities(g, v, m):
    """The velocity each step fed into error feedback, m·u_{t-1} + g_t, from the recorded (masked) u."""
    fed = np.empty_like(g)
    for t in range(len(g)):
        prev = v[t - 1] if t else np.zeros_like(g[0])
        fed[t] = np.float32(m) * prev + g[t]
    return fed


@pytest.mark.parametrize("name", CONSERVING)
@pytest.mark.parametrize("P", [2, 4])
def test_momentum_correction_conserves_mass_and_masks_the_velocity_where_entries_were_sent(name, P):
    n, T, m = 512, 12, 0.5
    g = grads(T, P, n, seed=P, **SMALL_INTS)
    res = simulate(_make(name, momentum_correction=m), g, average=False)
    assert res.velocities is not None
    fed = _fed_velocities(g, res.velocities, m)
    # P·Σ updates (here op=Sum: Σ updates) + Σ residuals == Σ velocities fed, exactly
    np.testing.assert_array_equal(res.updates.sum(axis=0)[0] + res.residuals[-1].sum(axis=0),
                                  fed.sum(axis=(0, 1)))
    prev = np.zeros((P, n), np.float32)
    for t in range(T):
        acc = prev + fed[t]
        sent = (res.residuals[t] == 0) & (acc != 0)
        assert sent.any()
        assert not res.velocities[t][sent].any()                       # masked where sent
        kept = res.residuals[t] != 0
        np.testing.assert_array_equal(res.velocities[t][kept], fed[t][kept])    # untouched elsewhere
        np.testing.assert_array_equal(res.residuals[t][kept], acc[kept])
        for r in range(1, P):
            np.testing.assert_array_equal(res.updates[t, r], res.updates[t, 0])
        prev = res.residuals[t]


def test_momentum_correction_during_dense_warmup_is_momentum_sgd_of_the_average():
    P, n, T, m = 4, 300, 6, 0.5
    g = grads(T, P, n, seed=3, **SMALL_INTS)
    res = simulate(C.oktopk(0.05, warmup_dense_steps=T, momentum_correction=m), g)
    U = np.zeros(n, np.float32)
    for t in range(T):                    # no masking on dense steps: the velocity is the optimizer's momentum
        U = np.float32(m) * U + g[t].sum(axis=0, dtype=np.float32) / np.float32(P)
        np.testing.assert_array_equal(res.updates[t, 0], U)
        assert not res.residuals[t].any()


def test_without_the_options_nothing_changes():
    g = grads(8, 4, 400, seed=5, normal=True, scale=np.linspace(0.1, 3, 400))
    a = simulate(C.oktopk(0.05), g)
    b = simulate(C.oktopk(0.05, warmup_dense_steps=0, momentum_correction=0.0), g)
    np.testing.assert_array_equal(a.updates, b.updates)
    assert b.velocities is None


@pytest.mark.parametrize("backend", ("torch", "tensorflow"))
@pytest.mark.parametrize("name", ("oktopk", "topka", "exdyna"))
def test_torch_and_tensorflow_backends_give_the_same_bits(name, backend):
    pytest.importorskip(backend)
    g = grads(10, 4, 700, seed=7, normal=True, scale=np.linspace(0.1, 3, 700))
    opts = dict(warmup_dense_steps=2, momentum_correction=0.9)
    a = simulate(_make(name, **opts), g)
    b = simulate(_make(name, **opts), g, backend=backend)
    np.testing.assert_array_equal(a.updates, b.updates)
    np.testing.assert_array_equal(a.residuals, b.residuals)
    np.testing.assert_array_equal(a.velocities, b.velocities)


def test_a_skipped_step_leaves_the_velocity_unchanged():
    P, n = 2, 200
    g = grads(4, P, n, seed=9, normal=True, scale=np.linspace(0.1, 3, n))
    g[2, 1, 5] = np.nan
    with pytest.warns(RuntimeWarning, match="non-finite"):
        res = simulate(C.topka(0.1, momentum_correction=0.9), g)
    np.testing.assert_array_equal(res.velocities[2], res.velocities[1])
    np.testing.assert_array_equal(res.residuals[2], res.residuals[1])


def test_resume_from_state_dict_is_bit_exact():
    P, n, T, cut = 2, 300, 8, 5
    g = grads(T, P, n, seed=11, normal=True, scale=np.linspace(0.1, 3, n))
    comp = C.oktopk(0.05, warmup_dense_steps=2, momentum_correction=0.9)
    full = simulate(comp, g)

    world = SimulatedWorld(P)
    comms = world.communicators()
    engines = [comp.new_engine(c) for c in comms]
    world.run(lambda c: [engines[c.rank].step(g[t, c.rank]) for t in range(cut)], comms)
    states = [e.state_dict() for e in engines]
    assert all("velocity" in s for s in states)
    world = SimulatedWorld(P)
    comms = world.communicators()
    resumed = [comp.new_engine(c) for c in comms]
    for e, s in zip(resumed, states):
        e.load_state_dict(s)
    out = world.run(lambda c: [resumed[c.rank].step(g[t, c.rank]) for t in range(cut, T)], comms)
    for r in range(P):
        np.testing.assert_array_equal(np.stack(out[r]), full.updates[cut:, r])
