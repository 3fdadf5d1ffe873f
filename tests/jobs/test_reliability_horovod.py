"""Reliability through real `horovodrun --gloo`: non-finite skip/raise across processes, the AMP
recipe, the consistency guard, and a worker that dies mid-step ending the job fast for every reducer."""

import subprocess
import sys
import time

import numpy as np
import pytest

from horovod_helpers import BIN, HERE, elastic_survivors, horovodrun, job_env, load_ranks, requires_horovod

pytestmark = [pytest.mark.horovod, requires_horovod]

NP = 2


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability")
    horovodrun(NP, "reliability_worker.py", "all", out)
    return {s: load_ranks(out, s, NP) for s in ("skip", "amp", "raise", "consistency", "inputs")}


def _unchanged_steps(params):
    return [t for t in range(len(params) - 1) if params[t].tobytes() == params[t + 1].tobytes()]


def test_nan_on_one_rank_skips_that_step_on_every_rank(policies):
    ranks = policies["skip"]
    for r in ranks:
        assert _unchanged_steps(r["params"]) == [3]              # only the poisoned step 3 left the weights
        assert int(r["skipped"]) == 1
        assert "non-finite gradient on rank 1" in str(r["warnings"][0])
    assert ranks[0]["params"].tobytes() == ranks[1]["params"].tobytes()


def test_amp_grad_scaler_backs_off_on_every_rank(policies):
    ranks = policies["amp"]
    for r in ranks:
        assert _unchanged_steps(r["params"]) == [3]
        assert r["scales"].tolist() == [1024.0] * 3 + [512.0] * 3   # the scale halves on every rank at step 3
    assert ranks[0]["params"].tobytes() == ranks[1]["params"].tobytes()


def test_nonfinite_raise_raises_on_every_rank_naming_the_rank(policies):
    for r in policies["raise"]:
        assert int(r["at"]) == 2
        assert "non-finite gradient (NaN or Inf) on rank 1 at step 2" in str(r["msg"])


def test_consistency_guard_names_the_first_differing_parameter_and_rank(policies):
    for r in policies["consistency"]:
        assert int(r["at"]) == 3                                     # the check after step 4 (every 2 steps)
        assert "parameter '2.weight' differs on rank 1 from rank 0" in str(r["msg"])


def test_bad_inputs_that_need_real_ranks(policies):
    """Rows of docs/reliability.md: each behaves as documented and every rank ends with the same parameters."""
    a, b = policies["inputs"]
    for key in a:
        assert a[key].tobytes() == b[key].tobytes(), f"{key} differs across ranks"
    for half in ("float16", "bfloat16"):
        assert bool(a[f"{half}_moved"]) and a[f"{half}_dtypes"].tolist() == [f"torch.{half}"]
    assert "tensor must be floating point" in str(a["int_error"]) and "torch.int64" in str(a["int_error"])
    assert np.isfinite(a["sparse_grads_False"]).all() and np.isfinite(a["sparse_grads_True"]).all()
    snaps = a["frozen_snaps"]           # layer 0 before each of 6 steps and at the end; frozen at steps 2 and 3
    moved = [snaps[t].tobytes() != snaps[t + 1].tobytes() for t in range(6)]
    assert moved == [True, True, False, False, True, True]
    assert int(a["empty_stats"]) == 0
    assert np.isfinite(a["no_backward_params"]).all()


# -- a worker dying mid-step ends the whole job ------------------------------------------------------------
REDUCER_PRESETS = ["dense", "topka", "topk_dsa", "gtopk", "oktopk", "exdyna", "spardl"]   # every reducer
CASES = [("kill", p) for p in REDUCER_PRESETS] + [("fail", "oktopk"), ("fail", "spardl")]
LIMIT = 60.0


def _launch(how, preset, outdir):
    cmd = [str(BIN / "horovodrun"), "-np", str(NP), "-H", f"localhost:{NP}", "--gloo", sys.executable,
           str(HERE / "hvd_workers" / "reliability_worker.py"), how, str(outdir), preset]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env())


def test_a_worker_killed_or_raising_mid_step_ends_the_job_within_60s_naming_the_rank(tmp_path):
    pending = [(how, preset, tmp_path / f"{how}-{preset}") for how, preset in CASES]
    running, results = [], {}
    while pending or running:                     # 3 jobs at a time on this 2-core machine
        while pending and len(running) < 3:
            how, preset, out = pending.pop(0)
            out.mkdir()
            running.append((how, preset, out, _launch(how, preset, out)))
        time.sleep(0.5)
        for job in list(running):
            how, preset, out, proc = job
            if proc.poll() is None:
                killed = out / "killed.time"
                if killed.exists() and killed.read_text() and time.time() - float(killed.read_text()) > 2 * LIMIT:
                    proc.kill()                   # hung: fail below, do not hang the suite
                continue
            ended = time.time()
            running.remove(job)
            results[(how, preset)] = (proc.returncode, proc.stdout.read(), out, ended)
    for (how, preset), (code, output, out, ended) in results.items():
        where = f"{how} {preset}"
        assert (out / "killed.time").exists(), f"{where}: the failure was never injected:\n{output[-3000:]}"
        took = ended - float((out / "killed.time").read_text())
        assert code != 0, f"{where}: the job succeeded although rank 1 died"
        assert took < LIMIT, f"{where}: the job took {took:.0f} s to end after rank 1 died"
        assert "Process name: 1" in output, f"{where}: the failed rank is not named:\n{output[-3000:]}"
        assert not list(out.glob("*.npz")), f"{where}: a surviving rank finished training"
        if how == "fail":
            assert "injected failure on rank 1 in the middle of step 3" in output


