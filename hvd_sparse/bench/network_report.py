"""The network benchmark's report: statistics of the workers' raw records, the Markdown table and the bar chart
(see :mod:`hvd_sparse.bench.network` for what each column means)."""

from __future__ import annotations

import statistics

#: Horovod's optimizer (as "dense"), with its ``synchronize`` waiting as hvd_sparse's communicator does (polls and
#: sleeps instead of spinning): what dense gains from the same wait, measured next to it
DENSE_POLL = "dense_poll"


def summarize(raw, workers, numel, rate, warmup, hosts=None):
    """Rows of the report from the workers' raw per-rank, per-step records (see the module docstring); ``hosts``:
    the emulated hosts (default: one worker each), whose ranks select on their shards of n / (P / hosts) entries
    in a two-level preset (``<preset>@h``)."""
    from .presets import TWO_LEVELS

    rows = []
    for run in raw:
        secs = [max(col) for col in zip(*run["seconds"])][warmup:]          # max over ranks, each step
        if run["algorithm"] in ("dense", DENSE_POLL):
            recv, source = 2 * numel * (workers - 1) / workers * 4, "ring allreduce formula 2n(P-1)/P x 4 B"
            density = 1.0
        else:
            recv = statistics.fmean(v for rank in run["recv_bytes"] for v in rank[warmup:])
            source = "measured (optimizer.sparse_stats)"
            sel = [statistics.fmean(col) for col in zip(*run["selected"])][warmup:]
            density = statistics.fmean(sel) / numel * (workers if run.get("partitioned") else 1)
            if run["algorithm"].endswith(TWO_LEVELS) and not run.get("partitioned"):    # of a shard of n / L
                density *= workers // (hosts or workers)
        special = [t for t, s in enumerate(run.get("special", [])[warmup:]) if s]
        steps = len(secs)
        links = [b for b in run.get("link_bytes", []) if b[0] >= 0]       # (sent, received) of each host's link
        phases = [phase for phase in run if phase.startswith("seconds_") and any(map(any, run[phase]))]
        parts, fastest = ({phase[len("seconds_"):]: statistics.median([pick(col) for col in zip(*run[phase])][warmup:])
                           for phase in phases} for pick in (max, min))
        rows.append({
            "link_sent_bytes_per_step": statistics.fmean(b[0] for b in links) / steps if links else None,
            "link_recv_bytes_per_step": statistics.fmean(b[1] for b in links) / steps if links else None,
            "step_parts_seconds_median": parts or None,
            "step_parts_fastest_rank_seconds_median": fastest or None,
            "algorithm": run["algorithm"],
            "step_seconds_median": statistics.median(secs),
            "step_seconds_mean": statistics.fmean(secs),
            "step_seconds_min": min(secs),
            "step_seconds_max": max(secs),
            "recv_bytes_mean": recv,
            "recv_bytes_source": source,
            "wire_seconds": recv / (rate / 8),
            "density_mean": density,
            "step_seconds": secs,
            "special_steps": special,
        })
    dense = next((r for r in rows if r["algorithm"] == "dense"), None)
    for r in rows:
        r["speedup_vs_dense"] = dense["step_seconds_median"] / r["step_seconds_median"] if dense else None
    for run, r in zip(raw, rows):
        if any(map(any, run.get("backward", []))):
            r["backward_seconds_median"] = statistics.median([max(col) for col in zip(*run["backward"])][warmup:])
    _overlap_ratios(rows)
    return rows


def _overlap_ratios(rows):
    """With a synthetic backward: each plain row's exchange after backward (its step less its backward), and each
    ``<preset>+o`` row's step over max(its backward, the plain preset's exchange after backward)."""
    from .presets import overlapped

    timed = [r for r in rows if r.get("backward_seconds_median") is not None]
    for r in timed:
        if not overlapped(r["algorithm"])[1]:
            r["exchange_after_backward_seconds"] = r["step_seconds_median"] - r["backward_seconds_median"]
    by_name = {r["algorithm"]: r for r in timed}
    for r in timed:
        preset, overlap = overlapped(r["algorithm"])
        if overlap and preset in by_name:
            exchange = by_name[preset]["exchange_after_backward_seconds"]
            r["overlap_ratio"] = r["step_seconds_median"] / max(r["backward_seconds_median"], exchange)


def decision(results):
    """:func:`hvd_sparse.bench.noise.decide` on the steps: the fastest preset against dense (None without dense)."""
    from . import noise

    samples = {r["algorithm"]: r["step_seconds"] for r in results}
    if "dense" not in samples:
        return None
    return noise.decide(samples, "dense", [a for a in samples if a not in ("dense", DENSE_POLL)])


def _mb(b):
    return f"{b / 1e6:,.2f} MB" if b >= 1e5 else f"{b / 1e3:,.1f} kB"


