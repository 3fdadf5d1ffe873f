"""Convergence benchmark: the digits CNN trained with each algorithm by a real Horovod job.

    python -m hvd_sparse.bench convergence --framework torch --workers 2 --epochs 12 --density 0.01 \
        --json conv.json --plot conv.png

Launches ONE ``horovodrun -np P -H localhost:P --gloo`` job (the ``horovodrun`` next to ``sys.executable``)
running :mod:`hvd_sparse.bench._convergence_worker`, which trains the digits CNN once per algorithm from the
same initial weights (the recipe of ``examples/pytorch_digits.py``). "dense" is Horovod's own dense
allreduce (``Compression.none``). Rank 0 writes the per-epoch records to a JSON file that this process
reads back.

Reported per algorithm:
    test_accuracy          test accuracy after the last epoch (fraction)
    epoch_seconds_median   median over epochs of rank 0's training seconds (evaluation excluded)
    loss_curve             per epoch, training loss averaged over steps and ranks
    accuracy_curve         per epoch, test accuracy (fraction)
    density_mean           achieved density (selected entries / n), mean over steps (and ranks; for a
                           partitioned sparsifier such as ExDyna the ranks' selections add up); 1.0 for dense
    sent_bytes_per_step    bytes each rank sends per step, mean over steps and ranks (dense: the ring
                           allreduce's 2n(P-1)/P float32 words)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FRAMEWORKS = ("torch", "keras")
WORKER = "hvd_sparse.bench._convergence_worker"


class JobFailed(RuntimeError):
    """The horovodrun job exited with an error (the message ends with its output tail)."""


def framework(text):
    """``--framework``: only ``torch`` runs today; ``keras`` is rejected with an argparse error."""
    if text == "keras":
        raise argparse.ArgumentTypeError("the Keras path arrives with the TensorFlow adapter "
                                         "(hvd_sparse.tensorflow); use --framework torch for now")
    if text not in FRAMEWORKS:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(FRAMEWORKS)})")
    return text


def horovodrun_path():
    return Path(sys.executable).parent / "horovodrun"


def launch(workers, worker_args, verbose=True, tail_lines=80):
    """Run the worker module under ``horovodrun``; forward rank 0's progress lines to stderr.

    Returns the job's output lines; raises :class:`JobFailed` (with the output tail) on a non-zero exit.
    """
    from ._convergence_worker import PROGRESS

    launcher = horovodrun_path()
    if not launcher.exists():
        raise JobFailed(f"horovodrun not found next to {sys.executable} (expected {launcher}); "
                        "install Horovod in this environment")
    cmd = [str(launcher), "-np", str(workers), "-H", f"localhost:{workers}", "--gloo",
           sys.executable, "-m", WORKER, *map(str, worker_args)]
    root = str(Path(__file__).resolve().parents[2])         # so that the ranks import this hvd_sparse
    env = dict(os.environ)
    env["PATH"] = f"{launcher.parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # horovodrun imports TensorFlow: keep the tail readable
    tail = collections.deque(maxlen=tail_lines)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          bufsize=1) as proc:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if verbose and PROGRESS in line and (line.startswith("[0]") or not line.startswith("[")):
                print("  " + line.split(PROGRESS, 1)[1].strip(), file=sys.stderr, flush=True)
        code = proc.wait()
    if code != 0:
        raise JobFailed(f"horovodrun -np {workers} ... -m {WORKER} failed (exit code {code}); "
                        f"last {len(tail)} lines of its output:\n" + "\n".join(tail))
    return list(tail)


def run(algorithms, workers, epochs, density, batch_size=32, lr=0.05, seed=42, verbose=True):
    """Train once per algorithm in one horovodrun job; return the report (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="hvd_sparse_convergence_") as tmp:
        out = Path(tmp) / "result.json"
        tail = launch(workers, ["--algorithms", ",".join(algorithms), "--epochs", epochs, "--density", density,
                                "--batch-size", batch_size, "--lr", lr, "--seed", seed, "--out", out],
                      verbose=verbose)
        if not out.exists():
            raise JobFailed("the horovodrun job succeeded but rank 0 wrote no result; last lines of its "
                            "output:\n" + "\n".join(tail))
        raw = json.loads(out.read_text())
    results = []
    for r in raw["runs"]:
        ep = r["epochs"]
        results.append({
            "algorithm": r["algorithm"],
            "test_accuracy": ep[-1]["accuracy"],
            "epoch_seconds_median": statistics.median(e["seconds"] for e in ep),
            "loss_curve": [e["loss"] for e in ep],
            "accuracy_curve": [e["accuracy"] for e in ep],
            "density_mean": statistics.fmean(e["density"] for e in ep),
            "sent_bytes_per_step": statistics.fmean(e["sent_bytes"] for e in ep),
            "epoch_seconds": [e["seconds"] for e in ep],
            "density_curve": [e["density"] for e in ep],
        })
    return {"framework": "torch", "workers": raw["workers"], "epochs": epochs, "density": density,
            "numel": raw["numel"], "train_images": raw["train_images"], "test_images": raw["test_images"],
            "batch_size": batch_size, "lr": lr, "seed": seed, "results": results}


