"""Reliability in the simulator: the non-finite policy (docs/reliability.md) for every preset.

The Horovod-level counterparts (real horovodrun: skip/raise across processes, the consistency guard, a killed
worker) are in tests/jobs/test_reliability_horovod.py.
"""

import numpy as np
import pytest

from hvd_sparse.bench import presets
from hvd_sparse.core.errors import NonFiniteGradientError
from hvd_sparse.core.validate import check_nonfinite
from hvd_sparse.testing import simulate

from oracles import int_grads

PRESETS = presets.names()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("preset", PRESETS)
def test_nonfinite_on_one_rank_skips_the_step_on_every_rank_and_leaves_all_state_untouched(preset, P, bad):
    g = int_grads(5, P, 240, seed=3)
    poisoned = g.copy()
    poisoned[2, P - 1, 17] = bad                       # one value on the last rank at step 2
    with pytest.warns(RuntimeWarning, match=f"non-finite gradient on rank {P - 1} at step 2"):
        res = simulate(presets.make(preset, 0.05), poisoned)
    clean = simulate(presets.make(preset, 0.05), np.delete(g, 2, axis=0))   # the same run without step 2
    assert np.isnan(res.updates[2]).all()             # every rank sees the skip (NaN: loss scalers back off)
    # nothing was exchanged after the step's opening (the collective whose header carried the flag)
    assert all(res.volume[2][r]["collectives"] <= 1 for r in range(P))
    assert res.residuals[2].tobytes() == res.residuals[1].tobytes()       # residual untouched
    # thresholds, partitions, counters untouched: the rest of the run is the run without the bad step, bit for bit
    keep = [0, 1, 3, 4]
    assert res.updates[keep].tobytes() == clean.updates.tobytes()
    assert res.residuals[keep].tobytes() == clean.residuals.tobytes()


@pytest.mark.parametrize("preset", ["topka", "oktopk", "exdyna"])
def test_nonfinite_raise_policy_raises_naming_the_ranks_and_the_step(preset):
    g = int_grads(5, 4, 240, seed=3)
    g[1, 1, 3] = np.nan
    g[1, 3, 9] = np.inf
    with pytest.raises(NonFiniteGradientError, match=r"ranks 1, 3 at step 1"):
        simulate(presets.make(preset, 0.05), g, nonfinite="raise")
    simulate(presets.make(preset, 0.05), int_grads(5, 4, 240, seed=3), nonfinite="raise")   # finite data: no error


def test_nonfinite_on_a_single_rank_also_skips():
    g = int_grads(5, 1, 240, seed=3)
    g[0, 0, 0] = np.nan
    res = simulate(presets.make("oktopk", 0.05), g)
    assert np.isnan(res.updates[0]).all() and not np.isnan(res.updates[1:]).any()


@pytest.mark.parametrize("policy", ["ignore", None, 1, "SKIP"])
def test_nonfinite_policy_is_validated(policy):
    with pytest.raises(ValueError, match="nonfinite must be one of 'skip', 'raise'"):
        check_nonfinite(policy, "api")
    with pytest.raises(ValueError, match="nonfinite"):
        simulate(presets.make("topka", 0.1), int_grads(1, 2, 240, seed=3), nonfinite=policy)


def test_nonfinite_flag_is_control_traffic_not_algorithm_volume():
    res = simulate(presets.make("topka", 0.05), int_grads(1, 3, 240, seed=3))
    # topka: one allgather of k (index, value) pairs; the flag rides in its header, outside the algorithm's words
    k = int(0.05 * 240)
    assert res.volume[0][0]["recv_words"] == 2 * 2 * k
    assert res.phases[0][0]["calls"] == {"agree": 0, "indices": 1, "values": 0}


@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("preset", PRESETS)
def test_all_zero_gradients_select_nothing_and_keep_zero_state(preset, P):
    res = simulate(presets.make(preset, 0.05), np.zeros((3, P, 120), np.float32))
    assert not res.updates.any() and not res.residuals.any()
    # ExDyna sends one fallback index per rank when nothing passes (docs/algorithms.md#exdyna), SparDL counts its fixed
    # budget and dense everything; the others select nothing
    if preset not in ("dense", "exdyna", "spardl"):
        assert not res.selected.any()
