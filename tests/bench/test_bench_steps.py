"""The step benchmarks at tiny sizes, so that they cannot rot (their GPU runs are in docs/gpu.md): ``engine`` (one
rank's engine step per preset) on the CPU and, with ``-m cuda``, on a GPU; ``trainstep`` and ``latency`` through
real horovodrun; ``advise`` launched by horovodrun as a user would; ``scripts/step_breakdown.py``. No timing is
asserted."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hvd_sparse.bench.__main__ import main
from hvd_sparse.bench.engine import REFERENCES
from hvd_sparse.bench.presets import names

from horovod_helpers import HOROVODRUN, ROOT, job_env, requires_horovod
from test_bench_select_plot import assert_png


def _engine(tmp_path, device):
    out, png = tmp_path / "e.json", tmp_path / "e.png"
    assert main(["engine", "--numel", "30000", "--repeat", "2", "--device", device, "--json", str(out),
                 "--plot", str(png), "--quiet"]) == 0
    assert_png(png)
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == names() + list(REFERENCES)
    assert report["numel"] == 30000 and report["k"] == 300
    for r in report["results"]:
        assert r["wall_seconds"] > 0
    return {r["name"]: r for r in report["results"]}


def test_engine_cli_times_every_preset_on_the_cpu(tmp_path, capsys):
    rows = _engine(tmp_path, "cpu")
    assert all(r["kernel_seconds"] == 0 and r["syncs"] == 0 for r in rows.values())     # nothing to wait for
    assert "| oktopk |" in capsys.readouterr().out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
def test_engine_and_select_cli_on_a_gpu_count_kernels_and_syncs(tmp_path):
    rows = _engine(tmp_path, "cuda")
    assert all(r["kernel_seconds"] > 0 for r in rows.values())
    assert rows["oktopk"]["syncs"] >= 1 and rows["stream"]["syncs"] == 0
    out = tmp_path / "s.json"
    assert main(["select", "--numel", "20000", "--repeat", "2", "--device", "cuda", "--json", str(out),
                 "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert report["device"].startswith(torch.cuda.get_device_name())
    assert {r["method"]: r["selected"] for r in report["results"]}["topk_exact"] == 200


@pytest.mark.horovod
@requires_horovod
def test_trainstep_and_latency_cli_through_horovodrun(tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["trainstep", "--workers", "2", "--device", "cpu", "--layers", "16,32,4", "--batch-size", "8",
                 "--steps", "3", "--warmup", "1", "--algorithms", "compute,wire,wire_pinned,dense,topka,oktopk",
                 "--json", str(out), "--plot", str(png), "--quiet"]) == 0
    assert_png(png)
    report = json.loads(out.read_text())
    rows = {r["algorithm"]: r for r in report["results"]}
    assert list(rows) == ["compute", "wire", "wire_pinned", "dense", "topka", "oktopk"]
    assert report["numel"] == 16 * 32 + 32 + 32 * 4 + 4
    assert rows["compute"]["over_compute_ms"] == 0 and len(rows["topka"]["step_ms_all"]) == 3
    assert rows["dense"]["recv_bytes"] == 2 * report["numel"] // 2 * 4          # the ring's 2n(P-1)/P words
    assert 0 < rows["topka"]["recv_bytes"] < rows["dense"]["recv_bytes"]
    assert rows["wire"]["recv_bytes"] == rows["wire_pinned"]["recv_bytes"] == rows["topka"]["recv_bytes"] \
        == 8 * max(1, int(0.01 * report["numel"]))
    assert rows["wire"]["over_wire"] == 1.0
    lat = tmp_path / "l.json"
    assert main(["latency", "--workers", "2", "--cycle-times", "0.1", "--repeat", "5", "--warmup", "1",
                 "--idle", "0.3", "--json", str(lat), "--quiet"]) == 0
    report = json.loads(lat.read_text())
    rows = report["results"]
    assert {(r["collective"], r["wait"]) for r in rows} == {(c, w) for c in ("allreduce", "allgather")
                                                            for w in ("poll", "spin")}
    assert all(r["workers"] == 2 and r["cycle_time_ms"] == "0.1" and r["median_us"] > 0 for r in rows)
    # a 0.1 ms cycle: thousands of coordination rounds a second, so an idle rank's process spends CPU
    [idle] = report["idle"]
    assert idle["workers"] == 2 and idle["cycle_time_ms"] == "0.1" and 0 < idle["mean_ms_per_s"] <= idle["max_ms_per_s"]


@requires_horovod
def test_advise_under_horovodrun_measures_every_configuration_and_gives_a_verdict(tmp_path):
    """``bench advise`` launched as training is: every configuration's step in rounds, bytes and the links'
    probes, in JSON and Markdown, with progress on the way, the ranks' torch threads sharing the host's cores; two
    rounds are too few for a winner; one rank alone is refused with the command to run."""
    out, md = tmp_path / "a.json", tmp_path / "a.md"
    cmd = [str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "hvd_sparse.bench",
           "advise", "--model", "hvd_sparse.bench.advise:digits_cnn", "--presets", "topka", "--densities", "0.01",
           "--steps", "2", "--warmup", "1", "--rounds", "2", "--probe-mb", "1", "--json", str(out),
           "--markdown", str(md)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=job_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["configurations"]}
    assert list(rows) == ["compute", "dense", "fp16", "topka@b0.05", "topka@d0.01"]
    assert report["workers"] == 2 and report["numel"] == 38_282 and report["build"]["gloo"]
    assert rows["dense"]["sent_bytes"] == 4 * 38_282 and rows["fp16"]["sent_bytes"] == 2 * 38_282   # the ring's
    assert 0 < rows["topka@d0.01"]["sent_bytes"] < rows["topka@b0.05"]["sent_bytes"] < rows["fp16"]["sent_bytes"]
    assert rows["compute"]["beyond_compute_ms"] == 0 and all(r["step_ms"] > 0 for r in rows.values())
    assert report["latency_us"] > 0 and report["bandwidth_gbit"] > 0
    assert report["rounds"] == 2 and all(len(r["rounds_ms"]) == 2 and [len(s) for s in r["steps_ms"]] == [2, 2]
                                         for r in rows.values())
    assert report["torch_threads"] == max(1, min(len(os.sched_getaffinity(0)), os.cpu_count() // 2))
    assert report["verdict"] in md.read_text() and "round 1:" in proc.stderr and "torch threads" in proc.stderr
    decision = report["decision"]
    assert decision["best"] in ("topka@b0.05", "topka@d0.01") and not decision["wins"] and decision["reason"]
    alone = subprocess.run([sys.executable, "-m", "hvd_sparse.bench", "advise"], capture_output=True, text=True,
                           timeout=300, env=job_env())
    assert alone.returncode != 0 and "horovodrun -np 2" in alone.stderr


@requires_horovod
def test_step_breakdown_script_reports_every_part_on_every_rank(tmp_path):
    """``scripts/step_breakdown.py`` (docs/benchmarks.md, "What the Ok-Topk step costs") at a tiny size: it wraps
    the engine's parts by name, so a renamed part fails here instead of in the next diagnosis."""
    cmd = [str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
           str(ROOT / "scripts" / "step_breakdown.py"), "--numel", "20000", "--steps", "2",
           "--data", str(tmp_path / "data")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=job_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split("<stdout>:", 1)[1].strip().rsplit(None, 2)[0]: line.split()[-2:]
            for line in proc.stdout.splitlines() if "<stdout>:  " in line}
    for part in ("reducer (incl. its collectives)", "selection", "residual + grad (the add pass)",
                 "the opening (incl. its allgather)", "step (wall, median)"):
        assert part in rows and all(float(v) > 0 for v in rows[part]), (part, rows)
