"""hvd_sparse.tensorflow.keras.callbacks through real `horovodrun -np 2` (Gloo), under Keras 3 and under tf_keras
(TF_USE_LEGACY_KERAS=1), with model.fit compiled ("graph") and with run_eagerly=True ("eager").

One job per Keras flavour runs every scenario of hvd_workers/keras_callbacks_worker.py (see its docstring)."""

import numpy as np
import pytest

from horovod_helpers import requires_horovod, scenario_job, tf_env

pytestmark = [pytest.mark.horovod, requires_horovod]

P = 2
SCENARIOS = ("broadcast", "metrics", "warmup", "sparsity", "flavour", "bf16")
MODES = ["graph", "eager"]
STEPS, EPOCHS = 4, 3                 # the worker's N / BATCH and EPOCHS
INITIAL_LR, WARMUP, COMPILED_LR, MOMENTUM = 0.4, 2, 0.123, 0.9


@pytest.fixture(scope="module", params=["keras3", "tf_keras"])
def job(request, tmp_path_factory):
    flavour = request.param
    return flavour, scenario_job(tmp_path_factory, f"kcb_{flavour}", P, "keras_callbacks_worker.py", SCENARIOS,
                                 f"kcb_{flavour}_", timeout=600, env=tf_env(flavour))


def same_on_all_ranks(ranks, key):
    return all(r[key].tobytes() == ranks[0][key].tobytes() for r in ranks)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_makes_different_ranks_identical(job, mode):
    _, res = job
    ranks = res["broadcast"]
    assert not same_on_all_ranks(ranks, f"{mode}.init"), "ranks should start from different weights"
    for part in ("model", "opt"):        # at the first batch end: different just before, identical just after
        assert not same_on_all_ranks(ranks, f"{mode}.before.{part}")
        assert same_on_all_ranks(ranks, f"{mode}.after.{part}")
        # the values are rank 0's
        assert ranks[1][f"{mode}.after.{part}"].tobytes() == ranks[0][f"{mode}.before.{part}"].tobytes()
    # the registered local variable is left alone
    assert not same_on_all_ranks(ranks, f"{mode}.after.local")
    for r in ranks:
        assert r[f"{mode}.after.local"].tobytes() == r[f"{mode}.before.local"].tobytes()
    if bool(ranks[0]["distributed"]):    # with gradient averaging they stay identical to the end
        assert same_on_all_ranks(ranks, f"{mode}.final")


@pytest.mark.parametrize("mode", MODES)
def test_metric_average_is_the_mean_of_the_ranks_and_identical(job, mode):
    _, res = job
    ranks = res["metrics"]
    keys = list(ranks[0][f"{mode}.keys"])
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(keys)
    raw = np.stack([r[f"{mode}.raw"] for r in ranks])               # (P, epochs, metrics)
    assert np.abs(raw[0] - raw[1]).max() > 1e-3, "ranks saw different data: raw metrics should differ"
    hist = ranks[0][f"{mode}.hist"]
    np.testing.assert_allclose(hist, raw.mean(axis=0), rtol=1e-12, atol=0)
    assert same_on_all_ranks(ranks, f"{mode}.hist")


def expected_lr():
    """Horovod's warmup at P ranks, per batch: lr/P * ((epoch + (batch+1)/steps) * (P-1)/warmup + 1), then flat."""
    lrs = []
    for e in range(EPOCHS):
        for b in range(STEPS):
            if e < WARMUP:
                lrs.append(INITIAL_LR / P * ((e + (b + 1) / STEPS) * (P - 1) / WARMUP + 1))
            else:
                lrs.append(lrs[-1])
    return np.array(lrs)


@pytest.mark.parametrize("mode", MODES)
def test_warmup_lr_follows_the_formula(job, mode):
    flavour, res = job
    want = expected_lr()
    assert want[0] == pytest.approx(INITIAL_LR / P * (1 + (P - 1) / (WARMUP * STEPS)))
    assert want[WARMUP * STEPS - 1] == pytest.approx(INITIAL_LR)
    for r in res["warmup"]:
        np.testing.assert_allclose(r[f"{mode}.lr"], want, rtol=1e-6)
        # History's "lr": the lr at each epoch end
        np.testing.assert_allclose(r[f"{mode}.hist_lr"], want[STEPS - 1::STEPS], rtol=1e-6)
        # the compiled (or eager) train step really uses it: the probe's weight moves by lr per step
        np.testing.assert_allclose(r[f"{mode}.deltas"], want, rtol=1e-5)
        if bool(r["legacy"]):
            # tf_keras legacy SGD: momentum is a variable -> Horovod's correction during warmup, restored after
            prev = np.concatenate([[COMPILED_LR], want[:-1]])
            corr = np.where(np.arange(len(want)) < WARMUP * STEPS, MOMENTUM * want / prev, MOMENTUM)
            np.testing.assert_allclose(r[f"{mode}.mom"], corr, rtol=1e-5)
            np.testing.assert_allclose(r[f"{mode}.mom_after"], MOMENTUM, rtol=1e-6)
            assert not bool(r[f"{mode}.warned"])
        else:
            # Keras 3 SGD: momentum is a Python float compiled into the step -> left alone, with a warning
            np.testing.assert_allclose(r[f"{mode}.mom"], MOMENTUM, rtol=1e-6)
            assert bool(r[f"{mode}.warned"])


