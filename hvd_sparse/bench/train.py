"""Train benchmark: time to accuracy of real data-parallel training on a bandwidth-limited network.

    sudo python -m hvd_sparse.bench train --workers 4 --bandwidth 1gbit --json train.json --plot train.png

P workers, each in its own network namespace behind a tbf-shaped link (:class:`hvd_sparse.bench.netns.Network`,
the network of ``bench network``), started by :func:`hvd_sparse.bench.launcher.launch`, train
:class:`~hvd_sparse.bench.digits_torch.WideNet` (4.2M parameters at the defaults) on scikit-learn's digits
upsampled to 16x16, with full forward + backward + exchange + update steps, once per configuration, every
configuration from the same seed, initial weights and data order (:mod:`hvd_sparse.bench._train_worker` lists
them): the compute-only floor, Horovod dense and fp16 (its allreduces start during backward), hvd_sparse presets,
PyTorch DDP over a gloo process group without a hook and with the PowerSGD hook.

Reported per configuration (:mod:`hvd_sparse.bench.train_report`; a step's time is that of its slowest rank,
statistics over the steps after the first):
    step_seconds_median / _mean   seconds per step
    forward, backward, exchange, update   the mean step split (the slowest rank's phases); ``exchange`` is the
                          wait between the end of backward and the end of the exchange (``optimizer.synchronize()``);
                          DDP waits for its allreduces inside backward, so its exchange is 0 and
                          ``after_backward_seconds`` estimates the wait as its backward minus the floor's
    x_floor               step median / the compute-only floor's
    sent_bytes_per_step   per rank: hvd_sparse's meter; Horovod and DDP: the ring allreduce's 2n(P-1)/P words
                          (2 bytes each for fp16); PowerSGD: 2(P-1)/P times the bytes its hook allreduces
    time_to_<target>      wall seconds (the sum of the step times, evaluation excluded) until the test accuracy
                          first reaches the target; None if never
    final_accuracy        the test accuracy after the last step
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from .launcher import WorkerFailed, add_run_arguments, launch, run_cli, tail
from .netns import Network, Rate, bandwidth, link_check, remove_stale, workers
from .train_report import markdown, plot, summarize

WORKER = "hvd_sparse.bench._train_worker"
DEFAULT_CONFIGS = ("compute", "horovod", "horovod_fp16", "oktopk", "topka", "exdyna", "ddp", "ddp_powersgd_r1",
                   "ddp_powersgd_r4")


def configs(text):
    """``--configs``: comma-separated configuration names (see :mod:`hvd_sparse.bench._train_worker`)."""
    from ._train_worker import parse_config

    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise argparse.ArgumentTypeError("must name at least one configuration")
    for name in names:
        try:
            parse_config(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def targets(text):
    """``--targets``: comma-separated test accuracies in (0, 1], e.g. ``0.9,0.95``."""
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated fractions like 0.9,0.95, got {text!r}") from None
    if not vals or not all(0 < v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"must be fractions in (0, 1], got {text!r}")
    return vals


def run(config_names, workers, rate, epochs=20, density=0.01, batch_size=32, lr=0.05, seed=42, image_size=16,
        hidden=1024, eval_every=4, floor_epochs=None, powersgd_warmup=None, accuracy_targets=(0.9, 0.95),
        timeout=7200.0, link_check_seconds=0.5, verbose=True, worker_cmd=None):
    """Build the network, run one job per configuration (a failed one is listed in ``failed`` and the others still
    run), tear everything down; return the report (see the module docstring)."""
    from ._train_worker import PROGRESS

    def say(msg):
        if verbose:
            print(msg, file=sys.stderr, flush=True)

    remove_stale(say, include_own=True)
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="hvd_sparse_train_") as tmp, Network(workers, rate) as net:
        say(f"  network: {workers} namespaces {net.namespaces[0]}..{net.namespaces[-1]} on bridge {net.bridge} "
            f"({net.subnet}.0/24), tbf {rate} each way per worker")
        link = link_check(net, link_check_seconds) if link_check_seconds else None
        if link is not None:
            say(f"  link check: {link / 1e6:.1f} MB/s payload, one TCP stream (line rate {rate / 8e6:.1f} MB/s)")
        runs, failed, raw = [], [], None
        deadline = time.monotonic() + timeout
        for name in config_names:            # a job per configuration: a failure stops only that configuration
            logdir = Path(tmp) / f"{len(runs) + len(failed)}"
            logdir.mkdir()
            out = logdir / "result.json"
            args = ["--configs", name, "--epochs", epochs, "--density", density, "--batch-size", batch_size,
                    "--lr", lr, "--seed", seed, "--image-size", image_size, "--hidden", hidden, "--eval-every",
                    eval_every, "--floor-epochs", floor_epochs or epochs, "--out", out]
            if powersgd_warmup is not None:
                args += ["--powersgd-warmup", powersgd_warmup]
            try:
                launch(net, worker_cmd or [sys.executable, "-m", WORKER], args, logdir,
                       max(1.0, deadline - time.monotonic()), PROGRESS, verbose=verbose)
                if not out.exists():
                    raise WorkerFailed(f"the workers exited normally but rank 0 wrote no result; rank 0's "
                                       f"output:\n{tail(logdir / 'rank0.log')}")
            except WorkerFailed as e:
                say(f"  [{name}] failed: {e}")
                failed.append({"config": name, "error": str(e)})
                continue
            raw = json.loads(out.read_text())
            runs += raw["runs"]
        if raw is None:
            raise WorkerFailed("every configuration failed:\n" + "\n".join(f"[{f['config']}] {f['error']}"
                                                                            for f in failed))
    report = {"workers": workers, "bandwidth": str(rate), "bandwidth_bits_per_s": int(rate), "epochs": epochs,
              "density": density, "batch_size": batch_size, "lr": lr, "seed": seed, "image_size": image_size,
              "hidden": hidden, "eval_every": eval_every, "targets": list(accuracy_targets),
              "numel": runs[0]["numel"], "train_images": raw["train_images"],
              "test_images": raw["test_images"], "torch_threads": raw["torch_threads"],
              "link_check_bytes_per_s": link, "cpus": os.cpu_count(), "load_average_before": load_before,
              "load_average_after": list(os.getloadavg())}
    report["results"] = summarize(runs, accuracy_targets)
    report["failed"] = failed
    return report


def add_arguments(p):
    from . import cli

    p.add_argument("--workers", type=workers, default=4, help="workers P, one network namespace each (default: 4)")
    p.add_argument("--bandwidth", type=bandwidth, default=Rate("1gbit"),
                   help="each worker's link rate, each direction: 1gbit, 100mbit, ... (default: 1gbit)")
    p.add_argument("--configs", type=configs, default=None,
                   help=f"comma-separated configurations (default: {','.join(DEFAULT_CONFIGS)}); a sparse preset "
                        "takes options: oktopk+w<N> (N dense warm-up steps), oktopk+mc (momentum correction), "
                        "oktopk+d<density> (its own density)")
    p.add_argument("--epochs", type=cli.positive_int, default=20, help="epochs per configuration (default: 20)")
    p.add_argument("--density", type=cli.density, default=0.01, help="k / n of the sparse presets (default: 0.01)")
    p.add_argument("--batch-size", type=cli.positive_int, default=32, help="per-worker batch size (default: 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, cosine-decayed to 0 (default: 0.05)")
    p.add_argument("--seed", type=int, default=42, help="data split, initial weights, data order (default: 42)")
    p.add_argument("--image-size", type=cli.positive_int, default=16,
                   help="digits upsampled to this size, even (default: 16)")
    p.add_argument("--hidden", type=cli.positive_int, default=1024,
                   help="width of the hidden dense layer (default: 1024; 4.2M parameters at --image-size 16)")
    p.add_argument("--eval-every", type=cli.positive_int, default=4,
                   help="steps between test evaluations (default: 4; not timed)")
    p.add_argument("--floor-epochs", type=cli.positive_int, default=None,
                   help="epochs of the compute-only floor (default: --epochs; timing only)")
    p.add_argument("--powersgd-warmup", type=cli.positive_int, default=None,
                   help="PowerSGD's start_powerSGD_iter (default: 10%% of the steps, at least 2)")
    p.add_argument("--targets", type=targets, default=[0.9, 0.95],
                   help="test accuracies whose time to reach is reported (default: 0.9,0.95)")
    add_run_arguments(p, 7200.0, "save test accuracy against wall time as a PNG")


def main(args):
    names = args.configs or list(DEFAULT_CONFIGS)

    def check():
        return f"--image-size must be even, got {args.image_size}" if args.image_size % 2 else None

    prog = "python -m hvd_sparse.bench train"
    reports = []

    def job():
        reports.append(run(
            names, args.workers, args.bandwidth, epochs=args.epochs, density=args.density,
            batch_size=args.batch_size, lr=args.lr, seed=args.seed, image_size=args.image_size, hidden=args.hidden,
            eval_every=args.eval_every, floor_epochs=args.floor_epochs, powersgd_warmup=args.powersgd_warmup,
            accuracy_targets=args.targets, timeout=args.timeout,
            link_check_seconds=0 if args.no_link_check else 0.5, verbose=not args.quiet))
        return reports[-1]

    code = run_cli(prog, args, job, plot, markdown, check=check,
                   banner=f"train: {', '.join(names)} on {args.workers} workers, {args.bandwidth} per worker, "
                          f"{args.epochs} epochs each")
    if code == 0 and reports[-1]["failed"]:
        failed = ", ".join(f["config"] for f in reports[-1]["failed"])
        print(f"{prog}: error: configuration(s) failed: {failed} (the report has the others)", file=sys.stderr)
        return 1
    return code
