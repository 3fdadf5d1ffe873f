"""``overlap=True`` of hvd_sparse's torch optimizer through real ``horovodrun -np 2`` (Gloo): buckets launched from
the gradient hooks equal the simulator running each bucket as a unit, bit for bit (tests/hvd_workers/overlap_worker.py
writes what each rank saw). The planning and the dense rule are checked in-process."""

import json

import numpy as np
import pytest
import torch

import hvd_sparse
from hvd_sparse.torch import buckets

from horovod_helpers import bucketed_oracle, requires_horovod, scenario_job

P = 2
PRESETS = {"topka": "topka", "oktopk": "oktopk", "exdyna": "exdyna", "topka_passes2": "topka", "exdyna_size": "exdyna"}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return scenario_job(tmp_path_factory, "overlap_np2", P, "overlap_worker.py", ["buckets", "frozen", "resume", "amp"],
                        timeout=600)


def bucket_slices(layout, names):
    """Where each of ``names`` lies in the sorted-name flat vector of ``layout`` ([(name, numel)])."""
    start, where = 0, {}
    for name, m in layout:
        where[name] = slice(start, start + m)
        start += m
    return [where[n] for n in names]


@pytest.mark.horovod
@requires_horovod
@pytest.mark.parametrize("tag", PRESETS)
def test_buckets_equal_the_simulator_bucket_by_bucket(job, tag):
    """Each bucket is a unit of its own (own error feedback; the dense one every step dense) and the budget's split
    over the sparse ones moves to where the whole model's top-k fell (``bucket_budget="size"``: k_b = d·n_b): the
    reduced gradients of every rank equal the simulator's bucketed run over the same raw gradients, replicas end
    bit-identical, error feedback conserves the mass, a checkpoint resumes bit for bit, and the hooks launched
    buckets during backward."""
    ranks = job["buckets"]
    layout = json.loads(str(ranks[0]["layout"]))
    plan = json.loads(str(ranks[0][f"{tag}.plan"]))
    assert plan[0] == {"names": ["c.bias"], "dense": True} and not plan[1]["dense"]       # 4 entries: dense
    assert all(json.loads(str(r[f"{tag}.plan"])) == plan for r in ranks)
    raw = np.stack([r[f"{tag}.raw"] for r in ranks], axis=1)           # (steps, P, n)
    budget = "size" if tag.endswith("_size") else "magnitude"
    expected, residuals, shares = bucketed_oracle(getattr(hvd_sparse.Compression, PRESETS[tag])(0.05), raw, layout,
                                                  plan, budget=budget, min_rate=3.0)
    applied = expected.sum(axis=0, dtype=np.float64)[0] * P + residuals.sum(axis=0, dtype=np.float64)
    np.testing.assert_allclose(applied, raw.sum(axis=(0, 1), dtype=np.float64), rtol=1e-5, atol=1e-6)
    assert (shares[-1] != shares[0]) == (budget == "magnitude")        # the split moved, or stays by size
    for r in range(P):
        assert ranks[r][f"{tag}.red"].tobytes() == expected[:, r].tobytes(), f"rank {r} differs from the simulator"
        assert ranks[r][f"{tag}.residual"].tobytes() == residuals[r].tobytes()
        assert ranks[r][f"{tag}.shares"].tolist() == shares[-1]
        assert ranks[r][f"{tag}.params"].tobytes() == ranks[0][f"{tag}.params"].tobytes()
        assert ranks[r][f"{tag}.resumed"].tobytes() == ranks[r][f"{tag}.params"].tobytes()
    unused = sum(any(n.startswith("extra.") for n in b["names"]) for b in plan)      # the last buckets
    for r in range(P):          # every bucket from the hooks, but the unused layer's from synchronize()
        used = [r == 0 and t % 2 == 0 for t in range(len(raw))]
        assert ranks[r][f"{tag}.hooks"].tolist() == [len(plan) - (0 if u else unused) for u in used]


@pytest.mark.horovod
@requires_horovod
def test_freezing_and_unfreezing_between_steps_keeps_replicas_identical(job):
    ranks = job["frozen"]
    assert all(r["params"].tobytes() == ranks[0]["params"].tobytes() for r in ranks)
    assert all(float(r["frozen_drift"]) == 0.0 for r in ranks)
    assert all(np.isfinite(float(r["residual"])) for r in ranks)