def _kib(b):
    return f"{b / 1024:,.1f} KiB"


def markdown(report):
    rows = report["results"]
    dense = next((r for r in rows if r["algorithm"] == "dense"), None)
    lines = [f"Digits CNN ({report['numel']:,} parameters), {report['framework']}, P = {report['workers']} "
             f"workers, {report['epochs']} epochs, density {report['density']}, batch {report['batch_size']} "
             f"per worker, lr {report['lr']} (cosine).", "",
             "| algorithm | final test accuracy | Δ vs dense (points) | epoch seconds (median) | density "
             "| sent per step |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        delta = "—" if dense is None else f"{(r['test_accuracy'] - dense['test_accuracy']) * 100:+.2f}"
        lines.append(f"| {r['algorithm']} | {r['test_accuracy'] * 100:.2f}% | {delta} | "
                     f"{r['epoch_seconds_median']:.2f} | {r['density_mean']:.4f} | "
                     f"{_kib(r['sent_bytes_per_step'])} |")
    return "\n".join(lines)


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = "osD^vP*Xh<>p"
    for i, r in enumerate(report["results"]):
        epochs = range(1, len(r["accuracy_curve"]) + 1)
        dense = r["algorithm"] == "dense"
        ax.plot(epochs, [a * 100 for a in r["accuracy_curve"]], marker=markers[i % len(markers)], markersize=4,
                label=r["algorithm"], color="black" if dense else None, linewidth=2.2 if dense else 1.2,
                linestyle="--" if dense else "-", zorder=3 if dense else 2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"Digits CNN, P = {report['workers']}, density {report['density']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p):
    from . import cli

    p.add_argument("--framework", type=framework, default="torch",
                   help="torch (default); keras arrives with the TensorFlow adapter")
    p.add_argument("--workers", type=cli.positive_int, default=2,
                   help="Horovod processes P, all on localhost (default: 2)")
    p.add_argument("--epochs", type=cli.positive_int, default=12, help="epochs per algorithm (default: 12)")
    p.add_argument("--density", type=cli.density, default=0.01, help="k / n (default: 0.01)")
    p.add_argument("--algorithms", type=cli.algorithms, default=None,
                   help="comma-separated subset (default: all presets, dense first)")
    p.add_argument("--batch-size", type=cli.positive_int, default=32, help="per-worker batch size (default: 32)")
    p.add_argument("--lr", type=float, default=0.05,
                   help="initial SGD learning rate, cosine-decayed to 0 (default: 0.05)")
    p.add_argument("--seed", type=int, default=42, help="data split, initial weights, shuffling (default: 42)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="save test accuracy vs epoch as a PNG")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args):
    from . import cli, presets

    algorithms = args.algorithms or presets.names()
    if not args.quiet:
        print(f"convergence: {', '.join(algorithms)} on {args.workers} Horovod workers, {args.epochs} epochs "
              f"each", file=sys.stderr, flush=True)
    try:
        report = run(algorithms, args.workers, args.epochs, args.density, batch_size=args.batch_size,
                     lr=args.lr, seed=args.seed, verbose=not args.quiet)
    except JobFailed as e:
        print(f"python -m hvd_sparse.bench convergence: error: {e}", file=sys.stderr)
        return 1
    report["framework"] = args.framework
    cli.write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    print(markdown(report))
    return 0
