"""The step benchmarks at tiny sizes, so that they cannot rot (their GPU runs are in docs/gpu.md): ``engine`` (one
rank's engine step per preset) on the CPU and, with ``-m cuda``, on a GPU; ``trainstep`` and ``latency`` through
real horovodrun. No timing is asserted."""

import json

import pytest
import torch

from hvd_sparse.bench.__main__ import main
from hvd_sparse.bench.engine import REFERENCES
from hvd_sparse.bench.presets import names

from horovod_helpers import requires_horovod
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
                 "--json", str(lat), "--quiet"]) == 0
    rows = json.loads(lat.read_text())["results"]
    assert {(r["collective"], r["wait"]) for r in rows} == {(c, w) for c in ("allreduce", "allgather")
                                                            for w in ("poll", "spin")}
    assert all(r["workers"] == 2 and r["cycle_time_ms"] == "0.1" and r["median_us"] > 0 for r in rows)
