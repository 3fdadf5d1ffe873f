"""The train benchmark's report: statistics of the workers' raw per-rank, per-step records, the Markdown table and
the plot of test accuracy against wall time (see :mod:`hvd_sparse.bench.train` for what each column means).

Targets chosen after a run, from the accuracy curves its report holds (no training again), and the reports of runs
on other seeds (``--seed 43 --seeds 1``, ...) merged into one:

    python -m hvd_sparse.bench.train_report train.json --targets 0.8,0.85 --json train.json --plot train.png
    python -m hvd_sparse.bench.train_report s42.json s43.json s44.json --targets 0.8,0.85 --json train.json
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys

PHASES = ("forward", "backward", "exchange", "update")
#: per-seed numbers whose mean over the seeds is a configuration's value
MEANS = ("step_seconds_median", "step_seconds_mean", *PHASES, *(f"{p}_median" for p in PHASES),
         "sent_bytes_per_step", "wall_seconds", "final_accuracy", "x_floor", "after_backward_seconds")
#: per-seed numbers whose spread over the seeds is reported (and each time_to_<target>)
SPREAD = ("step_seconds_median", "x_floor", "final_accuracy")


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


def _run_row(run, accuracy_targets):
    """One run's statistics (one configuration on one seed), before the comparison with the floor."""
    totals, phases = _slowest(run)
    measured = totals[1:] or totals               # the first step allocates: not in the statistics
    split = phases[1:] or phases
    wall = list(itertools.accumulate(totals))
    curve = [(wall[step - 1], acc) for step, acc in run["evals"]]
    row = {"config": run["config"], "kind": run["kind"], "seed": run.get("seed"), "numel": run["numel"],
           "steps": len(totals), "step_seconds": measured, "step_seconds_median": statistics.median(measured),
           "step_seconds_mean": statistics.fmean(measured),
           **{p: statistics.fmean(s[i] for s in split) for i, p in enumerate(PHASES)},
           **{f"{p}_median": statistics.median(s[i] for s in split) for i, p in enumerate(PHASES)},
           "sent_bytes_per_step": statistics.fmean(v for rank in run["sent_bytes"] for v in rank[1:] or rank),
           "wall_seconds": wall[-1] if wall else 0.0,
           "accuracy_curve": [[w, a] for w, a in curve], "stopped": bool(run.get("stopped")),
           "final_accuracy": curve[-1][1] if curve and not run.get("stopped") else None}
    _times_to(row, accuracy_targets)
    return row


def _times_to(row, accuracy_targets):
    """A per-seed row's ``time_to_<target>`` for each target (and no other): the wall seconds of the first
    evaluation of its accuracy curve at or above the target, None if none is."""
    for key in [k for k in row if k.startswith("time_to_")]:
        del row[key]
    for target in accuracy_targets:
        row[f"time_to_{target:g}"] = next((w for w, a in row["accuracy_curve"] if a >= target), None)


def _spread(values):
    """``{"mean", "min", "max", "std"}`` of ``values`` (None where a value is None: every entry is None when
    one is); ``std`` is the sample standard deviation, None for fewer than 2 values."""
    if not values or any(v is None for v in values):
        return {"mean": None, "min": None, "max": None, "std": None}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else None}


def _combine(rows, accuracy_targets):
    """The row of one configuration from its per-seed rows (see :func:`summarize`)."""
    first = rows[0]
    out = {"config": first["config"], "kind": first["kind"], "numel": first["numel"], "steps": first["steps"],
           "seeds": [r["seed"] for r in rows], "stopped": any(r.get("stopped") for r in rows)}
    for key in MEANS:
        out[key] = _spread([r[key] for r in rows])["mean"]
    out["spread"] = {key: _spread([r[key] for r in rows]) for key in SPREAD}
    for target in accuracy_targets:
        key = f"time_to_{target:g}"
        reached = [r[key] for r in rows if r[key] is not None]
        out["spread"][key] = dict(_spread(reached), reached=len(reached))
        if len(reached) < len(rows):
            out["spread"][key]["mean"] = None
        out[key] = out["spread"][key]["mean"]
    curves = [r["accuracy_curve"] for r in rows]        # the i-th evaluation is at the same step on every seed
    # (up to the shortest curve: a run stopped at the highest target has fewer)
    points = list(zip(*curves))
    out["accuracy_curve"] = [[statistics.fmean(w for w, _ in p), statistics.fmean(a for _, a in p)] for p in points]
    out["accuracy_band"] = [[min(a for _, a in p), max(a for _, a in p)] for p in points]
    out["per_seed"] = rows
    return out


