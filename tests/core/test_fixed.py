"""The fixed-size selections (hvd_sparse/core/xp/fixed.py): every backend and path gives the same bits -- numpy (the
host implementation), numpy with the C kernels, torch on the CPU, torch on the device path (the operations a GPU
runs, forced here on CPU tensors) -- on data with ties, zeros and more candidates than fit."""

import numpy as np
import pytest
import torch

from hvd_sparse.bench.syncs import HostReads, as_if_on_a_device
from hvd_sparse.core.xp import NumpyBackend, TorchBackend
from hvd_sparse.core.xp.fixed import lower_bounds
from hvd_sparse.core.xp.generic import rule_mask

NP, TORCH = NumpyBackend(), TorchBackend()


def data(seed, n=5000):
    """Gradient-like values with exact ties (rounded), zeros and both signs."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.standard_normal(n) * 8).astype(np.float32) / 8
    x[rng.random(n) < 0.2] = 0.0
    return x


def on_every_path(fn, x):
    """``fn(xp, array)`` as numpy arrays, on numpy, torch CPU and the torch device path."""
    outs = [fn(NP, x.copy()), fn(TORCH, torch.from_numpy(x.copy()))]
    with as_if_on_a_device():
        outs.append(fn(TORCH, torch.from_numpy(x.copy())))
    return [tuple(np.asarray(o.numpy() if isinstance(o, torch.Tensor) else o) for o in out) for out in outs]


def same(outs):
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
    return outs[0]


@pytest.mark.parametrize("rule", ["ge", "gt", "ge_nonzero"])
def test_the_bounds_select_what_the_rule_selects(rule):
    mag = np.abs(data(1))
    for th in (0.0, 0.125, 0.3, 1.0, 100.0):
        u = lower_bounds([th], rule)[0]
        np.testing.assert_array_equal(mag >= u, rule_mask(NP, mag, th, rule))


@pytest.mark.parametrize("k", [1, 7, 300, 3999, 4000, 6000])
def test_topk_padded_is_the_exact_topk_padded_with_n(k):
    x = data(2)
    idx, th, count = same(on_every_path(lambda xp, a: xp.topk_padded(a, k), x))
    want, want_th = NP.topk(x, min(k, x.size))
    assert idx.size == k and (idx[want.size:] == x.size).all()
    np.testing.assert_array_equal(idx[:want.size], want)
    assert float(th) == want_th and int(count) == want.size


def largest_first(mag, passing, cap):
    """The oracle of a cut: the ``cap`` entries of ``passing`` (positions) of the largest ``mag``, ties by the lower
    position, ascending."""
    order = sorted(passing.tolist(), key=lambda i: (-mag[i], i))
    return np.sort(np.asarray(order[:cap], np.int64))


@pytest.mark.parametrize("rule", ["ge", "gt", "ge_nonzero"])
@pytest.mark.parametrize("cap", [10, 400, 4000])
def test_select_capped_climbs_the_ladder_until_the_selection_fits(rule, cap):
    """Up the ladder until at most ``cap`` pass; past its top (caps 10 and 400 here) the ``cap`` largest of the top rung stay,
    ties by the lower index, on every path alike."""
    x = data(3)
    factors = (1.0, 1.5, 2.25, 3.375)
    idx, count, rung = same(on_every_path(
        lambda xp, a: xp.select_capped(a, xp.ladder(0.25, factors, a), rule, cap, 10**6, base=7), x))
    mag = np.abs(x)
    counts = [int(rule_mask(NP, mag, 0.25 * f, rule).sum()) for f in factors]
    j = next((i for i, c in enumerate(counts) if c <= cap), len(factors) - 1)
    want = largest_first(mag, np.flatnonzero(rule_mask(NP, mag, 0.25 * factors[j], rule)), cap) + 7
    assert (counts[-1] > cap) == (cap < 4000)        # the smaller capacities are cut past the top
    assert int(count) == want.size and int(rung) == j
    np.testing.assert_array_equal(idx, np.concatenate([want, np.full(cap - want.size, 10**6)]))
    counted = same(on_every_path(lambda xp, a: (xp.ladder_counts(a, xp.ladder(0.25, factors, a), rule),), x))[0]
    assert counted.tolist() == counts
    first = same(on_every_path(
        lambda xp, a: xp.select_capped(a, xp.ladder(0.25, factors, a), rule, cap, 10**6, counts=3), x))
    assert int(first[2]) == j and first[3].tolist() == counts[:3]


@pytest.mark.parametrize("th, cap", [(0.25, 4000), (0.25, 400), (0.25, 10), (2.7, 10)])
def test_select_capped_from_a_start_rung_counts_the_rungs_below_it(th, cap):
    """``start``: the selection begins at that rung (never below it, even where a lower one fits or where it passes
    none), and the counts still cover the rungs below it, on every path alike (Ok-Topk's owners count Γ/f, send from
    Γ). th = 2.7: the rungs from the start pass none, the one below 22."""
    x = data(4)
    factors = (1.0, 1.5, 2.25, 3.375)
    idx, count, rung, counted = same(on_every_path(
        lambda xp, a: xp.select_capped(a, xp.ladder(th, factors, a), "ge_nonzero", cap, -1, counts=4, start=1), x))
    mag = np.abs(x)
    counts = [int(rule_mask(NP, mag, th * f, "ge_nonzero").sum()) for f in factors]
    j = next((i for i in range(1, 4) if counts[i] <= cap), 3)
    j = min(j, max(1, sum(c > 0 for c in counts) - 1))
    want = largest_first(mag, np.flatnonzero(rule_mask(NP, mag, th * factors[j], "ge_nonzero")), cap)
    assert counted.tolist() == counts and int(rung) == j and int(count) == want.size
    np.testing.assert_array_equal(idx, np.concatenate([want, np.full(cap - want.size, -1)]))
    assert (counts[0] <= cap) == (cap == 4000) and (counts[1] == 0 < counts[0]) == (th == 2.7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_largest_in_runs_keeps_each_runs_largest_ties_by_the_lower_position(seed):
    """Ok-Topk's split capacity: each run of consecutive entries keeps its ``caps[j]`` largest magnitudes (ties by the
    lower position; runs that fit keep everything, empty runs and caps of 0 included), the positions ascending and
    padded with ``fill``, on every path alike."""
    x = data(5 + seed, 600)
    rng = np.random.default_rng(seed)
    lengths = rng.multinomial(600, rng.dirichlet(np.ones(12))).tolist()
    caps = [int(rng.integers(0, m + 3)) for m in lengths]
    pos = same(on_every_path(lambda xp, a: (xp.largest_in_runs(a, lengths, caps, -1),), x))[0]
    mag, start, want = np.abs(x), 0, []
    for m, c in zip(lengths, caps):
        want.append(start + largest_first(mag[start:start + m], np.arange(m), c))
        start += m
    want = np.concatenate(want)
    np.testing.assert_array_equal(pos, np.concatenate([want, np.full(600 - want.size, -1)]))
    assert 0 < want.size < 600


@pytest.mark.parametrize("cap", [1, 5, 40])
def test_a_selection_past_the_ladder_keeps_the_largest_wherever_they_are(cap):
    """A cut keeps the largest magnitudes, not the lowest indexes: here the largest lie at the end of the buffer,
    behind many ties and zeros that pass the one rung; ``select_at`` (a known count) cuts alike."""
    x = np.ones(3000, np.float32)
    x[::7] = 0.0
    x[-cap * 3:] = np.linspace(2.0, 3.0, cap * 3, dtype=np.float32)[::-1]
    x[100] = 2.5                                     # a tie with one of the tail's, at a lower index
    mag = np.abs(x)
    want = largest_first(mag, np.flatnonzero(mag > 0), cap)
    idx, count, rung = same(on_every_path(lambda xp, a: xp.select_capped(a, [0.5], "ge_nonzero", cap, -1), x))
    np.testing.assert_array_equal(idx, want)
    assert int(count) == cap and int(rung) == 0
    at = same(on_every_path(lambda xp, a: (xp.select_at(a, 0.5, "gt", cap, -1, int((mag > 0.5).sum())),), x))[0]
    np.testing.assert_array_equal(at, want)


@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 4], [4, 0, 0], [2, 3, 0, 0, 1], [7]])
def test_repeat_gives_each_value_its_segment_also_around_empty_ones(counts):
    vals = np.arange(1, len(counts) + 1, dtype=np.float32)
    out = same(on_every_path(lambda xp, a: (xp.repeat(a, counts, sum(counts)),), vals))[0]
    np.testing.assert_array_equal(out, np.repeat(vals, counts))


@pytest.mark.parametrize("guard", [None, (300, 200, 20), (5000, 10, 3)])
@pytest.mark.parametrize("th", [0.01, 0.5, 2.0])
def test_the_kernels_climb_the_full_ladder_to_the_hosts_rung_in_few_passes(th, guard):
    """The C kernels search the monotone rung counts instead of counting every rung: the same rung and selection
    as the host rule (FixedOps, which counts them all), in a few passes: at most 12 counts per search of 60 rungs
    (a gallop and a halving), a search for the guard and one for the capacity, and the selecting pass (two when
    the last rung passes far more than fit: its workspace grows)."""
    from hvd_sparse.core import native
    from hvd_sparse.core.sparsifiers.base import CLIMB
    from hvd_sparse.core.xp.fixed import FixedOps
    if not native.available():
        pytest.skip("the C kernels are not built")
    x = data(4, n=20000)
    args = (NP.ladder(th, CLIMB, x), "ge", 150, 10**6)
    before = native.calls()
    got = NP.select_capped(x, *args, guard=guard)
    passes = native.calls() - before
    want = FixedOps.select_capped(NP, x, *args, guard=guard)
    np.testing.assert_array_equal(NP.to_numpy(got[0]), NP.to_numpy(want[0]))
    assert got[1:] == want[1:]
    assert passes <= (2 * 12 if guard else 12) + 2


@pytest.mark.parametrize("order", ["ascending", "rows", "shuffled"])
def test_members_keeps_the_common_entries_in_place(order):
    """Ok-Topk's included set: the selection (ascending, padded) where the gathered sums hold it. The gathered
    indexes arrive ascending (the merge kernel's one pass), as rows padded each (a device's), or in any order."""
    a = np.array([1, 4, 5, 9, 12, 20, 20], np.int64)
    b = {"ascending": [0, 4, 9, 11, 12, 20, 20], "rows": [[0, 4, 20], [9, 11, 12]],
         "shuffled": [12, 20, 4, 0, 9, 11]}[order]
    want = [20, 4, 20, 9, 12, 20, 20]
    for wide in (True, False):
        got = same(on_every_path(lambda xp, x: (xp.members(
            x, xp.asarray(np.array(b), xp.index_dtype if wide else xp.int32, like=x), 20),), a))
        assert got[0].tolist() == want


@pytest.mark.parametrize("P", [1, 2, 5])
def test_region_sums_add_the_sources_in_rank_order(P):
    """The host keeps the sums on their support, a device a dense region: the same (index, value) pairs, as a
    selection of the largest sums (``RegionSums.pairs``) shows."""
    rng = np.random.default_rng(P)
    lo, hi, n, runs, vals, pieces = 10, 60, 80, [], [], []
    for s in range(P):
        m = int(rng.integers(0, 20))
        idx = np.sort(rng.choice(np.arange(lo, hi), m, replace=False))
        pad = int(rng.integers(0, 4))
        runs.append(np.concatenate([idx, np.full(pad, n)]))
        vals.append(np.concatenate([rng.standard_normal(m).astype(np.float32), np.zeros(pad, np.float32)]))
        pieces += [(m, True), (pad, False)]
    idx, val = np.concatenate(runs).astype(np.int64), np.concatenate(vals)
    want = np.zeros(n + 1, np.float32)
    for r, v in zip(runs, vals):
        want[r] += v
    support = np.flatnonzero(want[:n])

    def largest(xp, i, v):
        region = xp.region_sums(i, v, pieces, lo, hi, n)
        pos = xp.topk_padded(region.values, 30)[0]
        return region.pairs(xp, pos)

    outs = [largest(NP, idx, val), largest(TORCH, torch.from_numpy(idx), torch.from_numpy(val))]
    with as_if_on_a_device():
        outs.append(largest(TORCH, torch.from_numpy(idx), torch.from_numpy(val)))
    got_i, got_v = same([tuple(np.asarray(o) for o in out) for out in outs])
    top = np.sort(support[np.argsort(-np.abs(want[support]), kind="stable")[:30]])
    np.testing.assert_array_equal(got_i[:top.size], top)
    np.testing.assert_array_equal(got_v[:top.size], want[top])
    assert (got_i[top.size:] == n).all() and (got_v[top.size:] == 0).all()


def test_the_device_paths_make_no_host_read():
    x = torch.from_numpy(data(4))
    reads = HostReads()
    with as_if_on_a_device(), reads:
        TORCH.topk_padded(x, 100)
        th = torch.tensor(0.25, dtype=torch.float64)
        TORCH.select_capped(x, TORCH.ladder(th, (1.0, 2.0), x), "ge_nonzero", 100, x.numel())
        TORCH.ladder_counts(x, TORCH.ladder(th, (1.0, 2.0), x), "gt")
        TORCH.members(torch.arange(5), torch.arange(3), 5)
        TORCH.region_sums(torch.arange(6), torch.ones(6), [(3, True), (3, True)], 0, 6, 6)
    assert reads.reads == 0, reads.where
