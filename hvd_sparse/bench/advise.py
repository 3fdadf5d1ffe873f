"""Should I use it, and which preset? Measured on your hosts, your Horovod build and your model, in one run.

    horovodrun -np 2 -H localhost:2 --gloo python -m hvd_sparse.bench advise --json advise.json
    horovodrun -np 8 -H node1:4,node2:4 python -m hvd_sparse.bench advise --device cuda \\
        --model mypackage.models:make_for_advise --budgets 0.02,0.05 --densities 0.01

Launch it the way you launch training: every rank runs this module (under ``horovodrun`` or any launcher Horovod
accepts). On the model -- ``--model package.module:factory``, a callable returning ``(model, (inputs, targets))``
or ``(model, (inputs, targets), loss_fn)`` (default loss: cross entropy), or else an MLP of ``--numel``
parameters -- it times, each configuration from the same weights and the same batch per rank:

    compute              the torch optimizer alone, no communication: the floor
    dense, fp16          Horovod's own DistributedOptimizer, ``Compression.none`` / ``Compression.fp16``
    <preset>@b<budget>   hvd_sparse's optimizer with the preset at ``byte_budget=budget`` (``--budgets``)
    <preset>@d<density>  the same at a density (``--densities``)

one step = a barrier (not timed), zero_grad, forward, backward, ``optimizer.step()`` and, on a GPU, a device
synchronize; a step's time is the slowest rank's; the median over ``--steps`` after ``--warmup``. Two probes
measure the links: the latency of an allreduce of one value and the bandwidth of an allreduce of ``--probe-mb``
megabytes (bytes a rank sends in a ring, 2·size·(P−1)/P, over the seconds).

Rank 0 prints the progress, then a table (step, time beyond compute, speedup over dense, bytes a rank sends per step)
and a verdict: the fastest configuration, how much faster than dense it is, and the link speed at which dense would
catch up, from the cost model of docs/choosing.md (time beyond compute = a fixed cost + bytes / bandwidth, the
fixed cost of each configuration taken from its measured time and the probed bandwidth). ``--json`` and
``--markdown`` write the report.
"""

from __future__ import annotations

import importlib
import math
import statistics
import sys
import time

PREFIX = "hvd_sparse.bench advise:"
#: the configurations that are not presets
BASELINES = ("compute", "dense", "fp16")


class Unusable(SystemExit):
    """The run cannot measure anything meaningful here (a message saying why and what to do)."""

    def __init__(self, message):
        super().__init__(f"{PREFIX} {message}")


# -- the model ------------------------------------------------------------------------------------------------------
def mlp_widths(numel, inputs=1024, classes=10):
    """Widths ``[inputs, h, h, classes]`` of an MLP whose parameters come closest to ``numel``."""
    a, b = 1.0, inputs + classes + 3.0            # h^2 + (inputs + classes + 3) h + classes ~ numel
    h = max(1, int((-b + math.sqrt(b * b + 4 * a * max(0, numel - classes))) / 2))
    return [inputs, h, h, classes]


def load_model(spec, numel, batch_size, seed, device):
    """``(model, (x, y), loss_fn)`` on ``device``: ``spec``'s factory, or the MLP of :func:`mlp_widths`."""
    import torch

    torch.manual_seed(seed)
    if spec:
        module, _, name = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise Unusable(f"--model {spec!r}: cannot load it ({e}); give package.module:callable") from e
        made = factory()
        if not (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[1], (tuple, list))
                and len(made[1]) == 2):
            raise Unusable(f"--model {spec!r} must return (model, (inputs, targets)) or (model, (inputs, targets), "
                           f"loss_fn), got {type(made).__name__}")
        model, (x, y), loss = (*made, torch.nn.functional.cross_entropy)[:3]
    else:
        from ._trainstep_worker import mlp

        widths = mlp_widths(numel)
        model, loss = mlp(widths, seed, "cpu"), torch.nn.functional.cross_entropy
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(batch_size, widths[0], generator=g), torch.randint(0, widths[-1], (batch_size,), generator=g)
    return model.to(device), (x.to(device), y.to(device)), loss