@pytest.mark.horovod
@requires_horovod
def test_a_checkpoint_without_buckets_is_refused_by_buckets_naming_the_option(job):
    for r in job["resume"]:
        assert "overlap" in str(r["message"]) and "bucket_cap_mb" in str(r["message"])


@pytest.mark.horovod
@requires_horovod
def test_grad_scaler_and_torch_compile_work_with_buckets(job):
    """hvd_sparse's GradScaler: the buckets wait for unscaling (the hooks launch none), an Inf on one rank skips the
    step on every rank and halves the scale alike; torch's own GradScaler is refused on every rank, naming ours;
    torch.compile around the model trains as without it; a deleted optimizer leaves no thread or state behind."""
    ranks = job["amp"]
    for r in ranks:
        assert r["params"].tobytes() == ranks[0]["params"].tobytes()
        p = r["params"]
        assert [t for t in range(len(p) - 1) if p[t].tobytes() == p[t + 1].tobytes()] == [3]
        assert r["scales"].tolist() == [1024.0] * 3 + [512.0] * 3 and r["hooks"].max() == 0
        assert "hvd_sparse.torch.GradScaler" in str(r["refused"])
        assert r["compiled"].tobytes() == r["eager"].tobytes()
        assert bool(r["freed"]) and r["threads"].size == 0     # deleting the optimizer ends its thread


def named(*numels):
    return [(f"p{i}", torch.zeros(m)) for i, m in enumerate(numels)]


def test_plan_reverses_registration_order_and_caps_buckets():
    mb = 2 ** 20 / 4                     # float32 entries in one MB
    parts = buckets.plan_buckets(named(int(3 * mb), int(0.5 * mb), int(0.4 * mb), int(0.3 * mb), 10), cap_mb=1.0)
    assert [[n for n, _ in part] for part in parts] == [["p4", "p3", "p2"], ["p1"], ["p0"]]
    even = buckets.plan_buckets(named(*[int(0.2 * mb)] * 10), cap_mb=1.0)
    assert [[n for n, _ in part] for part in even] == [[f"p{i}" for i in range(9, 4, -1)],
                                                       [f"p{i}" for i in range(4, -1, -1)]]    # the first as large


def test_small_buckets_go_dense_where_sparse_would_not_be_smaller():
    topka = hvd_sparse.Compression.topka(0.01)
    assert not buckets.goes_dense(topka, 10 ** 6, 4, 1.0)          # 4% of dense's bytes
    assert buckets.goes_dense(topka, 3, 4, 1.0)                     # k = 1 of 3: 2·4/3 of dense
    assert buckets.goes_dense(topka, 10 ** 6, 4, 30.0)              # 4% is not 30x smaller
    assert not buckets.goes_dense(topka, 3, 1, 1.0)                 # one rank sends nothing


def test_on_two_levels_the_dense_rule_weighs_the_shards_exchange_among_the_hosts():
    topka = hvd_sparse.Compression.topka(0.3)       # P = 4: 1.2x dense's bytes; among 2 hosts: 0.6x
    assert buckets.goes_dense(topka, 10 ** 6, 4, 1.0) and not buckets.goes_dense(topka, 10 ** 6, 4, 1.0, 2)
    assert buckets.goes_dense(hvd_sparse.Compression.topka(0.01), 3, 4, 1.0, 2)    # a shard of 2, k = 1: 1x
    assert not buckets.goes_dense(topka, 10 ** 6, 4, 1.0, 4)       # one host: nothing crosses


@pytest.mark.parametrize("args, named", [((1, None, None), "overlap"), ((False, 10, None), "bucket_cap_mb"),
                                          ((True, 0, None), "bucket_cap_mb"),
                                          ((True, None, -1.0), "min_compression_rate"),
                                          ((True, None, float("inf")), "min_compression_rate"),
                                          ((True, None, None, "largest"), "bucket_budget"),
                                          ((False, None, None, "size"), "bucket_budget")])
def test_bad_overlap_options_raise_naming_the_argument(args, named):
    from hvd_sparse.torch.optimizer import check_overlap

    with pytest.raises(ValueError, match=named):
        check_overlap(*args[:3], "api", *args[3:])
    assert check_overlap(True, None, None, "api") == (buckets.BUCKET_CAP_MB, buckets.MIN_COMPRESSION_RATE,
                                                      "magnitude")
    assert check_overlap(False, None, None, "api") is None
