"""The two-level step (hvd_sparse/core/hierarchy.py): dense inside a host, the preset's own algorithm across the
hosts on each shard. Against its oracle -- the flat preset on N virtual ranks holding the hosts' sums of one shard,
shard by shard --, bit for bit; L = 1 is the flat step itself, N = 1 a dense allreduce; replicas, mass, the residual's
size, the non-finite policy, disagreement inside a host and the words that cross the hosts."""

import warnings

import numpy as np
import pytest

from hvd_sparse.bench import presets
from hvd_sparse.core.errors import NonFiniteGradientError, RankDisagreementError
from hvd_sparse.core.hierarchy import Topology, TwoLevelEngine, clipped, shard_of
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.testing import simulate

from oracles import assert_mass_conserved, int_grads

STEPS, P, L, N_ENTRIES, DENSITY = 5, 4, 2, 600, 0.05
LAYOUT = [(250,), (7,), (300,), (43,)]


def two_level_oracle(comp, g, L, layout):
    """The two-level step written out: per shard j, the flat preset on N = P / L virtual ranks whose gradients are
    the hosts' sums of shard j (added in local-rank order), its sum over the hosts scaled by 1/P."""
    steps, P, n = g.shape
    N = P // L
    hosts = g.reshape(steps, N, L, n)
    sums = hosts[:, :, 0].copy()
    for i in range(1, L):
        sums = sums + hosts[:, :, i]
    out = np.zeros((steps, n), np.float32)
    for j in range(L):
        lo, hi = shard_of(n, L, j)
        res = simulate(comp, np.ascontiguousarray(sums[:, :, lo:hi]), shapes=[(m,) for m in clipped(layout, lo, hi)],
                       average=False, record=("updates",))
        out[:, lo:hi] = res.updates[:, 0]
    return out / np.float32(P)


SPARSE = [p for p in presets.names() if p != "dense"]


@pytest.mark.parametrize("name", SPARSE)
def test_each_shard_runs_the_preset_itself_across_the_hosts(name):
    g = int_grads(STEPS, P, N_ENTRIES, seed=3) / np.float32(7)      # inexact sums: their order shows
    comp = presets.make(name, DENSITY)
    res = simulate(comp, g, shapes=LAYOUT, local_size=L)
    want = two_level_oracle(comp, g, L, [s[0] for s in LAYOUT])
    for r in range(P):                                      # every rank the same bits, the oracle's
        np.testing.assert_array_equal(res.updates[:, r], want)


@pytest.mark.parametrize("name", ["topka", "oktopk", "exdyna"])
def test_four_ranks_a_host_add_in_local_rank_order(name):
    """P = 8 on 2 hosts of 4: a host's sum of 4 inexact pieces, in local-rank order, as the oracle adds them."""
    g = int_grads(3, 8, N_ENTRIES, seed=17) / np.float32(7)
    comp = presets.make(name, DENSITY)
    res = simulate(comp, g, shapes=LAYOUT, local_size=4, record=("updates",))
    np.testing.assert_array_equal(res.updates[:, 5], two_level_oracle(comp, g, 4, [s[0] for s in LAYOUT]))


@pytest.mark.parametrize("name", [p for p in SPARSE if p != "gtopk"])
def test_two_levels_conserve_mass_and_keep_a_shard_of_residual_per_rank(name):
    g = int_grads(STEPS, P, N_ENTRIES, seed=5)
    res = simulate(presets.make(name, DENSITY), g, local_size=L, average=False)
    assert_mass_conserved(g, res)
    for r in range(P):
        lo, hi = shard_of(N_ENTRIES, L, r % L)
        outside = np.concatenate([res.residuals[:, r, :lo], res.residuals[:, r, hi:]], axis=1)
        assert not outside.any() and hi - lo == N_ENTRIES // L


@pytest.mark.parametrize("name", ["topka", "oktopk", "exdyna"])
def test_one_rank_a_host_is_the_flat_step_bit_for_bit(name):
    g = int_grads(STEPS, P, N_ENTRIES, seed=7).astype(np.float32) / 7
    comp = presets.make(name, DENSITY)
    flat, one = simulate(comp, g), simulate(comp, g, local_size=1)
    assert flat.updates.tobytes() == one.updates.tobytes()
    assert flat.residuals.tobytes() == one.residuals.tobytes()


def test_one_host_is_a_dense_allreduce():
    g = int_grads(STEPS, P, N_ENTRIES, seed=9)
    res = simulate(presets.make("topka", DENSITY), g, local_size=P, average=False)
    np.testing.assert_array_equal(res.updates, np.repeat(g.sum(axis=1)[:, None], P, axis=1))
    assert not res.residuals.any()
    assert all(res.volume[t][r]["across"]["sent_words"] == 0 for t in range(STEPS) for r in range(P))


