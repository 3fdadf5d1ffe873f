"""DGC's recipe beyond momentum correction on the simulator (``hvd_sparse/core/recipe.py``): the density warm-up
(``warmup_density``, ``warmup_stage_steps``, ``warmup_factor``: stages of fixed density down to the preset's, each
starting the scheme afresh with the residual kept) and local gradient clipping (``local_clip_norm``: each rank's
gradient scaled by min(1, c / (sqrt(P)·||g||)) before the velocity and the residual). The stages' k and selections,
replica consistency, mass conservation, the bytes of every step, the exact scaling, checkpoints mid-warm-up, the
backends' bits and the two-level step."""

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse.compression import SparseCompression
from hvd_sparse.core.recipe import clip_local, stage_at, stage_densities
from hvd_sparse.core.reducers import Dense
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.core.state import SparsityWindow
from hvd_sparse.testing import simulate

from oracles import NP, assert_mass_conserved, grads, int_grads

C = hvd_sparse.Compression
CONSERVING = ("oktopk", "topka", "topk_dsa", "gaussiank", "exdyna", "dct")
EVERY = CONSERVING + ("gtopk", "spardl")
#: the tensors of the flat gradient (DCT's per-tensor thresholds)
SHAPES = [(200,), (300,), (100,), (200,)]
N = 800
#: one dense step, then 3 steps at 0.2 and 3 at 0.05, then the preset's 0.0125 (0.2 / 4²)
SCHEDULE = dict(warmup_dense_steps=1, warmup_density=0.2, warmup_stage_steps=3)
FINAL, STAGES = 0.0125, ((1, 0.2), (4, 0.05), (7, 0.0125))


def _make(name, density=FINAL, **options):
    return getattr(C, name)(density, **options)


def _normal(steps, P, seed):
    return grads(steps, P, N, seed=seed, normal=True, scale=np.linspace(0.1, 3, N))


# -- the options -----------------------------------------------------------------------------------------------------
def test_options_are_validated_and_named():
    c = C.topka(0.01, warmup_density=0.25, warmup_stage_steps=100, warmup_factor=2, local_clip_norm=5)
    assert (c.warmup_density, c.warmup_stage_steps, c.warmup_factor, c.local_clip_norm) == (0.25, 100, 2.0, 5.0)
    assert repr(c) == ("Compression.topka(density=0.01, warmup_density=0.25, warmup_stage_steps=100, "
                       "warmup_factor=2, local_clip_norm=5)")
    off = C.oktopk(0.01)
    assert (off.warmup_density, off.warmup_stage_steps, off.warmup_factor, off.local_clip_norm) == (None, 0, 4.0, None)
    assert off.stage_sparsifiers() == ()
    bad = [(dict(warmup_density=0.0, warmup_stage_steps=5), "warmup_density must be a number in"),
           (dict(warmup_density=1.5, warmup_stage_steps=5), "warmup_density must be a number in"),
           (dict(warmup_density=float("nan"), warmup_stage_steps=5), "warmup_density must be a number in"),
           (dict(warmup_density="0.25", warmup_stage_steps=5), "warmup_density must be a number in"),
           (dict(warmup_density=0.01, warmup_stage_steps=5), "warmup_density must be above the preset's density"),
           (dict(warmup_density=0.25), "warmup_stage_steps must be an integer >= 1"),
           (dict(warmup_density=0.25, warmup_stage_steps=2.5), "warmup_stage_steps must be an integer >= 1"),
           (dict(warmup_stage_steps=5), "warmup_stage_steps=5 needs warmup_density"),
           (dict(warmup_factor=2.0), "warmup_factor=2.0 needs warmup_density"),
           (dict(warmup_density=0.25, warmup_stage_steps=5, warmup_factor=1.0), "warmup_factor must be a number > 1"),
           (dict(warmup_density=0.25, warmup_stage_steps=5, warmup_factor=float("inf")), "warmup_factor must be"),
           (dict(local_clip_norm=0.0), "local_clip_norm must be a number > 0"),
           (dict(local_clip_norm=-1), "local_clip_norm must be a number > 0"),
           (dict(local_clip_norm=float("nan")), "local_clip_norm must be a number > 0"),
           (dict(local_clip_norm=True), "local_clip_norm must be a number > 0")]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            C.topka(0.01, **options)
    with pytest.raises(ValueError, match="local_clip_norm needs a sparse preset"):
        SparseCompression(None, Dense(), local_clip_norm=1.0)
    with pytest.raises(ValueError, match="warmup_density needs a sparse preset"):
        SparseCompression(None, Dense(), warmup_density=0.5, warmup_stage_steps=2)


