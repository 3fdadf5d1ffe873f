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
synchronize; a step's time is the slowest rank's. Each configuration first runs ``--warmup`` steps, not timed;
then the configurations take turns in rounds, ``--steps`` steps each, in their order, then the reverse, and so on
(a load that comes and goes falls on all of them alike): at least twenty rounds, the fewest pairs
:mod:`hvd_sparse.bench.noise` trusts, then rounds until ``--seconds`` are spent or ``--rounds`` run. A round's
step is the median of its steps; a configuration's step the median of its rounds, with their quartiles as its
spread. Every rank runs torch with ``--threads`` threads (default: the host's cores over the ranks on it, so that
the ranks do not oversubscribe the cores). Two probes measure the links: the latency of an allreduce of one value
and the bandwidth of an allreduce of ``--probe-mb`` megabytes (bytes a rank sends in a ring, 2·size·(P−1)/P, over
the seconds).

Rank 0 prints the progress, then a table (step and quartiles, time beyond compute, speedup over dense, whether the
difference from dense counts, bytes a rank sends per step) and a verdict: the fastest preset and how
much faster than dense it is where the rounds tell them apart (:mod:`hvd_sparse.bench.noise`, paired round by
round: the 99% confidence interval of the median per-round speedup, by the sign test, on one side of 1; otherwise
"no measurable difference"), and the link speed at which that changes, from the cost model of docs/choosing.md
(time beyond compute = a fixed cost + bytes / bandwidth, the fixed cost of each configuration taken from its
measured time and the probed bandwidth). The table's speedup is that median per-round speedup.
``--json`` and ``--markdown`` write the report; the JSON keeps every round's steps.
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
import sys
import time

from . import noise

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
#: the label of a configuration on two levels: ``<preset>@b<budget>`` + this
TWO_LEVELS = "@h"


def configurations(presets, budgets, densities, two_levels=False):
    """``[(label, compression factory)]``: the baselines, then every preset at every budget and density, flat, and
    with ``two_levels`` also on two levels (``hierarchical=True``, label + :data:`TWO_LEVELS`)."""
    import hvd_sparse.torch as hvds

    out = [("compute", None), ("dense", lambda: hvds.Compression.none), ("fp16", lambda: hvds.Compression.fp16)]
    for p in presets:
        factory = getattr(hvds.Compression, p)
        for hierarchical in ((False, True) if two_levels else (False,)):
            tag = TWO_LEVELS if hierarchical else ""
            out += [(f"{p}@b{b:g}{tag}", lambda f=factory, b=b, h=hierarchical: f(byte_budget=b, hierarchical=h))
                    for b in budgets]
            out += [(f"{p}@d{d:g}{tag}", lambda f=factory, d=d, h=hierarchical: f(d, hierarchical=h))
                    for d in densities]
    return out


def two_levels_possible(hvd):
    """``(possible, why not)``: whether this job can measure two levels -- its ranks sit several to a host on
    several hosts, and Horovod lets hvd_sparse add process sets (``HOROVOD_DYNAMIC_PROCESS_SETS=1``)."""
    if hvd.local_size() < 2 or hvd.cross_size() < 2:
        return False, None
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0").strip().lower() in ("", "0", "false"):
        return False, ("two levels (hierarchical=True) not measured: launch with HOROVOD_DYNAMIC_PROCESS_SETS=1 so "
                       "that hvd_sparse can register the hosts' process sets")
    return True, None


def stepper(label, made, compression, lr=0.01):
    """One configuration's step on ``made``, a fresh ``(model, batch, loss)``: a callable returning this rank's
    seconds and the bytes it sent (None for the baselines). Horovod's collectives are named after ``label``, so
    that dense's and fp16's, which alternate, never meet in its cache."""
    import horovod.torch as hvd
    import torch

    import hvd_sparse.torch as hvds

    model, (x, y), loss_fn = made
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if compression is not None:
        named = [(f"{label}.{n}", p) for n, p in model.named_parameters()]
        opt = hvds.DistributedOptimizer(opt, named_parameters=named, compression=compression())
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def step():
        hvd.allreduce(torch.zeros(1), name="hvd_sparse.advise.barrier")
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        sync()
        seconds = time.perf_counter() - t0
        return seconds, (opt.sparse_stats().get("sent_bytes", 0) if hasattr(opt, "sparse_stats") else None)

    return step


def order(n, r):
    """The configurations' order in round ``r`` (from 0): 0, 1, ..., n - 1, then the reverse, and so on."""
    return range(n) if r % 2 == 0 else range(n - 1, -1, -1)


