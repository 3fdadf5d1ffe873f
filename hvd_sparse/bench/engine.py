"""Engine-step benchmark: one rank's whole sparse step, per preset, on the CPU or a GPU, beside one read pass and
``torch.topk``.

    python -m hvd_sparse.bench engine --device cuda --numel 25000000 --json engine.json --plot engine.png

At P = 1 (a ``SimulatedWorld(1)`` communicator: no collective is issued) the step is everything a rank does besides
communicating: error feedback, the selection, the reducer's local work and the write-back into the gradient. It
runs as the torch optimizer runs it: the gradient is the pieces of the synthetic layout (views of one buffer of n
float32 values), read and written in place (``Engine.step(pieces, out=pieces)``), and refilled from a copy before
every step (not timed). ``--warmup`` steps first (Ok-Topk re-evaluates its threshold at step 0; ExDyna and DCT set
theirs), then per preset:

    wall_seconds      median over ``--repeat`` steps of the step's wall time (CUDA synchronized before and after)
    kernel_seconds    the GPU kernels' time per step (torch.profiler, over ``--profile`` more steps); 0 on the CPU
    syncs             host waits for the GPU per step: cudaStreamSynchronize / cudaDeviceSynchronize /
                      cudaEventSynchronize calls (each ``.item()``, ``nonzero``, device-to-host copy makes one)
    memcpys           cudaMemcpy / cudaMemcpyAsync calls per step (host <-> device copies)

and, on the same buffer, ``stream`` (``torch.amax``: one read pass, the memory-bandwidth floor) and ``torch.topk``.
"""

from __future__ import annotations

import statistics
import sys

#: reference rows beside the presets
REFERENCES = ("stream", "torch.topk")
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_COPIES = ("cudaMemcpy", "cudaMemcpyAsync")


def _profiled(fn, steps, cuda):
    """(GPU kernel seconds, syncs, memcpys) per call of ``fn`` over ``steps`` calls, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        return 0.0, 0, 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
    events = prof.events()
    kernel_us = sum(e.device_time_total for e in events if e.device_type == DeviceType.CUDA)
    syncs = sum(1 for e in events if e.name in _SYNCS)
    copies = sum(1 for e in events if e.name in _COPIES)
    return kernel_us * 1e-6 / steps, syncs / steps, copies / steps


def _preset_step(name, density, source, layout, warmup):
    """``(refill, step)``: preset ``name``'s engine step on views of a copy of ``source``, and the refill of that copy
    from ``source`` that must come before each step (the step writes its result into the views)."""
    from ..core.sim import SimulatedWorld
    from .presets import make

    engine = make(name, density).new_engine(SimulatedWorld(1).communicators()[0])
    engine.layout = list(layout)
    buf = source.clone()
    pieces = list(buf.split(list(layout)))

    def refill():
        buf.copy_(source)

    def step():
        engine.step(pieces, out=pieces)

    for _ in range(warmup):
        refill()
        step()
    return refill, step


def run(n, density, repeat, names, device="cpu", warmup=2, profile_steps=3, seed=0, verbose=True):
    import torch

    from .data import SyntheticGradients
    from .select import device_name, time_one

    data = SyntheticGradients(n, 1, seed=seed)
    source = torch.from_numpy(data.grad(0, 0)).to(device)
    layout = list(data.layout)
    del data
    cuda = source.is_cuda
    sync = torch.cuda.synchronize if cuda else None
    k = max(1, int(density * n))
    calls = {"stream": lambda: torch.amax(source), "torch.topk": lambda: torch.topk(source.abs(), k)}
    rows = []
    for name in list(names) + list(REFERENCES):
        if verbose:
            print(f"  {name} ...", file=sys.stderr, flush=True)
        if name in calls:
            refill, fn = (lambda: None), calls[name]
            fn()
        else:
            refill, fn = _preset_step(name, density, source, layout, warmup)
        wall = statistics.median(time_one(lambda: (refill(), fn)[1], sync) for _ in range(repeat))  # refill untimed
        both = _profiled(lambda: (refill(), fn()), profile_steps, cuda)      # the refill's share taken out
        kernel, syncs, copies = (a - b for a, b in zip(both, _profiled(refill, profile_steps, cuda)))
        rows.append({"name": name, "wall_seconds": wall, "kernel_seconds": kernel, "syncs": syncs,
                     "memcpys": copies})
    return {"numel": n, "density": density, "k": k, "repeat": repeat, "warmup": warmup, "device": device_name(source),
            "threads": torch.get_num_threads(), "results": rows}


def markdown(report):
    lines = [f"Engine step at P = 1 on {report['device']}: n = {report['numel']:,}, k = {report['k']:,}, median of "
             f"{report['repeat']} steps after {report['warmup']} warm-up steps.", "",
             "| step | wall ms | GPU kernels ms | wall / kernels | syncs / step | memcpys / step |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        w, g = r["wall_seconds"] * 1e3, r["kernel_seconds"] * 1e3
        ratio = f"{w / g:.2f}" if g > 0 else ""
        lines.append(f"| {r['name']} | {w:.3f} | {g:.3f} | {ratio} | {r['syncs']:.3g} | {r['memcpys']:.3g} |")
    return "\n".join(lines)


def plot(report, path):
    """PNG: one bar per row, its wall milliseconds, the GPU kernels' share drawn inside."""
    from . import cli

    res = report["results"]
    names = [r["name"] for r in res]
    wall = [r["wall_seconds"] * 1e3 for r in res]
    fig, ax, y = cli.bar_chart(names, wall, names, [f" {w:.3g} ms, {r['syncs']:.3g} syncs" for w, r in zip(wall, res)])
    ax.barh(y, [r["kernel_seconds"] * 1e3 for r in res], color="black", alpha=0.35, label="GPU kernels")
    ax.legend(fontsize=8)
    cli.finish_chart(fig, ax, "milliseconds per step (median)",
                     f"Engine step, P = 1, n = {report['numel']:,}, {report['device']}", path)


def add_arguments(p):
    from . import cli, presets

    p.add_argument("--numel", type=cli.positive_int, default=25_000_000, help="n (default: 25,000,000)")
    p.add_argument("--density", type=cli.density, default=0.01, help="k / n (default: 0.01)")
    p.add_argument("--algorithms", type=cli.algorithms, default=presets.names(),
                   help="comma-separated presets (default: all)")
    p.add_argument("--repeat", type=cli.positive_int, default=20, help="timed steps per preset (default: 20)")
    p.add_argument("--warmup", type=cli.positive_int, default=2, help="steps before timing (default: 2)")
    p.add_argument("--profile", type=cli.positive_int, default=3, help="profiled steps per preset (default: 3)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="save a PNG bar chart")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args):
    from . import cli

    report = run(args.numel, args.density, args.repeat, args.algorithms, device=args.device, warmup=args.warmup,
                 profile_steps=args.profile, seed=args.seed, verbose=not args.quiet)
    cli.write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    print(markdown(report))
    return 0
