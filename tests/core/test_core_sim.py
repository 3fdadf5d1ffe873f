"""Simulator tests of the engine core (docs/algorithms.md#invariants): dense is the mean, replica consistency, P = 1
and all-zero gradients (the dense and TopkA presets), the exact top-k, the simulator itself, the arguments, and
state_dict and gradient pieces for every preset. TopkA's own tests (the sum of the local top-k, its volume, mass
conservation) are in test_topka.py."""

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse.core.sim import CollectiveMismatchError, SimulatedWorld
from hvd_sparse.core.selection import topk_indices
from hvd_sparse.core.xp import backend_of
from hvd_sparse.testing import simulate

from oracles import int_grads, topka_reference

PS = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("P", PS)
def test_dense_is_the_mean(P):
    g = int_grads(3, P, 257, seed=P)
    res = simulate(hvd_sparse.Compression.dense(), g)
    total = g.sum(axis=1)
    for t in range(3):
        for r in range(P):
            if P & (P - 1) == 0:
                np.testing.assert_array_equal(res.updates[t, r], total[t] / P)
            else:
                np.testing.assert_allclose(res.updates[t, r] * P, total[t], rtol=1e-7)
    assert not res.residuals.any()


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("preset", ["dense", "topka"])
def test_every_rank_holds_the_same_bits(P, preset):
    rng = np.random.default_rng(P)
    g = rng.standard_normal((5, P, 1000)).astype(np.float32) * rng.lognormal(0, 2, size=1000).astype(np.float32)
    comp = hvd_sparse.Compression.dense() if preset == "dense" else hvd_sparse.Compression.topka(0.01)
    res = simulate(comp, g)
    for r in range(1, P):
        assert res.updates[:, r].tobytes() == res.updates[:, 0].tobytes()


@pytest.mark.parametrize("preset", ["dense", "topka"])
def test_single_rank_issues_no_collective_and_keeps_semantics(preset):
    g = int_grads(5, 1, 200, seed=5)
    comp = hvd_sparse.Compression.dense() if preset == "dense" else hvd_sparse.Compression.topka(0.05)
    res = simulate(comp, g)
    assert all(v[0]["collectives"] == 0 and v[0]["recv_words"] == 0 for v in res.volume)
    if preset == "topka":
        ref_u, ref_eps, _ = topka_reference(g, 0.05, average=True)
        np.testing.assert_array_equal(res.updates[:, 0], ref_u)
        np.testing.assert_array_equal(res.residuals[:, 0], ref_eps[:, 0])
    else:
        np.testing.assert_array_equal(res.updates[:, 0], g[:, 0])


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("preset", ["dense", "topka"])
def test_all_zero_gradients_give_zero_update_and_residual(P, preset):
    g = np.zeros((3, P, 100), np.float32)
    comp = hvd_sparse.Compression.dense() if preset == "dense" else hvd_sparse.Compression.topka(0.1)
    res = simulate(comp, g)
    assert not res.updates.any() and not res.residuals.any()
    assert not res.selected.any() or preset == "dense"


# -- topk selection -----------------------------------------------------------------------------------
def test_topk_ties_broken_by_lower_index_and_zeros_never_selected():
    x = np.array([0, 3, -5, 3, 0, 5, 3, 1], np.float32)
    idx, th = topk_indices(backend_of(x), x, 4)
    assert idx.tolist() == [1, 2, 3, 5] and th == 3.0
    idx, _ = topk_indices(backend_of(x), x, 8)
    assert idx.tolist() == [1, 2, 3, 5, 6, 7]
    z = np.zeros(10, np.float32)
    assert topk_indices(backend_of(z), z, 3)[0].size == 0


def test_simulator_detects_mismatched_collectives_instead_of_pairing_them():
    world = SimulatedWorld(2)

    def body(comm):
        x = np.ones(3, np.float32)
        return comm.allgather(x, "values" if comm.rank == 0 else "indices")

    with pytest.raises(CollectiveMismatchError, match="rank 0: allgather 'values'"):
        world.run(body)


def test_simulator_one_rank_raising_does_not_hang_the_others():
    world = SimulatedWorld(3, timeout=30)

    def body(comm):
        if comm.rank == 1:
            raise RuntimeError("boom on rank 1")
        return comm.allreduce(np.ones(2, np.float32), "sum", "x")

    with pytest.raises(RuntimeError, match="boom on rank 1"):
        world.run(body)


# -- arguments ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-0.1, ValueError), (1.5, ValueError),
                                      (float("nan"), ValueError), ("0.01", TypeError), (True, TypeError)])
def test_density_is_validated_with_a_message_naming_it(bad, exc):
    with pytest.raises(exc, match="density"):
        hvd_sparse.Compression.topka(bad)


def test_density_given_in_percent_gets_a_hint():
    with pytest.raises(ValueError, match="pass density=0.05"):
        hvd_sparse.Compression.topka(5)


