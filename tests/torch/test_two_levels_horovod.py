"""The two-level step through real Horovod: `horovodrun -np 4 -H localhost:2,127.0.0.1:2` gives one machine two
hosts of two ranks (hvd.local_size() 2, hvd.cross_size() 2), whose process sets hvd_sparse registers
(HOROVOD_DYNAMIC_PROCESS_SETS=1). Every sparse preset equals simulate(..., local_size=2) bit for bit; left at None,
`hierarchical` follows HOROVOD_HIERARCHICAL_ALLREDUCE; hosts of unequal size are refused on every rank; with
overlap=True every bucket is a two-level unit of its own."""

import json

import numpy as np
import pytest

from hvd_sparse.bench import presets
from hvd_sparse.testing import simulate

from horovod_helpers import assert_ranks_equal_simulator, bucketed_oracle, requires_horovod, scenario_job

pytestmark = [pytest.mark.horovod, requires_horovod]

TWO_HOSTS = "localhost:2,127.0.0.1:2"
ENV = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return scenario_job(tmp_path_factory, "two_levels", 4, "two_level_worker.py", ["presets", "auto", "overlap"],
                        timeout=600, env=ENV, hosts=TWO_HOSTS)


@pytest.mark.parametrize("preset", [p for p in presets.names() if p != "dense"])
def test_every_preset_on_two_hosts_equals_the_simulator(job, preset):
    ranks = job["presets"]
    grads = np.stack([r[f"{preset}.raw"] for r in ranks], axis=1)
    sim = simulate(presets.make(preset, 0.05), grads, shapes=[(int(m),) for m in ranks[0]["layout"]],
                   backend="torch", local_size=2)
    assert_ranks_equal_simulator(ranks, preset, sim, grads, preset, 2)      # two ranks a sum: exact
    assert 0 < ranks[0][f"{preset}.across"] < ranks[0][f"{preset}.inside"]


def test_buckets_on_two_hosts_equal_the_simulator_bucket_by_bucket(job):
    """overlap=True on two levels: each bucket is a two-level unit of its own (the 4-entry one dense across the
    hosts) and the budget's split moves over the sparse ones, equal to the simulator's two-level bucketed run, bit
    for bit, on every rank."""
    ranks = job["overlap"]
    layout, plan = json.loads(str(ranks[0]["layout"])), json.loads(str(ranks[0]["plan"]))
    assert len(plan) == 4 and [b["dense"] for b in plan] == [True, False, False, False]
    raw = np.stack([r["raw"] for r in ranks], axis=1)
    expected, _, shares = bucketed_oracle(presets.make("topka", 0.05), raw, layout, plan, local_size=2,
                                          min_rate=3.0)
    assert shares[-1] != shares[0]                  # the split moved
    for r, rank in enumerate(ranks):
        assert rank["red"].tobytes() == expected[:, r].tobytes()
        assert rank["params"].tobytes() == ranks[0]["params"].tobytes()


def test_hierarchical_none_follows_horovods_switch(job):
    for rank in job["auto"]:
        assert str(rank["auto"]) == "TwoLevelEngine" and str(rank["flat"]) == "Engine"


def test_hosts_of_unequal_size_are_refused_on_every_rank(tmp_path_factory):
    ranks = scenario_job(tmp_path_factory, "two_levels_uneven", 3, "two_level_worker.py", ["uneven"],
                         timeout=300, env=ENV, hosts="localhost:2,127.0.0.1:1")["uneven"]
    for rank in ranks:
        message = str(rank["message"])
        assert "localhost: 2" in message and "127.0.0.1: 1" in message, message