@pytest.mark.parametrize("option", [dict(warmup_density=0.1, warmup_stage_steps=1), dict(local_clip_norm=1.0)])
def test_the_agreement_tells_presets_of_other_recipes_apart(option):
    """The options are in the preset's repr, which the agreement's fingerprint covers: ranks built with different
    recipes raise together instead of exchanging messages of other shapes."""
    from hvd_sparse.core.errors import RankDisagreementError

    world = SimulatedWorld(2)
    comms = world.communicators()
    engines = [C.topka(0.01, **option).new_engine(comms[0]), C.topka(0.01).new_engine(comms[1])]
    with pytest.raises(RankDisagreementError, match=next(iter(option))):
        world.run(lambda c: engines[c.rank].step(np.ones(100, np.float32)), comms)


# -- the density warm-up's stages ----------------------------------------------------------------------------------
def test_stages_follow_dgc_down_to_the_presets_density():
    assert stage_densities(0.25, 0.001, 4) == (0.25, 0.0625, 0.015625, 0.00390625)      # DGC's, then 0.1%
    assert stage_densities(0.2, 0.0125, 4) == (0.2, 0.05)             # a stage at the preset's density is its own
    assert stage_densities(0.3, 0.1, 2) == (0.3, 0.15)
    assert stage_densities(0.1, 0.1, 4) == ()
    assert [stage_at(s, 2, 5, 3) for s in (2, 6, 7, 16, 17, 1000)] == [(0, 2), (0, 2), (1, 7), (2, 12), (3, 17),
                                                                       (3, 17)]
    assert stage_at(9, 2, 0, 0) == (0, 2)                             # no warm-up: the preset from the first step
    c = _make("topka", **SCHEDULE)
    assert [c.density_at(t) for t in range(9)] == [1.0, 0.2, 0.2, 0.2, 0.05, 0.05, 0.05, 0.0125, 0.0125]
    assert [s.density for s in c.stage_sparsifiers()] == [0.2, 0.05]


def _stage_of(t):
    return max(i for i, (start, _) in enumerate(STAGES) if t >= start)


@pytest.mark.parametrize("name", EVERY)
def test_every_step_runs_at_its_stages_k_and_selects_within_its_capacity(name):
    P, T = 4, 10
    comp = _make(name, **SCHEDULE)
    res = simulate(comp, _normal(T, P, seed=1), shapes=SHAPES, after_step=lambda t, r, e: e.last["k"])
    sparsifiers = comp.stage_sparsifiers() + (comp.sparsifier,)
    assert [res.observed[t][0] for t in range(T)] == [N] + [int(comp.density_at(t) * N) for t in range(1, T)]
    assert res.selected[0].min() == N                                 # the dense step
    if name == "spardl":                                              # SparDL picks its own entries from k
        return
    for t in range(1, T):
        sp = sparsifiers[_stage_of(t)]
        k = int(sp.density * N)
        for r in range(P):
            assert res.observed[t][r] == k
            assert 0 < res.selected[t, r] <= sp.capacity(k, N, P)
    per_stage = [res.selected[start:start + 3].sum(axis=1).mean() for start, _ in STAGES]
    assert per_stage[0] > per_stage[1] > per_stage[2]                  # the selections come down with the stages


@pytest.mark.parametrize("name", EVERY)
def test_each_stage_starts_the_scheme_afresh_at_its_density_with_the_residual_kept(name):
    P, T = 4, 12
    g = _normal(T, P, seed=2)
    res = simulate(_make(name, **SCHEDULE), g, shapes=SHAPES)
    for (start, density), stop in zip(STAGES[1:], (STAGES[2][0], T)):
        carried = res.residuals[start - 1]

        def seed_residual(t, r, engine):
            if t == 0:
                engine.memory.replace(carried[r].copy())

        fresh = simulate(_make(name, density), g[start:stop], shapes=SHAPES, before_step=seed_residual)
        np.testing.assert_array_equal(res.updates[start:stop], fresh.updates)
        np.testing.assert_array_equal(res.residuals[start:stop], fresh.residuals)


@pytest.mark.parametrize("name", CONSERVING)
@pytest.mark.parametrize("P", [2, 3])
def test_the_warmup_conserves_mass_and_keeps_the_replicas_identical(name, P):
    g = int_grads(11, P, N, seed=P, scale=64)
    res = simulate(_make(name, **SCHEDULE), g, shapes=SHAPES, average=False)
    assert_mass_conserved(g, res)
    for r in range(1, P):
        np.testing.assert_array_equal(res.updates[:, r], res.updates[:, 0])


