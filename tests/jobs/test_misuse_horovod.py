"""What real training scripts do with a wrapped torch optimizer, through real `horovodrun -np 2 --gloo`: either
bit-identical parameters on every rank or the same clear error on every rank within a bounded time -- never a hang,
never silent divergence (docs/reliability.md, "Misuse and Horovod's recipes"; worker: hvd_workers/misuse_worker.py).
A job that hangs is killed at its time limit; the scenarios it did not finish then fail by name."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from horovod_helpers import BIN, HERE, job_env, requires_horovod

pytestmark = [pytest.mark.horovod, requires_horovod]

NP = 2
LIMIT = 480          # seconds per job (a loaded machine included); a disagreement raises within seconds


def _job(tmp_path_factory, job):
    out = tmp_path_factory.mktemp(job)
    cmd = [str(BIN / "horovodrun"), "-np", str(NP), "-H", f"localhost:{NP}", "--gloo", sys.executable,
           str(HERE / "hvd_workers" / "misuse_worker.py"), job, str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env(),
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)          # horovodrun and its workers: nothing is left behind
        log, _ = proc.communicate()
        log = f"(killed after {LIMIT} s: a hang)\n{log}"
    return out, log


@pytest.fixture(scope="module")
def agree(tmp_path_factory):
    return _job(tmp_path_factory, "agree")


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    return _job(tmp_path_factory, "train")


def ranks(job, scenario):
    out, log = job
    files = [out / f"{scenario}.rank{r}.npz" for r in range(NP)]
    if not all(f.exists() for f in files):
        pytest.fail(f"scenario {scenario!r} did not finish on every rank:\n{log[-5000:]}")
    return [dict(np.load(f)) for f in files]


def same_error(rs, key, *says):
    msgs = [str(r[key]) for r in rs]
    assert msgs[0] == msgs[1], f"{key}: the ranks raised different errors: {msgs}"
    assert msgs[0].startswith("RankDisagreementError: hvd_sparse: ranks disagree on "), msgs[0]
    for s in says:
        assert s in msgs[0], msgs[0]


def identical(rs, *keys):
    for key in keys:
        assert rs[0][key].tobytes() == rs[1][key].tobytes(), f"{key} differs across ranks"


# -- refused at construction -------------------------------------------------------------------------------------
def test_a_preset_factory_not_called_momentum_twice_and_options_dense_ignores_are_refused_on_every_rank(train):
    rs = ranks(train, "refused")
    for r in rs:
        assert str(r["factory"]).startswith("TypeError: hvd_sparse.torch.DistributedOptimizer: compression="), r
        assert "Compression.topka(" in str(r["factory"])                     # the call to make
        assert str(r["allreduce_factory"]).startswith("TypeError: hvd_sparse.torch.sparse_allreduce: compression=")
        assert "Compression.oktopk(" in str(r["allreduce_factory"])
        assert str(r["allreduce_positional"]).startswith("TypeError: hvd_sparse.torch.sparse_allreduce: ")
        assert "sparse_allreduce(tensor, compression=" in str(r["allreduce_positional"])
        assert str(r["momentum_twice"]).startswith("ValueError: hvd_sparse.torch.DistributedOptimizer: "), r
        assert "momentum=0" in str(r["momentum_twice"])
        for name in ("nonfinite", "elastic_residuals", "consistency_check_every"):      # the dense path's rule
            assert str(r[f"dense.{name}"]).startswith(f"ValueError: hvd_sparse.torch.DistributedOptimizer: {name}=")
    identical(rs, "params")                                                  # the fixed call trains


# -- ranks that disagree -----------------------------------------------------------------------------------------
def test_ranks_that_disagree_on_the_compression_raise_on_every_rank_within_seconds(agree):
    rs = ranks(agree, "compression")
    same_error(rs, "oktopk_topka", "the compression of 'model': 'Compression.oktopk(density=0.1)' on rank 0, "
                                   "'Compression.topka(density=0.1)' on rank 1")
    same_error(rs, "topka_gtopk", "'Compression.gtopk(density=0.1)' on rank 1")
    same_error(rs, "threshold_period", "the compression argument 'threshold_period'", "32 on rank 0, 4 on rank 1")
    same_error(rs, "repartition_period", "the compression argument 'repartition_period'", "64 on rank 0, 4 on rank 1")
    for r in rs:
        for key in ("oktopk_topka", "topka_gtopk", "threshold_period", "repartition_period"):
            assert float(r[key + ".seconds"]) < 30, (key, float(r[key + ".seconds"]))


def test_ranks_that_disagree_on_the_density_raise_instead_of_diverging(agree):
    rs = ranks(agree, "density")
    for key in ("topka", "oktopk"):
        same_error(rs, key, "the compression argument 'density'", "0.1 on rank 0, 0.3 on rank 1")


def test_sparse_allreduce_with_other_shapes_per_rank_raises_on_every_rank_like_horovod(agree):
    rs = ranks(agree, "allreduce_shapes")
    for key in ("topka", "oktopk"):
        same_error(rs, f"{key}.sizes",
                   f"parameter '{key}.sizes' is (10,) torch.float32 on rank 0 but (12,) torch.float32 on rank 1")
        same_error(rs, f"{key}.shapes", "(3, 4) torch.float32 on rank 0 but (4, 3) torch.float32 on rank 1")
        identical(rs, f"{key}.same")


def test_two_optimizers_stepped_in_another_order_raise_and_never_mix_gradients(agree):
    rs = ranks(agree, "two_optimizers")
    msgs = [str(r["msg"]) for r in rs]
    assert msgs[0] == msgs[1] and "ranks disagree on what is being exchanged" in msgs[0], msgs
    assert "on rank 0" in msgs[0] and "on rank 1" in msgs[0]
    identical(rs, "a", "b")                          # then stepped in the same order: each trains on its own


# -- recipes that train ------------------------------------------------------------------------------------------
def test_a_parameter_group_added_after_wrapping_is_averaged_and_checked(train):
    rs = ranks(train, "add_param_group")
    identical(rs, "params")
    head = rs[0]["head"]
    moved = [head[t].tobytes() != head[t + 1].tobytes() for t in range(len(head) - 1)]
    assert moved == [False, False, True, True, True, True]   # trained from the step it was added


def test_parameters_frozen_at_wrapping_and_unfrozen_later_are_averaged(train):
    rs = ranks(train, "unfreeze")
    identical(rs, "params")
    bb = rs[0]["backbone"]
    assert [bb[t].tobytes() != bb[t + 1].tobytes() for t in range(len(bb) - 1)] == [False, False] + [True] * 4


@pytest.mark.parametrize("run", ["later", "first"])
def test_sparse_embedding_without_a_gradient_in_some_steps_trains(train, run):
    rs = ranks(train, "embedding")
    identical(rs, f"{run}.params")
    assert np.isfinite(rs[0][f"{run}.params"]).all() and bool(rs[0][f"{run}.moved"])


def test_a_script_that_catches_a_disagreement_goes_on_training(train):
    rs = ranks(train, "after_an_error")
    assert "RankDisagreementError" in str(rs[0]["msg"]) and str(rs[0]["msg"]) == str(rs[1]["msg"])
    identical(rs, "a", "b")


def test_sparse_allreduce_takes_names_built_at_run_time(train):
    rs = ranks(train, "after_an_error")
    identical(rs, "allreduced")
    assert np.count_nonzero(rs[0]["allreduced"]) > 0


def test_torch_compile_around_step_trains_as_without_it(train):
    rs = ranks(train, "compiled")
    identical(rs, "compiled")
    for r in rs:
        assert r["compiled"].tobytes() == r["plain"].tobytes()


def test_plain_grad_scaler_pattern_skips_on_every_rank_and_agrees_on_the_scale(train):
    rs = ranks(train, "grad_scaler")
    identical(rs, "params", "scales")
    for r in rs:
        p = r["params"]
        assert [t for t in range(len(p) - 1) if p[t].tobytes() == p[t + 1].tobytes()] == [3]
        assert r["scales"].tolist() == [1024.0] * 3 + [512.0] * 3
        assert int(r["skipped"]) == 1


def test_wrapping_a_wrapped_optimizer_says_so(train):
    for r in ranks(train, "wrap_twice"):
        for key in ("msg", "msg2"):
            assert "ValueError" in str(r[key]) and "already a distributed optimizer" in str(r[key]), str(r[key])


def test_tied_weights_listed_twice_train(train):
    rs = ranks(train, "tied")
    identical(rs, "params")
    assert np.isfinite(rs[0]["params"]).all()


def test_load_sparse_state_dict_checks_rank_size_preset_and_density(train):
    for r in ranks(train, "state_checks"):
        assert "saved by rank" in str(r["other_rank"]) and "saved by rank" in str(r["other_size"])
        for key in ("other_preset", "other_density", "other_period"):
            assert "this sparse state was saved with" in str(r[key]), (key, str(r[key]))
        assert str(r["own"]) == ""


def test_broadcast_optimizer_state_when_only_rank_0_has_state_neither_hangs_nor_exchanges(train):
    rs = ranks(train, "broadcast_resume")
    identical(rs, "params", "bufs")
    for r in rs:
        assert not bool(r["engine_before"])          # no sparse exchange ran inside broadcast_optimizer_state


def test_broadcast_optimizer_state_on_a_fresh_start_leaves_the_sparse_state_alone(train):
    rs = ranks(train, "broadcast_fresh")
    for r in rs:
        for preset in ("dct", "exdyna"):
            assert r[f"{preset}.with"].tobytes() == r[f"{preset}.without"].tobytes(), preset
            assert float(r[f"{preset}.density.True"]) == float(r[f"{preset}.density.False"])
    identical(rs, "dct.with", "exdyna.with")


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_importing_both_horovod_frameworks_still_exchanges_and_keeps_replicas_identical(tmp_path, framework):
    """Both Horovod frameworks imported before ``hvd.init()``: Horovod leaves the global process set's rank list
    empty (``included()`` False everywhere), which must not make the wrapped optimizer skip its exchange."""
    pytest.importorskip("tensorflow")
    from horovod_helpers import horovodrun, load_ranks

    horovodrun(NP, "both_frameworks_worker.py", framework, tmp_path, timeout=LIMIT)
    ranks = load_ranks(tmp_path, "both", NP)
    assert list(ranks[0]["ranks"]) == [], "Horovod filled the ranks: this test no longer covers its case"
    assert all(int(r["collectives"]) > 0 for r in ranks)                   # the sparse step exchanged
    assert ranks[1]["params"].tobytes() == ranks[0]["params"].tobytes()    # from other data on each rank


def test_one_preset_shared_by_optimizers_of_both_frameworks_and_sparse_allreduce_trains_each_independently(
        tmp_path):
    """A preset is configuration: one object given to two torch optimizers (models of the same shape), Horovod's own
    optimizer, a Keras optimizer and sparse_allreduce in both frameworks, stepped in turn, gives every job exactly
    what it gives with a preset of its own -- no residual, threshold or counter is shared."""
    pytest.importorskip("tensorflow")
    from horovod_helpers import horovodrun, load_ranks

    horovodrun(NP, "shared_preset_worker.py", tmp_path, timeout=LIMIT)
    rs = load_ranks(tmp_path, "shared", NP)
    jobs = ["ours.0", "ours.1", "horovod", "keras", "torch.allreduce", "tf.allreduce", "residual_norms"]
    for r in rs:
        for job in jobs:
            assert r[f"shared.{job}"].tobytes() == r[f"separate.{job}"].tobytes(), job
        assert (r["shared.residual_norms"] > 0).all()                   # every optimizer's step was sparse
        assert r["shared.ours.0"].tobytes() != r["shared.ours.1"].tobytes()
    identical(rs, "shared.ours.0", "shared.ours.1", "shared.horovod", "shared.keras", "shared.tf.allreduce",
              "shared.torch.allreduce")


JOIN = """
import sys
import horovod.torch as hvd, torch, hvd_sparse.torch as hvds
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(50, 4)
opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(), compression=hvds.Compression.topka(0.1))
try:
    for t in range(3 if hvd.rank() == 0 else 1):        # uneven steps: rank 1 joins while rank 0 still exchanges
        opt.zero_grad(); model(torch.randn(8, 50)).sum().backward(); opt.step()
    hvd.join()
except Exception as e:
    print(f"rank {hvd.rank()} raised {type(e).__name__}: {e}", flush=True)
"""


def test_hvd_join_with_a_sparse_preset_ends_the_job_naming_join_on_the_ranks_still_stepping(tmp_path):
    script = tmp_path / "join.py"
    script.write_text(JOIN)
    proc = subprocess.run([str(BIN / "horovodrun"), "-np", str(NP), "-H", f"localhost:{NP}", "--gloo", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=LIMIT, env=job_env())
    lines = [line for line in proc.stdout.splitlines() if "raised" in line]
    assert any("rank 0 raised PeerFailureError" in line and "hvd.join()" in line for line in lines), proc.stdout[-3000:]
    assert any("rank 1 raised" in line for line in lines)               # the joined rank stops too: no hang
