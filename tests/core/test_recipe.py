"""DGC's recipe beyond momentum correction on the simulator (``hvd_sparse/core/recipe.py``): the density warm-up
(``warmup_density``, ``warmup_stage_steps``, ``warmup_factor``: stages of fixed density down to the preset's, each
starting the scheme afresh with the residual kept). The stages' k and selections, replica consistency, mass
conservation, the bytes of every step, checkpoints mid-warm-up."""

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse.compression import SparseCompression
from hvd_sparse.core.recipe import stage_at, stage_densities
from hvd_sparse.core.reducers import Dense
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.core.state import SparsityWindow
from hvd_sparse.testing import simulate

from oracles import assert_mass_conserved, grads, int_grads

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
    c = C.topka(0.01, warmup_density=0.25, warmup_stage_steps=100, warmup_factor=2)
    assert (c.warmup_density, c.warmup_stage_steps, c.warmup_factor) == (0.25, 100, 2.0)
    assert repr(c) == "Compression.topka(density=0.01, warmup_density=0.25, warmup_stage_steps=100, warmup_factor=2)"
    off = C.oktopk(0.01)
    assert (off.warmup_density, off.warmup_stage_steps, off.warmup_factor) == (None, 0, 4.0)
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
           (dict(warmup_density=0.25, warmup_stage_steps=5, warmup_factor=float("inf")), "warmup_factor must be")]
    for options, message in bad:
        with pytest.raises(ValueError, match=message):
            C.topka(0.01, **options)
    with pytest.raises(ValueError, match="warmup_density needs a sparse preset"):
        SparseCompression(None, Dense(), warmup_density=0.5, warmup_stage_steps=2)


@pytest.mark.parametrize("option", [dict(warmup_density=0.1, warmup_stage_steps=1)])
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
    comp = _make(name, momentum_correction=0.5, **SCHEDULE)
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