# -- the configurations ----------------------------------------------------------------------------------------------
def configurations(presets, budgets, densities):
    """``[(label, compression factory)]``: the baselines, then every preset at every budget and density."""
    import hvd_sparse.torch as hvds

    out = [("compute", None), ("dense", lambda: hvds.Compression.none), ("fp16", lambda: hvds.Compression.fp16)]
    for p in presets:
        factory = getattr(hvds.Compression, p)
        out += [(f"{p}@b{b:g}", lambda f=factory, b=b: f(byte_budget=b)) for b in budgets]
        out += [(f"{p}@d{d:g}", lambda f=factory, d=d: f(d)) for d in densities]
    return out


def measure(made, compression, steps, warmup, lr=0.01):
    """This rank's step seconds (a list) and mean bytes sent per step (None for the baselines) of one configuration;
    ``made``: a fresh ``(model, batch, loss)``."""
    import horovod.torch as hvd
    import torch

    import hvd_sparse.torch as hvds

    model, (x, y), loss_fn = made
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if compression is not None:
        opt = hvds.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression())
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    seconds, sent = [], []
    for t in range(warmup + steps):
        hvd.allreduce(torch.zeros(1), name="hvd_sparse.advise.barrier")
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        sync()
        if t >= warmup:
            seconds.append(time.perf_counter() - t0)
            if hasattr(opt, "sparse_stats"):
                sent.append(opt.sparse_stats().get("sent_bytes", 0))
    return seconds, (statistics.fmean(sent) if sent else None)


# -- the probes ------------------------------------------------------------------------------------------------------
def probe(device, megabytes, reps=5):
    """``(latency seconds, bandwidth bytes/s)`` of this job's links: the medians of ``reps`` allreduces of one value
    and of ``megabytes`` MB (after one of each not timed); the slowest rank's times."""
    import horovod.torch as hvd
    import torch

    small = torch.zeros(1, device=device)
    big = torch.zeros(max(1, int(megabytes * 2**20 / 4)), device=device)
    times = {"small": [], "big": []}
    for which, x in (("small", small), ("big", big)):
        for r in range(reps + 1):
            hvd.allreduce(torch.zeros(1), name="hvd_sparse.advise.barrier")
            t0 = time.perf_counter()
            hvd.allreduce(x, name=f"hvd_sparse.advise.probe.{which}")
            if r:
                times[which].append(slowest(time.perf_counter() - t0))
    P = hvd.size()
    sent = 2 * big.numel() * 4 * (P - 1) / P
    return statistics.median(times["small"]), sent / statistics.median(times["big"])


def slowest(seconds):
    """The largest of every rank's ``seconds`` (a collective)."""
    import horovod.torch as hvd
    import torch

    return float(hvd.allreduce(torch.tensor([seconds], dtype=torch.float64), op=hvd.Max,
                               name="hvd_sparse.advise.slowest")[0])


# -- the report ------------------------------------------------------------------------------------------------------
def rows_of(measured, numel, P):
    """Table rows from ``[(label, every rank's (seconds, sent))]``: the slowest rank per step, the median over steps;
    dense and fp16 send the ring's 2n(P-1)/P words of 4 and 2 bytes."""
    from .loop import ring_allreduce_bytes

    rows = []
    for label, ranks in measured:
        steps = [max(s[t] for s, _ in ranks) for t in range(len(ranks[0][0]))]
        sent = {"compute": 0.0, "dense": ring_allreduce_bytes(numel, P),
                "fp16": ring_allreduce_bytes(numel, P, itemsize=2)}.get(label)
        if sent is None:
            sent = statistics.fmean(b for _, b in ranks)
        rows.append({"name": label, "step_ms": statistics.median(steps) * 1e3, "sent_bytes": sent})
    floor = rows[0]["step_ms"]
    dense = next(r["step_ms"] for r in rows if r["name"] == "dense")
    for r in rows:
        r["beyond_compute_ms"] = r["step_ms"] - floor
        r["speedup_vs_dense"] = dense / r["step_ms"]
    return rows