def summarize(raw_runs, accuracy_targets):
    """Rows of the report from the workers' raw records (see :mod:`hvd_sparse.bench.train`), one per configuration
    in the order of first appearance.

    Each raw run (one configuration on one seed, its ``seed`` key; runs without one count as one seed) gives a
    per-seed row, listed in the configuration's ``per_seed``; ``x_floor`` and ``after_backward_seconds`` compare it
    with the ``compute`` run of the same seed. The configuration's row has ``seeds`` (the list), the mean over
    the seeds of every per-seed number (None when a seed has None), ``accuracy_curve`` (per evaluation, the mean
    wall seconds and mean accuracy over the seeds), ``accuracy_band`` (per evaluation, the min and max accuracy)
    and ``spread``: for step_seconds_median, x_floor, final_accuracy and each time_to_<target>, ``{"mean", "min",
    "max", "std"}`` (std: the sample standard deviation, None for one seed). A time_to_<target> entry also has
    ``reached``, the number of seeds that reached the target; its min, max and std are over those seeds, its
    mean (and the row's time_to_<target>) None unless every seed reached it.
    """
    per_seed = [_run_row(run, accuracy_targets) for run in raw_runs]
    floors = {}
    for r in per_seed:
        if r["kind"] == "compute":
            floors.setdefault(r["seed"], r)
    groups = {}
    for r in per_seed:
        floor = floors.get(r["seed"])
        r["x_floor"] = r["step_seconds_median"] / floor["step_seconds_median"] if floor else None
        if r["kind"] == "ddp":      # DDP waits for its allreduces at the end of backward
            r["after_backward_seconds"] = (r["backward_median"] - floor["backward_median"]) if floor else None
        else:
            r["after_backward_seconds"] = r["exchange_median"]
        groups.setdefault(r["config"], []).append(r)
    return [_combine(rows, accuracy_targets) for rows in groups.values()]


def decision(results):
    """:func:`hvd_sparse.bench.noise.decide` on the steps of every seed: the fastest configuration against Horovod's
    dense one, ``horovod``, with ``compute`` as the floor. None without ``horovod`` or without step times (a report
    written before they were kept)."""
    from . import noise

    samples = {r["config"]: [t for seed in r["per_seed"] for t in seed.get("step_seconds", [])] for r in results}
    if not samples.get("horovod") or not all(samples.values()):
        return None
    floor = "compute" if "compute" in samples else None
    return noise.decide(samples, "horovod", [c for c in samples if c not in ("compute", "horovod")], floor=floor)


def _mb(b):
    return f"{b / 1e6:,.2f} MB" if b >= 1e5 else f"{b / 1e3:,.1f} kB"


def _pm(row, key, digits, suffix="", scale=1.0):
    """The row's ``key`` (its mean over the seeds) times ``scale`` with ``digits`` decimals and ``suffix``, then
    `` ± `` the sample standard deviation when there is one (several seeds); "—" when the mean is None."""
    v = row[key]
    if v is None:
        return "—"
    std = row.get("spread", {}).get(key, {}).get("std")
    text = f"{v * scale:.{digits}f}{suffix}"
    return text if std is None else f"{text} ± {std * scale:.{digits}f}"


def _time(row, key):
    """A time to a target: the mean ± std, or "—", with "(k/N reached)" when some of N seeds reached it."""
    n, reached = len(row.get("seeds", [None])), row.get("spread", {}).get(key, {}).get("reached")
    if row[key] is None and reached and reached < n:
        return f"— ({reached}/{n} reached)"
    return _pm(row, key, 1)