def test_every_step_reports_its_bytes_warmup_included_and_the_window_averages_them():
    P, T = 4, 10
    windows = [SparsityWindow() for _ in range(P)]
    res = simulate(_make("topka", **SCHEDULE), _normal(T, P, seed=3), after_step=lambda t, r, e: windows[r].add(e.last))
    sent = [res.volume[t][0]["sent_bytes"] for t in range(T)]
    dense = 8 * N * (P - 1) // P                                      # a ring allreduce's
    assert sent == [dense] + [8 * int(_make("topka", **SCHEDULE).density_at(t) * N) * (P - 1) for t in range(1, T)]
    assert sent[1] > sent[4] > sent[7] > 0
    assert windows[0].local()[2] == pytest.approx(np.mean(sent))      # sparse_stats(average=True)'s sent_bytes


def test_a_schedule_of_s_stages_adds_s_message_shapes():
    """TopkA's allgather carries its k pairs: one shape per stage and one for the preset's density."""
    P, T = 3, 10
    res = simulate(_make("topka", **SCHEDULE), _normal(T, P, seed=4))
    shapes = {res.phases[t][0]["sent_words"]["indices"] for t in range(1, T)}
    assert len(shapes) == len(STAGES)


@pytest.mark.parametrize("name", ("oktopk", "exdyna", "dct", "gaussiank"))
@pytest.mark.parametrize("cut", [4, 5, 7])          # a stage's first step, inside a stage, the preset's first step
def test_a_checkpoint_mid_warmup_resumes_bit_for_bit(name, cut):
    P, T = 3, 10
    g = _normal(T, P, seed=5)
    comp = _make(name, momentum_correction=0.5, local_clip_norm=40.0, **SCHEDULE)
    full = simulate(comp, g, shapes=SHAPES)

    def run(states, steps):
        world = SimulatedWorld(P)
        comms = world.communicators()
        engines = [comp.new_engine(c) for c in comms]
        for e, state in zip(engines, states):
            e.layout = [s[0] for s in SHAPES]
            if state is not None:
                e.load_state_dict(state)
        out = world.run(lambda c: [engines[c.rank].step(g[t, c.rank]) for t in steps], comms)
        return out, [e.state_dict() for e in engines]

    _, states = run([None] * P, range(cut))
    out, _ = run(states, range(cut, T))
    for r in range(P):
        np.testing.assert_array_equal(np.stack(out[r]), full.updates[cut:, r])


def test_a_byte_budget_is_the_last_stages():
    P = 4
    c = C.topka(byte_budget=0.01, warmup_density=0.2, warmup_stage_steps=2)
    final = c.density_for(P)
    stages = stage_densities(0.2, final, 4)
    assert [s.density for s in c.for_size(P).stage_sparsifiers()] == list(stages) and len(stages) == 4
    assert [c.density_at(t, P) for t in range(0, 10, 2)] == list(stages) + [final]
    with pytest.warns(RuntimeWarning, match="the density warm-up has no stage"):
        C.topka(byte_budget=0.5, warmup_density=0.2, warmup_stage_steps=2).for_size(2).stage_sparsifiers()


# -- local gradient clipping -----------------------------------------------------------------------------------------
def _clip_data(steps, P, seed, aligned=False):
    """Signed permutations of 1..m times 2^r on rank r: every row of rank r has the norm 2^r·B, B that of 1..m.
    m = N, or with ``aligned`` N / 2, in the first half of the row, the same on every rank of a step (so that a
    shard of a host's sum is larger than any rank's gradient)."""
    rng = np.random.default_rng(seed)
    m = N // 2 if aligned else N
    g = np.zeros((steps, P, N), np.float32)
    for t in range(steps):
        for r in range(P):
            if r == 0 or not aligned:
                row = rng.permutation(np.arange(1, m + 1)) * rng.choice([-1, 1], m)
            g[t, r, :m] = row * 2.0 ** r
    return g, float(np.sqrt(np.sum(np.arange(1, m + 1, dtype=np.float64) ** 2)))


def _clipped(g, base):
    """What DGC's rule makes of ``_clip_data`` with c = 1.5·B·sqrt(P): rank 0 within the limit, untouched; rank r > 0
    scaled by 1.5 / 2^r (exactly, in float32)."""
    out = g.copy()
    out[:, 1:] = g[:, 1:] / (2.0 ** np.arange(1, g.shape[1]))[None, :, None] * np.float32(1.5)
    limit = 1.5 * base
    assert np.linalg.norm(out[0, 1].astype(np.float64)) == pytest.approx(limit, rel=1e-12)
    return out, limit


def test_clip_local_scales_to_the_limit_and_leaves_a_gradient_within_it():
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    for P, f in ((1, 0.5), (4, 0.3), (9, 0.9)):
        c = f * norm * np.sqrt(P)
        (y,) = clip_local(NP, [x[:1000], x[1000:]], c, P)
        np.testing.assert_array_equal(y, x * np.float32(c / np.sqrt(P) / norm))
        assert np.linalg.norm(y.astype(np.float64)) == pytest.approx(c / np.sqrt(P), rel=1e-6)
        pieces = [x[:1000], x[1000:]]
        assert clip_local(NP, pieces, 2 * norm * np.sqrt(P), P) is pieces          # within: untouched, no copy
    bad = x.copy()
    bad[7] = np.nan
    assert clip_local(NP, [bad], 1e-3, 4)[0] is bad                     # the non-finite policy sees the NaN


