"""``python -m hvd_sparse.bench network``: argument errors, the non-root message, the real-model layouts, the
shared gradient data, and real tiny runs (2 Horovod workers in network namespaces on a tc-shaped bridge) that
check the report and that nothing of the network is left behind -- also after a failed worker and SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hvd_sparse.bench import layouts, netns, shm
from hvd_sparse.bench import network as N
from hvd_sparse.bench.__main__ import main

from horovod_helpers import ROOT, requires_horovod

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


_WHY_NOT = netns.cannot_build()
requires_netns = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


def leftovers(pid):
    """Namespaces, links and /etc/netns entries of the run of process ``pid``."""
    ns, links = netns.list_names()
    etc = [d.name for d in netns.ETC_NETNS.iterdir()] if netns.ETC_NETNS.is_dir() else []
    return [x for x in ns + links + etc if x.startswith(f"hvds{pid}") and netns.NAME.match(x)]


# -- arguments ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, where, what", [
    (["--bandwidth", "fast"], "--bandwidth", "1gbit"),
    (["--bandwidth", "100"], "--bandwidth", "bits per second"),
    (["--bandwidth", "1gbps"], "--bandwidth", "bits per second"),
    (["--bandwidth", "10bit"], "--bandwidth", "between 100kbit"),
    (["--workers", "1"], "--workers", "between 2 and 64"),
    (["--workers", "two"], "--workers", "integer"),
    (["--density", "0"], "--density", "(0, 1]"),
    (["--model", "resnet5"], "--model", "resnet50"),
    (["--model", "resnet50", "--numel", "1000"], "--numel", "not allowed with"),
    (["--algorithms", "dense,topk"], "--algorithms", "topk"),
    (["--warmup", "0"], "--warmup", ">= 1"),
])
def test_bad_arguments_are_argparse_errors_naming_the_argument(argv, where, what, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["network", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert where in err and what in err and "Traceback" not in err


@pytest.mark.parametrize("text, bits", [("1gbit", 10**9), ("100mbit", 10**8), ("500mbit", 5 * 10**8),
                                        ("2.5gbit", 25 * 10**8), ("1GBIT", 10**9), ("800kbit", 8 * 10**5)])
def test_bandwidth_parses_tc_rates_in_bits_per_second(text, bits):
    rate = netns.bandwidth(text)
    assert int(rate) == bits and str(rate) == text.lower()


def test_without_root_the_command_says_what_is_missing_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["network", "--workers", "2", "--numel", "1000", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "root privileges" in err and "sudo" in err and "network namespaces" in err


def test_without_tc_the_command_names_the_missing_tool(monkeypatch, capsys):
    import shutil

    which = shutil.which
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool, *a, **k: None if tool == "tc" else which(tool, *a, **k))
    assert main(["network", "--workers", "2", "--numel", "1000", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "`tc` command" in err and "iproute2" in err and "root privileges" not in err


# -- models and data ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(layouts.MODELS))
def test_model_layouts_add_up_to_the_published_parameter_counts(name):
    layout = layouts.model_layout(name)
    names = [n for n, _ in layout]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert sum(int(np.prod(s)) for _, s in layout) == layouts.MODELS[name][1]


def test_resnet50_has_torchvisions_parameter_tensors():
    layout = dict(layouts.model_layout("resnet50"))
    assert len(layout) == 161                                   # len(list(resnet50().parameters()))
    assert layout["conv1.weight"] == (64, 3, 7, 7)
    assert layout["layer4.2.conv3.weight"] == (2048, 512, 1, 1)
    assert layout["layer3.0.downsample.0.weight"] == (1024, 512, 1, 1)
    assert layout["fc.weight"] == (1000, 2048)


def test_shared_gradients_equal_synthetic_gradients_bit_for_bit(tmp_path):
    from hvd_sparse.bench.shm import SharedGradients
    from hvd_sparse.bench.data import SyntheticGradients

    n, P, T = 5003, 3, 4
    shm.write_gradient_data(tmp_path, n, P, T, seed=7)
    shared, ref = SharedGradients(tmp_path), SyntheticGradients(n, P, seed=7)
    assert shared.layout == ref.layout
    assert sum(s for _, (s,) in layouts.synthetic_layout(n)) == n
    buf = np.full(n, np.nan, np.float32)
    for t in range(T):
        for r in range(P):
            g = shared.grad(t, r)
            assert type(g) is np.ndarray and g.dtype == np.float32
            np.testing.assert_array_equal(g, ref.grad(t, r))
            assert shared.grad(t, r, out=buf) is buf
            np.testing.assert_array_equal(buf, ref.grad(t, r))
    assert not np.array_equal(shared.grad(1, 0), shared.grad(1, 1))     # rank-dependent
    with pytest.raises(IndexError, match="step 4 was not precomputed"):
        shared.grad(T, 0)


def test_dense_poll_makes_horovods_optimizer_wait_by_polling_and_restores_it():
    pytest.importorskip("horovod.torch")
    import horovod.torch.optimizer as hvd_optimizer

    from hvd_sparse.bench._network_worker import polling_synchronize
    from hvd_sparse.torch.comm import wait

    original = hvd_optimizer.synchronize
    with polling_synchronize(True):
        assert hvd_optimizer.synchronize is wait
    assert hvd_optimizer.synchronize is original
    with polling_synchronize(False):
        assert hvd_optimizer.synchronize is original
    with pytest.raises(RuntimeError), polling_synchronize(True):
        raise RuntimeError("a failed run restores it too")
    assert hvd_optimizer.synchronize is original


def test_the_summary_names_the_fastest_preset_only_beyond_the_spread_of_the_steps():
    """noise.decide on the steps after the warm-up: dense the baseline; dense_poll, a dense, is no candidate."""
    from hvd_sparse.bench import network_report, noise

    rng = np.random.default_rng(9)

    def run(algorithm, seconds, steps=33):
        per_rank = [[seconds * float(rng.lognormal(0, 0.25)) for _ in range(steps)] for _ in range(2)]
        return {"algorithm": algorithm, "seconds": per_rank, "recv_bytes": [[8.0] * steps] * 2,
                "selected": [[1.0] * steps] * 2}

    raw = [run("dense", 1.0), run(network_report.DENSE_POLL, 0.4), run("topka", 0.5), run("oktopk", 0.6)]
    results = network_report.summarize(raw, workers=2, numel=100, rate=1e9, warmup=1)
    facts = network_report.decision(results)
    assert (facts["best"], facts["wins"]) == ("topka", True) and 1.6 < facts["speedup"] < 2.5
    report = {"workers": 2, "bandwidth": "1gbit", "model": None, "numel": 100, "density": 0.01, "steps": 32,
              "warmup": 1, "torch_threads": 1, "results": results}
    assert noise.sentence(facts, "dense") in network_report.markdown(report)
    even = [0.8 + 0.4 * ((7 * i) % 33) / 32 for i in range(33)]               # 0.8 to 1.2 s, in some order
    close = [dict(r, seconds=[[x * f for x in even]] * 2) for r, f in ((raw[0], 1), (raw[2], 0.95))]
    facts = network_report.decision(network_report.summarize(close, workers=2, numel=100, rate=1e9, warmup=1))
    assert (facts["best"], facts["wins"], facts["outcome"]) == ("topka", False, noise.NOISE)   # 5%: noise
    assert network_report.decision(results[1:]) is None                          # no dense to compare with


# -- real runs -------------------------------------------------------------------------------------------------

@pytest.mark.horovod
@requires_horovod
@requires_netns
def test_tiny_run_reports_every_algorithm_and_leaves_no_network_behind(tmp_path):
    out, png = tmp_path / "net.json", tmp_path / "net.png"
    cmd = [sys.executable, "-m", "hvd_sparse.bench", "network", "--workers", "2", "--numel", "20000", "--steps",
           "3", "--bandwidth", "1gbit", "--algorithms", "dense,dense_poll,topka,oktopk,topka+o", "--json", str(out),
           "--plot", str(png), "--backward", "0.05"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    assert leftovers(proc.pid) == []
    assert not list(Path("/dev/shm").glob(f"{shm.DATA_DIR_PREFIX}{proc.pid}_*"))
    report = json.loads(out.read_text())
    assert (report["workers"], report["bandwidth"], report["bandwidth_bits_per_s"]) == (2, "1gbit", 10**9)
    assert (report["numel"], report["density"], report["steps"], report["warmup"]) == (20000, 0.01, 3, 1)
    assert report["torch_threads"] == 1 and report["model"] is None
    # one TCP stream through both shaped ends: at most the line rate, and not far below it
    assert 0.5 * 125e6 < report["link_check_bytes_per_s"] < 1.02 * 125e6
    rows = {r["algorithm"]: r for r in report["results"]}
    assert list(rows) == ["dense", "dense_poll", "topka", "oktopk", "topka+o"]
    for r in rows.values():         # every step behind a synthetic backward of 0.05 s (sleeps)
        assert 0.05 <= r["backward_seconds_median"] < 0.5 and min(r["step_seconds"]) >= 0.05
        assert len(r["step_seconds"]) == 3 and all(s > 0 for s in r["step_seconds"])
        assert r["step_seconds_median"] == sorted(r["step_seconds"])[1]
        assert r["step_seconds_mean"] == pytest.approx(sum(r["step_seconds"]) / 3)
        assert r["speedup_vs_dense"] == pytest.approx(rows["dense"]["step_seconds_median"] / r["step_seconds_median"])
    assert rows["dense"]["recv_bytes_mean"] == 2 * 20000 * (2 - 1) / 2 * 4         # ring formula
    assert rows["dense_poll"]["recv_bytes_mean"] == rows["dense"]["recv_bytes_mean"]
    assert rows["topka"]["recv_bytes_mean"] == 200 * 2 * 4 * (2 - 1)                 # k (index, value) pairs
    assert 0 < rows["oktopk"]["recv_bytes_mean"] < rows["dense"]["recv_bytes_mean"] / 10
    assert rows["dense"]["density_mean"] == 1.0 and rows["topka"]["density_mean"] == 0.01
    assert rows["topka+o"]["recv_bytes_mean"] == rows["topka"]["recv_bytes_mean"]     # one bucket: the same k
    plain = rows["topka"]
    assert plain["exchange_after_backward_seconds"] == pytest.approx(plain["step_seconds_median"]
                                                                      - plain["backward_seconds_median"])
    assert rows["topka+o"]["overlap_ratio"] == pytest.approx(rows["topka+o"]["step_seconds_median"] / max(
        rows["topka+o"]["backward_seconds_median"], plain["exchange_after_backward_seconds"]))
    assert "- topka+o: step" in stdout
    assert "| dense |" in stdout and "| oktopk |" in stdout and "speedup vs dense" in stdout
    assert "| dense_poll |" in stdout and "dense_poll = dense with Horovod's spinning synchronize()" in stdout
    assert "link check:" in stderr and "[oktopk] step 4/4" in stderr
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)


@pytest.mark.horovod
@requires_horovod
@requires_netns
def test_two_hosts_of_two_carry_less_across_their_links_with_two_levels(tmp_path):
    """--hosts 2 --workers 4: two namespaces of two ranks; TopkA on two levels (topka@h) sends fewer bytes through
    each host's shaped link than flat TopkA (the veths' own counters), reports its step's three parts, and selects
    at the same density (of its shard)."""
    out = tmp_path / "net.json"
    cmd = [sys.executable, "-m", "hvd_sparse.bench", "network", "--workers", "4", "--hosts", "2", "--numel", "1000000",
           "--steps", "3", "--algorithms", "topka,topka@h", "--no-link-check", "--json", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    assert leftovers(proc.pid) == []
    report = json.loads(out.read_text())
    assert (report["workers"], report["hosts"]) == (4, 2)
    flat, two = ({r["algorithm"]: r for r in report["results"]}[a] for a in ("topka", "topka@h"))
    assert 0 < two["link_sent_bytes_per_step"] < 0.6 * flat["link_sent_bytes_per_step"]
    assert 0 < two["link_recv_bytes_per_step"] < 0.6 * flat["link_recv_bytes_per_step"]
    parts = two["step_parts_seconds_median"]
    assert set(parts) == {"scatter", "across", "across_collectives", "gather"}
    assert 0 < parts["across_collectives"] < parts["across"]
    assert set(flat["step_parts_seconds_median"]) == {"collectives"}
    assert flat["density_mean"] == two["density_mean"] == 0.01


@pytest.mark.horovod
@requires_horovod
@requires_netns
def test_a_failing_worker_ends_the_run_with_its_output_and_a_clean_teardown(tmp_path):
    bad = tmp_path / "bad_worker.py"
    bad.write_text("import os, sys, time\n"
                   "if os.environ['HOROVOD_RANK'] == '1':\n"
                   "    print('rank 1 gives up: simulated failure', file=sys.stderr); sys.exit(3)\n"
                   "time.sleep(120)\n")                                       # rank 0 would wait forever
    t0 = time.monotonic()
    with pytest.raises(N.WorkerFailed) as exc:
        N.run(["dense"], 2, N.Rate("100mbit"), numel=1000, steps=1, verbose=False, link_check_seconds=0,
              worker_cmd=[sys.executable, str(bad)], timeout=100)
    assert time.monotonic() - t0 < 60
    msg = str(exc.value)
    assert "rank 1 exited with code 3" in msg and "simulated failure" in msg
    assert leftovers(os.getpid()) == []


@pytest.mark.horovod
@requires_horovod
@requires_netns
def test_sigterm_stops_the_workers_and_removes_the_network(tmp_path):
    import psutil

    slow = tmp_path / "slow_worker.py"
    slow.write_text("import time\ntime.sleep(300)\n")
    code = ("import sys; from hvd_sparse.bench import network as N\n"
            f"N.WORKER_CMD = [sys.executable, {str(slow)!r}]\n"
            "from hvd_sparse.bench.__main__ import main\n"
            "sys.exit(main(['network', '--workers', '2', '--numel', '1000', '--steps', '1', '--no-link-check']))\n")

    def workers():
        return [p for p in psutil.process_iter(["cmdline"]) if str(slow) in (p.info["cmdline"] or [])[1:2]]

    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(workers()) < 2 and proc.poll() is None:
            time.sleep(0.2)
        assert len(workers()) == 2, "the workers did not start"
        assert len([x for x in leftovers(proc.pid) if x.endswith(("n0", "n1"))]) == 4     # namespaces, etc
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err
    assert leftovers(proc.pid) == []
    assert workers() == []


@requires_netns
def test_leftovers_of_a_dead_run_are_removed_and_a_live_runs_are_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                   # a pid that no longer exists
    dead_ns, live_ns = f"hvds{dead.pid}n0", f"hvds{os.getpid()}n98"
    dead_link = f"hvds{dead.pid}b"
    try:
        subprocess.run(["ip", "netns", "add", dead_ns], check=True)
        subprocess.run(["ip", "netns", "add", live_ns], check=True)
        subprocess.run(["ip", "link", "add", dead_link, "type", "bridge"], check=True)
        removed = netns.remove_stale()
        assert set(removed) >= {dead_ns, dead_link}
        ns, links = netns.list_names()
        assert dead_ns not in ns and dead_link not in links and live_ns in ns
    finally:
        for name in (dead_ns, live_ns):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", dead_link], capture_output=True)
