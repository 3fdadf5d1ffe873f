"""Network benchmark: seconds per training step of P real Horovod workers on a bandwidth-limited network.

    sudo python -m hvd_sparse.bench network --workers 4 --bandwidth 1gbit --numel 25000000 --density 0.01 \
        --algorithms dense,topka,oktopk --json net.json --plot net.png

The network (built by the command, torn down by it, root needed) is :class:`hvd_sparse.bench.netns.Network`:
every worker runs in its own network namespace and owns a full-duplex "NIC" of RATE in each direction (a
``tc qdisc tbf`` on both ends of its veth pair) plugged into a non-blocking switch (the bridge): all of its
traffic, including what Horovod/Gloo sends to the other workers, crosses the shaped links. ``<prefix>`` is
``hvds<pid>`` of this process; leftovers of an earlier run that died (a prefix whose pid is gone) are
removed first, and the command tears everything down on exit, error, Ctrl-C or SIGTERM. Before the run, a
link check times one TCP stream between two namespaces (``link_check_bytes_per_s``, payload bytes/s: the line
rate RATE / 8 less the Ethernet/IP/TCP headers; docs/benchmarks.md has the rate measured at 1gbit).

The job: Horovod over Gloo, launched by :func:`hvd_sparse.bench.launcher.launch` the way ``horovodrun --gloo``
does it, but with each rank started by ``ip netns exec <ns>``. Rank r runs
:mod:`hvd_sparse.bench._network_worker`, which measures every algorithm in turn, with one torch thread.

One step, backward-free: the model's ``.grad`` are set from :class:`~hvd_sparse.bench.data.SyntheticGradients`
(rank- and step-dependent, fixed seed: every algorithm sees the same gradients), a barrier aligns the ranks
(an ``hvd.allreduce`` of one value), then ``optimizer.step()`` of
``hvd_sparse.torch.DistributedOptimizer(SGD, compression=...)`` is timed (exchange, write-back and the SGD
update). "dense" is Horovod's own optimizer with ``Compression.none`` (fused ring allreduce: the baseline
users have); ``dense_poll`` is the same optimizer with Horovod's ``synchronize`` (which spins: a ``yield`` loop)
replaced by the polling wait hvd_sparse's communicator uses (:func:`hvd_sparse.torch.comm.wait`), so that the
gain of waiting without spinning can be told apart from the gain of sparsification; every other name is a preset
of :mod:`hvd_sparse.bench.presets`. The model is either
``--numel`` float32 values in the 16 layers of the synthetic gradient's layout, or ``--model NAME``: the
parameter names and shapes of a real network (:data:`hvd_sparse.bench.layouts.MODELS`). The gradient data
itself is built once by this process (:mod:`hvd_sparse.bench.shm`: the noise pool and the shared component of
every step, in ``/dev/shm``) and mapped read-only by the workers.

``--hosts N`` makes N namespaces of P / N ranks each: a host's ranks talk over its loopback (the fast link), the
hosts over their shaped veths; the presets named ``<preset>@h`` run on two levels there (``hierarchical=True``:
dense inside a host, the preset across the hosts; docs/algorithms.md, "Two levels"), beside the flat ones.

``--backward SECONDS`` puts a synthetic backward of that duration in front of every step (:func:`hvd_sparse.bench.
_network_worker.synthetic_backward`: one autograd node per layer, in reverse layer order, each sleeping its layer's
share of the time -- no CPU used -- then handing the layer its gradient, so that gradient hooks fire as in real
training); the step is then timed from the start of backward. The presets named ``<preset>+o`` run with
``overlap=True`` (buckets launched from those hooks, :mod:`hvd_sparse.torch.buckets`) beside the plain ones, and
the report gives each its ratio to max(backward, the plain preset's exchange after backward).

Reported per algorithm (:mod:`hvd_sparse.bench.network_report`; steps after ``--warmup`` warm-up steps; each
step's time is the max over ranks):
    step_seconds_median   median over steps -- Ok-Topk's exact re-evaluation steps (every 32 steps) are
                          part of the run, as in training; ``--steps 32 --warmup 1`` includes one
    step_seconds_mean     mean over steps
    recv_bytes_mean       bytes received per rank per step, mean over steps and ranks: for sparse presets the
                          communicator's meter (``optimizer.sparse_stats()``); for dense the ring allreduce's
                          2n(P-1)/P float32 words (Horovod has no traffic counter)
    wire_seconds          recv_bytes_mean / (RATE / 8): the time the link needs for it, a lower bound
    speedup_vs_dense      dense's median / this median
    link_sent_bytes_per_step, link_recv_bytes_per_step   bytes through a host's shaped link each way per measured
                          step, mean over the hosts: the veth's kernel counters (every packet, headers included),
                          read by each host's local rank 0 around the measured steps
    step_parts_seconds_median   a sparse step's parts, the median over steps of the slowest rank's: the time
                          inside its collectives (``collectives``: the wire and the waits); on two levels the
                          scatter inside the host, the step across the hosts (``across``, of which
                          ``across_collectives`` inside the collectives between the hosts, the rest the shard's
                          selection and error feedback) and the gather inside the host
    step_parts_fastest_rank_seconds_median   the same parts, the median over steps of the fastest rank's: for the
                          collectives the rank that came last to them, whose time is the exchange without a wait
                          for the others
    backward_seconds_median    with ``--backward``: the backward's time (slowest rank), median over steps
    exchange_after_backward_seconds   with ``--backward``, of a plain preset: its step less its backward
    overlap_ratio         of ``<preset>+o``: its step over max(backward, the plain preset's exchange after backward)

Below its table the Markdown names the fastest preset against dense where the steps tell them apart, and says "no
measurable difference" where they do not (:mod:`hvd_sparse.bench.noise`: the rule of ``bench advise``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .launcher import WorkerFailed, add_run_arguments, launch, run_cli, tail
from .layouts import MODELS, model_choice, model_layout
from .netns import MAX_WORKERS, Network, Rate, bandwidth, link_check, \
    remove_stale, workers
from .network_report import DENSE_POLL, markdown, plot, summarize
from .shm import DATA_DIR_PREFIX, cleanup_stale_data_dirs, data_bytes, shm_root, write_gradient_data

WORKER = "hvd_sparse.bench._network_worker"
#: the command of one rank, before its arguments (None: ``[sys.executable, "-m", WORKER]``; tests replace it)
WORKER_CMD = None
#: prefix of rank 0's progress lines (the parent forwards them to stderr)
PROGRESS = "hvd_sparse.network:"
#: private memory of one worker: a base (torch, Horovod) plus bytes per parameter (parameters, the step's
#: gradient, the optimizer's flat buffers, residual and temporaries); measured peaks at n = 25M: 0.8 GiB (dense),
#: 0.95-1.3 GiB (oktopk), 1.2 GiB (topka) over 3 steps at P = 2 and 4, up to 1.95 GiB over 33 steps at P = 8
WORKER_BASE_BYTES = 300 * 2**20
WORKER_BYTES_PER_PARAM = 68


def run(algorithms, workers, rate, numel=None, model=None, density=0.01, steps=32, warmup=1, seed=0, lr=0.01,
        timeout=3600.0, link_check_seconds=0.5, verbose=True, worker_cmd=None, profile=False, hosts=None,
        backward=0.0, bucket_cap_mb=None):
    """Build the network, run the job, tear everything down; return the report (see the module docstring).
    ``hosts``: that many namespaces of ``workers / hosts`` ranks each (None: one rank a namespace); ``backward``:
    the synthetic backward's seconds (0: none); ``bucket_cap_mb``: the buckets of the ``<preset>+o`` runs (None: the
    optimizer's default)."""
    import numpy as np

    def say(msg, end="\n"):
        if verbose:
            print(msg, end=end, file=sys.stderr, flush=True)

    if model is not None:
        layout = model_layout(model)
        numel = sum(int(np.prod(s)) for _, s in layout)
    T = warmup + steps
    shm = shm_root()
    cleanup_stale_data_dirs(shm)
    cleanup_stale_data_dirs(tempfile.gettempdir())
    remove_stale(say, include_own=True)
    load_before = list(os.getloadavg())
    tmp = tempfile.mkdtemp(prefix=f"{DATA_DIR_PREFIX}{os.getpid()}_", dir=shm)
    try:
        t0 = time.perf_counter()

        tty = sys.stderr.isatty()

        def progress(t, total):
            if tty or t == total:
                say(f"\r  gradient data: step {t}/{total} ({time.perf_counter() - t0:.0f} s)",
                    end="" if t < total else "\n")

        say(f"  gradient data: {data_bytes(numel, T) / 2**30:.2f} GiB in {tmp}")
        write_gradient_data(tmp, numel, workers, T, seed, progress)
        args = ["--algorithms", ",".join(algorithms), "--density", density, "--steps", steps,
                "--warmup", warmup, "--seed", seed, "--lr", lr, "--data", tmp, "--backward", backward]
        args += ["--bucket-cap-mb", bucket_cap_mb] if bucket_cap_mb else []
        args += ["--model", model] if model else ["--numel", numel]
        raw, link, profiles = _run_in_network(workers, rate, link_check_seconds, args, tmp, timeout,
                                              worker_cmd, profile, say, verbose, hosts or workers)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"workers": workers, "hosts": hosts or workers, "bandwidth": str(rate),
              "bandwidth_bits_per_s": int(rate), "numel": numel,
              "model": model, "density": density, "steps": steps, "warmup": warmup, "seed": seed, "lr": lr,
              "backward_seconds": backward, "bucket_cap_mb": bucket_cap_mb,
              "torch_threads": raw["torch_threads"], "link_check_bytes_per_s": link,
              "cpus": os.cpu_count(), "load_average_before": load_before,
              "load_average_after": list(os.getloadavg()),
              "worker_private_peak_bytes": max(raw.get("private_peak_bytes") or [0]),
              "shared_data_bytes": data_bytes(numel, T),
              "results": summarize(raw["runs"], workers, numel, rate, warmup, hosts)}
    if profiles:
        report["profiles"] = profiles
    return report