def _intro(report):
    """The sentence above the table: the network, the task and model, the training settings."""
    link = report.get("link_check_bytes_per_s")
    seeds = report.get("seeds") or [report.get("seed")]
    if report.get("task", "digits") == "mnist1d":
        task = (f"WideNet1D ({report['numel']:,} parameters) on MNIST-1D ({report['train_images']:,} training, "
                f"{report['test_images']:,} test sequences)")
    else:
        task = f"WideNet ({report['numel']:,} parameters) on digits {report['image_size']}x{report['image_size']}"
    eq = report.get("equal_bytes")
    density = f"density {report['density']}"
    if eq:
        ref = eq["reference"]
        density = (f"sparse presets at equal bytes with {ref['preset']} at {ref['density']:g} "
                   f"({_mb(ref['sent_bytes'])} per rank and step on the simulator): "
                   + ", ".join(f"{p} {v['density']:g}" for p, v in eq["presets"].items()) + f"; otherwise {density}")
    many = (f"{len(seeds)} seeds ({seeds[0]}..{seeds[-1]}): step s (median), x floor, s to a target and final "
            "accuracy as mean ± sample standard deviation over the seeds; ") if len(seeds) > 1 else ""
    hosts = report.get("hosts") or report["workers"]
    where = ("one network namespace each" if hosts == report["workers"] else
             f"{hosts} network namespaces (hosts) of {report['workers'] // hosts}")
    return (f"P = {report['workers']} workers, {where}, {report['bandwidth']} full duplex per "
            f"namespace (tc tbf both ways" + (f"; link check {link / 1e6:.1f} MB/s" if link else "") + f"); {task}, "
            f"{report['epochs']} epochs, batch {report['batch_size']} per worker, "
            f"{'AdamW' if _setting(report, 'optimizer') == 'adamw' else 'SGD'} lr {report['lr']} cosine, "
            f"{density}; step = slowest rank, statistics after the first step; {many}"
            f"load average before {report['load_average_before'][0]:.2f}.")


def markdown(report):
    from . import noise

    t = report["targets"]
    several = len(report.get("seeds") or [None]) > 1
    lines = [_intro(report), "",
             "| configuration | step s (median) | step s (mean) | forward | backward | exchange wait | update "
             "| after backward | x floor | sent per rank per step | "
             + " | ".join(f"s to {x * 100:g}%" for x in t) + " | final accuracy |",
             "|---|" + "---:|" * (9 + len(t) + 1)]
    for r in report["results"]:
        xf = "" if r["x_floor"] is None else _pm(r, "x_floor", 2, "x")
        ab = "" if r["after_backward_seconds"] is None else f"{r['after_backward_seconds']:.3f}"
        lines.append(f"| {r['config']} | {_pm(r, 'step_seconds_median', 3)} | {r['step_seconds_mean']:.3f} | "
                     f"{r['forward']:.3f} | {r['backward']:.3f} | {r['exchange']:.3f} | {r['update']:.3f} | {ab} | "
                     f"{xf} | {_mb(r['sent_bytes_per_step'])} | "
                     + " | ".join(_time(r, f"time_to_{x:g}") for x in t)
                     + f" | {'stopped at target' if r.get('stopped') else _pm(r, 'final_accuracy', 2, '%', 100)} |")
    for f in report.get("failed", []):
        seed = f" (seed {f.get('seed')})" if several else ""
        lines.append(f"| {f['config']} | failed{seed}: {f['error'].splitlines()[0]} |" + " |" * (10 + len(t)))
    facts = decision(report["results"])
    if facts and facts["best"]:
        lines += ["", f"{noise.sentence(facts, 'horovod')} {noise.RULE}"]
    lines += ["", "forward, backward, exchange wait, update: the mean step's split (seconds). after backward: median "
              "seconds from the end of backward to the end of the exchange (DDP: its backward minus the floor's, "
              "since it waits inside backward). compute = the floor: the same steps without communication."
              + (" Over several seeds, the other columns are means; a time to a target is a mean only when every "
                 "seed reached the target (k/N reached: how many did)." if several else "")
              + (" stopped at target: the run stopped once it reached the highest target (--stop-at-target)."
                 if any(r.get("stopped") for r in report["results"]) else "")]
    return "\n".join(lines)


