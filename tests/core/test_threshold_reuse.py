"""Simulator tests of ThresholdReuse, Ok-Topk's sparsifier (hvd_sparse/core/oktopk/selection.py),
docs/algorithms.md#oktopk: the guard and band bookkeeping of the local threshold, the select rules, ThresholdReuse
with TopkA, its arguments, and the density it reaches on the benchmark data. The reducer and the pair together are in
test_oktopk.py."""

import numpy as np
import pytest

from hvd_sparse.compression import SparseCompression
from hvd_sparse.core.reducers.topka import TopkA
from hvd_sparse.core.sparsifiers.base import ladder_factors
from hvd_sparse.core.oktopk.selection import ThresholdReuse

from oracles import (Recording, acc_of, assert_mass_conserved, distinct_grads, drifting_grads, mean_density_ratio,
                     oktopk_reference, rule_mask)
from oracles import make_oktopk as make
from oracles import run_oktopk as run


def count_rule(a, th, rule="ge_nonzero"):
    return int(rule_mask(a, th, rule).sum())


@pytest.mark.parametrize("P", [1, 3, 4])
def test_threshold_guard_and_band_bookkeeping(P):
    steps, n, density = 40, 400, 0.05
    k = int(density * n)
    g = drifting_grads(steps, P, n, seed=15 + P)
    res = run(make(density, tp=10, rp=20), g)
    seen = set()
    for t in range(1, steps):
        for r in range(P):
            s_prev, s = res["sp"][t - 1][r], res["sp"][t][r]
            if s["reeval"]:
                continue
            a = acc_of(g, res, t)[r]
            L, raises = s_prev["threshold"], s["guard_raises"]
            F = ladder_factors(1.03, 60)                             # L·1.03^j: the guard's rungs, the capacity's
            assert s["threshold_used"] == L * F[raises]
            # raised only while more than the capacity pass (1.25k: below the guard's trigger and limit, 1.5k)
            cap = ThresholdReuse(density).capacity(k, n)
            assert all(count_rule(a, L * F[j]) > cap for j in range(raises))
            assert count_rule(a, L * F[raises]) <= cap
            m = s["selected"]
            assert m == count_rule(a, L * F[raises])
            L = s["threshold_used"]
            expect = L / 1.012 if m < 0.75 * k else L * 1.012 if m > 1.25 * k else L
            assert s["threshold"] == expect
            seen.add(("raise", min(raises, 1), raises > 5))
            seen.add(("L", "relax" if m < 0.75 * k else "tighten" if m > 1.25 * k else "keep"))
        info, prev = res["info"][t][0], res["info"][t - 1][0]
        if not info["reeval"]:
            K, gam = info["K"], info["threshold"]
            assert gam == prev["next_threshold"]
            expect = gam / 1.01 if K < 0.75 * k else gam * 1.008 if K > 1.25 * k else gam
            assert info["next_threshold"] == expect
            seen.add(("G", "relax" if K < 0.75 * k else "tighten" if K > 1.25 * k else "keep"))
    # every branch was exercised (so the checks above are not vacuous); the bands never tighten L (nor Γ at P = 1,
    # where G is S): the capacity keeps |S| <= 1.25k = band_hi·k, and the climb past it raises L instead (the raised L
    # is the one stored)
    expected = {("L", "relax"), ("L", "keep"), ("raise", 1, False)}
    assert expected | ({("G", "tighten")} if P > 1 else set()) <= seen


@pytest.mark.parametrize("P", [1, 3, 4])
def test_threshold_reuse_standalone_with_topka(P):
    g = drifting_grads(20, P, 300, seed=31)
    res = run(SparseCompression(Recording(0.05, threshold_period=6), TopkA()), g)
    ref = oktopk_reference(g, 0.05, tp=6)           # step 0 selections coincide (same a, same rule)
    eps = np.zeros((P, 300), np.float32)
    for t in range(20):
        a = eps + g[t]
        u = np.zeros(300, np.float32)
        for r in range(P):
            s = res["sel"][t][r]
            u[s] += a[r][s]
            eps[r] = a[r]
            eps[r][s] = 0
        np.testing.assert_array_equal(res["updates"][t, 0], u)
    assert np.array_equal(res["sel"][0][0], np.flatnonzero(ref["S"][0][0]))
    assert_mass_conserved(g, res)


def test_gt_rule_selects_k_minus_1_on_reeval_steps_without_ties():
    g = distinct_grads(1, 2, 200, seed=3, spread=True)
    res = run(make(0.05, tp=1, sp={"select_rule": "gt"}, rd={"select_rule": "gt"}), g)
    assert [res["sel"][0][r].size for r in range(2)] == [9, 9]
    ge = run(make(0.05, tp=1), g)
    assert [ge["sel"][0][r].size for r in range(2)] == [10, 10]


@pytest.mark.parametrize("kwargs, match", [
    ({"threshold_period": 0}, "threshold_period"), ({"select_rule": "ge"}, "select_rule"),
    ({"guard_ratio": -1}, "guard_ratio"), ({"guard_factor": 0.9}, "guard_factor"),
    ({"guard_iters": -1}, "guard_iters"), ({"band_lo": 1.0, "band_hi": 0.5}, "band_hi"),
    ({"band_relax": 0.5}, "band_relax"), ({"max_select_ratio": 0.5}, "max_select_ratio"),
])
def test_sparsifier_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=f"ThresholdReuse: {match}"):
        ThresholdReuse(0.01, **kwargs)


@pytest.mark.parametrize("data", ["synthetic", "recorded"])
def test_threshold_reuse_density_within_10_percent_over_200_steps(data):
    """The library preset's mean density is within 10% of the target (P = 8, density 0.01, 200 steps)."""
    import hvd_sparse
    from hvd_sparse.bench.data import RecordedGradients, SyntheticGradients

    P, steps = 8, 200
    src = SyntheticGradients(30000, P, seed=3) if data == "synthetic" else RecordedGradients(P, steps)
    ratio = mean_density_ratio(hvd_sparse.Compression.oktopk(0.01), src, steps)
    assert 0.9 <= ratio <= 1.1, ratio