def _run_in_network(workers, rate, link_check_seconds, args, tmp, timeout, worker_cmd, profile, say, verbose,
                    hosts):
    """Build the namespaces (``hosts`` of them, ``workers / hosts`` ranks in each), check a link, run the workers
    with ``args``; ``(rank 0's result, link check bytes/s, profiles)``. The network is torn down on the way out."""
    with Network(hosts, rate) as net:
        say(f"  network: {hosts} namespaces {net.namespaces[0]}..{net.namespaces[-1]} of {workers // hosts} "
            f"rank(s) each on bridge {net.bridge} ({net.subnet}.0/24), tbf "
            f"{rate.text if hasattr(rate, 'text') else rate} each way per namespace")
        link = link_check(net, link_check_seconds) if link_check_seconds else None
        if link is not None:
            say(f"  link check: {link / 1e6:.1f} MB/s payload, one TCP stream "
                f"({net.namespaces[0]} -> {net.namespaces[1]}; line rate {rate / 8e6:.1f} MB/s)")
        out = Path(tmp) / "result.json"
        args = args + ["--out", out] + (["--profile", Path(tmp) / "profile"] if profile else [])
        launch(net, worker_cmd or WORKER_CMD or [sys.executable, "-m", WORKER], args, tmp, timeout, PROGRESS,
               verbose=verbose, ranks_per_host=workers // hosts)
        if not out.exists():
            raise WorkerFailed(f"the workers exited normally but rank 0 wrote no result; rank 0's output:\n"
                               f"{tail(Path(tmp) / 'rank0.log')}")
        profiles = {p.stem: p.read_text() for p in sorted(Path(tmp).glob("profile*.txt"))} if profile else {}
        return json.loads(out.read_text()), link, profiles



# -- command line ---------------------------------------------------------------------------------------------

def add_arguments(p):
    from . import cli, presets

    p.add_argument("--workers", type=workers, default=4,
                   help=f"Horovod workers P, one network namespace each, 2..{MAX_WORKERS} (default: 4)")
    p.add_argument("--hosts", type=workers, default=None,
                   help="emulated hosts N: N network namespaces of P / N workers each, which talk inside over the "
                        "namespace's loopback and between the hosts over the shaped links (default: P, one worker "
                        "a host); presets named <preset>@h run on two levels there (hierarchical=True)")
    p.add_argument("--bandwidth", type=bandwidth, default=Rate("1gbit"),
                   help="each worker's link rate, each direction, as tc writes it: 1gbit, 500mbit, 100mbit "
                        "(default: 1gbit)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--numel", type=cli.positive_int, default=None,
                      help="gradient size n: n float32 parameters in 16 layers (default: 25,000,000)")
    size.add_argument("--model", type=model_choice, default=None,
                      help=f"the parameter names and shapes of a real model instead: {', '.join(MODELS)}")
    p.add_argument("--density", type=cli.density, default=0.01, help="k / n (default: 0.01)")
    p.add_argument("--steps", type=cli.positive_int, default=32,
                   help="measured steps per algorithm (default: 32; with --warmup 1 this includes one of "
                        "Ok-Topk's exact threshold re-evaluations, as in training)")
    p.add_argument("--warmup", type=cli.positive_int, default=1,
                   help="steps run before the measured ones, not reported (default: 1, at least 1)")
    p.add_argument("--algorithms", type=lambda text: cli.algorithms(text, extra=(DENSE_POLL,
                                                                                 *presets.two_level_names(),
                                                                                 *presets.overlap_names())),
                   default=None,
                   help="comma-separated subset; dense = Horovod's own allreduce; dense_poll = the same with "
                        "Horovod's spinning wait replaced by hvd_sparse's polling one; <preset>+o = the preset with "
                        "overlap=True (default: all presets)")
    p.add_argument("--backward", type=float, default=0.0,
                   help="seconds of a synthetic backward (sleeps, layer by layer, in reverse order) before every "
                        "step, so that overlap can be seen (default: 0, none)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket_cap_mb of the <preset>+o runs (default: the optimizer's, 25)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic gradients (default: 0)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default: 0.01)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile every rank's measured steps; the top functions go into the JSON")
    add_run_arguments(p, 3600.0, "save a PNG bar chart of the seconds per step")


def main(args):
    from . import presets

    algorithms = args.algorithms or presets.names()
    numel = args.numel if args.numel is not None or args.model else 25_000_000

    def memory_check():
        n_total = MODELS[args.model][1] if args.model else numel
        shared = data_bytes(n_total, args.warmup + args.steps)
        private = WORKER_BASE_BYTES + WORKER_BYTES_PER_PARAM * n_total
        avail = _mem_available()
        if avail is not None and shared + args.workers * private > avail:
            return (f"not enough memory: the shared gradient data needs {shared / 2**30:.1f} GiB "
                    f"((9 + warmup + steps) x n x 4 bytes) and each of the {args.workers} workers about "
                    f"{private / 2**30:.1f} GiB (0.3 GiB + {WORKER_BYTES_PER_PARAM} bytes per parameter), but "
                    f"{avail / 2**30:.1f} GiB is available; lower --workers, --numel or --steps")
        return None

    def check():
        if args.hosts is not None and args.workers % args.hosts:
            return f"--hosts {args.hosts} must divide --workers {args.workers} (the same number of ranks a host)"
        return memory_check()

    return run_cli("python -m hvd_sparse.bench network", args, lambda: run(
        algorithms, args.workers, args.bandwidth, numel=None if args.model else numel, model=args.model,
        density=args.density, steps=args.steps, warmup=args.warmup, seed=args.seed, lr=args.lr, timeout=args.timeout,
        link_check_seconds=0 if args.no_link_check else 0.5, verbose=not args.quiet, profile=args.profile,
        hosts=args.hosts, backward=args.backward, bucket_cap_mb=args.bucket_cap_mb),
        plot, markdown, check=check,
        banner=f"network: {', '.join(algorithms)} on {args.workers} Horovod workers, {args.bandwidth} per worker")


def _mem_available():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
