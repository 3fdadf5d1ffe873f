"""Volume benchmark: words each rank receives per step, for every reducer, on the same gradients.

Runs every algorithm on P virtual ranks with the in-process simulator (the same engine code as a Horovod
rank) and reads the communicators' volume meters: exact logical counts, independent of the machine.
One word = one value or one index (paper Table 1).

Reported per algorithm:
    recv_words_max         max over steps and ranks
    recv_words_mean        mean over steps and ranks
    recv_words_max_steady  max over the steps on which the algorithm neither re-evaluates thresholds periodically
                           nor repartitions (== recv_words_max for algorithms without such steps; Ok-Topk's
                           library preset re-evaluates its global threshold on every step: those count)
    recv_words_mean_steady mean over those steps (and ranks)
    steady_over_bound      the steady steps whose busiest rank received more than Table 1's worst case
    steady_max_phases      the phases (words) of the busiest rank on the step of the steady maximum
    phase_share            per phase: its words in that maximum / the maximum
    phase_steps            per phase: on how many steady steps some rank received words in it (how often a
                           collective that runs only on some steps, such as Ok-Topk's ``refine``, ran)
    density_mean           achieved density: selected entries / n, mean over steps (and ranks; for
                           partitioned sparsifiers such as ExDyna the ranks' selections add up)

``--oktopk-boundaries periodic,result,load`` runs Ok-Topk once per region-boundary policy (reported as
``oktopk[periodic]`` ...). ``--numel`` and ``--density`` take one value, or one per P (e.g. a larger density at
P = 1024 keeps k/P >= 10 with a smaller n). The report gives the process's peak resident memory.

``--workers 8,16,32`` runs every P on the same gradients (rank r sees the same data whatever P) and writes
``{"numel", "density", "steps", "data", "runs": [<one report per P>]}``; one P writes that report itself.
``--plot FILE`` saves a PNG: recv_words_max_steady vs P (log-log, Table 1 dashed) for a list of P, a bar chart
per algorithm for one P.
"""

from __future__ import annotations

import resource
import sys
import time

import numpy as np

from ..core.sim import SimulatedWorld
from .presets import make

#: Table 1 of Li & Hoefler (n >> k), bandwidth term in words per rank: (best, worst) as functions of n, k, P.
TABLE1 = {
    "dense": lambda n, k, P: (2 * n * (P - 1) / P,) * 2,
    "topka": lambda n, k, P: (2 * k * (P - 1),) * 2,
    "gaussiank": lambda n, k, P: (2 * k * (P - 1),) * 2,
    "topk_dsa": lambda n, k, P: (4 * k * (P - 1) / P, (2 * k + n) * (P - 1) / P),
    "gtopk": lambda n, k, P: (4 * k * np.ceil(np.log2(P)),) * 2,
    "oktopk": lambda n, k, P: (2 * k * (P - 1) / P, 6 * k * (P - 1) / P),
}


def make_algorithm(algorithm, density):
    """``make`` for a preset name, or ``oktopk[<boundaries>]`` for Ok-Topk with that boundary policy."""
    if algorithm.startswith("oktopk[") and algorithm.endswith("]"):
        from ..compression import Compression
        return Compression.oktopk(density, boundaries=algorithm[len("oktopk["):-1])
    return make(algorithm, density)