def test_sparse_rejects_unknown_allreduce_listing_valid_names():
    with pytest.raises(ValueError, match="must be one of .*topka"):
        hvd_sparse.Compression.sparse(hvd_sparse.TopK(0.1), allreduce="nope")


def test_simulate_validates_shapes():
    with pytest.raises(ValueError, match="steps, P, n"):
        simulate(hvd_sparse.Compression.topka(0.1), np.zeros((2, 3)))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_simulate_gradients_made_on_demand_equal_the_array_run(backend):
    """``gradients`` as a function (t, rank) is called once per step and rank, each rank in step order, and gives
    the same bits as the (steps, P, n) array."""
    P, steps = 3, 5
    g = int_grads(steps, P, 300, seed=7)
    calls = [[] for _ in range(P)]

    def grad(t, r):
        calls[r].append(t)
        return g[t, r]

    comp = hvd_sparse.Compression.oktopk(0.05)
    a = simulate(comp, g, backend=backend, average=False)
    b = simulate(comp, grad, steps=steps, size=P, backend=backend, average=False)
    assert calls == [list(range(steps))] * P
    assert a.updates.tobytes() == b.updates.tobytes() and a.residuals.tobytes() == b.residuals.tobytes()
    assert a.volume == b.volume and a.info == b.info and (a.selected == b.selected).all()


def test_simulate_records_what_is_asked_and_the_states_as_they_were():
    """``record`` leaves out what is not asked for; "states" keeps each step's states (copies, not the live
    dicts), equal to what the engine held right after that step."""
    import copy

    g = int_grads(6, 2, 400, seed=3)
    comp = hvd_sparse.Compression.oktopk(0.05, threshold_period=2)
    full = simulate(comp, g)
    assert full.sparsifier_states is None and full.reducer_states is None and full.observed is None
    few = simulate(comp, g, record=("selected",))
    assert few.updates is None and few.residuals is None and few.info is None and few.volume is None
    assert (few.selected == full.selected).all()
    seen = simulate(comp, g, record=("states",),
                    after_step=lambda t, r, e: copy.deepcopy((e.sparsifier_state, e.reducer_state)))
    for t in range(6):
        for r in range(2):
            sp, rd = seen.observed[t][r]
            assert seen.sparsifier_states[t][r] == sp and seen.reducer_states[t][r]["offsets"] == rd["offsets"]
    assert len({seen.sparsifier_states[t][0]["threshold"] for t in range(6)}) > 1   # not one aliased dict


def test_simulate_hooks_run_on_every_rank_around_every_step_over_the_given_communicator():
    """``before_step`` runs before each step, ``after_step`` after it (its result kept), and the engines talk to
    what ``communicator`` returns."""
    class Counting:
        """Counts this rank's collectives and delegates them."""

        def __init__(self, comm):
            self.comm, self.rank, self.size, self.meter, self.calls = comm, comm.rank, comm.size, comm.meter, 0

        def allreduce(self, x, op, phase, bucket=None):
            self.calls += 1
            return self.comm.allreduce(x, op, phase, bucket=bucket)

        def allgather(self, x, phase, parts=None):
            self.calls += 1
            return self.comm.allgather(x, phase, parts=parts)

        def grouped_allgather(self, xs, phases):
            self.calls += 1
            return self.comm.grouped_allgather(xs, phases)

        def alltoall(self, x, splits, phase, parts=None):
            self.calls += 1
            return self.comm.alltoall(x, splits, phase, parts=parts)

        def broadcast(self, x, root, phase):
            self.calls += 1
            return self.comm.broadcast(x, root, phase)

    P, steps = 3, 4
    g = int_grads(steps, P, 200, seed=1)
    order = [[] for _ in range(P)]
    res = simulate(hvd_sparse.Compression.topka(0.05), g, communicator=Counting,
                   before_step=lambda t, r, e: order[r].append(("before", t, e.steps)),
                   after_step=lambda t, r, e: (order[r].append(("after", t, e.steps)), e.comm.calls)[1])
    assert order == [[(w, t, t + (w == "after")) for t in range(steps) for w in ("before", "after")]] * P
    for r in range(P):
        calls = [0] + [res.observed[t][r] for t in range(steps)]
        assert all(calls[t + 1] - calls[t] >= res.volume[t][r]["collectives"] > 0 for t in range(steps))
    np.testing.assert_array_equal(res.updates, simulate(hvd_sparse.Compression.topka(0.05), g).updates)