def break_even(row, dense, bandwidth):
    """The link speed (bytes/s) at which ``row``'s and ``dense``'s exchanges would cost the same, by the cost model
    (beyond compute = fixed + bytes / bandwidth, each fixed cost what its measured time leaves at ``bandwidth``):
    None when one of the two is cheaper at every speed."""
    fixed = [max(0.0, r["beyond_compute_ms"] / 1e3 - r["sent_bytes"] / bandwidth) for r in (row, dense)]
    saved, extra = dense["sent_bytes"] - row["sent_bytes"], fixed[0] - fixed[1]
    return saved / extra if saved > 0 and extra > 0 else None


def decide(rows, bandwidth, margin=1.1):
    """The verdict's facts: the fastest preset (``best``, None without presets), its ``speedup`` over dense,
    whether it wins (faster by more than ``margin``) and the ``break_even_gbit`` link speed (None: no crossing)."""
    dense = next(r for r in rows if r["name"] == "dense")
    sparse = [r for r in rows if r["name"] not in BASELINES]
    if not sparse:
        return {"best": None, "speedup": None, "wins": False, "break_even_gbit": None}
    best = min(sparse, key=lambda r: r["step_ms"])
    at = break_even(best, dense, bandwidth)
    speedup = dense["step_ms"] / best["step_ms"]
    return {"best": best["name"], "speedup": speedup, "wins": speedup >= margin,
            "break_even_gbit": None if at is None else at * 8 / 1e9}


def verdict(rows, bandwidth, P, margin=1.1):
    """One paragraph on :func:`decide`'s facts: the fastest preset against dense, and the link speed where that
    changes."""
    facts = decide(rows, bandwidth, margin)
    dense = next(r for r in rows if r["name"] == "dense")
    where = f"On these hosts (P = {P}, links measured at {bandwidth * 8 / 1e9:.2f} Gbit/s)"
    if facts["best"] is None:
        return f"{where} Horovod's dense step takes {dense['step_ms']:.1f} ms; no preset was measured."
    best = next(r for r in rows if r["name"] == facts["best"])
    at = facts["break_even_gbit"]
    if facts["wins"]:
        text = (f"{where} {best['name']} is {facts['speedup']:.1f}x faster per step than Horovod's dense optimizer "
                f"({best['step_ms']:.1f} ms against {dense['step_ms']:.1f} ms, with "
                f"{best['sent_bytes'] / max(dense['sent_bytes'], 1):.3f} of its bytes). ")
        text += (f"Dense would catch up on links faster than {at:.1f} Gbit/s (docs/choosing.md)." if at else
                 "It stays ahead on faster links too: its fixed cost is not above dense's.")
    else:
        text = (f"{where} no preset is more than {margin:.1f}x faster than Horovod's dense step "
                f"({dense['step_ms']:.1f} ms; the fastest preset, {best['name']}, {best['step_ms']:.1f} ms): "
                "keep Horovod's optimizer. ")
        text += f"{best['name']} would win on links slower than {at:.2f} Gbit/s (docs/choosing.md)." if at else ""
    if best["name"].startswith("topka@d"):
        text += " TopkA's bytes grow with P: past P = 1/density it sends more than dense; a byte_budget scales it."
    elif "@b" in best["name"]:
        text += (" At a byte budget the bytes keep their share of dense's at any number of ranks; the fixed cost grows "
                 "with the ranks: measure again at another P.")
    return text.rstrip()


def digits_cnn():
    """A ``--model`` factory that ships with the package: the digits CNN (38,282 parameters) and a batch of 32."""
    from .digits_torch import Net, load_data

    (x, y), _ = load_data()
    return Net(), (x[:32], y[:32])


def markdown(report):
    lines = [f"P = {report['workers']}, {report['device']}, model {report['model']} ({report['numel']:,} parameters); "
             f"one small allreduce {report['latency_us']:.0f} us, links {report['bandwidth_gbit']:.2f} Gbit/s", "",
             "| configuration | step ms | beyond compute ms | speedup over dense | MB sent per rank and step |",
             "|---|---:|---:|---:|---:|"]
    for r in report["configurations"]:
        lines.append(f"| {r['name']} | {r['step_ms']:.2f} | {r['beyond_compute_ms']:.2f} | "
                     f"{r['speedup_vs_dense']:.2f} | {r['sent_bytes'] / 1e6:.3f} |")
    return "\n".join(lines + ["", report["verdict"]])


