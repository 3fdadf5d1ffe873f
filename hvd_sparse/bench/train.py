"""Train benchmark: time to accuracy of real data-parallel training on a bandwidth-limited network.

    sudo python -m hvd_sparse.bench train --workers 4 --bandwidth 1gbit --json train.json --plot train.png
    sudo python -m hvd_sparse.bench train --task mnist1d --seeds 3 --epochs 8 --targets 0.95,0.98

P workers, each in its own network namespace behind a tbf-shaped link (:class:`hvd_sparse.bench.netns.Network`,
the network of ``bench network``), started by :func:`hvd_sparse.bench.launcher.launch`, train with full forward +
backward + exchange + update steps, one job per seed and configuration, every configuration of a seed from the
same initial weights and data order (:mod:`hvd_sparse.bench._train_worker` lists the configurations): the
compute-only floor, Horovod dense and fp16 (its allreduces start during backward), hvd_sparse presets, PyTorch DDP
over a gloo process group without a hook and with the PowerSGD hook. ``--task`` picks the model and data:

    digits    :class:`~hvd_sparse.bench.digits_torch.WideNet` (4.2M parameters at the defaults) on scikit-learn's
              digits upsampled to ``--image-size`` (1,437 training, 360 test images)
    mnist1d   :class:`~hvd_sparse.bench.mnist1d_torch.WideNet1D` (2.7M parameters at the defaults) on MNIST-1D
              generated from the seed (:mod:`hvd_sparse.bench.mnist1d`; ``--train-samples``, ``--test-samples``)

``--seeds N`` runs every configuration on the seeds ``--seed`` .. ``--seed + N - 1``; the seed sets the initial
weights, the data order and the data (the digits' split, MNIST-1D's sequences).

Reported per configuration (:mod:`hvd_sparse.bench.train_report`; a step's time is that of its slowest rank,
statistics over the steps after the first; with several seeds, the mean over the seeds, the per-seed rows in
``per_seed`` and the mean, min, max and sample standard deviation of step_seconds_median, x_floor, each
time_to_<target> and final_accuracy in ``spread``):
    step_seconds_median / _mean   seconds per step
    forward, backward, exchange, update   the mean step split (the slowest rank's phases); ``exchange`` is the
                          wait between the end of backward and the end of the exchange (``optimizer.synchronize()``);
                          DDP waits for its allreduces inside backward, so its exchange is 0 and
                          ``after_backward_seconds`` estimates the wait as its backward minus the floor's
    x_floor               step median / the compute-only floor's (of the same seed)
    sent_bytes_per_step   per rank: hvd_sparse's meter; Horovod and DDP: the ring allreduce's 2n(P-1)/P words
                          (2 bytes each for fp16); PowerSGD: 2(P-1)/P times the bytes its hook allreduces
    time_to_<target>      wall seconds (the sum of the step times, evaluation excluded) until the test accuracy
                          first reaches the target; None if never (with several seeds: if any seed never does;
                          ``spread`` counts the seeds that did in ``reached``)
    final_accuracy        the test accuracy after the last step; None for a run stopped at the highest target
                          (``--stop-at-target``: ``stopped`` is then True, its steps fewer)
    step_seconds          (each per-seed row) the step times after the first

Below its table the Markdown names the fastest configuration against Horovod's dense one (``horovod``) where the
steps of every seed tell them apart, and says "no measurable difference" where they do not
(:mod:`hvd_sparse.bench.noise`: the rule of ``bench advise``, ``compute`` as the floor).

The report also records the options (``task``, ``seeds``, ...), the model's parameter count (``numel``) and the
sizes of the training and test sets (``train_images``, ``test_images``: images or MNIST-1D sequences).

Equal bytes. At one density the presets send different bytes; ``--equal-bytes PRESET@DENSITY`` (e.g. ``topka@0.01``)
first calibrates, on the in-process simulator over synthetic gradients with the model's parameter layout
(:func:`hvd_sparse.bench.equal_bytes.calibrate`), the density at which each preset of the sparse configurations
sends, as measured, the bytes PRESET sends at DENSITY (within 3%), and runs every sparse configuration without its
own ``+d<density>`` or ``+b<budget>`` at it, renamed ``<name>+d<density>``. The report's ``equal_bytes`` holds the
calibration: ``reference`` (preset, density, sent_bytes), per preset the density and the simulator's sent_bytes (per
rank and step, scaled to the model's size), ``configs`` (each renamed configuration's new name) and the settings;
None without the option. ``sent_bytes_per_step`` is still what the workers' meters measured in training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ._train_worker import OPTIMIZERS, TASKS, parse_config
from .launcher import WorkerFailed, add_run_arguments, launch, run_cli, tail
from .netns import Network, Rate, bandwidth, link_check, remove_stale, workers
from .train_report import markdown, plot, summarize

WORKER = "hvd_sparse.bench._train_worker"
#: ``--lr`` when not given, per ``--optimizer``
DEFAULT_LR = {"sgd": 0.05, "adamw": 0.001}
DEFAULT_CONFIGS = ("compute", "horovod", "horovod_fp16", "oktopk", "topka", "exdyna", "ddp", "ddp_powersgd_r1",
                   "ddp_powersgd_r4")


def configs(text):
    """``--configs``: comma-separated configuration names (see :mod:`hvd_sparse.bench._train_worker`)."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise argparse.ArgumentTypeError("must name at least one configuration")
    for name in names:
        try:
            parse_config(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def equal_bytes_reference(text):
    """``--equal-bytes``: ``PRESET@DENSITY`` -> ``(preset, density)``
    (:func:`hvd_sparse.bench.equal_bytes.parse_reference`)."""
    from .equal_bytes import parse_reference

    try:
        return parse_reference(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _job(net, cmd, args, logdir, deadline, verbose, ranks_per_host=1):
    """One job of the workers (arguments ``args``, logs in the new directory ``logdir``); returns rank 0's result,
    raises WorkerFailed."""
    from ._train_worker import PROGRESS

    logdir.mkdir()
    out = logdir / "result.json"
    launch(net, cmd, [*args, "--out", out], logdir, max(1.0, deadline - time.monotonic()), PROGRESS, verbose=verbose,
           ranks_per_host=ranks_per_host)
    if not out.exists():
        raise WorkerFailed(f"the workers exited normally but rank 0 wrote no result; rank 0's output:\n"
                           f"{tail(logdir / 'rank0.log')}")
    return json.loads(out.read_text())


def _equalize(config_names, reference, workers, task, image_size, hidden, say):
    """``--equal-bytes``: the configuration names with the calibrated densities, and the calibration
    (:func:`hvd_sparse.bench.equal_bytes.equalize`, on the layout of the model the workers build)."""
    from .equal_bytes import density_text, equalize, model_layout

    say(f"  equal bytes: calibrating the densities to {reference[0]} at {density_text(reference[1])} on the "
        f"simulator ({workers} ranks)")
    names, calibration = equalize(config_names, reference, workers, model_layout(task, image_size, hidden),
                                  say=lambda text: say(f"    {text}"))
    ref = calibration["reference"]
    say(f"  equal bytes: {ref['preset']} sends {ref['sent_bytes'] / 1e6:.4g} MB per rank and step; "
        f"{calibration['seconds']:.0f} s; configurations: {', '.join(names)}")
    return names, calibration


def run(config_names, workers, rate, epochs=20, density=0.01, batch_size=32, lr=None, seed=42, seeds=1,
        task="digits", train_samples=20_000, test_samples=10_000, image_size=16, hidden=1024, eval_every=4,
        floor_epochs=None, powersgd_warmup=None, accuracy_targets=(0.9, 0.95), timeout=7200.0,
        link_check_seconds=0.5, verbose=True, worker_cmd=None, equal_bytes=None, stop_at_target=False, hosts=None,
        optimizer="sgd"):
    """Build the network, run one job per seed and configuration (seeds ``seed`` to ``seed + seeds - 1``, each
    running every configuration in turn; a failed job is listed in ``failed`` and the others still run), tear
    everything down; return the report (see the module docstring). With ``equal_bytes`` (``(preset, density)``),
    first calibrate the sparse configurations' densities to that reference's bytes (``--equal-bytes``). With
    ``stop_at_target``, each configuration stops once it reaches the highest target (``--stop-at-target``).
    ``hosts``: that many namespaces of ``workers / hosts`` ranks (``--hosts``; default one rank each).
    ``optimizer``: each rank's ``"sgd"`` (momentum 0.9) or ``"adamw"`` (``--optimizer``), at ``lr`` (default: the
    optimizer's :data:`DEFAULT_LR`)."""
    def say(msg):
        if verbose:
            print(msg, file=sys.stderr, flush=True)

    lr = DEFAULT_LR[optimizer] if lr is None else lr
    calibration = None
    if equal_bytes is not None:
        config_names, calibration = _equalize(config_names, equal_bytes, workers, task, image_size, hidden, say)

    common = ["--task", task, "--epochs", epochs, "--density", density, "--batch-size", batch_size, "--lr", lr,
              "--optimizer", optimizer,
              "--image-size", image_size, "--hidden", hidden, "--eval-every", eval_every, "--floor-epochs",
              floor_epochs or epochs]
    if task == "mnist1d":
        common += ["--train-samples", train_samples, "--test-samples", test_samples]
    if powersgd_warmup is not None:
        common += ["--powersgd-warmup", powersgd_warmup]
    if stop_at_target:
        common += ["--stop-at", max(accuracy_targets)]
    remove_stale(say, include_own=True)
    load_before = list(os.getloadavg())
    hosts = hosts or workers
    with tempfile.TemporaryDirectory(prefix="hvd_sparse_train_") as tmp, Network(hosts, rate) as net:
        say(f"  network: {hosts} namespaces {net.namespaces[0]}..{net.namespaces[-1]} of {workers // hosts} "
            f"rank(s) on bridge {net.bridge} ({net.subnet}.0/24), tbf {rate} each way per namespace")
        link = link_check(net, link_check_seconds) if link_check_seconds else None
        if link is not None:
            say(f"  link check: {link / 1e6:.1f} MB/s payload, one TCP stream (line rate {rate / 8e6:.1f} MB/s)")
        runs, failed, raw = [], [], None
        deadline = time.monotonic() + timeout
        cmd = worker_cmd or [sys.executable, "-m", WORKER]
        jobs = [(s, name) for s in range(seed, seed + seeds) for name in config_names]
        for i, (s, name) in enumerate(jobs):    # a job per seed and configuration: a failure stops only that one
            if seeds > 1 and name == config_names[0]:
                say(f"  seed {s}")
            try:
                raw = _job(net, cmd, ["--configs", name, "--seed", s, *common], Path(tmp) / str(i), deadline,
                           verbose, workers // hosts)
            except WorkerFailed as e:
                say(f"  [{name}" + (f", seed {s}" if seeds > 1 else "") + f"] failed: {e}")
                failed.append({"config": name, "seed": s, "error": str(e)})
                continue
            runs += [dict(r, seed=s) for r in raw["runs"]]
        if raw is None:
            raise WorkerFailed("every configuration failed:\n" + "\n".join(f"[{f['config']}] {f['error']}"
                                                                            for f in failed))
    report = {"workers": workers, "hosts": hosts, "bandwidth": str(rate), "bandwidth_bits_per_s": int(rate),
              "task": task,
              "epochs": epochs, "density": density, "batch_size": batch_size, "lr": lr,
              "optimizer": optimizer, "seed": seed,
              "seeds": list(range(seed, seed + seeds)), "image_size": image_size if task == "digits" else None,
              "train_samples": train_samples if task == "mnist1d" else None,
              "test_samples": test_samples if task == "mnist1d" else None, "hidden": hidden,
              "eval_every": eval_every, "targets": list(accuracy_targets), "stop_at_target": stop_at_target,
              "numel": runs[0]["numel"],
              "train_images": raw["train_images"], "test_images": raw["test_images"],
              "torch_threads": raw["torch_threads"], "link_check_bytes_per_s": link, "cpus": os.cpu_count(),
              "load_average_before": load_before, "load_average_after": list(os.getloadavg())}
    report["equal_bytes"] = calibration
    report["results"] = summarize(runs, accuracy_targets)
    report["failed"] = failed
    return report


def add_arguments(p):
    from . import cli

    p.add_argument("--workers", type=workers, default=4, help="workers P, one network namespace each (default: 4)")
    p.add_argument("--hosts", type=workers, default=None,
                   help="emulated hosts N: N network namespaces of P / N workers each (their loopback the fast "
                        "link, the shaped veths between the hosts); configurations with +h run on two levels")
    p.add_argument("--bandwidth", type=bandwidth, default=Rate("1gbit"),
                   help="each worker's link rate, each direction: 1gbit, 100mbit, ... (default: 1gbit)")
    p.add_argument("--configs", type=configs, default=None,
                   help=f"comma-separated configurations (default: {','.join(DEFAULT_CONFIGS)}); a sparse preset "
                        "takes options: oktopk+w<N> (N dense warm-up steps), oktopk+mc (momentum correction), "
                        "oktopk+d<density> (its own density), oktopk+b<budget> (byte_budget=budget instead of a "
                        "density), oktopk+s<d0>x<T> (the density warm-up: T steps at each of d0, d0/4, ... above "
                        "the density), oktopk+c<norm> (local gradient clipping), oktopk+fill (global_fill), "
                        "oktopk+h (two levels, with --hosts); options combine: topka+mc+s0.1x11")
    p.add_argument("--equal-bytes", type=equal_bytes_reference, default=None, metavar="PRESET@DENSITY",
                   help="before the jobs, give every sparse configuration without +d or +b the density at which "
                        "its preset sends, measured on the simulator, the bytes PRESET sends at DENSITY, e.g. "
                        "topka@0.01 (the configuration is renamed <name>+d<density>)")
    p.add_argument("--epochs", type=cli.positive_int, default=20, help="epochs per configuration (default: 20)")
    p.add_argument("--density", type=cli.density, default=0.01, help="k / n of the sparse presets (default: 0.01)")
    p.add_argument("--batch-size", type=cli.positive_int, default=32, help="per-worker batch size (default: 32)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="each rank's optimizer: sgd (momentum 0.9) or adamw (torch's defaults) (default: sgd)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate, cosine-decayed to 0 (default: 0.05 for sgd, 0.001 for adamw)")
    p.add_argument("--seed", type=int, default=42,
                   help="the first seed: data split (MNIST-1D: the data), initial weights, data order (default: 42)")
    p.add_argument("--seeds", type=cli.positive_int, default=1,
                   help="run every configuration on the seeds --seed, --seed + 1, ..., --seed + N - 1 and report "
                        "the mean and spread over them (default: 1)")
    p.add_argument("--task", choices=TASKS, default="digits",
                   help="digits: WideNet on scikit-learn's digits; mnist1d: WideNet1D on MNIST-1D, generated from "
                        "the seed (default: digits)")
    p.add_argument("--train-samples", type=cli.positive_int, default=20_000,
                   help="MNIST-1D training sequences (default: 20000; --task mnist1d only)")
    p.add_argument("--test-samples", type=cli.positive_int, default=10_000,
                   help="MNIST-1D test sequences (default: 10000; --task mnist1d only)")
    p.add_argument("--image-size", type=cli.positive_int, default=16,
                   help="digits upsampled to this size, even (default: 16; --task digits only)")
    p.add_argument("--hidden", type=cli.positive_int, default=1024,
                   help="width of the hidden dense layer (default: 1024; parameters: 4.2M for digits at "
                        "--image-size 16, 2.7M for mnist1d)")
    p.add_argument("--eval-every", type=cli.positive_int, default=4,
                   help="steps between test evaluations (default: 4; not timed)")
    p.add_argument("--floor-epochs", type=cli.positive_int, default=None,
                   help="epochs of the compute-only floor (default: --epochs; timing only)")
    p.add_argument("--powersgd-warmup", type=cli.positive_int, default=None,
                   help="PowerSGD's start_powerSGD_iter (default: 10%% of the steps, at least 2)")
    p.add_argument("--targets", type=cli.targets, default=[0.9, 0.95],
                   help="test accuracies whose time to reach is reported (default: 0.9,0.95)")
    p.add_argument("--stop-at-target", action="store_true",
                   help="stop each configuration once its test accuracy reaches the highest target (its final "
                        "accuracy is then not reported): slow configurations on a slow link need not run every "
                        "epoch")
    add_run_arguments(p, 7200.0, "save test accuracy against wall time as a PNG")


def main(args):
    names = args.configs or list(DEFAULT_CONFIGS)

    def check():
        if args.task == "digits" and args.image_size % 2:
            return f"--image-size must be even, got {args.image_size}"
        if args.task == "mnist1d" and args.train_samples < args.workers:
            return f"--train-samples must be at least --workers ({args.workers}), got {args.train_samples}"
        if args.optimizer != "sgd" and any(parse_config(n).get("momentum_correction") for n in names):
            return "momentum correction (+mc) needs --optimizer sgd: it keeps SGD's velocity in the residual"
        if args.hosts is not None and args.workers % args.hosts:
            return f"--hosts {args.hosts} must divide --workers {args.workers} (the same number of ranks a host)"
        return None

    prog = "python -m hvd_sparse.bench train"
    reports = []

    def job():
        reports.append(run(
            names, args.workers, args.bandwidth, epochs=args.epochs, density=args.density,
            batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer, seed=args.seed, seeds=args.seeds, task=args.task,
            train_samples=args.train_samples, test_samples=args.test_samples, image_size=args.image_size,
            hidden=args.hidden,
            eval_every=args.eval_every, floor_epochs=args.floor_epochs, powersgd_warmup=args.powersgd_warmup,
            accuracy_targets=args.targets, timeout=args.timeout,
            link_check_seconds=0 if args.no_link_check else 0.5, verbose=not args.quiet,
            equal_bytes=args.equal_bytes, stop_at_target=args.stop_at_target, hosts=args.hosts))
        return reports[-1]

    code = run_cli(prog, args, job, plot, markdown, check=check,
                   banner=f"train: {', '.join(names)} on {args.workers} workers, {args.bandwidth} per worker, "
                          f"{args.task}, {args.epochs} epochs each"
                          + (f", seeds {args.seed}..{args.seed + args.seeds - 1}" if args.seeds > 1 else "")
                          + (f", equal bytes with {args.equal_bytes[0]} at {args.equal_bytes[1]:g}"
                             if args.equal_bytes else ""))
    if code == 0 and reports[-1]["failed"]:
        failed = ", ".join(f["config"] + (f" (seed {f['seed']})" if args.seeds > 1 else "")
                           for f in reports[-1]["failed"])
        print(f"{prog}: error: configuration(s) failed: {failed} (the report has the others)", file=sys.stderr)
        return 1
    return code