def peak_memory_mb():
    """Peak resident memory of this process so far, in MB (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def engines_of(comp, workers, local_size):
    """``(world, comms, engines)`` of P simulated ranks: flat, or two levels of ``local_size`` ranks a host
    (``TwoLevelEngine``: its ``topology`` holds the communicators inside and between the hosts, whose meters count
    apart)."""
    world = SimulatedWorld(workers)
    comms = world.communicators()
    if not local_size or local_size == 1 or comp.hierarchical is False:
        return world, comms, [comp.new_engine(c) for c in comms]
    from ..core.hierarchy import Topology, TwoLevelEngine

    tops = [Topology(*pair) for pair in world.two_levels(local_size)]
    return world, comms, [TwoLevelEngine(comp, t) for t in tops]


def run_one(algorithm, data, workers, steps, density, progress=None, local_size=None):
    comp = make_algorithm(algorithm, density)
    world, comms, engines = engines_of(comp, workers, local_size)
    for e in engines:
        e.layout = list(data.layout)
    inside = np.zeros((steps, workers), np.int64)
    recv = np.zeros((steps, workers), np.int64)
    selected = np.zeros((steps, workers), np.int64)
    special = np.zeros(steps, bool)
    phases = [[None] * workers for _ in range(steps)]
    # a periodic exact re-evaluation is special; one on every step is the steady state (Ok-Topk's library preset)
    periodic = getattr(comp.reducer, "threshold_period", None) != 1

    def body(comm):
        r = comm.rank
        eng = engines[r]
        for t in range(steps):
            g = np.array(data.grad(t, r), np.float32)       # a private copy: the step writes its result into it
            eng.step(g, out=[g])                             # (no n-sized output per rank: P = 1024 fits)
            del g
            across = eng.last.get("across")                 # two levels: the words between the hosts
            recv[t, r] = eng.last["recv_words"] if across is None else across["recv_words"]
            inside[t, r] = 0 if across is None else eng.last["inside"]["recv_words"]
            meter = comm.meter if across is None else eng.topology.cross.meter
            phases[t][r] = dict(meter.recv_words)
            selected[t, r] = eng.last["selected"]
            if r == 0:
                info = eng.last["info"]
                special[t] = bool(info.get("reeval") and periodic or info.get("repartition"))
                if progress:
                    progress(t + 1)

    world.run(body, comms)
    n = data.n
    mask = ~special if (~special).any() else np.ones(steps, bool)
    steady = recv[mask]
    t_max, r_max = np.unravel_index(np.argmax(np.where(mask[:, None], recv, -1)), recv.shape)
    k = max(1, int(density * data.n))
    base = algorithm.split("[")[0]
    L = local_size if hasattr(engines[0], "topology") else 1
    # two levels: the preset over N = P / L ranks on a shard of n / L at the same density
    bound = TABLE1[base](n / L, k / L, workers // L)[1] if base in TABLE1 else None
    top = phases[t_max][r_max]
    total = max(1, sum(top.values()))
    partitioned = getattr(comp.sparsifier, "partitioned", False)
    dens = selected.sum(axis=1) / n if partitioned else selected.mean(axis=1) / (n / L)     # two levels: of a shard
    phase_steps = {}
    for t in np.flatnonzero(mask):
        for p in dict.fromkeys(q for d in phases[t] for q, w in d.items() if w):
            phase_steps[p] = phase_steps.get(p, 0) + 1
    return {
        "algorithm": algorithm,
        "recv_words_max": int(recv.max()),
        "recv_words_mean": float(recv.mean()),
        "recv_words_max_steady": int(steady.max()),
        "density_mean": float(dens.mean()),
        "recv_words_mean_steady": float(steady.mean()),
        "local_size": L,
        "inside_recv_words_mean": float(inside.mean()),
        "steady_steps": int((~special).sum()),
        "steady_over_bound": None if bound is None else
        [int(t) for t in np.flatnonzero(mask & (recv.max(axis=1) > bound))],
        # where the steady maximum comes from: words received per phase by that rank on that step
        "steady_max_phases": {"step": int(t_max), "rank": int(r_max), **top},
        "phase_share": {p: round(w / total, 4) for p, w in top.items()},
        "phase_steps": phase_steps,
    }


def run(algorithms, data, workers, steps, density, verbose=True, local_size=None):
    k = max(1, int(density * data.n))
    results = []
    for alg in algorithms:
        t0 = time.perf_counter()

        def progress(t, alg=alg):
            if verbose:
                print(f"\r  {alg:<10} step {t}/{steps}  ({time.perf_counter() - t0:.0f} s)", end="",
                      file=sys.stderr, flush=True)

        res = run_one(alg, data, workers, steps, density, progress, local_size)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        if verbose:
            print(file=sys.stderr)
        results.append(res)
    return {"workers": workers, "numel": data.n, "k": k, "density": density, "steps": steps,
            "results": results, "peak_memory_mb": peak_memory_mb()}


def markdown(report):
    n, k, P = report["numel"], report["k"], report["workers"]
    unit = k * (P - 1) / P if P > 1 else 1.0
    L = max((r.get("local_size", 1) for r in report["results"]), default=1)     # dense runs flat: L = 1
    where = "" if L == 1 else (f"; two levels, {L} ranks a host: the words between the hosts (Table 1: the preset "
                               f"over {P // L} ranks on a shard of n/{L})")
    lines = [f"Words received per rank per step: P = {P}, n = {n:,}, k = {k:,} "
             f"(density {report['density']}), {report['steps']} steps; u = k(P-1)/P = {unit:,.0f}; "
             f"peak memory {report.get('peak_memory_mb', 0):,.0f} MB{where}.", "",
             "| algorithm | recv words max | recv words mean | max, steady steps | steady max / k "
             "| Table 1 (best .. worst) | density | steady max / u | steady mean / u | phases of the steady max "
             "| steady steps over Table 1 |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    for r in sorted(report["results"], key=lambda r: r["recv_words_max_steady"]):
        t1 = TABLE1.get(r["algorithm"].split("[")[0])
        Lr = r.get("local_size", 1)
        ref = "" if t1 is None else " .. ".join(f"{v:,.0f}" for v in sorted(set(t1(n / Lr, k / Lr, P // Lr))))
        lines.append(f"| {r['algorithm']} | {r['recv_words_max']:,} | {r['recv_words_mean']:,.0f} | "
                     f"{r['recv_words_max_steady']:,} | {r['recv_words_max_steady'] / k:.2f} | {ref} | "
                     f"{r['density_mean']:.4f} | {r['recv_words_max_steady'] / unit:.2f} | "
                     f"{r['recv_words_mean_steady'] / unit:.2f} | "
                     + ", ".join(f"{p} {v:.0%}" for p, v in r["phase_share"].items() if v) + " | "
                     + ("" if r["steady_over_bound"] is None else str(len(r["steady_over_bound"]))) + " |")
    return "\n".join(lines)


def _table1_curve(alg, n, k, Ps):
    """Table 1's (best, worst) words for ``alg`` at each P of ``Ps``, or None when Table 1 has no formula."""
    f = TABLE1.get(alg)
    if f is None:
        return None
    vals = np.array([f(n, k, P) for P in Ps], dtype=float)
    return vals[:, 0], vals[:, 1]