def measure(steppers, steps, warmup, seconds, rounds, say=lambda r, elapsed: None, every=5.0):
    """Every configuration's steps on this rank, in rounds (:func:`order`), ``steps`` steps each, after ``warmup``
    of each not kept: at least :data:`hvd_sparse.bench.noise.MIN_PAIRS` rounds (``rounds`` if fewer), then until
    the slowest rank has spent ``seconds`` or ``rounds`` are done. Returns per configuration its seconds per round
    (a list of ``steps``), per configuration its mean bytes sent per step (None for the baselines), and the seconds
    the slowest rank spent in the rounds; ``say(rounds done, seconds)`` after the first round and then every
    ``every`` seconds."""
    for step in steppers:
        for _ in range(warmup):
            step()
    times, sent = [[] for _ in steppers], [[] for _ in steppers]
    start, r, said = time.perf_counter(), 0, -every
    while True:
        for i in order(len(steppers), r):
            out = [steppers[i]() for _ in range(steps)]
            times[i].append([s for s, _ in out])
            sent[i] += [b for _, b in out if b is not None]
        r += 1
        elapsed = slowest(time.perf_counter() - start)          # every rank's decision the same
        if elapsed >= said + every:
            said = elapsed
            say(r, elapsed)
        if r >= rounds or (r >= noise.MIN_PAIRS and elapsed >= seconds):
            return times, [statistics.fmean(b) if b else None for b in sent], elapsed


