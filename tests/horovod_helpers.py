"""Launch real `horovodrun --gloo` jobs from tests and load what each rank wrote."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
#: the repository
ROOT = HERE.parent
#: the horovodrun next to this Python (the project's .venv), else the one on PATH (the GPU check installs it apart)
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
if not HOROVODRUN.exists() and shutil.which("horovodrun"):
    HOROVODRUN = Path(shutil.which("horovodrun"))
BIN = HOROVODRUN.parent


def horovodrun_available():
    return HOROVODRUN.exists()


requires_horovod = pytest.mark.skipif(not horovodrun_available(), reason="horovodrun not installed "
                                      "(run `make test`, which builds it)")


def job_env(**extra):
    """The environment of a test's horovodrun job: this venv's binaries, one thread per worker, the repo, and the
    polling wait: the suite runs several ranks per core (jobs side by side, hosts emulated on one machine), where
    hvd_sparse's "auto" wait could spin; tests/torch/test_torch_wait.py covers "auto" itself."""
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1", PYTHONPATH=path)
    env.setdefault("HVD_SPARSE_WAIT", "poll")
    return dict(env, **extra)


def horovodrun(np_, script, *args, timeout=300, env=None, hosts=None):
    """Run ``script args`` on ``np_`` local Gloo workers; fail the test with the job's output on error. ``hosts``:
    horovodrun's ``-H`` (default ``localhost:<np>``; ``localhost:2,127.0.0.1:2``: two hosts on this machine)."""
    cmd = [str(HOROVODRUN), "-np", str(np_), "-H", hosts or f"localhost:{np_}", "--gloo",
           sys.executable, str(HERE / "hvd_workers" / script), *map(str, args)]
    full_env = job_env(**(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if proc.returncode != 0:
        pytest.fail(f"horovodrun -np {np_} {script} {' '.join(map(str, args))} failed "
                    f"({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def load_ranks(outdir, scenario, np_):
    return [dict(np.load(Path(outdir) / f"{scenario}.rank{r}.npz")) for r in range(np_)]


def scenario_job(tmp_path_factory, name, np_, script, scenarios, prefix="", *, args=None, timeout=300, env=None,
                 hosts=None):
    """A module's job: ``script <out> <scenarios>`` (or ``<out> <args>``) on ``np_`` local workers (on ``hosts``:
    :func:`horovodrun`), ``out`` a fresh folder ``name``; returns {scenario: what each rank wrote to
    ``<out>/<prefix><scenario>.rank<r>.npz``}."""
    out = tmp_path_factory.mktemp(name)
    horovodrun(np_, script, out, *(scenarios if args is None else args), timeout=timeout, env=env, hosts=hosts)
    return {s: load_ranks(out, f"{prefix}{s}", np_) for s in scenarios}


def tf_env(flavour="keras3", fusion=True, **extra):
    """The environment of a TensorFlow job: TensorFlow's start-up log off, Keras 3 or tf_keras (TF_USE_LEGACY_KERAS)
    by ``flavour``, Horovod's tensor fusion off unless ``fusion`` (the fused layout depends on timing), ``extra``."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1" if flavour == "tf_keras" else "0", **extra}
    if not fusion:
        env["HOROVOD_FUSION_THRESHOLD"] = "0"
    return env


def elastic_survivors(tmp_path, script, *args, env=None, timeout=600):
    """Run ``script args`` under elastic horovodrun: 3 workers on two "hosts" of this machine (localhost:2 and
    127.0.0.1:1, at least 2 kept), the worker scripts kill the one on 127.0.0.1. Fails the test unless the job
    succeeds; returns what the survivors wrote (``<tmp_path>/elastic.*.npz``, sorted)."""
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:1\n")
    discover.chmod(0o755)
    cmd = [str(HOROVODRUN), "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script",
           str(discover), sys.executable, str(HERE / "hvd_workers" / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env(**(env or {})))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [dict(np.load(f)) for f in sorted(tmp_path.glob("elastic.*.npz"))]


#: presets whose exchange sums float values in an allreduce: Gloo's ring adds them in another order than the
#: simulator, so above two ranks they agree to within a few ulps, not bit for bit
FLOAT_ALLREDUCE = {"dense", "exdyna"}


def assert_ranks_equal_simulator(ranks, tag, sim, grads, preset, P):
    """Every rank holds rank 0's parameters (``<tag>.params``) and reduced the simulator's updates (``<tag>.red``):
    bit for bit, or for a float allreduce (:data:`FLOAT_ALLREDUCE`) at P > 2 within a few ulps of the largest
    addend."""
    for r in range(P):
        assert ranks[r][f"{tag}.params"].tobytes() == ranks[0][f"{tag}.params"].tobytes()
        got = ranks[r][f"{tag}.red"]
        if preset in FLOAT_ALLREDUCE and P > 2:
            np.testing.assert_allclose(got, sim.updates[:, r], rtol=1e-6, atol=1e-6 * np.abs(grads).max())
        else:
            assert got.tobytes() == sim.updates[:, r].tobytes(), f"rank {r} differs from the simulator"


def bucketed_oracle(compression, raw, layout, plan, local_size=None, budget="magnitude", min_rate=1.0):
    """The simulator's bucketed run (``simulate_buckets``) of a torch job's buckets: ``raw`` (steps, P, n) and the
    result in the job's flat order, ``layout`` ``[(name, numel)]``; ``plan`` ``[{"names", "dense"}]`` in bucket
    order; ``min_rate``: the job's ``min_compression_rate``. Returns ``(updates, residuals, shares)`` with updates
    (steps, P, n) and residuals (P, n) in flat order."""
    from hvd_sparse.testing import simulate_buckets

    where, at = {}, 0
    for name, m in layout:
        where[name], at = slice(at, at + m), at + m
    order = [where[n] for bucket in plan for n in bucket["names"]]
    sim = simulate_buckets(compression, np.concatenate([raw[:, :, s] for s in order], axis=2),
                           [([(where[n].stop - where[n].start,) for n in b["names"]], b["dense"]) for b in plan],
                           backend="torch", local_size=local_size, budget=budget, min_compression_rate=min_rate)
    updates, residuals, at = np.zeros_like(raw), np.zeros(raw.shape[1:], np.float32), 0
    for s in order:
        updates[:, :, s], residuals[:, s] = sim.updates[:, :, at:at + s.stop - s.start], sim.residuals[:, at:at +
                                                                                                      s.stop - s.start]
        at += s.stop - s.start
    return updates, residuals, sim.shares