def markdown(report):
    from . import noise
    from .presets import overlapped

    what = (f"{report['model']} ({report['numel']:,} parameters)" if report.get("model")
            else f"n = {report['numel']:,} parameters")
    link = report.get("link_check_bytes_per_s")
    hosts = report.get("hosts", report["workers"])
    where = ("one network namespace each" if hosts == report["workers"] else
             f"{hosts} network namespaces (hosts) of {report['workers'] // hosts}")
    lines = [f"P = {report['workers']} Horovod workers (Gloo), {where}, {report['bandwidth']} "
             f"full duplex per namespace (tc tbf both ways"
             + (f"; link check {link / 1e6:.1f} MB/s" if link else "") + f"); {what}, density "
             f"{report['density']}; median and mean of {report['steps']} steps after {report['warmup']} warm-up, "
             f"each step the slowest rank; {report['torch_threads']} torch thread per worker.", "",
             "| algorithm | step s (median) | step s (mean) | speedup vs dense | recv per rank per step "
             "| wire s at line rate | density | a host's link per step, out / in | parts s (median) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["results"]:
        sp = "" if r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x"
        link = ("" if r.get("link_sent_bytes_per_step") is None else
                f"{_mb(r['link_sent_bytes_per_step'])} / {_mb(r['link_recv_bytes_per_step'])}")
        fastest = r.get("step_parts_fastest_rank_seconds_median") or {}
        parts = ", ".join(f"{k} {v:.3f}" + (f" ({fastest[k]:.3f} on the last rank in)" if k.endswith("collectives")
                                             else "")
                          for k, v in (r.get("step_parts_seconds_median") or {}).items())
        lines.append(f"| {r['algorithm']} | {r['step_seconds_median']:.3f} | {r['step_seconds_mean']:.3f} | {sp} | "
                     f"{_mb(r['recv_bytes_mean'])} | {r['wire_seconds']:.3f} | {r['density_mean']:.4f} | {link} | "
                     f"{parts} |")
    overlap = [r for r in report["results"] if r.get("overlap_ratio") is not None]
    if overlap:
        lines += ["", f"Synthetic backward of {report.get('backward_seconds', 0):g} s (sleeps, no CPU):"]
        by_name = {r["algorithm"]: r for r in report["results"]}
        for r in overlap:
            plain = by_name[overlapped(r["algorithm"])[0]]
            lines.append(f"- {r['algorithm']}: step {r['step_seconds_median']:.3f} s (backward "
                         f"{r['backward_seconds_median']:.3f}); without overlap {plain['step_seconds_median']:.3f} s "
                         f"= backward {plain['backward_seconds_median']:.3f} + exchange "
                         f"{plain['exchange_after_backward_seconds']:.3f}; step / max(backward, exchange) = "
                         f"{r['overlap_ratio']:.2f}")
    facts = decision(report["results"])
    if facts and facts["best"]:
        lines += ["", f"{noise.sentence(facts, 'dense')} {noise.RULE}"]
    if any(r["algorithm"] == "dense" for r in report["results"]):
        lines.append("")
        lines.append("dense = Horovod's own optimizer (Compression.none, ring allreduce); its bytes are the ring "
                     "formula 2n(P-1)/P x 4 B, the sparse presets' are measured.")
    if any(r["algorithm"] == DENSE_POLL for r in report["results"]):
        lines.append(f"{DENSE_POLL} = dense with Horovod's spinning synchronize() replaced by hvd_sparse's polling "
                     "wait (hvd_sparse.torch.comm.wait), as the sparse presets wait.")
    return "\n".join(lines)


def plot(report, path):
    """PNG: one bar per algorithm, median seconds per step (the mean as a black tick), wire time hatched."""
    from . import cli, presets

    res = report["results"]
    med = [r["step_seconds_median"] for r in res]
    mean = [r["step_seconds_mean"] for r in res]
    labels = [f"  {m:.3g} s" + ("" if r["speedup_vs_dense"] is None or r["algorithm"] == "dense" else
                                f"  ({r['speedup_vs_dense']:.2f}x dense)") for m, r in zip(med, res)]
    fig, ax, y = cli.bar_chart([r["algorithm"] for r in res], med, presets.names(), labels,
                               label_at=[max(a, b) for a, b in zip(med, mean)], label="median step")
    ax.barh(y, [r["wire_seconds"] for r in res], height=0.3, color="none", edgecolor="black", hatch="//",
            label="bytes received / line rate")
    ax.plot(mean, y, "|", color="black", markersize=16, label="mean step")
    ax.set_xlim(0, max(med + mean) * 1.45)
    ax.legend(fontsize=8, loc="lower right")
    what = report["model"] or f"n = {report['numel']:,}"
    cli.finish_chart(fig, ax, "seconds per step (slowest rank)",
                     f"P = {report['workers']}, {report['bandwidth']} per worker, {what}, density {report['density']}",
                     path)
