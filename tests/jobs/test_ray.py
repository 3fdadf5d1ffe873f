"""Horovod's Ray integration with hvd_sparse (Ray pinned by the ``[ray]`` extra, installed by ``make test``):
``horovod.ray.RayExecutor`` runs examples/pytorch_digits.py (dense, then TopkA) on a local Ray cluster of 2 actors
and trains exactly what ``horovodrun -np 2`` trains; ``ElasticRayExecutor`` runs the sparse half as an elastic job
with ``hvd.elastic.TorchState``. Each run starts its own Ray (under a private temporary directory) in a child
process; whatever of it is left when the test ends is stopped by pid."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from horovod_helpers import BIN, ROOT, job_env, requires_horovod

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install '.[ray]' here; make test installs it)")

pytestmark = [pytest.mark.horovod, requires_horovod]

EXAMPLE = ROOT / "examples" / "ray_digits.py"
LINE = re.compile(r"\[ *(dense|sparse)\] epoch +(\d+) +loss ([\d.]+) +test acc +([\d.]+)%")


def _ray_processes(tmp):
    """Pids of the processes of the Ray started with RAY_TMPDIR=tmp: ``tmp`` is in their command line (raylet,
    GCS) or environment (the actors, whose command line Ray rewrites)."""
    pids, mark = [], str(tmp).encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if mark in (d / "cmdline").read_bytes() or b"RAY_TMPDIR=" + mark in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def run_ray_example(*args, timeout=600):
    tmp = Path(tempfile.mkdtemp(prefix="hvdray", dir="/tmp"))     # short: Ray's socket paths must fit 107 bytes
    out = tmp / "result.json"
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--workers", "2", "--json", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=job_env(RAY_TMPDIR=str(tmp)), start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            pytest.fail(f"ray_digits.py {' '.join(args)} failed ({proc.returncode}):\n{text[-6000:]}")
        return json.loads(out.read_text()), text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _ray_processes(tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_executor_trains_the_torch_example_as_horovodrun_does():
    results, text = run_ray_example("--", "--epochs", "2")
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    for key in ("dense", "sparse"):
        ours = [[(e["loss"], e["acc"], e["density"], e["bytes"]) for e in r[key]] for r in results]
        assert ours[0] == ours[1], f"{key}: the ranks disagree"     # same weights on both ranks
        assert len(ours[0]) == 2
    assert all(e["density"] == pytest.approx(0.01, rel=0.05) for e in results[0]["sparse"])
    # the same job under horovodrun: the same numbers, epoch by epoch
    proc = subprocess.run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                           str(ROOT / "examples" / "pytorch_digits.py"), "--epochs", "2"],
                          capture_output=True, text=True, timeout=600, env=job_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = [m.groups() for m in LINE.finditer(proc.stdout)]
    got = [(label, str(e + 1), f"{h['loss']:.4f}", f"{h['acc'] * 100:.2f}")
           for label in ("dense", "sparse") for e, h in enumerate(results[0][label])]
    assert want == got
    # rank 0's progress reached the driver (Ray streams the actors' output asynchronously: the last lines may not
    # be printed yet when the job ends)
    seen = [m.groups() for m in LINE.finditer(text)]
    assert seen and seen == got[:len(seen)]


def test_elastic_ray_executor_with_the_sparse_optimizer_state():
    results, text = run_ray_example("--elastic", "--", "--epochs", "2")
    assert sorted(r["rank"] for r in results) == [0, 1]
    hist = [r["sparse"] for r in sorted(results, key=lambda r: r["rank"])]
    assert hist[0] == hist[1]                                        # sparse_stats(average=True): identical
    assert [h["epoch"] for h in hist[0]] == [1, 2] and all(h["size"] == 2 for h in hist[0])
    assert all(h["density"] == pytest.approx(0.01, rel=0.05) and h["residual_norm"] > 0 for h in hist[0])
    assert "[elastic] epoch  2" in text
