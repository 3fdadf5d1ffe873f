"""Volume benchmark: words each rank receives per step, for every reducer, on the same gradients.

Runs every algorithm on P virtual ranks with the in-process simulator (the same engine code as a Horovod
rank) and reads the communicators' volume meters: exact logical counts, independent of the machine.
One word = one value or one index (paper Table 1).

Reported per algorithm:
    recv_words_max         max over steps and ranks
    recv_words_mean        mean over steps and ranks
    recv_words_max_steady  max over the steps on which the algorithm neither re-evaluates thresholds nor
                           repartitions (== recv_words_max for algorithms without such steps)
    density_mean           achieved density: selected entries / n, mean over steps (and ranks; for
                           partitioned sparsifiers such as ExDyna the ranks' selections add up)
"""

from __future__ import annotations

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


def run_one(algorithm, data, workers, steps, density, progress=None):
    comp = make(algorithm, density)
    world = SimulatedWorld(workers)
    comms = world.communicators()
    engines = [comp.new_engine(c) for c in comms]
    for e in engines:
        e.layout = list(data.layout)
    recv = np.zeros((steps, workers), np.int64)
    selected = np.zeros((steps, workers), np.int64)
    special = np.zeros(steps, bool)
    phases = [[None] * workers for _ in range(steps)]

    def body(comm):
        r = comm.rank
        eng = engines[r]
        for t in range(steps):
            eng.step(data.grad(t, r))
            recv[t, r] = eng.last["recv_words"]
            phases[t][r] = dict(comm.meter.recv_words)
            selected[t, r] = eng.last["selected"]
            if r == 0:
                info = eng.last["info"]
                special[t] = bool(info.get("reeval") or info.get("repartition"))
                if progress:
                    progress(t + 1)

    world.run(body, comms)
    n = data.n
    mask = ~special if (~special).any() else np.ones(steps, bool)
    steady = recv[mask]
    t_max, r_max = np.unravel_index(np.argmax(np.where(mask[:, None], recv, -1)), recv.shape)
    partitioned = getattr(comp.sparsifier, "partitioned", False)
    dens = selected.sum(axis=1) / n if partitioned else selected.mean(axis=1) / n
    return {
        "algorithm": algorithm,
        "recv_words_max": int(recv.max()),
        "recv_words_mean": float(recv.mean()),
        "recv_words_max_steady": int(steady.max()),
        "density_mean": float(dens.mean()),
        "steady_steps": int((~special).sum()),
        # where the steady maximum comes from: words received per phase by that rank on that step
        "steady_max_phases": {"step": int(t_max), "rank": int(r_max), **phases[t_max][r_max]},
    }


def run(algorithms, data, workers, steps, density, verbose=True):
    k = max(1, int(density * data.n))
    results = []
    for alg in algorithms:
        t0 = time.perf_counter()

        def progress(t, alg=alg):
            if verbose:
                print(f"\r  {alg:<10} step {t}/{steps}  ({time.perf_counter() - t0:.0f} s)", end="",
                      file=sys.stderr, flush=True)

        res = run_one(alg, data, workers, steps, density, progress)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        if verbose:
            print(file=sys.stderr)
        results.append(res)
    return {"workers": workers, "numel": data.n, "k": k, "density": density, "steps": steps,
            "results": results}


def markdown(report):
    n, k, P = report["numel"], report["k"], report["workers"]
    lines = [f"Words received per rank per step: P = {P}, n = {n:,}, k = {k:,} "
             f"(density {report['density']}), {report['steps']} steps.", "",
             "| algorithm | recv words max | recv words mean | max, steady steps | steady max / k "
             "| Table 1 (best .. worst) | density |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for r in sorted(report["results"], key=lambda r: r["recv_words_max_steady"]):
        t1 = TABLE1.get(r["algorithm"])
        ref = "" if t1 is None else " .. ".join(f"{v:,.0f}" for v in sorted(set(t1(n, k, P))))
        lines.append(f"| {r['algorithm']} | {r['recv_words_max']:,} | {r['recv_words_mean']:,.0f} | "
                     f"{r['recv_words_max_steady']:,} | {r['recv_words_max_steady'] / k:.2f} | {ref} | "
                     f"{r['density_mean']:.4f} |")
    return "\n".join(lines)


def add_arguments(v):
    from . import cli

    v.add_argument("--workers", type=cli.positive_int, required=True, help="number of (simulated) ranks P")
    v.add_argument("--numel", type=cli.positive_int, default=1_000_000,
                   help="gradient size n for synthetic data (recorded data uses the digits CNN's n)")
    v.add_argument("--density", type=cli.density, default=0.01, help="k / n (default: 0.01)")
    v.add_argument("--steps", type=cli.positive_int, default=10, help="steps per algorithm (default: 10)")
    v.add_argument("--algorithms", type=cli.algorithms, default=None,
                   help="comma-separated subset (default: all presets)")
    v.add_argument("--data", choices=["synthetic", "recorded"], default="synthetic")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--json", metavar="FILE", help="write the report as JSON")
    v.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args):
    from . import cli, data, presets

    if args.data == "synthetic":
        src = data.SyntheticGradients(args.numel, args.workers, seed=args.seed)
    else:
        src = data.RecordedGradients(args.workers, args.steps, seed=args.seed)
    report = run(args.algorithms or presets.names(), src, args.workers, args.steps, args.density,
                 verbose=not args.quiet)
    report["data"] = args.data
    cli.write_json(args.json, report)
    print(markdown(report))
    return 0