def test_a_survivor_names_the_collective_horovod_shut_down_under(monkeypatch):
    """When Horovod shuts down under a collective (another rank died), the survivor's PeerFailureError names that
    collective as Horovod knows it: a sized one with its rung, a grouped allgather by its joined phases. Horovod's
    own shutdown error comes from the calls a framework subclass runs, without a job: in a real one horovodrun may
    stop the survivor before it reports (the killed-worker test above checks that the job ends)."""
    from types import SimpleNamespace

    from horovod.common.exceptions import HorovodInternalError

    from hvd_sparse.horovod_comm import HorovodCommunicator, _peer_failure_type

    class ShutDown(HorovodCommunicator):
        def _allreduce(self, x, op, kw):
            raise HorovodInternalError("Horovod has been shut down")

        def _grouped_allgather(self, xs, kw):
            raise HorovodInternalError("Horovod has been shut down")

    monkeypatch.setenv("HOROVOD_ELASTIC", "1")                  # no grace before raising
    comm = ShutDown(SimpleNamespace(Sum="sum", Max="max"), SimpleNamespace(rank=lambda: 0, size=lambda: 2), "u")
    with pytest.raises(_peer_failure_type(), match=r"'hvd_sparse\.u\.values\.3' failed on rank 0"):
        comm.allreduce(np.zeros(3, np.float32), "sum", "values", bucket=3)
    with pytest.raises(_peer_failure_type(), match=r"'hvd_sparse\.u\.indices\+values' failed"):
        comm.grouped_allgather([np.zeros(2, np.int32), np.zeros(2, np.float32)], ["indices", "values"])


# -- elastic: a killed worker, restore, reset to fewer ranks -----------------------------------------------
@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_elastic_run_survives_a_killed_worker_and_resets_sparse_state(tmp_path, policy):
    survivors = elastic_survivors(tmp_path, "elastic_worker.py", tmp_path, policy)
    assert len(survivors) == 2                                  # the worker on 127.0.0.1 died at step 5
    for s in survivors:
        steps, sizes, engine_steps, norms = s["records"].T
        assert steps.tolist() == list(range(12))                # step 5 (uncommitted when the worker died) redone
        assert sizes.tolist() == [3] * 5 + [2] * 7
        # partitions, thresholds and counters start afresh after the reset: the engine counts again from 1
        assert engine_steps.tolist() == [1, 2, 3, 4, 5] + [1, 2, 3, 4, 5, 6, 7]
        (s0, size0, r0), (s1, size1, r1) = s["starts"].tolist()
        assert (s0, size0, r0) == (0, 3, 0.0) and (s1, size1) == (5, 2)
        # the residual after the reset: this process's residual at the last commit (after step 4), or zero
        assert r1 == (norms[4] if policy == "keep" else 0.0)
        assert norms[4] > 0
    assert survivors[0]["params"].tobytes() == survivors[1]["params"].tobytes()


_STALE_WORLD = """
import horovod.torch as hvd, torch, hvd_sparse.torch as hvds
hvd.init()
model = torch.nn.Linear(30, 3)          # the gradient of model(ones).sum() does not depend on the parameters
opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                compression=hvds.Compression.oktopk(0.1), elastic_residuals=POLICY)
def step():
    opt.zero_grad(); model(torch.ones(4, 30)).sum().backward(); opt.step()
    return opt._hvds.engine().memory.residual.clone()
first = step()
second = step()
old = opt._hvds.engine()
old.comm.size, old.comm.rank = 3, 2        # as if built before the world shrank (elastic reset without a sync)
third = step()
new = opt._hvds.engine()
assert new is not old and (new.comm.rank, new.comm.size) == (0, 1) and new.steps == 1, new.steps
# drop: the rebuilt engine starts from an empty residual, exactly like the first step; keep: from the old one
assert torch.equal(third, first) == (POLICY == "drop"), (POLICY, third, first)
"""


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_engine_built_for_another_world_is_rebuilt_at_the_next_exchange(policy):
    """hvd.elastic skips sync() after a graceful host removal: the optimizer itself notices the changed world
    and rebuilds its engine (counters afresh, residual kept or dropped by the policy)."""
    src = _STALE_WORLD.replace("POLICY", repr(policy))
    out = subprocess.run([sys.executable, "-c", src], env=job_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