@pytest.mark.parametrize("local_size", [2, 4])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(local_size):
    g = int_grads(4, P, N_ENTRIES, seed=11)
    g[2, 3, 5] = np.nan                                     # rank 3, step 2: the shard of local rank 0
    comp = presets.make("oktopk", DENSITY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = simulate(comp, g, local_size=local_size)
        clean = simulate(comp, np.delete(g, 2, axis=0), local_size=local_size)
    assert np.isnan(res.updates[2]).all()
    np.testing.assert_array_equal(np.delete(res.updates, 2, axis=0), clean.updates)
    with pytest.raises(NonFiniteGradientError):
        simulate(comp, g, local_size=local_size, nonfinite="raise")


def test_ranks_of_one_host_that_disagree_raise_on_every_rank():
    world = SimulatedWorld(P)
    engines = [TwoLevelEngine(presets.make("topka", DENSITY), Topology(*c)) for c in world.two_levels(L)]
    sizes = [600, 600, 600, 601]                            # rank 3's gradient has another size

    def run(comm):
        engines[comm.rank].step(np.ones(sizes[comm.rank], np.float32))

    with pytest.raises(RankDisagreementError):
        world.run(run)


def test_only_the_shards_selections_cross_the_hosts():
    """At P = 4 on 2 hosts the words received across the hosts: TopkA's at most 0.4x its flat step's, every other
    sparse preset's at most 0.6x (docs/algorithms.md, "Two levels"). A flat rank receives from P - 1 peers, P - L
    of them on other hosts: the flat step's words across the hosts are (P - L) / (P - 1) of what it receives (exact
    where a rank hears alike from every peer: an allgather, the opening)."""
    g = int_grads(6, P, 20_000, seed=13).astype(np.float32)
    for name in SPARSE:
        comp = presets.make(name, 0.01)
        flat, two = simulate(comp, g, record=("volume",)), simulate(comp, g, local_size=L, record=("volume",))
        across = sum(two.volume[t][r]["across"]["recv_words"] for t in range(2, 6) for r in range(P))
        flat_across = sum(flat.volume[t][r]["recv_words"] for t in range(2, 6) for r in range(P)) * (P - L) / (P - 1)
        assert across <= (0.4 if name == "topka" else 0.6) * flat_across, (name, across / flat_across)


def test_a_preset_that_says_flat_runs_flat_on_hosts_too():
    g = int_grads(3, P, N_ENTRIES, seed=19) / np.float32(7)
    for comp in (presets.make("dense", DENSITY), presets.make("topka", DENSITY, hierarchical=False)):
        assert simulate(comp, g, local_size=L).updates.tobytes() == simulate(comp, g).updates.tobytes()


def test_local_size_must_divide_the_ranks():
    with pytest.raises(ValueError, match="local_size"):
        simulate(presets.make("topka", DENSITY), int_grads(2, 4, 100, seed=1), local_size=3)


def run_engines(engines, world, g, steps):
    """Drive ``engines`` (one per rank of ``world``) through the gradients ``g[steps]``: their updates (t, P, n)."""
    out = np.zeros((len(steps), world.size, g.shape[-1]), np.float32)

    def run(comm):
        for i, t in enumerate(steps):
            out[i, comm.rank] = engines[comm.rank].step(g[t, comm.rank])

    world.run(run)
    return out


def test_a_checkpoint_resumes_bit_for_bit_and_another_topology_starts_afresh():
    g = int_grads(5, P, N_ENTRIES, seed=23) / np.float32(7)
    comp = presets.make("oktopk", DENSITY)
    whole = simulate(comp, g, local_size=L, record=("updates",)).updates
    world = SimulatedWorld(P)
    first = [TwoLevelEngine(comp, Topology(*c)) for c in world.two_levels(L)]
    run_engines(first, world, g, range(3))
    states = [e.state_dict() for e in first]
    world = SimulatedWorld(P)
    again = [TwoLevelEngine(comp, Topology(*c)) for c in world.two_levels(L)]
    for e, s in zip(again, states):
        e.load_state_dict(s)
    np.testing.assert_array_equal(run_engines(again, world, g, range(3, 5)), whole[3:])
    flat = comp.new_engine(None)                             # a flat rank meets a shard's state: afresh
    with pytest.warns(RuntimeWarning):
        flat.load_state_dict(states[0])
    assert flat.memory.residual is None and flat.steps == 0
    world = SimulatedWorld(P)                               # a shard meets a flat state: afresh
    fresh = [TwoLevelEngine(comp, Topology(*c)) for c in world.two_levels(L)]
    with pytest.warns(RuntimeWarning):
        fresh[0].load_state_dict(dict(flat.state_dict(), unit="model"))
    assert fresh[0].steps == 0
