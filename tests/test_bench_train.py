"""``python -m hvd_sparse.bench train``: argument errors, the configuration names, the report's statistics on
hand-made records, and a real tiny run (2 workers in network namespaces on a tc-shaped bridge: Horovod, a preset,
DDP and PowerSGD side by side) that checks the report and that nothing of the network is left behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_sparse.bench import train_report
from hvd_sparse.bench._train_worker import parse_config
from hvd_sparse.bench.__main__ import main

from horovod_helpers import requires_horovod
from test_bench_network import PNG_MAGIC, leftovers, requires_netns

ROOT = Path(__file__).resolve().parents[1]

#: a stand-in for the train worker: fails on configuration "topka", else rank 0 writes one step's records
FAILING_WORKER = r"""
import json, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
if args["--configs"] == "topka":
    sys.exit("topka broke on purpose")
if os.environ["HOROVOD_RANK"] == "0":
    run = {"config": args["--configs"], "kind": "compute" if args["--configs"] == "compute" else "horovod",
           "numel": 10, "evals": [[1, 0.5]], "sent_bytes": [[1.0]] * 2,
           **{p: [[0.1]] * 2 for p in ("forward", "backward", "exchange", "update")}}
    json.dump({"torch_threads": 1, "train_images": 1, "test_images": 1, "runs": [run]}, open(args["--out"], "w"))
