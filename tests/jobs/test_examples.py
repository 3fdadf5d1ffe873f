"""The examples stand alone: copied out of the repository, each trains under ``horovodrun -np 2`` with a preset at a
byte budget (the torch one also logs the sparse statistics through ``logging``)."""

import shutil
import subprocess
import sys

import pytest

from horovod_helpers import HOROVODRUN, ROOT, job_env, requires_horovod


@pytest.mark.horovod
@requires_horovod
def test_the_torch_example_runs_from_a_copy_with_any_preset(tmp_path):
    example = shutil.copy(ROOT / "examples" / "pytorch_digits.py", tmp_path)
    assert "hvd_sparse.bench" not in (tmp_path / "pytorch_digits.py").read_text()
    proc = subprocess.run([str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, example,
                           "--epochs", "1", "--compression", "exdyna", "--byte-budget", "0.05",
                           "--log-stats-every", "10"], capture_output=True, text=True, timeout=300,
                          env=job_env(), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Compression.exdyna(byte_budget=0.05)" in out and "[sparse] epoch  1" in out
    assert out.count("hvd_sparse step ") == 2            # 22 steps: steps 10 and 20, on rank 0 only


@pytest.mark.horovod
@requires_horovod
@pytest.mark.parametrize("script", ["keras_digits.py", "tensorflow2_digits.py"])
def test_the_tensorflow_examples_run_from_a_copy(tmp_path, script):
    example = shutil.copy(ROOT / "examples" / script, tmp_path)
    assert "hvd_sparse.bench" not in (tmp_path / script).read_text()
    proc = subprocess.run([str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, example,
                           "--epochs", "1", "--compression", "topka", "--byte-budget", "0.05"],
                          capture_output=True, text=True, timeout=300, env=job_env(), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "final test accuracy" in out and "Compression.topka(byte_budget=0.05)" in out
