"""The agreement step of every engine step (hvd_sparse/core/comm.py), in the simulator: ranks that disagree on
the preset, an argument, the layout, the unit or the step get the same RankDisagreementError on every rank
before any data moves; a layout change starts the unit afresh and carries the residual by name; the fingerprint is
computed only when what it covers changes. The same checks through real horovodrun: test_agreement_horovod.py."""

import numpy as np
import pytest

from hvd_sparse.bench import presets
from hvd_sparse.compression import Compression
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.testing import simulate

from oracles import grads


def run_ranks(steps_of_rank, P):
    """Run ``steps_of_rank(rank, comm)`` on P virtual ranks; returns per rank the result or the error's text."""
    world = SimulatedWorld(P, timeout=30)

    def target(comm):
        try:
            return steps_of_rank(comm.rank, comm)
        except Exception as e:        # noqa: BLE001 - every rank's error is compared by its text
            return f"{type(e).__name__}: {e}"

    return world.run(target)


def engines_of(comps, P=2):
    def fn(r, comm):
        return comps[r].new_engine(comm).step(grads(1, P, 200, normal=True)[0][r])
    return run_ranks(fn, P)


@pytest.mark.parametrize("a, b, says", [
    (Compression.oktopk(0.1), Compression.topka(0.1), "the compression of 'model': 'Compression.oktopk(density=0.1)' "
                                                      "on rank 0, 'Compression.topka(density=0.1)' on rank 1"),
    (Compression.topka(0.1), Compression.gtopk(0.1), "the compression of 'model'"),
    (Compression.oktopk(0.1), Compression.oktopk(0.1, threshold_period=8),
     "the compression argument 'threshold_period' of 'model': 32 on rank 0, 8 on rank 1"),
    (Compression.oktopk(0.1), Compression.oktopk(0.1, repartition_period=8),
     "the compression argument 'repartition_period' of 'model': 64 on rank 0, 8 on rank 1"),
    (Compression.topka(0.1), Compression.topka(0.3), "the compression argument 'density' of 'model': 0.1 on rank 0, "
                                                     "0.3 on rank 1"),
    (Compression.oktopk(0.1), Compression.oktopk(0.3), "the compression argument 'density'"),
])
def test_ranks_that_disagree_on_the_compression_raise_the_same_error_on_every_rank(a, b, says):
    got = engines_of([a, b])
    assert got[0] == got[1], got
    assert got[0].startswith("RankDisagreementError: hvd_sparse: ranks disagree on ") and says in got[0], got[0]


def test_a_disagreement_among_three_ranks_names_the_odd_rank():
    got = engines_of([Compression.topka(0.1), Compression.topka(0.1), Compression.topka(0.2)], P=3)
    assert len(set(got)) == 1 and "0.1 on ranks 0, 1, 0.2 on rank 2" in got[0], got


def test_shapes_dtypes_and_unit_names_are_agreed():
    g = grads(1, 2, 200, normal=True)[0]

    def shapes(r, comm):      # the same n, another shape
        e = Compression.topka(0.1).new_engine(comm)
        e.declare([("w", (10, 20) if r == 0 else (20, 10), "float32")])
        return e.step(g[r])

    got = run_ranks(shapes, 2)
    assert got[0] == got[1] and "parameter 'w' is (10, 20) float32 on rank 0 but (20, 10) float32 on rank 1" in got[0]

    def sizes(r, comm):       # undeclared: one tensor of the gradient's size
        return Compression.topka(0.1).new_engine(comm, "x").step(g[r][:200 - 10 * r])

    got = run_ranks(sizes, 2)
    assert got[0] == got[1] and "parameter 'x' is (200,) float32 on rank 0 but (190,) float32 on rank 1" in got[0]

    def units(r, comm):       # two units stepped in a different order on the two ranks
        comp = Compression.topka(0.1)
        first, second = comp.new_engine(comm, "a"), comp.new_engine(comm, "b")
        order = (first, second) if r == 0 else (second, first)
        return [e.step(g[r]) for e in order]

    got = run_ranks(units, 2)
    assert got[0] == got[1] and "what is being exchanged: 'a' on rank 0, 'b' on rank 1" in got[0]


def test_a_rank_that_skipped_a_step_is_named_by_the_step_count():
    g = grads(1, 2, 200, normal=True)[0]

    def fn(r, comm):
        e = Compression.topka(0.1).new_engine(comm)
        if r == 1:
            e.steps = 1       # as if rank 1 had run one step alone
        return e.step(g[r])

    got = run_ranks(fn, 2)
    assert got[0] == got[1] and "the step count of 'model': 0 on rank 0, 1 on rank 1" in got[0]
    assert "scaler.unscale_(optimizer)" in got[0]


def test_a_local_problem_of_one_rank_is_raised_on_every_rank():
    g = grads(1, 2, 200, normal=True)[0]

    def fn(r, comm):
        e = Compression.topka(0.1).new_engine(comm)
        e.step(g[r])
        return e.step(g[r][:100] if r == 1 else g[r])        # rank 1 alone feeds another model

    got = run_ranks(fn, 2)
    assert got[0] == got[1] and "on rank 1: " in got[0] and "cannot serve two models" in got[0], got


def test_layout_change_starts_afresh_and_carries_the_residual_by_name():
    P, g = 2, grads(1, 2, 30, normal=True)[0]

    def fn(r, comm):
        e = Compression.topka(0.2).new_engine(comm)
        e.declare([("a", (10,), "float32"), ("b", (20,), "float32")])
        e.step(g[r])
        before = np.array(e.memory.residual)
        e.declare([("b", (20,), "float32"), ("c", (5,), "float32")])      # 'a' left, 'c' is new
        after = np.array(e.memory.residual)
        return before, after, e.steps, e.layout

    for before, after, steps, layout in run_ranks(fn, P):
        assert steps == 0 and layout == [20, 5]
        assert after[:20].tobytes() == before[10:].tobytes() and not after[20:].any()