def plot(report, path):
    """PNG: test accuracy (%) against wall seconds, one curve per configuration, the targets dashed. With several
    seeds, point i of a curve is the i-th evaluation (the same step on every seed): at the mean over the seeds of
    its wall seconds, the mean accuracy, shaded between the lowest and the highest accuracy of the seeds."""
    from . import cli

    plt = cli.pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = [r for r in report["results"] if r["accuracy_curve"]]
    names = [r["config"] for r in rows]
    for r in rows:
        w, a = zip(*r["accuracy_curve"])
        color = cli.color_of(r["config"], names)
        ax.plot(w, [x * 100 for x in a], label=r["config"], color=color,
                linewidth=2.0 if r["kind"] == "sparse" else 1.2)
        if len(r.get("seeds", [])) > 1:
            low, high = zip(*r["accuracy_band"])
            ax.fill_between(w, [x * 100 for x in low], [x * 100 for x in high], color=color, alpha=0.2, linewidth=0)
    for x in report["targets"]:
        ax.axhline(x * 100, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("wall seconds (sum of the slowest rank's step times)")
    ax.set_ylabel("test accuracy (%)")
    lowest = [lo for r in rows for lo, _ in r.get("accuracy_band") or [(a, a) for _, a in r["accuracy_curve"]]]
    ax.set_ylim(max(0, min([a * 100 for a in lowest] or [0]) - 2), 100)
    seeds = report.get("seeds") or []
    ax.set_title(f"P = {report['workers']}, {report['bandwidth']} per worker, {report['numel']:,} parameters"
                 + (f", mean of {len(seeds)} seeds (band: min to max)" if len(seeds) > 1 else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    cli.save_png(fig, path)


def _setting(report, key):
    """``report[key]``; reports written before ``--optimizer`` existed trained with SGD."""
    return report.get(key, "sgd" if key == "optimizer" else None)


def retarget(report, accuracy_targets, others=()):
    """A copy of ``report`` whose times to accuracy are those of ``accuracy_targets``: each seed's from its accuracy
    curve (evaluations every ``eval_every`` steps, as in the run), then the spreads over the seeds again. ``others``:
    reports of the same configurations on other seeds, whose seeds join (their settings must be the same)."""
    out = copy.deepcopy(report)
    seeds = {row["config"]: row["per_seed"] for row in out["results"]}
    for other in others:
        for key in ("workers", "bandwidth", "task", "epochs", "numel", "batch_size", "lr", "optimizer"):
            if _setting(other, key) != _setting(out, key):
                raise ValueError(f"the reports differ in {key}: {_setting(out, key)!r} and {_setting(other, key)!r}")
        for row in copy.deepcopy(other["results"]):
            seeds.setdefault(row["config"], []).extend(row["per_seed"])
        out["seeds"] = sorted(set(out.get("seeds") or []) | set(other.get("seeds") or []))
    for rows in seeds.values():
        for r in rows:
            _times_to(r, accuracy_targets)
    out["results"] = [_combine(rows, accuracy_targets) for rows in seeds.values()]
    out["targets"] = list(accuracy_targets)
    return out


def main(argv=None):
    from . import cli

    p = argparse.ArgumentParser(description="A train report with other targets (module docstring).")
    p.add_argument("reports", nargs="+", help="JSON reports of python -m hvd_sparse.bench train (several: merged)")
    p.add_argument("--targets", type=cli.targets, required=True, help="test accuracies, e.g. 0.8,0.85")
    p.add_argument("--json", metavar="FILE", help="write the new report as JSON")
    p.add_argument("--plot", metavar="FILE", help="save its plot as a PNG")
    args = p.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    report = retarget(reports[0], args.targets, reports[1:])
    print(markdown(report))
    if args.json:
        cli.write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