@pytest.mark.parametrize("kwargs, match", [
    (dict(record=("updates", "thresholds")), "thresholds"),
    (dict(after_step=3), "after_step must be callable"),
    (dict(steps=3), "contradict"),
])
def test_simulate_rejects_bad_options_naming_them(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        simulate(hvd_sparse.Compression.topka(0.1), np.zeros((2, 3, 10), np.float32), **kwargs)


def test_simulate_needs_steps_and_size_with_a_gradient_function():
    with pytest.raises(ValueError, match="steps >= 1 and size >= 1"):
        simulate(hvd_sparse.Compression.topka(0.1), lambda t, r: np.zeros(10, np.float32), steps=3)
    with pytest.raises(ValueError, match="1-D"):
        simulate(hvd_sparse.Compression.topka(0.1), lambda t, r: np.zeros((2, 5), np.float32), steps=1, size=2)


@pytest.mark.parametrize("device", [False, True])
@pytest.mark.parametrize("preset", ["topka", "gaussiank", "topk_dsa", "gtopk", "oktopk", "exdyna", "dct", "spardl"])
def test_state_dict_round_trip_resumes_bit_for_bit(preset, device):
    """Engines rebuilt from state_dict() continue exactly as uninterrupted ones; without it they do not. On the
    device paths (torch tensors as on a GPU) the statistics a step leaves on the device come back as plain values."""
    import contextlib
    import json

    import torch
    from hvd_sparse.bench.presets import make
    from hvd_sparse.bench.syncs import as_if_on_a_device

    g = np.random.default_rng(0).standard_normal((16, 3, 600)).astype(np.float32)

    def run(start, steps, states=None):
        comp = make(preset, 0.05)
        world = SimulatedWorld(3)
        comms = world.communicators()
        engines = [comp.new_engine(c) for c in comms]
        for e, s in zip(engines, states or []):
            e.load_state_dict(s)
        outs = [[] for _ in range(3)]

        def body(comm):
            for t in range(start, start + steps):
                x = torch.from_numpy(g[t, comm.rank].copy()) if device else g[t, comm.rank]
                outs[comm.rank].append(np.asarray(engines[comm.rank].step(x)))

        with as_if_on_a_device() if device else contextlib.nullcontext():
            world.run(body, comms)
        return engines, np.array(outs)

    _, straight = run(0, 16)
    engines, _ = run(0, 8)
    states = [e.state_dict() for e in engines]
    json.dumps([{key: s[key] for key in ("sparsifier", "reducer")} for s in states])      # plain values only
    _, resumed = run(8, 8, states)
    _, cold = run(8, 8)
    assert resumed.tobytes() == straight[:, 8:].tobytes()
    assert cold.tobytes() != straight[:, 8:].tobytes()


def test_state_names_its_unit_and_a_state_of_another_unit_is_refused():
    """A state records its unit as "unit"; a state of another unit is refused by name."""
    comp = hvd_sparse.Compression.topka(0.1)
    engine = comp.new_engine(SimulatedWorld(1).communicators()[0], "fc")
    engine.step(np.arange(1, 101, dtype=np.float32))
    state = engine.state_dict()
    assert state["unit"] == "fc"
    fresh = comp.new_engine(SimulatedWorld(1).communicators()[0], "fc")
    fresh.load_state_dict(state)
    assert fresh.steps == 1 and fresh.memory.residual.tobytes() == engine.memory.residual.tobytes()
    with pytest.raises(ValueError, match="unit 'other': the state is of unit 'fc'"):
        comp.new_engine(SimulatedWorld(1).communicators()[0], "other").load_state_dict(state)


@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("name", __import__("hvd_sparse.bench.presets", fromlist=["names"]).names())
def test_engine_on_gradient_pieces_written_in_place_equals_the_flat_path(name, P):
    """What the torch optimizer does -- the engine reads the gradients where they are (a list of pieces, one fp16)
    and writes the averaged result back into them (``out=``) -- gives the same bits as one flat float32 buffer
    in and a new flat result out, step after step (error feedback, thresholds and partitions included)."""
    import torch

    from hvd_sparse.bench.presets import make

    sizes = [40, 7, 90, 23]
    g = int_grads(6, P, sum(sizes), seed=P, scale=2**8)      # integers <= 2^8: exact in fp16 too
    world = SimulatedWorld(P)
    comms_flat, comms_pieces = world.communicators(), SimulatedWorld(P).communicators()
    flat_engines = [make(name, 0.1).new_engine(c) for c in comms_flat]
    piece_engines = [make(name, 0.1).new_engine(c) for c in comms_pieces]

    def body(comm):                    # rank r's thread drives both worlds, in the same order on every rank
        r = comm.rank
        a, b = flat_engines[r], piece_engines[r]
        a.layout = b.layout = sizes
        for t in range(6):
            want = a.step(torch.from_numpy(g[t, r].copy())).split(sizes)
            pieces = list(torch.from_numpy(g[t, r].copy()).split(sizes))
            pieces[1] = pieces[1].half()
            assert b.step(pieces, out=pieces) is pieces
            for p, w in zip(pieces, want):
                assert p.numpy().tobytes() == w.to(p.dtype).numpy().tobytes(), (name, P, t, r)
            ra, rb = a.memory.residual, b.memory.residual
            assert (ra is None and rb is None) or ra.numpy().tobytes() == rb.numpy().tobytes()
            assert a.last["selected"] == b.last["selected"]
        return True

    assert all(world.run(body, comms_flat))
