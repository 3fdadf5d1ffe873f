"""Latency of one small Horovod collective under ``horovodrun`` (loopback, Gloo): what a sparse step pays per
negotiated collective, by number of ranks, Horovod's cycle time and hvd_sparse's wait mode.

    python -m hvd_sparse.bench latency --workers 2,4 --cycle-times default,0.1 --json latency.json

One job per (ranks, ``HOROVOD_CYCLE_TIME``) runs :mod:`hvd_sparse.bench._latency_worker`: an allreduce of one
float32 value and an allgather of 7 int32 words (the agreement's), each waited for by polling (hvd_sparse's
communicator) and by spinning (Horovod's ``synchronize``). Reported: the median over calls of the slowest rank's
call, in microseconds. ``cpus`` says how many cores the machine has: with fewer cores than ranks a spinning wait
takes a core from a rank that still works. And per job, the CPU an idle rank spends (``--idle`` seconds of sleep
after the collectives, milliseconds of CPU per second, mean and largest over ranks): Horovod's background thread
runs a coordination round every cycle, collective or not, so this is what the cycle time costs a host whose cores
the training needs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path


def run(workers, cycle_times, repeat=200, warmup=20, idle=1.0, verbose=True):
    from .convergence import JobFailed, launch

    rows, idles, cpus = [], [], None
    for P in workers:
        for cycle in cycle_times:
            env = {"HOROVOD_CYCLE_TIME": None if cycle == "default" else str(cycle)}
            with tempfile.TemporaryDirectory(prefix="hvd_sparse_latency_") as tmp:
                out = Path(tmp) / "result.json"
                launch(P, ["--repeat", repeat, "--warmup", warmup, "--idle", idle, "--out", out], verbose=verbose,
                       module="hvd_sparse.bench._latency_worker", env_updates=env)
                if not out.exists():
                    raise JobFailed("rank 0 wrote no result")
                raw = json.loads(out.read_text())
            cpus = raw["cpus"]
            idles.append({"workers": P, "cycle_time_ms": cycle, "mean_ms_per_s": 1e3 * statistics.mean(raw["idle_cpu"]),
                          "max_ms_per_s": 1e3 * max(raw["idle_cpu"])})
            for r in raw["results"]:
                slowest = [max(rank[i] for rank in r["ranks"]) for i in range(repeat)]
                rows.append({"workers": P, "cycle_time_ms": cycle, "collective": r["collective"], "wait": r["wait"],
                             "median_us": statistics.median(slowest) * 1e6})
    return {"cpus": cpus, "repeat": repeat, "results": rows, "idle": idles}


def markdown(report):
    lines = [f"One small Horovod collective (Gloo, loopback), {report['cpus']} cores, median of {report['repeat']} "
             "calls (slowest rank).", "", "| ranks | HOROVOD_CYCLE_TIME ms | collective | wait | us |",
             "|---:|---|---|---|---:|"]
    for r in report["results"]:
        lines.append(f"| {r['workers']} | {r['cycle_time_ms']} | {r['collective']} | {r['wait']} | "
                     f"{r['median_us']:.0f} |")
    lines += ["", "CPU of an idle rank (Horovod's background thread between collectives), ms per second.", "",
              "| ranks | HOROVOD_CYCLE_TIME ms | mean over ranks | largest |", "|---:|---|---:|---:|"]
    for r in report["idle"]:
        lines.append(f"| {r['workers']} | {r['cycle_time_ms']} | {r['mean_ms_per_s']:.1f} | {r['max_ms_per_s']:.1f} |")
    return "\n".join(lines)


def add_arguments(p):
    from . import cli

    p.add_argument("--workers", type=cli.positive_ints, default=[2, 4], help="ranks per job (default: 2,4)")
    p.add_argument("--cycle-times", default="default,0.1",
                   help="comma-separated HOROVOD_CYCLE_TIME values in ms, 'default' for Horovod's "
                        "(default: default,0.1)")
    p.add_argument("--repeat", type=cli.positive_int, default=200)
    p.add_argument("--warmup", type=cli.positive_int, default=20)
    p.add_argument("--idle", type=cli.positive_float, default=1.0,
                   help="seconds each idle rank sleeps while its CPU is measured (default: 1)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args):
    from . import cli

    report = run(args.workers, [c.strip() for c in args.cycle_times.split(",") if c.strip()], repeat=args.repeat,
                 warmup=args.warmup, idle=args.idle, verbose=not args.quiet)
    cli.write_json(args.json, report)
    print(markdown(report))
    return 0
