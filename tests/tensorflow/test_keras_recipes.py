"""What real training scripts and Horovod's own Keras test suite (test_tensorflow2_keras.py) do with the optimizer,
through real `horovodrun -np 2` (Gloo), under Keras 3 and tf_keras (TF_USE_LEGACY_KERAS=1): every rank ends with
bit-identical weights, or every rank gets the same clear error, within the job's timeout (a hang fails the test).

* mixed_float16 with Keras's LossScaleOptimizer and an overflow on one rank only: the same skip on every rank, the
  same loss scale, identical weights (the loss scaler around hvd_sparse's optimizer, added by Keras or by hand; also
  with backward_passes_per_step=2);
  the other way round is refused naming the recipe;
* jit_compile=True (model.compile, and a tape step in tf.function): an error naming hvd_sparse and the fix;
* a user's optimizer subclass defined in the script: averaged, backward_passes_per_step honoured;
* type(opt).from_config(opt.get_config()): Horovod's test_from_config, and the copy trains;
* register_local_var: Horovod's test_gradient_aggregation_with_local_vars (expected values by its formula);
* LearningRateScheduleCallback with LearningRateWarmupCallback: Horovod's test_train_model_lr_schedule;
* ranks that disagree on the compression (model.fit: density, preset; the tape, eagerly and in a tf.function:
  preset, Ok-Topk's periods): the same RankDisagreementError on every rank, naming the argument and the ranks;
* a preset's factory not called, momentum_correction beside the optimizer's momentum, and options of the sparse path
  with Compression.none or fp16: refused at construction;
* sparse_stats(average=True) and skipped_steps(), as torch's optimizer has them.
"""

import re

import numpy as np
import pytest

from horovod_helpers import requires_horovod, scenario_job, tf_env

pytestmark = [pytest.mark.horovod, requires_horovod]

P = 2
SCENARIOS = ("loss_scale", "jit", "subclass", "from_config", "local_vars", "schedule", "disagree", "refused",
             "stats")


@pytest.fixture(scope="module", params=["keras3", "tf_keras"])
def job(request, tmp_path_factory):
    flavour = request.param
    return scenario_job(tmp_path_factory, f"recipes_{flavour}", P, "keras_recipes_worker.py", SCENARIOS,
                        f"recipes_{flavour}_", timeout=900, env=tf_env(flavour, fusion=False))


def ok(ranks):
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}: {res['error']}"
    return ranks


def same_on_every_rank(ranks, key):
    assert all(r[key].tobytes() == ranks[0][key].tobytes() for r in ranks), f"{key} differs across ranks"


@pytest.mark.parametrize("preset", ["topka", "none", "topka.passes2"])
@pytest.mark.parametrize("how", ["auto", "explicit"])
def test_loss_scale_overflow_on_one_rank_skips_on_every_rank(job, preset, how):
    ranks = ok(job["loss_scale"])
    name, _, passes = preset.partition(".")
    key = f"{name}.{how}" + (f".{passes}" if passes else "")     # passes2: backward_passes_per_step=2
    same_on_every_rank(ranks, f"{key}.weights")
    assert bool(ranks[0][f"{key}.moved"])
    scales = [float(r[f"{key}.scale"]) for r in ranks]
    assert scales == [2.0 ** 14] * P          # 2^15 halved once, on every rank, for rank 1's overflow
    assert len({int(r[f"{key}.iterations"]) for r in ranks}) == 1
    assert str(ranks[0][f"{key}.lso"]).startswith("LossScaleOptimizer")


def test_a_loss_scale_optimizer_inside_ours_is_refused_naming_the_recipe(job):
    for r in ok(job["loss_scale"]):
        msg = str(r["wrapped_error"])
        assert "LossScaleOptimizer(hvds.DistributedOptimizer(opt))" in msg and "mixed_float16" in msg


@pytest.mark.parametrize("where", ["fit_error", "tape_error"])
def test_jit_compile_raises_naming_hvd_sparse_and_the_fix(job, where):
    for r in ok(job["jit"]):
        msg = str(r[where])
        assert "hvd_sparse cannot run under XLA (jit_compile=True)" in msg and "jit_compile=False" in msg


def test_user_optimizer_subclass_is_averaged_and_aggregates(job):
    ranks = ok(job["subclass"])
    same_on_every_rank(ranks, "weights")      # per-rank data: identical only if averaged
    for r in ranks:
        assert int(r["iterations"]) == 6 and int(r["exchanges"]) == 3    # 6 batches, 2 passes per exchange


def test_optimizer_rebuilt_from_config_works(job):
    ranks = ok(job["from_config"])
    same_on_every_rank(ranks, "weights")
    for r in ranks:
        assert bool(r["config_equal"]) and bool(r["separate_state"])


@pytest.mark.parametrize("run", ["dense.4.1", "dense.4.0", "dense.1.0", "sparse.4.1", "sparse.4.0", "sparse.1.0"])
def test_register_local_var_as_horovod(job, run):
    """Horovod's expected values: x += 1, y0 -= (rank + 1) per call (SGD with lr = -1 adds the gradient); the first
    4 of 8 x/y are local (own gradient / size), the others averaged; one update per ``passes`` calls."""
    ranks = ok(job["local_vars"])
    passes, average = int(run.split(".")[1]), run.endswith(".1")
    for rank, res in enumerate(ranks):
        assert res[f"{run}.iterations"].tolist() == list(range(1, 11))
        for idx in range(10):
            steps = (idx + 1) // passes
            gx, mult = steps * 1.0, (P + 1) / 2
            gy0 = -steps * mult
            if not average:
                gx, gy0 = gx * passes, gy0 * passes
            x = [gx / P if i < 4 else gx for i in range(8)]
            y0 = [1.0 + (gy0 / mult * (rank + 1) / P if i < 4 else gy0) for i in range(8)]
            np.testing.assert_allclose(res[f"{run}.x"][idx].reshape(-1), x)
            np.testing.assert_allclose(res[f"{run}.y"][idx][:, 0], y0)
            np.testing.assert_allclose(res[f"{run}.y"][idx][:, 1], 2.0)
    for key in ("x", "y"):                    # the averaged variables: bit-identical across ranks
        assert all(r[f"{run}.{key}"][:, 4:].tobytes() == ranks[0][f"{run}.{key}"][:, 4:].tobytes() for r in ranks)


