"""The train benchmark's report: statistics of the workers' raw per-rank, per-step records, the Markdown table and
the plot of test accuracy against wall time (see :mod:`hvd_sparse.bench.train` for what each column means)."""

from __future__ import annotations

import itertools
import statistics

PHASES = ("forward", "backward", "exchange", "update")


def _slowest(run):
    """Per step: the slowest rank's total and phases."""
    ranks = len(run["forward"])
    steps = len(run["forward"][0])
    totals, phases = [], []
    for t in range(steps):
        per_rank = [[run[p][r][t] for p in PHASES] for r in range(ranks)]
        worst = max(per_rank, key=sum)
        totals.append(sum(worst))
        phases.append(worst)
    return totals, phases


def summarize(raw_runs, accuracy_targets):
    """Rows of the report from the workers' raw records (see :mod:`hvd_sparse.bench.train`)."""
    rows = []
    for run in raw_runs:
        totals, phases = _slowest(run)
        measured = totals[1:] or totals               # the first step allocates: not in the statistics
        split = phases[1:] or phases
        wall = list(itertools.accumulate(totals))
        curve = [(wall[step - 1], acc) for step, acc in run["evals"]]
        row = {"config": run["config"], "kind": run["kind"], "numel": run["numel"], "steps": len(totals),
               "step_seconds_median": statistics.median(measured), "step_seconds_mean": statistics.fmean(measured),
               **{p: statistics.fmean(s[i] for s in split) for i, p in enumerate(PHASES)},
               **{f"{p}_median": statistics.median(s[i] for s in split) for i, p in enumerate(PHASES)},
               "sent_bytes_per_step": statistics.fmean(v for rank in run["sent_bytes"] for v in rank[1:] or rank),
               "wall_seconds": wall[-1] if wall else 0.0,
               "accuracy_curve": [[w, a] for w, a in curve],
               "final_accuracy": curve[-1][1] if curve else None}
        for target in accuracy_targets:
            row[f"time_to_{target:g}"] = next((w for w, a in curve if a >= target), None)
        rows.append(row)
    floor = next((r for r in rows if r["kind"] == "compute"), None)
    for r in rows:
        r["x_floor"] = r["step_seconds_median"] / floor["step_seconds_median"] if floor else None
        if r["kind"] == "ddp":      # DDP waits for its allreduces at the end of backward
            r["after_backward_seconds"] = (r["backward_median"] - floor["backward_median"]) if floor else None
        else:
            r["after_backward_seconds"] = r["exchange_median"]
    return rows


def _mb(b):
    return f"{b / 1e6:,.2f} MB" if b >= 1e5 else f"{b / 1e3:,.1f} kB"


def _s(v):
    return "—" if v is None else f"{v:.1f}"


def markdown(report):
    t = report["targets"]
    link = report.get("link_check_bytes_per_s")
    lines = [f"P = {report['workers']} workers, one network namespace each, {report['bandwidth']} full duplex per "
             f"worker (tc tbf both ways" + (f"; link check {link / 1e6:.1f} MB/s" if link else "") + "); WideNet "
             f"({report['numel']:,} parameters) on digits {report['image_size']}x{report['image_size']}, "
             f"{report['epochs']} epochs, batch {report['batch_size']} per worker, SGD lr {report['lr']} cosine, "
             f"density {report['density']}; step = slowest rank, statistics after the first step; "
             f"load average before {report['load_average_before'][0]:.2f}.", "",
             "| configuration | step s (median) | step s (mean) | forward | backward | exchange wait | update "
             "| after backward | x floor | sent per rank per step | "
             + " | ".join(f"s to {x * 100:g}%" for x in t) + " | final accuracy |",
             "|---|" + "---:|" * (9 + len(t) + 1)]
    for r in report["results"]:
        xf = "" if r["x_floor"] is None else f"{r['x_floor']:.2f}x"
        ab = "" if r["after_backward_seconds"] is None else f"{r['after_backward_seconds']:.3f}"
        acc = "—" if r["final_accuracy"] is None else f"{r['final_accuracy'] * 100:.2f}%"
        lines.append(f"| {r['config']} | {r['step_seconds_median']:.3f} | {r['step_seconds_mean']:.3f} | "
                     f"{r['forward']:.3f} | {r['backward']:.3f} | {r['exchange']:.3f} | {r['update']:.3f} | {ab} | "
                     f"{xf} | {_mb(r['sent_bytes_per_step'])} | "
                     + " | ".join(_s(r[f"time_to_{x:g}"]) for x in t) + f" | {acc} |")
    for f in report.get("failed", []):
        lines.append(f"| {f['config']} | failed: {f['error'].splitlines()[0]} |" + " |" * (10 + len(t)))
    lines += ["", "forward, backward, exchange wait, update: the mean step's split (seconds). after backward: median "
              "seconds from the end of backward to the end of the exchange (DDP: its backward minus the floor's, "
              "since it waits inside backward). compute = the floor: the same steps without communication."]
    return "\n".join(lines)


def plot(report, path):
    """PNG: test accuracy (%) against wall seconds, one curve per configuration, the targets dashed."""
    from . import cli

    plt = cli.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = [r for r in report["results"] if r["accuracy_curve"]]
    names = [r["config"] for r in rows]
    for r in rows:
        w, a = zip(*r["accuracy_curve"])
        ax.plot(w, [x * 100 for x in a], label=r["config"], color=cli.color_of(r["config"], names),
                linewidth=2.0 if r["kind"] == "sparse" else 1.2)
    for x in report["targets"]:
        ax.axhline(x * 100, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("wall seconds (sum of the slowest rank's step times)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(max(0, min([a * 100 for r in rows for _, a in r["accuracy_curve"]] or [0]) - 2), 100)
    ax.set_title(f"P = {report['workers']}, {report['bandwidth']} per worker, {report['numel']:,} parameters",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    cli.save_png(fig, path)
