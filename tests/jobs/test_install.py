"""``pip install .`` into an environment that already has the frameworks and Horovod (README, "Should I use it?"):
a fresh virtual environment that sees this one's packages (a ``.pth`` line: what ``--system-site-packages`` gives
a venv made from a system Python), the package installed into it by pip from a copy of the source tree, imported
from there (not from the checkout) and trained by a two-rank ``horovodrun`` job."""

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest

from horovod_helpers import HOROVODRUN, ROOT, requires_horovod

JOB = textwrap.dedent("""
    import horovod.torch as hvd
    import torch

    import hvd_sparse
    import hvd_sparse.torch as hvds

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(50, 4)
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.topka(0.1))
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(8, 50, generator=torch.Generator().manual_seed(hvd.rank() * 10 + step))
        model(x).pow(2).mean().backward()
        opt.step()
    opt.check_consistency()
    print("installed", hvd.rank(), hvd.size(), hvd_sparse.__file__, opt.sparse_stats()["selected"], flush=True)
""")


@requires_horovod
@pytest.mark.horovod
def test_pip_install_into_an_existing_environment_trains_a_two_rank_job(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "setup.cfg", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "hvd_sparse", src / "hvd_sparse", ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "existing_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                          "--no-build-isolation", str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    (tmp_path / "job.py").write_text(JOB)
    env = {"PATH": f"{env_dir / 'bin'}:{HOROVODRUN.parent}:/usr/bin:/bin", "HOME": str(tmp_path),
           "OMP_NUM_THREADS": "1", "HVD_SPARSE_WAIT": "poll"}
    job = subprocess.run([str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", str(python), "job.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    lines = [line.split("installed ", 1)[1].split() for line in job.stdout.splitlines() if "installed " in line]
    assert sorted(int(rank) for rank, *_ in lines) == [0, 1]
    for _, size, path, selected in lines:
        assert size == "2" and Path(path).is_relative_to(site) and selected == "20"      # k = 0.1 x 204
