"""Selection benchmark: seconds one rank spends choosing its entries, for every sparsifier of the presets.

Every method runs on the same gradient-like float32 torch buffer of n values
(``SyntheticGradients(n, 1).grad(0, 0)``), on the CPU or on ``--device`` (``cuda``: each timed call is bracketed by
``torch.cuda.synchronize()``), with k = max(1, floor(density * n)), on one rank (P = 1: a
``StepContext`` with a ``SimulatedWorld(1)`` communicator; no selection below issues a collective at P = 1).
The sparsifiers are those of the library presets (``Compression.<preset>(density).sparsifier``):

    topk_exact        TopK (topka, topk_dsa, gtopk, spardl): exact deterministic top-k, every step
    threshold_reuse   ThresholdReuse (oktopk): a *reuse* step -- step 1, after the exact re-evaluation of
                      step 0 (threshold_period 32): the guard's count pass(es) and one thresholding pass
    gaussiank         GaussianK (gaussiank): mean/std fit, adjustment loop, one thresholding pass
    exdyna            ExDyna (exdyna): step 1, after the first step (which sets tau0 with one top-k)
    dct               DCT (dct): step 1, a non-recompute step (lifespan 1000), per-tensor thresholds
                      over the buffer's layer layout
    torch.topk        ``torch.topk(buf.abs(), k)``: the exact selection most codes use
    stream            ``torch.amax(buf)``: one read pass over the buffer, the memory-bandwidth floor

Set-up steps (threshold re-evaluation, tau0) run once and are not timed; every timed call starts from a
copy of the same post-set-up state, so all repetitions do the same work. Each method is called once as a
warm-up, then timed in ``--repeat`` rounds, each round timing every method once (round-robin, so a change
of machine load during the run -- minutes on a shared machine -- affects all methods alike); the median is
reported. Wall-clock seconds: they depend on the machine and its load (the JSON records torch's thread
count).

On a CPU buffer, threshold_reuse, gaussiank and exdyna threshold with the fused select-and-compact kernel
(``hvd_sparse.core.native``) unless ``HVD_SPARSE_NATIVE=0``: each row records ``native`` (the kernel ran
during the timed calls) and the report records ``native_kernel`` (build flags, SIMD path, kernel threads).
The warm-up call also pays the kernel's one-time build (cached on disk afterwards).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import time

#: the methods, in report order
METHODS = ("topk_exact", "threshold_reuse", "gaussiank", "exdyna", "dct", "torch.topk", "stream")

#: sparsifier methods -> (preset whose sparsifier is timed, set-up steps before the timed step)
SPARSIFIERS = {
    "topk_exact": ("topka", 0),
    "threshold_reuse": ("oktopk", 1),
    "gaussiank": ("gaussiank", 0),
    "exdyna": ("exdyna", 1),
    "dct": ("dct", 1),
}


def time_one(make_call, sync=None):
    """Seconds of one call of ``make_call()``'s result (its set-up, e.g. copying the state, is not timed); ``sync``
    (``torch.cuda.synchronize`` on a GPU) runs before the clock starts and before it stops."""
    call = make_call()
    if sync:
        sync()
    t0 = time.perf_counter()
    call()
    if sync:
        sync()
    return time.perf_counter() - t0


def sparsifier_call(name, buf, k, density, layout):
    """``make_call`` for sparsifier method ``name``: runs the set-up steps once, then returns a factory of
    zero-argument calls of the timed step's ``select`` (each on a fresh copy of the post-set-up state).

    Also returns ``check(state)``, which raises unless the timed step was the intended one (a reuse step).
    """
    from ..compression import Compression
    from ..core.context import StepContext
    from ..core.sim import SimulatedWorld
    from ..core.sparsifiers.base import fit_selection
    from ..core.xp import backend_of

    preset, setup = SPARSIFIERS[name]
    sp = getattr(Compression, preset)(density).sparsifier
    xp = backend_of(buf)
    comm = SimulatedWorld(1).communicators()[0]

    def ctx(t):
        return StepContext(0, 1, t, tuple(layout), comm, bool(sp.exact_k))

    if name == "threshold_reuse" and setup % sp.threshold_period == 0:   # pragma: no cover - config guard
        raise RuntimeError("select: the timed ThresholdReuse step would be a re-evaluation step")
    state = sp.initial_state()
    n = xp.numel(buf)
    for t in range(setup):              # as the engine steps it: its count and note back to update, on the host
        _, count, note = fit_selection(xp, sp.select(xp, buf, k, state, ctx(t)), n, sp.capacity(k, n), buf)
        sp.update(xp, state, {}, dataclasses.replace(ctx(t), selected=int(xp.item(count)), note=int(xp.item(note))))
    out = {}

    def make_call():
        st = copy.deepcopy(state)

        def call():
            out["idx"] = sp.select(xp, buf, k, st, ctx(setup))
            out["state"] = st
        return call

    def check():
        st = out["state"]
        if name == "threshold_reuse" and st.get("reeval"):
            raise RuntimeError("select: threshold_reuse re-evaluated on the timed step")
        if name == "dct" and st.get("recomputed"):
            raise RuntimeError("select: dct recomputed its thresholds on the timed step")
        return int(xp.item(fit_selection(xp, out["idx"], n, sp.capacity(k, n), buf)[1]))

    return make_call, check


def run(n, density, repeat, seed=0, verbose=True, device="cpu"):
    import torch

    from ..core import native
    from .data import SyntheticGradients

    def say(msg, end="\n"):
        if verbose:
            print(msg, end=end, file=sys.stderr, flush=True)

    say(f"  building a gradient-like buffer of {n:,} values ...")
    data = SyntheticGradients(n, 1, seed=seed)
    buf = torch.from_numpy(data.grad(0, 0)).to(device)
    sync = torch.cuda.synchronize if buf.is_cuda else None
    layout = list(data.layout)
    del data                                       # the generator's noise pool is 8n floats
    k = max(1, int(density * n))
    calls = {}
    for method in METHODS:                         # set-up and one warm-up call each
        say(f"\r  set-up {method:<16}", end="")
        if method in SPARSIFIERS:
            make_call, check = sparsifier_call(method, buf, k, density, layout)
        elif method == "torch.topk":
            make_call, check = (lambda: lambda: torch.topk(buf.abs(), k)), (lambda: k)
        else:
            make_call, check = (lambda: lambda: torch.amax(buf)), (lambda: None)
        make_call()()
        calls[method] = (make_call, check)
    secs = {m: [] for m in METHODS}
    used = set()
    t0 = time.perf_counter()
    for rnd in range(repeat):                      # round-robin: load drift hits every method alike
        say(f"\r  round {rnd + 1}/{repeat} ({time.perf_counter() - t0:.0f} s)      ", end="")
        for method in METHODS:
            c0 = native.calls()
            secs[method].append(time_one(calls[method][0], sync))
            if native.calls() > c0:
                used.add(method)
    say("")
    results = []
    for method in METHODS:
        med = statistics.median(secs[method])
        say(f"  {method:<16} median {med:.4f} s" + ("  [native kernel]" if method in used else ""))
        results.append({"method": method, "seconds_median": med, "seconds": secs[method],
                        "selected": calls[method][1](), "native": method in used})
    kinfo = native.info()
    return {"numel": n, "density": density, "k": k, "threads": torch.get_num_threads(), "repeat": repeat,
            "device": device_name(buf),
            "native_kernel": {"enabled": kinfo["enabled"], "flags": kinfo["flags"], "simd": kinfo["simd"],
                              "threads": native.threads_for(n), "reason": kinfo["reason"]},
            "results": results}


def device_name(buf):
    """``"cpu"``, or the GPU's name with torch's and CUDA's versions (the report names the card it ran on)."""
    import torch

    if not buf.is_cuda:
        return "cpu"
    return f"{torch.cuda.get_device_name(buf.device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def markdown(report):
    rows = {r["method"]: r["seconds_median"] for r in report["results"]}
    stream, topk = rows.get("stream"), rows.get("torch.topk")
    nk = (report.get("native_kernel") or {}) if report.get("device", "cpu") == "cpu" else {}   # CPU buffers only
    kernel = (f"fused kernel: {nk['simd']}, {nk['threads']} thread(s)" if nk.get("enabled")
              else f"fused kernel off ({nk.get('reason')})" if nk else "")
    lines = [f"Selection on one rank: n = {report['numel']:,}, k = {report['k']:,} (density {report['density']}), "
             + (f"float32 torch CPU, {report['threads']} threads" if report.get("device", "cpu") == "cpu"
                else f"float32 on {report['device']}") + f", median of {report['repeat']}"
             + (f"; {kernel}" if kernel else "") + ".", "",
             "| method | seconds (median) | x stream | torch.topk / method | native |",
             "|---|---:|---:|---:|:---:|"]
    for r in report["results"]:
        s = r["seconds_median"]
        xs = f"{s / stream:.1f}" if stream else ""
        sp = f"{topk / s:.2f}" if topk and s > 0 else ""
        lines.append(f"| {r['method']} | {s:.4f} | {xs} | {sp} | {'yes' if r.get('native') else ''} |")
    return "\n".join(lines)