KEYS = ("sparse_density", "sparse_sent_bytes", "sparse_residual_norm")


@pytest.mark.parametrize("mode", MODES)
def test_sparsity_callback_fake_optimizer_averages_over_steps_and_ranks(job, mode):
    _, res = job
    ranks = res["sparsity"]
    tag = f"{mode}.fake"
    returned = [r[f"{tag}.returned"] for r in ranks]              # per batch: iteration, density, sent bytes
    assert all(len(x) == EPOCHS * STEPS for x in returned)
    assert not np.array_equal(returned[0][:, 1:], returned[1][:, 1:])
    want = np.zeros((EPOCHS, 3))
    for e in range(EPOCHS):
        rows = [x[e * STEPS:(e + 1) * STEPS] for x in returned]
        want[e, 0] = np.mean([x[:, 1].mean() for x in rows])
        want[e, 1] = np.mean([x[:, 2].mean() for x in rows])
        want[e, 2] = np.mean([0.5 + r + 0.001 * STEPS * (e + 1) for r in range(P)])   # the fake's norm
    assert same_on_all_ranks(ranks, f"{tag}.hist")
    np.testing.assert_allclose(ranks[0][f"{tag}.hist"], want, rtol=1e-12)
    # every_n_batches=2: batch logs carry the average of the last 2 batches from the 2nd batch on
    logs = ranks[0][f"{tag}.batch_logs"]
    assert same_on_all_ranks(ranks, f"{tag}.batch_logs")
    assert np.isnan(logs[0]).all()
    for j in range(1, EPOCHS * STEPS):
        c = (j + 1) // 2 * 2
        win = [x[c - 2:c] for x in returned]
        np.testing.assert_allclose(logs[j], [np.mean([w[:, 1].mean() for w in win]),
                                             np.mean([w[:, 2].mean() for w in win]),
                                             np.mean([0.5 + r + 0.001 * c for r in range(P)])], rtol=1e-12)


def test_sparsity_callback_real_optimizer(job):
    _, res = job
    ranks = res["sparsity"]
    if "oktopk" not in list(ranks[0]["configs"]):
        pytest.skip("hvd_sparse.tensorflow.keras.DistributedOptimizer not available")
    mode = "graph"
    n = int(ranks[0][f"{mode}.oktopk.n"])
    dense_bytes = 2 * n * (P - 1) / P * 4
    for name in ("oktopk", "none"):
        tag = f"{mode}.{name}"
        assert same_on_all_ranks(ranks, f"{tag}.hist"), f"{name}: sparse_* logs differ across ranks"
        assert same_on_all_ranks(ranks, f"{tag}.final"), f"{name}: weights differ across ranks"
        hist = ranks[0][f"{tag}.hist"]
        assert hist.shape == (EPOCHS, 3) and np.isfinite(hist).all()
        if name == "none":
            np.testing.assert_allclose(hist, np.tile([1.0, dense_bytes, 0.0], (EPOCHS, 1)))
        else:
            assert ((hist[:, 0] > 0) & (hist[:, 0] <= 0.05 * 1.5)).all(), hist[:, 0]
            assert ((hist[:, 1] > 0) & (hist[:, 1] < dense_bytes)).all(), hist[:, 1]
            assert (hist[:, 2] > 0).all()


def test_callbacks_subclass_the_flavours_callback_and_reject_the_other(job):
    flavour, res = job
    for r in res["flavour"]:
        assert str(r["flavour"]) == ("tf_keras" if flavour == "tf_keras" else "keras")
        for cls in ("BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
                    "SparsityCallback"):
            msg = str(r[cls])
            assert msg != "accepted" and "TF_USE_LEGACY_KERAS" in msg, msg


def test_bfloat16_variables_are_broadcast_and_trained_identically(job):
    _, res = job
    a, b = res["bf16"]
    assert a["dtypes"].tolist() == ["bfloat16"]
    assert a["before"].tobytes() != b["before"].tobytes()                       # different initial weights
    assert a["after"].tobytes() == b["after"].tobytes() == a["before"].tobytes()    # rank 0's, bit for bit
    assert a["fit"].tobytes() == b["fit"].tobytes() and bool(a["fit_moved"])        # fit with Ok-Topk trained
    # what hvd_sparse.tensorflow.broadcast_variables is for: Horovod 0.28.1's own refuses bfloat16
    assert "DataType bfloat16 not in list of allowed values" in str(a["horovod"])