def plot_scaling(reports, path):
    """PNG: recv_words_max_steady vs P, log-log, one line per algorithm; Table 1 dashed in the same color."""
    from . import cli, presets

    plt = cli.pyplot()
    reports = sorted(reports, key=lambda r: r["workers"])
    Ps = np.array([r["workers"] for r in reports])
    n, k = reports[0]["numel"], reports[0]["k"]
    algs = [r["algorithm"] for r in reports[0]["results"]]
    order = presets.names()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    grid = np.unique(np.round(np.geomspace(Ps.min(), Ps.max(), 200)).astype(int)) if len(Ps) > 1 else Ps
    for alg in algs:
        color = cli.color_of(alg, order)
        y = np.array([next((x["recv_words_max_steady"] for x in r["results"] if x["algorithm"] == alg), np.nan)
                      for r in reports], dtype=float)
        ok = y > 0                                    # log axes: P = 1 receives nothing
        ax.plot(Ps[ok], y[ok], "o-", color=color, label=alg)
        curve = _table1_curve(alg, n, k, grid)
        if curve is not None:
            best, worst = curve
            for c in ((best,) if np.allclose(best, worst) else (best, worst)):
                m = c > 0
                ax.plot(grid[m], c[m], "--", color=color, alpha=0.7, linewidth=1)
    ax.plot([], [], "--", color="grey", label="Table 1 (best, worst)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(Ps, [str(P) for P in Ps])
    ax.minorticks_off()
    ax.set_xlabel("P (ranks)")
    ax.set_ylabel("words received per rank per step (max, steady steps)")
    ax.set_title(f"n = {n:,}, k = {k:,}, {reports[0]['steps']} steps, {reports[0].get('data', 'synthetic')} data",
                 fontsize=10)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    cli.save_png(fig, path)


def plot_bars(report, path):
    """PNG for one P: a horizontal bar per algorithm of recv_words_max_steady (log axis), Table 1's best
    and worst as black ticks."""
    from . import cli, presets

    plt = cli.pyplot()
    n, k, P = report["numel"], report["k"], report["workers"]
    res = sorted(report["results"], key=lambda r: r["recv_words_max_steady"])
    names = [r["algorithm"] for r in res]
    vals = np.array([r["recv_words_max_steady"] for r in res], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(res) + 1.6))
    y = np.arange(len(res))
    ax.barh(y, np.where(vals > 0, vals, np.nan), color=[cli.color_of(a, presets.names()) for a in names])
    labelled = False
    for yi, alg in zip(y, names):
        curve = _table1_curve(alg, n, k, [P])
        if curve is not None:
            pts = [v for v in {float(curve[0][0]), float(curve[1][0])} if v > 0]
            ax.plot(pts, [yi] * len(pts), "|", color="black", markersize=14,
                    label=None if labelled else "Table 1 (best, worst)")
            labelled = labelled or bool(pts)
    ax.set_yticks(y, names)
    if (vals > 0).any():                              # P = 1: nothing is received, keep a linear axis
        ax.set_xscale("log")
    ax.set_xlabel("words received per rank per step (max, steady steps; log scale)")
    ax.set_title(f"P = {P}, n = {n:,}, k = {k:,}, {report['steps']} steps", fontsize=10)
    ax.grid(axis="x", which="both", alpha=0.3)
    if labelled:
        ax.legend(fontsize=8, loc="lower right")
    cli.save_png(fig, path)