@pytest.mark.parametrize("name", EVERY)
def test_clipping_equals_the_preset_on_the_clipped_gradients_and_conserves_their_mass(name):
    P, T = 4, 8
    g, base = _clip_data(T, P, seed=6)
    want, limit = _clipped(g, base)
    res = simulate(_make(name, 0.05, local_clip_norm=limit * np.sqrt(P)), g, shapes=SHAPES, average=False)
    ref = simulate(_make(name, 0.05), want, shapes=SHAPES, average=False)
    np.testing.assert_array_equal(res.updates, ref.updates)
    np.testing.assert_array_equal(res.residuals, ref.residuals)
    if name in CONSERVING:
        assert_mass_conserved(want, res)
    assert not np.array_equal(want, g)


def test_clipping_comes_before_the_velocity_and_holds_on_dense_steps():
    P, T = 4, 8
    g, base = _clip_data(T, P, seed=7)
    want, limit = _clipped(g, base)
    opts = dict(momentum_correction=0.5, warmup_dense_steps=2)
    res = simulate(C.oktopk(0.05, local_clip_norm=limit * np.sqrt(P), **opts), g)
    ref = simulate(C.oktopk(0.05, **opts), want)
    np.testing.assert_array_equal(res.updates, ref.updates)
    np.testing.assert_array_equal(res.velocities, ref.velocities)
    np.testing.assert_array_equal(res.residuals, ref.residuals)
    np.testing.assert_array_equal(res.updates[0, 0], want[0].sum(axis=0) / np.float32(P))       # a dense step


def test_clipping_on_two_levels_clips_each_ranks_whole_gradient_over_all_ranks():
    P, T = 4, 6
    g, base = _clip_data(T, P, seed=8, aligned=True)
    want, limit = _clipped(g, base)
    res = simulate(C.topka(0.05, local_clip_norm=limit * np.sqrt(P)), g, local_size=2)
    ref = simulate(C.topka(0.05), want, local_size=2)
    np.testing.assert_array_equal(res.updates, ref.updates)
    np.testing.assert_array_equal(res.residuals, ref.residuals)


def test_a_nonfinite_gradient_is_still_skipped_with_clipping():
    P = 2
    g = _normal(4, P, seed=9)
    g[2, 1, 5] = np.inf
    with pytest.warns(RuntimeWarning, match="non-finite"):
        res = simulate(C.topka(0.1, local_clip_norm=1.0, momentum_correction=0.9), g)
    assert np.isnan(res.updates[2]).all()
    np.testing.assert_array_equal(res.residuals[2], res.residuals[1])


@pytest.mark.parametrize("backend", ("torch", "tensorflow"))
@pytest.mark.parametrize("name", ("oktopk", "exdyna", "dct"))
def test_torch_and_tensorflow_backends_give_the_same_bits(name, backend):
    pytest.importorskip(backend)
    g = _normal(9, 3, seed=10)
    opts = dict(momentum_correction=0.9, local_clip_norm=30.0, **SCHEDULE)
    a = simulate(_make(name, **opts), g, shapes=SHAPES)
    b = simulate(_make(name, **opts), g, shapes=SHAPES, backend=backend)
    np.testing.assert_array_equal(a.updates, b.updates)
    np.testing.assert_array_equal(a.residuals, b.residuals)
    np.testing.assert_array_equal(a.velocities, b.velocities)


def test_the_device_path_clips_alike_without_a_host_read():
    torch = pytest.importorskip("torch")
    from hvd_sparse.bench.syncs import HostReads, as_if_on_a_device
    from hvd_sparse.core.xp import backend_of

    P, T = 4, 5
    g, base = _clip_data(T, P, seed=11)
    want, limit = _clipped(g, base)
    with as_if_on_a_device():
        res = simulate(C.topka(0.05, local_clip_norm=limit * np.sqrt(P)), g, backend="torch")
        x = torch.from_numpy(g[0, 2].copy())
        reads = HostReads()
        with reads:
            y = clip_local(backend_of(x), [x], limit * np.sqrt(P), P)[0]
        assert reads.reads == 0
    np.testing.assert_array_equal(y.numpy(), want[0, 2])
    np.testing.assert_array_equal(res.updates, simulate(C.topka(0.05), want).updates)
    nan = torch.full((4,), float("nan"))
    with as_if_on_a_device():
        assert torch.isnan(clip_local(backend_of(nan), [nan], 1.0, 4)[0]).all()      # a NaN stays one