# -- the command -----------------------------------------------------------------------------------------------------
def add_arguments(p):
    from . import cli

    p.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                   help="a callable returning (model, (inputs, targets)[, loss_fn]); default: an MLP of --numel")
    p.add_argument("--numel", type=cli.positive_int, default=10_000_000,
                   help="parameters of the default MLP (default: 10,000,000)")
    p.add_argument("--batch-size", type=cli.positive_int, default=32, help="the default MLP's batch per rank")
    p.add_argument("--presets", type=cli.algorithms, default=["topka", "oktopk", "exdyna"],
                   help="comma-separated presets (default: topka,oktopk,exdyna)")
    p.add_argument("--budgets", type=_fractions, default=[0.05], help="byte budgets (default: 0.05)")
    p.add_argument("--densities", type=_fractions, default=[], help="densities, besides the budgets")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=cli.positive_int, default=20)
    p.add_argument("--warmup", type=cli.positive_int, default=5)
    p.add_argument("--probe-mb", type=cli.positive_float, default=16.0,
                   help="size of the bandwidth probe (default: 16 MB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON (rank 0)")
    p.add_argument("--markdown", metavar="FILE", help="write the table and the verdict as Markdown (rank 0)")


def _fractions(text):
    from . import cli

    return [cli.density(t) for t in text.split(",") if t.strip()]


def _start(device):
    """Horovod initialised, this rank's device chosen; an :class:`Unusable` when the job cannot compare exchanges."""
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise Unusable(f"Horovod for PyTorch does not import ({e}); install it with HOROVOD_WITH_PYTORCH=1") from e
    import torch

    hvd.init()
    if hvd.size() < 2:
        raise Unusable("one rank has no exchange to measure: launch it the way you launch training, e.g. "
                       "horovodrun -np 2 -H localhost:2 python -m hvd_sparse.bench advise")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise Unusable(f"--device cuda, but rank {hvd.rank()} sees no CUDA device")
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return hvd


def main(args):
    from . import cli

    hvd = _start(args.device)
    say = (lambda line: print(f"{PREFIX} {line}", file=sys.stderr, flush=True)) if hvd.rank() == 0 else (lambda _: None)
    measured = []
    configs = configurations(args.presets, args.budgets, args.densities)
    for i, (label, compression) in enumerate(configs):
        made = load_model(args.model, args.numel, args.batch_size, args.seed, args.device)
        seconds, sent = measure(made, compression, args.steps, args.warmup)
        measured.append((label, hvd.allgather_object((seconds, sent), name=f"hvd_sparse.advise.{label}")))
        say(f"[{i + 1}/{len(configs)}] {label}: median step {statistics.median(seconds) * 1e3:.2f} ms on rank 0")
    latency, bandwidth = probe(args.device, args.probe_mb)
    say(f"links: one small allreduce {latency * 1e6:.0f} us, {bandwidth * 8 / 1e9:.2f} Gbit/s")
    numel = sum(p.numel() for p in made[0].parameters())
    rows = rows_of(measured, numel, hvd.size())
    report = {"workers": hvd.size(), "device": _device_name(args.device), "model": args.model or "mlp",
              "numel": numel, "latency_us": latency * 1e6, "bandwidth_gbit": bandwidth * 8 / 1e9,
              "build": {"nccl": bool(hvd.nccl_built()), "gloo": bool(hvd.gloo_enabled()),
                        "mpi": bool(hvd.mpi_enabled())},
              "configurations": rows, "decision": decide(rows, bandwidth),
              "verdict": verdict(rows, bandwidth, hvd.size())}
    if hvd.rank() == 0:
        cli.write_json(args.json, report)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(report) + "\n")
        print(markdown(report))
    hvd.shutdown()
    return 0


def _device_name(device):
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"