"""


@pytest.mark.parametrize("argv, where, what", [
    (["--configs", "horovod,topk"], "--configs", "'topk'"),
    (["--configs", "oktopk+x"], "--configs", "unknown option 'x'"),
    (["--configs", "ddp_powersgd_r0"], "--configs", "ddp_powersgd_r<rank>"),
    (["--configs", "spardl+mc"], "--configs", "does not apply to spardl"),
    (["--configs", "oktopk+d1.5"], "--configs", "unknown option 'd1.5'"),
    (["--targets", "0.9,1.5"], "--targets", "(0, 1]"),
    (["--bandwidth", "fast"], "--bandwidth", "1gbit"),
    (["--workers", "1"], "--workers", "between 2 and 64"),
])
def test_bad_arguments_are_argparse_errors_naming_the_argument(argv, where, what, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert where in err and what in err and "Traceback" not in err


def test_without_root_the_command_says_what_is_missing_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["train", "--workers", "2", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "root privileges" in err and "network namespaces" in err


def test_configuration_names():
    assert parse_config("horovod_fp16") == {"kind": "horovod", "name": "horovod_fp16", "fp16": True}
    assert parse_config("ddp_powersgd_r4") == {"kind": "ddp", "name": "ddp_powersgd_r4", "powersgd_rank": 4}
    assert parse_config("oktopk+w20+mc") == {"kind": "sparse", "name": "oktopk+w20+mc", "preset": "oktopk",
                                             "warmup_dense_steps": 20, "momentum_correction": True}
    assert parse_config("oktopk+d0.03")["density"] == 0.03 and "density" not in parse_config("oktopk")
    with pytest.raises(ValueError, match="unknown configuration 'dense'"):
        parse_config("dense")                  # the engine's dense reducer is not a baseline users have


def _raw(config, kind, phases_per_rank, evals, sent=100.0):
    """Raw records as the worker writes them: per phase, per rank, per step."""
    ranks, steps = len(phases_per_rank), len(phases_per_rank[0])
    run = {"config": config, "kind": kind, "numel": 10, "evals": evals,
           "sent_bytes": [[sent] * steps for _ in range(ranks)]}
    for i, p in enumerate(train_report.PHASES):
        run[p] = [[phases_per_rank[r][t][i] for t in range(steps)] for r in range(ranks)]
    return run


def test_summary_takes_the_slowest_rank_per_step_and_times_the_targets_on_the_wall_clock():
    floor = _raw("compute", "compute", [[(1, 2, 0, 1)] * 4, [(1, 2, 0, 1)] * 4], [])
    # rank 1 is slower on steps 0 and 2, rank 0 on steps 1 and 3
    hvd = _raw("horovod", "horovod", [[(1, 2, 3, 1), (1, 2, 5, 1), (1, 2, 1, 1), (1, 2, 6, 1)],
                                      [(1, 2, 4, 1), (1, 2, 1, 1), (1, 2, 2, 1), (1, 2, 1, 1)]],
               [[2, 0.5], [3, 0.92], [4, 0.96]])
    ddp = _raw("ddp", "ddp", [[(1, 5, 0, 1)] * 4, [(1, 4, 0, 1)] * 4], [[4, 0.91]])
    rows = {r["config"]: r for r in train_report.summarize([floor, hvd, ddp], [0.9, 0.95])}
    h = rows["horovod"]
    assert h["steps"] == 4 and h["wall_seconds"] == 8 + 9 + 6 + 10            # slowest rank, every step
    assert h["step_seconds_median"] == 9 and h["step_seconds_mean"] == pytest.approx(25 / 3)  # after the first
    assert h["exchange"] == pytest.approx((5 + 2 + 6) / 3) and h["exchange_median"] == 5
    assert h["accuracy_curve"] == [[17, 0.5], [23, 0.92], [33, 0.96]]
    assert (h["time_to_0.9"], h["time_to_0.95"], h["final_accuracy"]) == (23, 33, 0.96)
    assert h["x_floor"] == pytest.approx(9 / 4) and h["after_backward_seconds"] == 5
    d = rows["ddp"]
    assert d["after_backward_seconds"] == 5 - 2 and d["time_to_0.95"] is None   # waits inside backward
    assert rows["compute"]["final_accuracy"] is None and rows["compute"]["x_floor"] == 1.0
    text = train_report.markdown({"workers": 2, "bandwidth": "1gbit", "numel": 10, "image_size": 8, "epochs": 1,
                                  "batch_size": 32, "lr": 0.05, "density": 0.01, "targets": [0.9, 0.95],
                                  "load_average_before": [0.1, 0, 0],
                                  "results": list(rows.values())})
    header, sep, *body = text.split("\n")[2:6]
    assert header.count("|") == sep.count("|") == body[0].count("|")             # a well-formed table
    assert "| horovod | 9.000 |" in text and "| 23.0 | 33.0 | 96.00% |" in text


@requires_netns
def test_a_failed_configuration_is_reported_and_the_others_still_run(tmp_path):
    from hvd_sparse.bench import train

    worker = tmp_path / "worker.py"
    worker.write_text(FAILING_WORKER)
    report = train.run(["compute", "topka", "horovod"], 2, train.Rate("1gbit"), link_check_seconds=0,
                       verbose=False, worker_cmd=[sys.executable, str(worker)], timeout=120)
    assert [r["config"] for r in report["results"]] == ["compute", "horovod"]
    (failed,) = report["failed"]
    assert failed["config"] == "topka" and "topka broke on purpose" in failed["error"]
    assert "| topka | failed: " in train_report.markdown(report)


@pytest.mark.horovod
@requires_horovod
@requires_netns
def test_tiny_run_trains_every_kind_of_configuration_and_leaves_no_network_behind(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    configs = "compute,horovod,horovod_fp16,topka,oktopk+w3+mc,ddp,ddp_powersgd_r1"
    cmd = [sys.executable, "-m", "hvd_sparse.bench", "train", "--workers", "2", "--bandwidth", "1gbit", "--epochs",
           "1", "--image-size", "8", "--hidden", "32", "--eval-every", "5", "--floor-epochs", "1",
           "--configs", configs, "--json", str(out), "--plot", str(png)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    assert leftovers(proc.pid) == []
    report = json.loads(out.read_text())
    assert (report["workers"], report["bandwidth"], report["epochs"], report["torch_threads"]) == (2, "1gbit", 1, 1)
    n = report["numel"]
    assert n == 18816 + 16 * 8 * 8 * 32 + 11 * 32 + 10                           # WideNet(8, 32)
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == configs.split(",")
    steps = (1437 // 2) // 32                                                     # rank 1's shard: 718 images
    for name, r in rows.items():
        assert r["steps"] == steps and r["step_seconds_median"] > 0 and r["wall_seconds"] > 0
        assert r["x_floor"] > 0 and r["after_backward_seconds"] is not None
        if name == "compute":
            assert r["accuracy_curve"] == [] and r["sent_bytes_per_step"] == 0
        else:                                 # every 5 steps and after the last, on the wall clock
            walls = [w for w, _ in r["accuracy_curve"]]
            assert len(walls) == steps // 5 + 1 and walls == sorted(walls) and walls[-1] == r["wall_seconds"]
            assert 0 <= r["final_accuracy"] <= 1
    ring = 2 * n * (2 - 1) / 2
    assert rows["horovod"]["sent_bytes_per_step"] == ring * 4 == rows["ddp"]["sent_bytes_per_step"]
    assert rows["horovod_fp16"]["sent_bytes_per_step"] == ring * 2
    assert rows["topka"]["sent_bytes_per_step"] == (n // 100) * 2 * 4                # k (index, value) pairs
    assert 0 < rows["ddp_powersgd_r1"]["sent_bytes_per_step"] < ring * 4             # compressed after warm-up
    # 3 dense warm-up steps (float32 ring allreduce) of 21 measured, then Ok-Topk's O(k) exchange
    assert 2 * ring * 4 / (steps - 1) < rows["oktopk+w3+mc"]["sent_bytes_per_step"] < 3 * ring * 4 / (steps - 1) + 1e4
    for kind in ("horovod", "horovod_fp16", "topka", "oktopk+w3+mc"):
        assert rows[kind]["exchange"] > 0                   # synchronize() is timed apart from the update
    assert rows["ddp"]["exchange"] == 0
    # same initial weights and data order: Horovod's and DDP's dense averages train the same model
    assert rows["horovod"]["final_accuracy"] == pytest.approx(rows["ddp"]["final_accuracy"], abs=0.02)
    assert "| ddp_powersgd_r1 |" in stdout and "s to 95%" in stdout
    assert "[ddp_powersgd_r1] epoch 1/1" in stderr
    assert png.read_bytes().startswith(PNG_MAGIC)