def add_arguments(v):
    from . import cli

    v.add_argument("--workers", type=cli.positive_ints, required=True,
                   help="number of (simulated) ranks P, or a comma-separated list (e.g. 8,16,32,64): one run "
                        "per P")
    v.add_argument("--numel", type=_per_p(cli.positive_int), default=[1_000_000],
                   help="gradient size n for synthetic data, or one per P (recorded data uses its model's n)")
    v.add_argument("--density", type=_per_p(cli.density), default=[0.01],
                   help="k / n (default: 0.01), or one per P")
    v.add_argument("--oktopk-boundaries", default=None, metavar="LIST",
                   help="run Ok-Topk once per region-boundary policy (comma-separated: periodic, result, load)")
    v.add_argument("--steps", type=cli.positive_int, default=10, help="steps per algorithm (default: 10)")
    v.add_argument("--algorithms", type=cli.algorithms, default=None,
                   help="comma-separated subset (default: all presets)")
    v.add_argument("--data", choices=["synthetic", "recorded", "recorded-mlp"], default="synthetic",
                   help="synthetic; recorded: the digits CNN (n = 38,282); recorded-mlp: a 448,778-parameter "
                        "MLP trained on digits (regenerated deterministically, see bench/data.py)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--local-size", type=cli.positive_int, default=None,
                   help="two levels: L ranks a host (P / L hosts): the words counted are those between the hosts "
                        "(inside the host apart: inside_recv_words_mean), Table 1 that of the preset over P / L ranks "
                        "on a shard of n / L")
    v.add_argument("--json", metavar="FILE", help="write the report as JSON")
    v.add_argument("--plot", metavar="FILE",
                   help="save a PNG: steady words received per rank vs P (log-log, Table 1 dashed) for a list "
                        "of P; a bar chart per algorithm for one P")
    v.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _per_p(kind):
    def parse(text):
        return [kind(x) for x in text.split(",") if x.strip()]
    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _for_each_p(values, workers, name):
    if len(values) == 1:
        return values * len(workers)
    if len(values) != len(workers):
        raise SystemExit(f"hvd_sparse.bench volume: --{name} needs one value or one per P ({len(workers)}), "
                         f"got {len(values)}")
    return values


def main(args):
    from . import cli, data, presets

    workers = args.workers if isinstance(args.workers, list) else [args.workers]
    if not workers:
        raise SystemExit("hvd_sparse.bench volume: --workers needs at least one P")
    numels = _for_each_p(args.numel, workers, "numel")
    densities = _for_each_p(args.density, workers, "density")
    algorithms = list(args.algorithms or presets.names())
    if args.oktopk_boundaries:
        from ..core.oktopk.exchange import BOUNDARY_POLICIES
        pols = [b.strip() for b in args.oktopk_boundaries.split(",") if b.strip()]
        bad = [b for b in pols if b not in BOUNDARY_POLICIES]
        if bad:
            raise SystemExit(f"hvd_sparse.bench volume: --oktopk-boundaries: unknown {bad}; "
                             f"choose from {BOUNDARY_POLICIES}")
        algorithms = [a for a in algorithms if a != "oktopk"] + [f"oktopk[{b}]" for b in pols]
    shared = {}
    reports = []
    for P, numel, density in zip(workers, numels, densities):
        if len(workers) > 1 and not args.quiet:
            print(f"P = {P}", file=sys.stderr)
        if args.data == "synthetic":
            # grad(t, r) depends on (seed, t, r) only: one generator per n serves every P (the same gradients)
            if numel not in shared:
                shared = {numel: data.SyntheticGradients(numel, max(workers), seed=args.seed)}
            src = shared[numel]
        elif args.data == "recorded":
            src = data.RecordedGradients(P, args.steps, seed=args.seed)
        else:
            src = data.MLPGradients(P, seed=args.seed)
        if args.local_size and P % args.local_size:
            raise SystemExit(f"hvd_sparse.bench volume: --local-size {args.local_size} must divide P = {P}")
        report = run(algorithms, src, P, args.steps, density, verbose=not args.quiet, local_size=args.local_size)
        report["data"] = args.data
        reports.append(report)
    if len(reports) == 1:
        report = reports[0]
        cli.write_json(args.json, report)
        if args.plot:
            plot_bars(report, args.plot)
        print(markdown(report))
        return 0
    cli.write_json(args.json, {"numel": reports[0]["numel"], "density": densities[0], "steps": args.steps,
                               "data": args.data, "runs": reports})
    if args.plot:
        plot_scaling(reports, args.plot)
    print("\n\n".join(markdown(r) for r in reports))
    return 0
