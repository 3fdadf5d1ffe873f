"""Convergence benchmark: the digits CNN trained with each algorithm by a real Horovod job.

    python -m hvd_sparse.bench convergence --framework torch --workers 2 --epochs 12 --density 0.01 \
        --json conv.json --plot conv.png
    python -m hvd_sparse.bench convergence --framework keras --workers 2 --epochs 12 --density 0.01 \
        [--keras-flavour tf_keras] --json conv_keras.json --plot conv_keras.png

Launches ONE ``horovodrun -np P -H localhost:P --gloo`` job (the ``horovodrun`` next to ``sys.executable``)
that trains the digits CNN once per algorithm, every run from the same initial weights:

    --framework torch   :mod:`hvd_sparse.bench._convergence_worker`, the recipe of ``examples/pytorch_digits.py``:
                        ``hvd_sparse.torch.DistributedOptimizer`` around SGD (momentum 0.9), learning rate
                        cosine-decayed from ``--lr`` to 0 over the run.
    --framework keras   :mod:`hvd_sparse.bench._convergence_keras_worker`, the recipe of
                        ``examples/keras_digits.py``: ``model.fit`` with ``hvd_sparse.tensorflow.keras``'s
                        DistributedOptimizer around SGD (momentum 0.9) and its callbacks (broadcast, metric
                        average, learning-rate warmup from lr/P to ``--lr`` over ``--warmup-epochs``, then
                        constant, or with ``--lr-decay cosine`` cosine-decayed to 0 from there; sparsity
                        statistics). Keras 3 by default; ``--keras-flavour tf_keras`` runs the job with
                        ``TF_USE_LEGACY_KERAS=1``.

"dense" is Horovod's own dense allreduce (``Compression.none`` of the framework). Rank 0 writes the
per-epoch records to a JSON file that this process reads back.

Reported per algorithm:
    test_accuracy          test accuracy after the last epoch (fraction)
    epoch_seconds_median   median over epochs of rank 0's training seconds (evaluation excluded)
    loss_curve             per epoch, training loss averaged over steps and ranks
    accuracy_curve         per epoch, test accuracy (fraction)
    density_mean           achieved density (selected entries / n), mean over steps (and ranks; for a
                           partitioned sparsifier such as ExDyna the ranks' selections add up); 1.0 for dense
    sent_bytes_per_step    bytes each rank sends per step, mean over steps and ranks (dense: the ring
                           allreduce's 2n(P-1)/P float32 words)
    epoch_seconds, density_curve   per epoch; lr_curve (keras): the learning rate at each epoch's end
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FRAMEWORKS = ("torch", "keras")
#: framework -> worker module run by every rank
WORKERS = {"torch": "hvd_sparse.bench._convergence_worker",
           "keras": "hvd_sparse.bench._convergence_keras_worker"}
KERAS_FLAVOURS = ("keras", "tf_keras")


class JobFailed(RuntimeError):
    """The horovodrun job exited with an error (the message ends with its output tail)."""


def framework(text):
    """``--framework``: ``torch`` or ``keras``."""
    if text not in FRAMEWORKS:
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(FRAMEWORKS)})")
    return text


def horovodrun_path():
    """The ``horovodrun`` next to ``sys.executable`` (a virtualenv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "horovodrun"
    found = beside if beside.exists() else shutil.which("horovodrun")
    return Path(found) if found else beside


def launch(workers, worker_args, verbose=True, tail_lines=80, module=WORKERS["torch"], env_updates=None):
    """Run the worker ``module`` under ``horovodrun``; forward rank 0's progress lines to stderr.

    ``env_updates`` (name -> value, or None to remove the variable) adjusts the job's environment.
    Returns the job's output lines; raises :class:`JobFailed` (with the output tail) on a non-zero exit.
    """
    from ._convergence_worker import PROGRESS

    launcher = horovodrun_path()
    if not launcher.exists():
        raise JobFailed(f"horovodrun not found next to {sys.executable} (expected {launcher}); "
                        "install Horovod in this environment")
    cmd = [str(launcher), "-np", str(workers), "-H", f"localhost:{workers}", "--gloo",
           sys.executable, "-m", module, *map(str, worker_args)]
    root = str(Path(__file__).resolve().parents[2])         # so that the ranks import this hvd_sparse
    env = dict(os.environ)
    env["PATH"] = f"{launcher.parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # horovodrun imports TensorFlow: keep the tail readable
    for key, value in (env_updates or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
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
        raise JobFailed(f"horovodrun -np {workers} ... -m {module} failed (exit code {code}); "
                        f"last {len(tail)} lines of its output:\n" + "\n".join(tail))
    return list(tail)


def run(algorithms, workers, epochs, density, batch_size=32, lr=0.05, seed=42, verbose=True, framework="torch",
        keras_flavour="keras", warmup_epochs=2, lr_decay="none"):
    """Train once per algorithm in one horovodrun job; return the report (see the module docstring).

    ``keras_flavour`` (``"keras"``: Keras 3, ``"tf_keras"``), ``warmup_epochs`` and ``lr_decay`` (``"none"``,
    ``"cosine"``) apply to ``framework="keras"``.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"hvd_sparse.bench.convergence.run: framework must be one of {', '.join(FRAMEWORKS)}, "
                         f"got {framework!r}")
    if keras_flavour not in KERAS_FLAVOURS:
        raise ValueError(f"hvd_sparse.bench.convergence.run: keras_flavour must be one of "
                         f"{', '.join(KERAS_FLAVOURS)}, got {keras_flavour!r}")
    if lr_decay not in ("none", "cosine"):
        raise ValueError(f"hvd_sparse.bench.convergence.run: lr_decay must be 'none' or 'cosine', got {lr_decay!r}")
    args = ["--algorithms", ",".join(algorithms), "--epochs", epochs, "--density", density,
            "--batch-size", batch_size, "--lr", lr, "--seed", seed]
    env = None
    if framework == "keras":
        args += ["--warmup-epochs", warmup_epochs, "--lr-decay", lr_decay]
        # tf.keras is tf_keras exactly when this is "1" (or "true") as TensorFlow loads: decide it for the job
        env = {"TF_USE_LEGACY_KERAS": "1" if keras_flavour == "tf_keras" else None}
    with tempfile.TemporaryDirectory(prefix="hvd_sparse_convergence_") as tmp:
        out = Path(tmp) / "result.json"
        tail = launch(workers, [*args, "--out", out], verbose=verbose, module=WORKERS[framework], env_updates=env)
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
            **({"lr_curve": [e["lr"] for e in ep]} if "lr" in ep[0] else {}),
        })
    report = {"framework": framework, "workers": raw["workers"], "epochs": epochs, "density": density,
              "numel": raw["numel"], "train_images": raw["train_images"], "test_images": raw["test_images"],
              "batch_size": batch_size, "lr": lr, "seed": seed}
    if framework == "keras":
        if raw["keras_flavour"] != keras_flavour:       # e.g. tf_keras not installed: tf.keras fell back
            raise JobFailed(f"asked for keras_flavour {keras_flavour!r}, but the job's tf.keras was "
                            f"{raw['keras_flavour']!r}")
        report.update(keras_flavour=raw["keras_flavour"], keras_version=raw["keras_version"],
                      warmup_epochs=warmup_epochs, lr_decay=lr_decay,
                      schedule=f"warmup from lr/P over {warmup_epochs} epochs, then "
                               f"{'cosine to 0' if lr_decay == 'cosine' else 'constant'}")
    else:
        report["schedule"] = "cosine to 0"
    report["results"] = results
    return report


def _kib(b):
    return f"{b / 1024:,.1f} KiB"


def _framework_label(report):
    """``torch``, or e.g. ``Keras 3.15.1 model.fit`` / ``tf_keras 2.21.0 model.fit``."""
    if report["framework"] != "keras":
        return report["framework"]
    flavour, version = report.get("keras_flavour", "keras"), report.get("keras_version")
    name = ("Keras " + (version or "3")) if flavour == "keras" else " ".join(filter(None, (flavour, version)))
    return f"{name} model.fit"


def markdown(report):
    rows = report["results"]
    dense = next((r for r in rows if r["algorithm"] == "dense"), None)
    lines = [f"Digits CNN ({report['numel']:,} parameters), {_framework_label(report)}, P = {report['workers']} "
             f"workers, {report['epochs']} epochs, density {report['density']}, batch {report['batch_size']} "
             f"per worker, lr {report['lr']} ({report.get('schedule', 'cosine to 0')}).", "",
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
    ax.set_title(f"Digits CNN ({_framework_label(report)}), P = {report['workers']}, "
                 f"density {report['density']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p):
    from . import cli

    p.add_argument("--framework", type=framework, default="torch",
                   help="torch (default): examples/pytorch_digits.py's loop; keras: examples/keras_digits.py's "
                        "model.fit with hvd_sparse's Keras optimizer and callbacks")
    p.add_argument("--keras-flavour", choices=KERAS_FLAVOURS, default=None,
                   help="with --framework keras: keras (Keras 3, default) or tf_keras (the job runs with "
                        "TF_USE_LEGACY_KERAS=1)")
    p.add_argument("--workers", type=cli.positive_int, default=2,
                   help="Horovod processes P, all on localhost (default: 2)")
    p.add_argument("--epochs", type=cli.positive_int, default=12, help="epochs per algorithm (default: 12)")
    p.add_argument("--density", type=cli.density, default=0.01, help="k / n (default: 0.01)")
    p.add_argument("--algorithms", type=cli.algorithms, default=None,
                   help="comma-separated subset (default: all presets, dense first)")
    p.add_argument("--batch-size", type=cli.positive_int, default=32, help="per-worker batch size (default: 32)")
    p.add_argument("--lr", type=float, default=0.05,
                   help="SGD learning rate (default: 0.05); torch: cosine-decayed to 0, keras: reached after "
                        "the warmup, then constant")
    p.add_argument("--warmup-epochs", type=cli.positive_int, default=2,
                   help="with --framework keras: learning-rate warmup epochs (default: 2)")
    p.add_argument("--lr-decay", choices=("none", "cosine"), default=None,
                   help="with --framework keras: after the warmup, none (constant lr, the example's recipe; "
                        "default) or cosine to 0 at the last step")
    p.add_argument("--seed", type=int, default=42, help="data split, initial weights, shuffling (default: 42)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="save test accuracy vs epoch as a PNG")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args):
    from . import cli, presets

    prog = "python -m hvd_sparse.bench convergence"
    for option, value in (("--keras-flavour", args.keras_flavour), ("--lr-decay", args.lr_decay)):
        if args.framework != "keras" and value is not None:
            print(f"{prog}: error: {option} applies to --framework keras, got --framework {args.framework} "
                  "(the torch recipe always decays the lr by a cosine)", file=sys.stderr)
            return 2
    flavour = args.keras_flavour or "keras"
    algorithms = args.algorithms or presets.names()
    if not args.quiet:
        what = args.framework if args.framework == "torch" else f"keras ({flavour})"
        print(f"convergence [{what}]: {', '.join(algorithms)} on {args.workers} Horovod workers, {args.epochs} "
              f"epochs each", file=sys.stderr, flush=True)
    try:
        report = run(algorithms, args.workers, args.epochs, args.density, batch_size=args.batch_size,
                     lr=args.lr, seed=args.seed, verbose=not args.quiet, framework=args.framework,
                     keras_flavour=flavour, warmup_epochs=args.warmup_epochs, lr_decay=args.lr_decay or "none")
    except JobFailed as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    cli.write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    print(markdown(report))
    return 0
