"""Training-step benchmark: the step of a ~25M-parameter MLP under ``horovodrun``, compute only, with Horovod's dense
optimizer and with every preset, on GPUs (or the CPU).

    python -m hvd_sparse.bench trainstep --workers 2 --device cuda --json trainstep.json --plot trainstep.png

One ``horovodrun -np P --gloo`` job (:mod:`hvd_sparse.bench._trainstep_worker`) runs every configuration in turn
on the same model (default widths 2048-4096-4096-10: 25.2M float32 parameters), batch and seed. On one GPU all
ranks share it (CUDA tensors travel through the host with Horovod's Gloo build, as with any build on a machine
with fewer GPUs than ranks). Reported per configuration (each step's time is the max over ranks, then the median
over steps): ``step_ms``, ``over_compute_ms`` (beyond the ``compute`` floor: the torch optimizer alone),
``over_wire`` (that, over the ``wire`` floor's: compute plus one fixed-shape allgather of TopkA's payload) and
``recv_bytes`` per rank and step (presets: the communicator's meter; dense: the ring's 2n(P-1)/P float32 words;
wire and wire_pinned: 2k(P-1) int32 words). ``wire_pinned`` is the wire floor with the payload staged through
reused pinned host buffers by the caller: whether such staging in a communicator would beat Horovod's own.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

#: the configurations besides the presets
BASELINES = ("compute", "wire", "wire_pinned", "dense")


def run(workers, algorithms, device="cuda", layers=(2048, 4096, 4096, 10), batch_size=256, steps=20, warmup=5,
        density=0.01, seed=0, verbose=True):
    from .convergence import JobFailed, launch
    from .loop import ring_allreduce_bytes

    args = ["--algorithms", ",".join(algorithms), "--density", density, "--seed", seed, "--layers",
            ",".join(map(str, layers)), "--batch-size", batch_size, "--steps", steps, "--warmup", warmup,
            "--device", device]
    with tempfile.TemporaryDirectory(prefix="hvd_sparse_trainstep_") as tmp:
        out = Path(tmp) / "result.json"
        tail = launch(workers, [*args, "--out", out], verbose=verbose, module="hvd_sparse.bench._trainstep_worker")
        if not out.exists():
            raise JobFailed("rank 0 wrote no result; last lines of the job:\n" + "\n".join(tail))
        raw = json.loads(out.read_text())
    rows = []
    for r in raw["runs"]:
        step = [max(rank["seconds"][t] for rank in r["ranks"]) for t in range(steps)]
        recv = statistics.fmean(rank["recv_bytes"] for rank in r["ranks"])
        if r["algorithm"] == "dense":
            recv = ring_allreduce_bytes(raw["numel"], workers)
        elif r["algorithm"] in ("wire", "wire_pinned"):
            recv = 8 * max(1, int(density * raw["numel"])) * (workers - 1)
        rows.append({"algorithm": r["algorithm"], "step_ms": statistics.median(step) * 1e3,
                     "step_ms_all": [s * 1e3 for s in step], "recv_bytes": recv})
    floor = next((r["step_ms"] for r in rows if r["algorithm"] == "compute"), None)
    dense = next((r["step_ms"] for r in rows if r["algorithm"] == "dense"), None)
    for r in rows:
        r["over_compute_ms"] = r["step_ms"] - floor if floor is not None else None
        r["dense_over_step"] = dense / r["step_ms"] if dense else None
    wire = next((r["over_compute_ms"] for r in rows if r["algorithm"] == "wire"), None)
    for r in rows:
        r["over_wire"] = r["over_compute_ms"] / wire if wire and r["over_compute_ms"] is not None else None
    return {"workers": workers, "device": raw["device"], "torch": raw["torch"], "cuda": raw["cuda"],
            "numel": raw["numel"], "layers": list(layers), "batch_size": batch_size, "density": density,
            "steps": steps, "warmup": warmup, "results": rows}


def markdown(report):
    lines = [f"Training step of a {report['numel'] / 1e6:.1f}M-parameter MLP ({'-'.join(map(str, report['layers']))}, "
             f"batch {report['batch_size']}), {report['workers']} ranks on {report['device']} (torch "
             f"{report['torch']}, CUDA {report['cuda']}), density {report['density']}, median of {report['steps']} "
             "steps (max over ranks).", "",
             "| configuration | step ms | beyond compute ms | beyond compute / wire's | dense / this "
             "| MB received per rank and step |", "|---|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        over = "" if r["over_compute_ms"] is None else f"{r['over_compute_ms']:.2f}"
        wire = "" if r.get("over_wire") is None else f"{r['over_wire']:.2f}"
        ratio = "" if r["dense_over_step"] is None else f"{r['dense_over_step']:.1f}"
        lines.append(f"| {r['algorithm']} | {r['step_ms']:.2f} | {over} | {wire} | {ratio} "
                     f"| {r['recv_bytes'] / 1e6:.2f} |")
    return "\n".join(lines)


def plot(report, path):
    from . import cli

    res = report["results"]
    names = [r["algorithm"] for r in res]
    ms = [r["step_ms"] for r in res]
    fig, ax, _ = cli.bar_chart(names, ms, names, [f" {m:.3g} ms" for m in ms])
    ax.set_xscale("log")
    cli.finish_chart(fig, ax, "milliseconds per training step (median, log scale)",
                     f"{report['numel'] / 1e6:.1f}M MLP, {report['workers']} ranks, {report['device']}", path)


def add_arguments(p):
    from . import cli, presets

    p.add_argument("--workers", type=cli.positive_int, default=2, help="ranks (default: 2)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--algorithms", type=lambda t: cli.algorithms(t, (*BASELINES, *presets.overlap_names())),
                   default=list(BASELINES) + [n for n in presets.names() if n != "dense"],
                   help="comma-separated: compute, wire (one fixed-shape allgather of TopkA's payload), "
                        "wire_pinned (the same through pinned host buffers), dense "
                        "(Horovod's optimizer), presets and <preset>+o (the preset with overlap=True) "
                        "(default: all but the +o)")
    p.add_argument("--layers", type=cli.positive_ints, default=[2048, 4096, 4096, 10],
                   help="MLP widths, input first (default: 2048,4096,4096,10)")
    p.add_argument("--batch-size", type=cli.positive_int, default=256)
    p.add_argument("--steps", type=cli.positive_int, default=20)
    p.add_argument("--warmup", type=cli.positive_int, default=5)
    p.add_argument("--density", type=cli.density, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="save a PNG bar chart")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args):
    from . import cli

    report = run(args.workers, args.algorithms, device=args.device, layers=args.layers, batch_size=args.batch_size,
                 steps=args.steps, warmup=args.warmup, density=args.density, seed=args.seed, verbose=not args.quiet)
    cli.write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    print(markdown(report))
    return 0
