"""How the torch communicator waits for Horovod (hvd_sparse.torch.comm.wait): Horovod's spinning synchronize() when
this host has a core per rank, else poll and sleep; its settings, and real collectives with each wait (Horovod size
1, in a subprocess)."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("horovod.torch")

from hvd_sparse.torch import comm as tcomm  # noqa: E402


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("HVD_SPARSE_WAIT", raising=False)
    monkeypatch.delenv("HVD_SPARSE_WAIT_MAX_US", raising=False)
    return monkeypatch


def test_wait_settings_come_from_the_environment_and_bad_values_are_named(clean_env):
    cores = len(os.sched_getaffinity(0))
    assert tcomm.wait_max_seconds() == pytest.approx(500e-6)              # auto, ranks per host unknown: poll
    assert tcomm.wait_max_seconds(local_ranks=cores) is None              # auto, a core per rank: spin
    assert tcomm.wait_max_seconds(local_ranks=cores + 1) == pytest.approx(500e-6)   # more ranks than cores: poll
    clean_env.setenv("HVD_SPARSE_WAIT", "poll")
    assert tcomm.wait_max_seconds(local_ranks=1) == pytest.approx(500e-6)
    clean_env.delenv("HVD_SPARSE_WAIT")
    clean_env.setenv("HVD_SPARSE_WAIT_MAX_US", "2000")
    assert tcomm.wait_max_seconds() == pytest.approx(2e-3)
    clean_env.setenv("HVD_SPARSE_WAIT", "spin")
    assert tcomm.wait_max_seconds() is None
    clean_env.setenv("HVD_SPARSE_WAIT", "busy")
    with pytest.raises(ValueError, match="HVD_SPARSE_WAIT must be 'auto' \\(default\\), 'poll' or 'spin'"):
        tcomm.wait_max_seconds()
    clean_env.setenv("HVD_SPARSE_WAIT", "poll")
    for bad in ("0", "-5", "abc", "2e6"):
        clean_env.setenv("HVD_SPARSE_WAIT_MAX_US", bad)
        with pytest.raises(ValueError, match="HVD_SPARSE_WAIT_MAX_US"):
            tcomm.wait_max_seconds()


def test_wait_polls_with_growing_sleeps_and_takes_the_result_once_done(monkeypatch):
    """A pending handle is polled, with sleeps of 20 us doubling up to the cap, and synchronize() is called only
    once poll() says done; with max_sleep=None it is Horovod's synchronize() at once (the spinning wait)."""
    polls, sleeps, synced = [], [], []
    pending = iter([False] * 8 + [True])
    monkeypatch.setattr(hvd, "poll", lambda h: polls.append(h) or next(pending))
    monkeypatch.setattr(hvd, "synchronize", lambda h: synced.append((h, len(polls))) or "result")
    monkeypatch.setattr(tcomm.time, "sleep", sleeps.append)
    assert tcomm.wait(7, max_sleep=150e-6) == "result"
    assert sleeps == pytest.approx([20e-6, 40e-6, 80e-6, 150e-6, 150e-6, 150e-6, 150e-6])
    assert synced == [(7, 9)]                                  # after the 9th poll, the first that said done
    polls.clear()
    assert tcomm.wait(8, max_sleep=None) == "result" and polls == []


SCRIPT = textwrap.dedent("""
    import torch, horovod.torch as hvd
    from hvd_sparse.torch.comm import HorovodTorchCommunicator
    hvd.init()
    comm = HorovodTorchCommunicator(hvd.global_process_set, "wait")
    x = torch.arange(6, dtype=torch.float32)
    assert torch.equal(comm.allreduce(x, "sum", "a"), x)
    assert torch.equal(comm.allgather(x, "g"), x)
    out, recv = comm.alltoall(x, [6], "t")
    assert torch.equal(out, x) and recv == [6]
    assert torch.equal(comm.broadcast(x, 0, "b"), x)
    assert comm.meter.totals()["collectives"] == 4
    print("max_sleep", comm._max_sleep)
""")


@pytest.mark.parametrize("mode, expect", [("poll", "max_sleep 0.0005"), ("spin", "max_sleep None"),
                                          ("auto", "max_sleep None")])          # auto: 1 rank on this host
def test_real_collectives_with_either_wait(mode, expect):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "HVD_SPARSE_WAIT"))}
    env["HVD_SPARSE_WAIT"] = mode
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert expect in res.stdout