def plot(report, path):
    """PNG: one bar per method, its median seconds per selection (log axis)."""
    from . import cli

    res = report["results"]
    secs = [r["seconds_median"] for r in res]
    fig, ax, _ = cli.bar_chart([r["method"] for r in res], secs, METHODS, [f" {s:.3g} s" for s in secs])
    ax.set_xscale("log")
    ax.set_xlim(min(secs) / 2, max(secs) * 4)
    cli.finish_chart(fig, ax, "seconds per selection (median, log scale)",
                     f"Selection, n = {report['numel']:,}, k = {report['k']:,}, {report['threads']} threads", path)


def add_arguments(p):
    from . import cli

    p.add_argument("--numel", type=cli.positive_int, default=25_000_000,
                   help="buffer size n (default: 25,000,000)")
    p.add_argument("--density", type=cli.density, default=0.01, help="k / n (default: 0.01)")
    p.add_argument("--repeat", type=cli.positive_int, default=5,
                   help="timed calls per method after one warm-up; the median is reported (default: 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="save a PNG bar chart of the medians (log axis)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--device", default="cpu", help="torch device of the buffer, e.g. cuda (default: cpu)")


def main(args):
    from . import cli

    report = run(args.numel, args.density, args.repeat, seed=args.seed, verbose=not args.quiet, device=args.device)
    cli.write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    print(markdown(report))
    return 0