def test_layout_change_carries_the_momentum_correction_velocity_by_name_and_the_step_runs():
    P, g = 2, grads(1, 2, 30, normal=True)[0]

    def fn(r, comm):
        e = Compression.topka(0.2, momentum_correction=0.9).new_engine(comm)
        e.declare([("a", (10,), "float32"), ("b", (20,), "float32")])
        e.step(g[r])
        before = np.array(e.memory.velocity)
        e.declare([("b", (20,), "float32"), ("c", (5,), "float32")])      # 'a' left, 'c' is new
        after = np.array(e.memory.velocity)
        e.step(g[r][:25])                                                  # the new layout's size
        return before, after

    for before, after in run_ranks(fn, P):
        assert after[:20].tobytes() == before[10:].tobytes() and not after[20:].any()


def test_a_fixed_layout_refuses_other_entries_on_every_rank_and_keeps_the_state():
    """declare(..., fixed=True) (TensorFlow: the preset owns the state): other entries at a later step -- here the
    same number of entries in other shapes -- are another model: RankDisagreementError on every rank, nothing
    changed; the first entries then step on."""
    g = grads(1, 2, 30, normal=True)[0]
    first = [("a", (10,), "float32"), ("b", (20,), "float32")]

    def fn(r, comm):
        e = Compression.topka(0.2).new_engine(comm)
        e.declare(first, fixed=True)
        e.step(g[r])
        residual = np.array(e.memory.residual)
        e.declare([("a", (20,), "float32"), ("b", (10,), "float32")], fixed=True)
        try:
            e.step(g[r])
            error = None
        except ValueError as exc:
            error = f"{type(exc).__name__}: {exc}"
        same = e.steps == 1 and np.array(e.memory.residual).tobytes() == residual.tobytes()
        e.declare(first, fixed=True)
        e.step(g[r])
        return error, same, e.steps

    (e0, same0, steps0), (e1, same1, steps1) = run_ranks(fn, 2)
    assert e0 == e1 and e0.startswith("RankDisagreementError: ") and "cannot serve two models" in e0, e0
    assert "position 0 is 'a' (20,) float32 now but was 'a' (10,) float32" in e0
    assert same0 and same1 and steps0 == steps1 == 2


def test_ranks_that_disagree_on_the_training_options_raise():
    out = engines_of([Compression.topka(0.1, warmup_dense_steps=2), Compression.topka(0.1)])
    assert all(isinstance(o, str) and "ranks disagree on the compression" in o for o in out), out
    out = engines_of([Compression.oktopk(0.1, momentum_correction=0.9), Compression.oktopk(0.1)])
    assert all(isinstance(o, str) and "ranks disagree on the compression" in o for o in out), out


def test_the_fingerprint_is_computed_only_when_the_layout_or_options_change(monkeypatch):
    from hvd_sparse.core import comm

    calls = []
    real = comm.describe
    monkeypatch.setattr(comm, "describe", lambda *a: calls.append(1) or real(*a))
    simulate(presets.make("oktopk", 0.1), np.random.default_rng(0).standard_normal((6, 2, 100)).astype(np.float32))
    assert len(calls) == 2                   # once per rank, not once per step

    def fn(r, comm):
        e = Compression.topka(0.1).new_engine(comm)
        e.declare([("a", (100,), "float32")])
        for t in range(3):
            e.step(grads(1, 2, 100, normal=True)[0][r])
        e.declare([("a", (50,), "float32"), ("b", (50,), "float32")])
        e.step(grads(1, 2, 100, normal=True)[0][r])

    calls.clear()
    run_ranks(fn, 2)
    assert len(calls) == 4                   # per rank: the first layout and the changed one


def test_the_agreement_is_a_header_of_36_bytes_in_the_steps_first_collective():
    def fn(r, comm):
        e = Compression.topka(0.1).new_engine(comm)
        e.step(grads(1, 3, 200, normal=True)[0][r])
        return e.last["control_bytes"], e.last["collectives"], e.last["control_collectives"], e.last["sent_words"]

    from hvd_sparse.core.comm import AGREE_WORDS

    assert AGREE_WORDS == 9
    # 9 int32 words to each of P - 1 ranks, in topka's one collective (its 2k words: the algorithm's volume)
    assert run_ranks(fn, 3) == [(2 * 36, 1, 0, 2 * 2 * 20)] * 3


@pytest.mark.parametrize("preset", presets.names())
def test_simulate_with_an_empty_gradient_returns_empty_updates(preset):
    res = simulate(presets.make(preset, 0.1), np.zeros((2, 3, 0), np.float32))
    assert res.updates.shape == (2, 3, 0) and res.residuals.shape == (2, 3, 0)


@pytest.mark.parametrize("adjust, most", [("lstm", 0.0), ("bert", 0.1), ("vgg", 0.02)])
def test_gaussiank_with_k_1_sends_in_almost_every_step(adjust, most):
    # n = 100, density 0.01: k = 1, so floor(3k/4) = 0 used to stop the threshold adjustment before it began
    g = np.random.default_rng(0).standard_normal((100, 2, 100)).astype(np.float32)
    res = simulate(Compression.gaussiank(0.01, adjust=adjust), g)
    assert (res.selected == 0).mean() <= most