def threads(option, local_size):
    """Torch threads per rank: ``option``, else the host's cores over the ranks on it (``local_size``), at most the
    cores this rank may run on, at least 1: the ranks' threads together do not oversubscribe the host."""
    if option:
        return option
    cores = os.cpu_count() or 1
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return max(1, min(mine, cores // local_size))


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
    """Table rows from ``[(label, every rank's (seconds per round, sent))]``: a step's time is the slowest rank's, a
    round's the median of its steps; a row has the rounds' median (``step_ms``) and quartiles (``q1_ms``,
    ``q3_ms``), the rounds (``rounds_ms``) and their steps (``steps_ms``), and ``speedup_vs_dense`` and
    ``against_dense``, the :func:`hvd_sparse.bench.noise.compare` speedup and outcome of its rounds against dense's,
    paired round by round (``below_compute``: faster than compute alone by the same rule). Dense and fp16 send the
    ring's 2n(P-1)/P words of 4 and 2 bytes."""
    from .loop import ring_allreduce_bytes

    rows = []
    for label, ranks in measured:
        steps = [[max(at) for at in zip(*(rounds[r] for rounds, _ in ranks))] for r in range(len(ranks[0][0]))]
        rounds = [statistics.median(st) * 1e3 for st in steps]
        sent = {"compute": 0.0, "dense": ring_allreduce_bytes(numel, P),
                "fp16": ring_allreduce_bytes(numel, P, itemsize=2)}.get(label)
        if sent is None:
            sent = statistics.fmean(b for _, b in ranks)
        q1, median, q3 = noise.quartiles(rounds)
        rows.append({"name": label, "step_ms": median, "q1_ms": q1, "q3_ms": q3, "sent_bytes": sent,
                     "rounds_ms": rounds, "steps_ms": [[t * 1e3 for t in st] for st in steps]})
    floor, dense = (next(r for r in rows if r["name"] == name) for name in ("compute", "dense"))
    for r in rows:
        r["beyond_compute_ms"] = r["step_ms"] - floor["step_ms"]
        against = noise.compare(dense["rounds_ms"], r["rounds_ms"], paired=True)
        r["speedup_vs_dense"], r["against_dense"] = against["speedup"], against["outcome"]
        r["below_compute"] = (r is not floor and noise.compare(floor["rounds_ms"], r["rounds_ms"],
                                                               paired=True)["outcome"] == noise.FASTER)
    return rows


def break_even(row, dense, bandwidth):
    """The link speed (bytes/s) at which ``row``'s and ``dense``'s exchanges would cost the same, by the cost model
    (beyond compute = fixed + bytes / bandwidth, each fixed cost what its measured time leaves at ``bandwidth``):
    None when one of the two is cheaper at every speed."""
    fixed = [max(0.0, r["beyond_compute_ms"] / 1e3 - r["sent_bytes"] / bandwidth) for r in (row, dense)]
    saved, extra = dense["sent_bytes"] - row["sent_bytes"], fixed[0] - fixed[1]
    return saved / extra if saved > 0 and extra > 0 else None


def decide(rows, bandwidth):
    """The verdict's facts: :func:`hvd_sparse.bench.noise.decide` on the rounds' step times, dense the baseline, the
    presets the candidates, compute the floor (``best``, ``speedup``, ``low``, ``high``, ``outcome``, ``below_floor``,
    ``wins``, ``reason``), and ``break_even_gbit``, the link speed at which ``best`` and dense would cost the same
    (None: no crossing, or no preset)."""
    named = {r["name"]: r for r in rows}
    samples = {name: r["rounds_ms"] for name, r in named.items()}
    facts = noise.decide(samples, "dense", [n for n in named if n not in BASELINES], floor="compute", paired=True)
    at = break_even(named[facts["best"]], named["dense"], bandwidth) if facts["best"] else None
    return {**facts, "break_even_gbit": None if at is None else at * 8 / 1e9}


def _ms(row):
    return f"{row['step_ms']:.1f} ms, quartiles {row['q1_ms']:.1f} to {row['q3_ms']:.1f}"


def verdict(rows, bandwidth, P):
    """One paragraph on :func:`decide`'s facts: the fastest preset against dense where the rounds tell them apart
    (docs/choosing.md, "When a difference counts"), and the link speed where that changes."""
    facts = decide(rows, bandwidth)
    named = {r["name"]: r for r in rows}
    dense = named["dense"]
    where = f"On these hosts (P = {P}, links measured at {bandwidth * 8 / 1e9:.2f} Gbit/s)"
    if facts["best"] is None:
        return f"{where} Horovod's dense step takes {dense['step_ms']:.1f} ms; no preset was measured."
    if facts["below_floor"]:
        return (f"{where} the step times are noise: {', '.join(facts['below_floor'])} measured faster than compute "
                "alone, round by round beyond the noise, which no exchange can be. Measure again on a quieter "
                "machine or for longer (--seconds).")
    best, at = named[facts["best"]], facts["break_even_gbit"]
    if not facts["enough"]:
        return (f"{where} {len(dense['rounds_ms'])} rounds are too few to tell the configurations apart: "
                f"{noise.MIN_PAIRS} are needed (--rounds).")
    if facts["wins"]:
        text = (f"{where} {best['name']} is {facts['speedup']:.2f}x faster per step than Horovod's dense optimizer in "
                f"the median round ({facts['low']:.2f}x to {facts['high']:.2f}x with 99% confidence; {_ms(best)} "
                f"against {_ms(dense)}, with {best['sent_bytes'] / max(dense['sent_bytes'], 1):.3f} of its bytes). ")
        text += (f"Dense would catch up on links faster than {at:.1f} Gbit/s (docs/choosing.md)." if at else
                 "It stays ahead on faster links too: its fixed cost is not above dense's.")
    elif facts["outcome"] == noise.NOISE:
        text = (f"{where} within the noise of this machine: no measurable difference between the fastest preset, "
                f"{best['name']} ({_ms(best)}), and Horovod's dense step ({_ms(dense)}): keep Horovod's optimizer.")
    else:
        text = (f"{where} Horovod's dense step ({_ms(dense)}) is shorter than every preset's, round by round beyond "
                f"the noise (the fastest preset, {best['name']}, at {facts['speedup']:.2f}x its speed: {_ms(best)}): "
                "keep Horovod's optimizer. ")
        text += f"{best['name']} would win on links slower than {at:.2f} Gbit/s (docs/choosing.md)." if at else ""
    text += two_levels_sentence(named, best["name"])
    if best["name"].startswith("topka@d"):
        text += " TopkA's bytes grow with P: past P = 1/density it sends more than dense; a byte_budget scales it."
    elif "@b" in best["name"]:
        text += (" At a byte budget the bytes keep their share of dense's at any number of ranks; the fixed cost grows "
                 "with the ranks: measure again at another P.")
    return text.rstrip()


def two_levels_sentence(named, best):
    """Where the fastest preset was measured flat and on two levels (``<label>`` and ``<label>@h``): which to use,
    by :func:`hvd_sparse.bench.noise.compare` of their rounds (empty where only one of them ran)."""
    flat = best[:-len(TWO_LEVELS)] if best.endswith(TWO_LEVELS) else best
    if flat not in named or flat + TWO_LEVELS not in named:
        return ""
    facts = noise.compare(named[flat]["rounds_ms"], named[flat + TWO_LEVELS]["rounds_ms"], paired=True)
    if facts["outcome"] == noise.FASTER:
        return (f" Two levels (hierarchical=True) make {flat} {facts['speedup']:.2f}x faster than flat here, round by "
                "round beyond the noise: use them.")
    if facts["outcome"] == noise.SLOWER:
        return (f" Two levels (hierarchical=True) make {flat} slower than flat here ({facts['speedup']:.2f}x), "
                "round by round beyond the noise: keep it flat.")
    return f" Two levels and flat {flat} differ within the noise here."


def digits_cnn():
    """A ``--model`` factory that ships with the package: the digits CNN (38,282 parameters) and a batch of 32."""
    from .digits_torch import Net, load_data

    (x, y), _ = load_data()
    return Net(), (x[:32], y[:32])


def markdown(report):
    lines = [f"P = {report['workers']}, {report['device']}, model {report['model']} ({report['numel']:,} parameters); "
             f"one small allreduce {report['latency_us']:.0f} us, links {report['bandwidth_gbit']:.2f} Gbit/s; "
             f"torch threads per rank {report['torch_threads']}; {report['rounds']} rounds of "
             f"{report['steps_per_round']} steps per configuration in {report['seconds']:.0f} s, a round's step the "
             "median of its steps (each the slowest rank's), median and quartiles over the rounds", "",
             "| configuration | step ms | quartiles ms | beyond compute ms | speedup over dense | against dense "
             "| MB sent per rank and step |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in report["configurations"]:
        against = ("noise: below compute" if r["below_compute"] else "—" if r["name"] in ("compute", "dense")
                   else {"noise": "within noise"}.get(r["against_dense"], r["against_dense"]))
        lines.append(f"| {r['name']} | {r['step_ms']:.2f} | {r['q1_ms']:.2f} to {r['q3_ms']:.2f} | "
                     f"{r['beyond_compute_ms']:.2f} | {r['speedup_vs_dense']:.2f} | {against} | "
                     f"{r['sent_bytes'] / 1e6:.3f} |")
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
    p.add_argument("--seconds", type=cli.positive_float, default=60.0,
                   help="time for the rounds of steps: at least %d rounds run, then rounds until this is spent "
                        "(default: 60)" % noise.MIN_PAIRS)
    p.add_argument("--rounds", type=cli.positive_int, default=100,
                   help="at most this many rounds, however short they are (default: 100)")
    p.add_argument("--steps", type=cli.positive_int, default=5,
                   help="steps of each configuration in a round (default: 5)")
    p.add_argument("--warmup", type=cli.positive_int, default=5,
                   help="steps of each configuration before the rounds, not timed (default: 5)")
    p.add_argument("--threads", type=cli.positive_int, default=None,
                   help="torch threads per rank, as your job sets them (default: the host's cores over its ranks, "
                        "at least 1)")
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
    run = _measure_all(args, hvd, say)
    latency, bandwidth = probe(args.device, args.probe_mb)
    say(f"links: one small allreduce {latency * 1e6:.0f} us, {bandwidth * 8 / 1e9:.2f} Gbit/s")
    rows = rows_of(run["measured"], run["numel"], hvd.size())
    report = {"workers": hvd.size(), "device": _device_name(args.device), "model": args.model or "mlp",
              "numel": run["numel"], "latency_us": latency * 1e6, "bandwidth_gbit": bandwidth * 8 / 1e9,
              "build": {"nccl": bool(hvd.nccl_built()), "gloo": bool(hvd.gloo_enabled()),
                        "mpi": bool(hvd.mpi_enabled())},
              **{k: run[k] for k in ("torch_threads", "rounds", "seconds")}, "steps_per_round": args.steps,
              "seconds_budget": args.seconds, "configurations": rows, "decision": decide(rows, bandwidth),
              "verdict": verdict(rows, bandwidth, hvd.size())}
    if hvd.rank() == 0:
        cli.write_json(args.json, report)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(report) + "\n")
        print(markdown(report))
    hvd.shutdown()
    return 0


def _measure_all(args, hvd, say):
    """The torch threads set, every configuration built and measured (:func:`measure`): ``measured`` (per
    configuration, its label and every rank's rounds and bytes), ``numel``, ``torch_threads``, ``rounds``,
    ``seconds``."""
    import torch

    n = threads(args.threads, hvd.local_size())
    torch.set_num_threads(n)
    say(f"torch threads per rank: {n} (" + ("--threads" if args.threads else
        f"{os.cpu_count()} cores over {hvd.local_size()} ranks on this host; --threads sets it") + ")")
    two, why_not = two_levels_possible(hvd)
    if why_not:
        say(why_not)
    configs = configurations(args.presets, args.budgets, args.densities, two_levels=two)
    made = [load_model(args.model, args.numel, args.batch_size, args.seed, args.device) for _ in configs]
    steppers = [stepper(label, m, compression) for (label, compression), m in zip(configs, made)]
    say(f"{', '.join(label for label, _ in configs)}: rounds of {args.steps} steps each for {args.seconds:g} s "
        f"(at least {min(noise.MIN_PAIRS, args.rounds)} rounds, at most {args.rounds})")
    times, sent, elapsed = measure(steppers, args.steps, args.warmup, args.seconds, args.rounds,
                                   lambda r, spent: say(f"round {r}: {spent:.0f} s"))
    say(f"{len(times[0])} rounds in {elapsed:.0f} s")
    ranks = hvd.allgather_object(list(zip(times, sent)), name="hvd_sparse.advise.steps")
    return {"measured": [(label, [rank[i] for rank in ranks]) for i, (label, _) in enumerate(configs)],
            "numel": sum(p.numel() for p in made[0][0].parameters()), "torch_threads": n, "rounds": len(times[0]),
            "seconds": elapsed}


def _device_name(device):
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"