def test_learning_rate_schedule_as_horovod(job):
    ranks = ok(job["schedule"])
    for key in ("lr", "loss", "weights"):
        same_on_every_rank(ranks, key)
    lr, initial = ranks[0]["lr"], float(ranks[0]["initial_lr"])
    assert len(lr) == 20
    for epoch, value in enumerate(lr):        # Horovod's assertions
        if epoch < 5:
            assert value <= initial or np.isclose(value, initial)
        if 5 < epoch < 10:
            assert value <= initial * 1e-1 or np.isclose(value, initial * 1e-1)
        if 10 < epoch < 15:
            assert value < initial * 1e-2 or np.isclose(value, initial * 1e-2)
        if epoch >= 15:
            assert np.isclose(value, initial * epoch)
    assert np.isclose(lr[4], initial)         # the warmup ends at initial_lr
    np.testing.assert_allclose(lr[5:10], [initial * 0.1 ** e for e in range(5, 10)], rtol=1e-6)


@pytest.mark.parametrize("case, expected", [
    ("fit.density", "the compression argument 'density' of 'model': 0.1 on rank 0, 0.3 on rank 1"),
    ("fit.preset", "the compression of 'model': 'Compression.oktopk(density=0.1)' on rank 0, "
                   "'Compression.topka(density=0.1)' on rank 1"),
    ("tape.preset.eager", "'Compression.gtopk(density=0.1)' on rank 0, 'Compression.topka(density=0.1)' on rank 1"),
    ("tape.preset.function", "'Compression.gtopk(density=0.1)' on rank 0, 'Compression.topka(density=0.1)' on "
                             "rank 1"),
    ("tape.periods.eager", "the compression argument 'threshold_period' of 'model': 8 on rank 0, 4 on rank 1"),
    ("tape.periods.function", "the compression argument 'threshold_period' of 'model': 8 on rank 0, 4 on rank 1"),
])
def test_ranks_that_disagree_on_the_compression_get_the_same_error(job, case, expected):
    ranks = ok(job["disagree"])
    lines = []
    for r in ranks:
        found = re.findall(r"hvd_sparse: ranks disagree on [^\n]*", str(r[case]))
        assert found, f"no disagreement error: {str(r[case])[-500:]}"
        lines.append(found[-1])
        assert float(r[f"{case}.seconds"]) < 60
    assert lines == [lines[0]] * P and expected in lines[0]


@pytest.mark.parametrize("case, api", [("optimizer.factory", "hvd_sparse.tensorflow.keras.DistributedOptimizer"),
                                       ("tape.factory", "hvd_sparse.tensorflow.DistributedGradientTape"),
                                       ("allreduce.factory", "hvd_sparse.tensorflow.sparse_allreduce")])
def test_a_preset_factory_not_called_is_refused_with_the_call_to_make(job, case, api):
    for r in ok(job["refused"]):
        assert str(r[case]).startswith(f"TypeError: {api}: compression=Compression.topka "), str(r[case])
        assert "Compression.topka(0.01)" in str(r[case])


def test_momentum_correction_beside_the_optimizers_momentum_is_refused(job):
    for r in ok(job["refused"]):
        assert str(r["momentum_twice"]).startswith("ValueError: hvd_sparse.tensorflow.keras.DistributedOptimizer: ")
        assert "momentum=0" in str(r["momentum_twice"]) and str(r["momentum_once"]) == ""


@pytest.mark.parametrize("case, says", [("dense.optimizer", "keras.DistributedOptimizer: nonfinite='raise'"),
                                        ("dense.elastic_residuals", "keras.DistributedOptimizer: elastic_residuals="),
                                        ("dense.tape", "DistributedGradientTape: nonfinite='raise'")])
def test_an_option_the_dense_path_cannot_honour_is_refused(job, case, says):
    for r in ok(job["refused"]):
        assert str(r[case]).startswith(f"ValueError: hvd_sparse.tensorflow.{says}"), str(r[case])
        assert str(r["dense.consistency"]) == ""


def test_a_preset_in_horovods_average_position_is_refused_with_the_keyword_call(job):
    for r in ok(job["refused"]):
        assert str(r["allreduce.positional"]).startswith("TypeError: hvd_sparse.tensorflow.sparse_allreduce: ")
        assert "sparse_allreduce(tensor, compression=" in str(r["allreduce.positional"])


def test_averaged_sparse_stats_and_skipped_steps_as_torch_has_them(job):
    ranks = ok(job["stats"])
    keys = ("averaged.density", "averaged.sent_bytes", "averaged.recv_bytes", "averaged.residual_norm")
    for key in keys:
        same_on_every_rank(ranks, key)                          # averaged over the ranks: one value everywhere
    r = ranks[0]
    assert 0 < float(r["averaged.density"]) <= 0.1 * (1 + 1e-9) and float(r["averaged.sent_bytes"]) > 0
    assert int(r["again"]) == 0 and int(r["skipped"]) == 0
    mean_sent = np.mean([float(x["last.sent_bytes"]) for x in ranks])
    assert float(r["averaged.sent_bytes"]) == pytest.approx(mean_sent)   # a fixed wire: every step sends the same
