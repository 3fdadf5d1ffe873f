"""The select command and the volume command's list of P and --plot, at tiny sizes (no timing asserted)."""

import json

from hvd_sparse.bench.__main__ import main
from hvd_sparse.bench.select import METHODS
from hvd_sparse.core import native

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC


def test_select_cli_reports_every_method(tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert main(["select", "--numel", "20000", "--repeat", "2", "--json", str(out), "--plot", str(png),
                 "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert {"numel", "density", "k", "threads", "results"} <= set(report)
    assert report["numel"] == 20000 and report["density"] == 0.01 and report["k"] == 200
    assert isinstance(report["threads"], int) and report["threads"] >= 1
    assert [r["method"] for r in report["results"]] == list(METHODS)
    assert set(METHODS) == {"topk_exact", "threshold_reuse", "gaussiank", "exdyna", "dct", "torch.topk", "stream"}
    rows = {r["method"]: r for r in report["results"]}
    for r in rows.values():
        assert r["seconds_median"] > 0 and len(r["seconds"]) == 2
        assert min(r["seconds"]) <= r["seconds_median"] <= max(r["seconds"])
    assert rows["topk_exact"]["selected"] == rows["torch.topk"]["selected"] == 200   # exact-k
    # the reuse step of a threshold computed on this very buffer selects exactly k (ge_nonzero rule)
    assert rows["threshold_reuse"]["selected"] == 200
    for m in ("gaussiank", "exdyna", "dct"):
        assert 0 < rows[m]["selected"] < 20000
    # the thresholding sparsifiers ran the fused kernel (when it builds here), the torch baselines did not
    kernel = report["native_kernel"]
    assert kernel["enabled"] is native.available() and kernel["threads"] == 1      # n < MIN_PER_THREAD
    for m in ("threshold_reuse", "gaussiank", "exdyna"):
        assert rows[m]["native"] is kernel["enabled"]
    for m in ("topk_exact", "torch.topk", "stream"):
        assert rows[m]["native"] is False
    assert_png(png)
    text = capsys.readouterr().out
    assert "| method | seconds (median) | x stream | torch.topk / method | native |" in text
    assert "| stream |" in text and "| threshold_reuse |" in text


def test_select_cli_records_the_generic_path_when_the_kernel_is_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HVD_SPARSE_NATIVE", "0")
    out = tmp_path / "s.json"
    assert main(["select", "--numel", "5000", "--repeat", "1", "--json", str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert report["native_kernel"]["enabled"] is False
    assert report["native_kernel"]["reason"] == "HVD_SPARSE_NATIVE=0"
    assert not any(r["native"] for r in report["results"])
    rows = {r["method"]: r for r in report["results"]}
    assert rows["threshold_reuse"]["selected"] == 50
    assert "fused kernel off (HVD_SPARSE_NATIVE=0)" in capsys.readouterr().out


def test_volume_cli_with_a_list_of_workers_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "v.json", tmp_path / "v.png"
    assert main(["volume", "--workers", "2,3", "--numel", "3000", "--steps", "3",
                 "--algorithms", "topka,oktopk,dense", "--json", str(out), "--plot", str(png), "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"numel", "density", "steps", "data", "runs"}
    assert report["numel"] == 3000 and report["density"] == 0.01 and report["steps"] == 3
    assert report["data"] == "synthetic"
    assert [r["workers"] for r in report["runs"]] == [2, 3]
    for run in report["runs"]:
        P, k = run["workers"], run["k"]
        assert k == 30 and run["numel"] == 3000 and run["steps"] == 3
        rows = {r["algorithm"]: r for r in run["results"]}
        assert set(rows) == {"topka", "oktopk", "dense"}
        assert rows["topka"]["recv_words_max"] == 2 * k * (P - 1)
        assert rows["dense"]["recv_words_max"] == 2 * 3000 * (P - 1) // P
        assert rows["dense"]["density_mean"] == 1.0
        for r in rows.values():
            assert r["recv_words_max_steady"] <= r["recv_words_max"]
    assert_png(png)
    text = capsys.readouterr().out
    assert "P = 2, n = 3,000" in text and "P = 3, n = 3,000" in text and text.count("| topka |") == 2


def test_volume_cli_single_worker_keeps_its_json_and_plots_bars(tmp_path, capsys):
    out, png = tmp_path / "v1.json", tmp_path / "v1.png"
    assert main(["volume", "--workers", "3", "--numel", "3000", "--steps", "3", "--algorithms", "topka,gtopk",
                 "--json", str(out), "--plot", str(png), "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert "runs" not in report
    assert report["workers"] == 3 and isinstance(report["workers"], int) and report["k"] == 30
    rows = {r["algorithm"]: r for r in report["results"]}
    assert rows["topka"]["recv_words_max"] == 2 * 30 * 2
    assert_png(png)
    assert capsys.readouterr().out.count("Words received per rank per step") == 1
