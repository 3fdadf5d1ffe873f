"""Real multi-host ``horovodrun``: 4 ranks on 2 ssh hosts (network namespaces on a tc-shaped bridge, see
ssh_cluster.py), launched from the root namespace the way users launch across machines --
``horovodrun -np 4 -H <ip1>:2,<ip2>:2 --gloo --ssh-identity-file KEY`` and ``--hostfile`` -- with the torch
optimizer (checked bit for bit against the simulator) and a Keras ``model.fit`` with our optimizer (identical weights
on every rank, equal to the simulator). Needs root (namespaces) and openssh-server; skipped otherwise."""

import subprocess
import sys

import numpy as np
import pytest

import hvd_sparse
from hvd_sparse.bench import presets
from hvd_sparse.testing import simulate

from horovod_helpers import BIN, HERE, job_env, load_ranks, requires_horovod
from ssh_cluster import ssh_cluster, why_not

_WHY_NOT = why_not()
pytestmark = [pytest.mark.horovod, requires_horovod,
              pytest.mark.skipif(_WHY_NOT is not None, reason=f"multi-host horovodrun: {_WHY_NOT}")]

P = 4


# first: the module's cluster (below) must not exist yet -- one network per process at a time
def test_cluster_is_removed_also_after_a_failure():
    from hvd_sparse.bench.netns import list_names

    with pytest.raises(RuntimeError, match="boom"):
        with ssh_cluster(hosts=2) as c:
            names, tmp = list(c.namespaces), c.tmp
            proc = subprocess.run(["ssh", "-i", c.key, c.ips[1], "echo", "reached"], capture_output=True,
                                  text=True, timeout=60, env=c.env())
            assert proc.stdout.strip() == "reached", proc.stderr
            raise RuntimeError("boom")
    ns, links = list_names()
    assert not set(names) & set(ns) and not [lk for lk in links if lk.startswith(names[0][:-2])]
    assert not tmp.exists()
    out = subprocess.run(["pgrep", "-f", f"{tmp}/sshd"], capture_output=True, text=True).stdout
    assert not out.strip(), f"sshd still running: {out}"


@pytest.fixture(scope="module")
def cluster():
    with ssh_cluster(hosts=2, rate="1gbit") as c:
        yield c


def run_over_ssh(cluster, hosts_args, script, *args, env=None, timeout=900):
    cmd = [str(BIN / "horovodrun"), "-np", str(P), *hosts_args, "--gloo", "--ssh-identity-file", cluster.key,
           sys.executable, str(HERE / "hvd_workers" / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=cluster.env(job_env(**(env or {}))))
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def test_torch_optimizer_across_two_hosts_equals_simulator(cluster, tmp_path):
    hosts = ["-H", ",".join(f"{ip}:2" for ip in cluster.ips)]
    run_over_ssh(cluster, hosts, "torch_worker.py", tmp_path, "optimizer", env={"HOROVOD_FUSION_THRESHOLD": "0"})
    assert all(cluster.logins(i) > 0 for i in range(len(cluster.ips))), "the ranks did not start over ssh"
    ranks = load_ranks(tmp_path, "optimizer", P)
    grads = np.stack([r["raw"] for r in ranks], axis=1)             # (steps, P, n)
    assert grads.shape[:2] == (50, P) and np.isfinite(grads).all()
    assert not np.array_equal(ranks[0]["raw"], ranks[2]["raw"])      # the hosts trained on different data
    sim = simulate(hvd_sparse.Compression.topka(0.05), grads)
    for r in range(P):
        assert ranks[r]["red"].tobytes() == sim.updates[:, r].tobytes(), f"rank {r} differs from the simulator"
        assert ranks[r]["params"].tobytes() == ranks[0]["params"].tobytes()
    assert int(ranks[0]["recv_words"]) == 2 * int(ranks[0]["k"]) * (P - 1)


def test_keras_fit_across_two_hosts_from_a_hostfile(cluster, tmp_path):
    before = [cluster.logins(i) for i in range(len(cluster.ips))]
    run_over_ssh(cluster, ["--hostfile", cluster.hostfile(slots=2)], "keras_worker.py", tmp_path, "fit",
                 env={"HOROVOD_FUSION_THRESHOLD": "0", "TF_CPP_MIN_LOG_LEVEL": "3",
                      "HVD_SPARSE_TEST_PRESETS": "oktopk"})
    assert all(cluster.logins(i) > b for i, b in enumerate(before)), "the ranks did not start over ssh"
    ranks = load_ranks(tmp_path, "keras_keras3_fit", P)
    for preset in ("none", "oktopk"):
        for r in range(1, P):
            assert ranks[r][f"{preset}.weights"].tobytes() == ranks[0][f"{preset}.weights"].tobytes(), \
                f"{preset}: rank {r}'s weights differ from rank 0's"
    grads = np.stack([r["oktopk.raw"] for r in ranks], axis=1)
    assert grads.shape[:2] == (6, P)
    sim = simulate(presets.make("oktopk", 0.05), grads, shapes=[(int(m),) for m in ranks[0]["layout"]])
    for r in range(P):
        assert ranks[r]["oktopk.red"].tobytes() == sim.updates[:, r].tobytes(), f"rank {r} differs"
