"""Gradients that strain a threshold preset's capacity, and what each preset sends through them, against TopkA.

    python -m hvd_sparse.bench regimes --workers 2 --density 0.01 --json regimes.json

A threshold preset sends what passes its threshold, in a capacity (docs/algorithms.md#the-wire). When its threshold
lags the gradients (their scale jumped, or it decayed over all-zero steps), or its estimate misses them (a mean far
from zero, heavy tails), more pass than fit, or fewer than k: the capacity keeps the largest, and the preset's
controller should bring the threshold to the new scale within a few steps. An entry that never fits would grow in
the residual without bound, which no sum of masses shows (error feedback conserves it) but training would.

Each regime (:data:`REGIMES`) is a gradient ``g(t, rank)`` of n entries with an event at step ``event``. P virtual
ranks of the simulator run each preset on it, and TopkA on the same data; from the event on:

    distinct    the entries the update touched at least once (what was sent, in the union)
    residual    the largest residual entry of any rank
    absorbed    where the event moves the gradients' scale: the steps until the preset's threshold stays within 2x
                of the level it ends at (None: it does not settle within the run; TopkA keeps no threshold)

TopkA runs at the preset's density, except against Ok-Topk, which applies at most k entries a step where TopkA's
union holds up to P·k: there TopkA runs at density / P (the same entries per step). ``tests/core/test_regimes.py``
asserts the bounds each preset keeps (:func:`bounds`); docs/algorithms.md ("Capacities") has the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import numpy as np

from ..compression import Compression
from ..testing import simulate


@dataclasses.dataclass(frozen=True)
class Regime:
    """A gradient ``grad(t, rank)`` (float32, ``n`` entries) for ``steps`` steps, hard from step ``event`` on;
    ``moves``: the event moves the gradients' scale, which a threshold must follow (``absorbed`` is reported)."""

    about: str
    n: int
    steps: int
    event: int
    grad: object
    moves: bool = False


def _normal(t, r, n, seed=2):
    return np.random.default_rng([seed, t, r]).standard_normal(n).astype(np.float32)


def _mean_dominated(t, r, n=1000):
    return (-1.0 - 0.1 * np.random.default_rng([1, t, r]).random(n)).astype(np.float32)


def _scale_jump(t, r, n=4096):
    return _normal(t, r, n) * np.float32(64.0 if t >= 30 else 1.0)


def _after_zeros(t, r, n=4096):
    return _normal(t, r, n) * np.float32(0.0 if 1 <= t < 200 else 1.0)


def _heavy_tail(t, r, n=4096):
    g = _normal(t, r, n)
    g[np.random.default_rng([3, t, r]).integers(0, n, 5)] *= 1e4
    return g


def _dominant_layer(t, r, n=4096):
    g = _normal(t, r, n)
    g[:512] *= 1000.0
    return g


def _sign_flip(t, r, n=4096):
    return (np.abs(_normal(0, r, n)) + np.float32(0.1)) * np.float32(1 if t % 2 else -1)


#: the regimes: name -> Regime
REGIMES = {
    "mean_dominated": Regime("every entry near -1 (mu + z·sigma < 0: every entry passes any threshold)",
                             1000, 60, 0, _mean_dominated),
    "scale_jump": Regime("N(0, 1), then x64 from step 30", 4096, 80, 30, _scale_jump, moves=True),
    "after_zeros": Regime("N(0, 1) at step 0, all zero for 199 steps, N(0, 1) again", 4096, 260, 200,
                          _after_zeros, moves=True),
    "heavy_tail": Regime("N(0, 1) with 5 entries a rank and step x10^4", 4096, 60, 0, _heavy_tail),
    "dominant_layer": Regime("N(0, 1), the first 512 entries x1000", 4096, 60, 0, _dominant_layer),
    "sign_flip": Regime("one gradient per rank, its sign flipped every step", 4096, 60, 0, _sign_flip),
}

#: the threshold presets: name -> (preset for a density, its threshold in a rank's sparsifier state)
PRESETS = {
    "gaussiank": (lambda d: Compression.gaussiank(d), lambda s: s["threshold"]),
    "dct": (lambda d: Compression.dct(d), lambda s: float(np.mean(s["tau"]))),
    "dct_paper": (lambda d: Compression.dct(d, drift=None), lambda s: float(np.mean(s["tau"]))),
    "exdyna": (lambda d: Compression.exdyna(d), lambda s: s["tau"]),
    "exdyna_reference": (lambda d: Compression.exdyna(d, threshold_rule="reference"), lambda s: s["tau"]),
    "oktopk": (lambda d: Compression.oktopk(d), lambda s: s["threshold"]),
}
#: presets whose global count is at most k (TopkA's union holds up to P·k): compared with TopkA at density / P
AT_MOST_K = ("oktopk",)


def run(compression, regime, workers, threshold=None):
    """``{"distinct", "residual", "absorbed"}`` of ``compression`` on ``regime`` (module docstring); ``threshold``:
    how to read its threshold from rank 0's sparsifier state (None, or a regime that moves no scale: no
    ``absorbed``)."""
    threshold = threshold if regime.moves else None
    record = ("updates", "residuals") + (("states",) if threshold else ())
    res = simulate(compression, regime.grad, steps=regime.steps, size=workers, record=record)
    after = slice(regime.event, regime.steps)
    out = {"distinct": int((res.updates[after, 0] != 0).any(axis=0).sum()),
           "residual": float(np.abs(res.residuals[after]).max()), "absorbed": None}
    if threshold:
        out["absorbed"] = settled([threshold(res.sparsifier_states[t][0]) for t in range(regime.event, regime.steps)])
    return out


def settled(ths, within=2.0, last=5):
    """The first position from which ``ths`` stays within a factor ``within`` of the mean of its ``last`` values,
    or None (it never does before its end)."""
    level = float(np.mean(ths[-last:]))
    if not level > 0:
        return None
    ok = [t > 0 and abs(math.log(t / level)) < math.log(within) for t in ths]
    for i in range(len(ok) - last):
        if all(ok[i:]):
            return i
    return None


def compare(preset, regime_name, workers=2, density=0.01):
    """One row: ``preset`` on the regime, and TopkA on the same data at the density it is compared at."""
    regime = REGIMES[regime_name]
    make, threshold = PRESETS[preset]
    mine = run(make(density), regime, workers, threshold)
    ref = run(Compression.topka(density / workers if preset in AT_MOST_K else density), regime, workers)
    return {"regime": regime_name, "preset": preset, **mine,
            "topka_distinct": ref["distinct"], "topka_residual": ref["residual"]}


def bounds(row, workers):
    """What a preset keeps on a regime (``row`` of :func:`compare`): ``{"distinct": ok, "residual": ok}`` -- at
    least half of TopkA's distinct entries, and a largest residual entry within 3x TopkA's, with two exceptions of
    the algorithms' own making:

    * ExDyna's ranks select only in their own partitions, which rotate every step, so an entry of a rank's gradient
      that lies in another partition waits up to P - 1 steps: its largest residual may reach 3x (P - 1) of the
      regime's largest gradient entry (a huge entry of one step waits there, where TopkA sends it at once);
    * Ok-Topk clears in each rank's residual only what that rank selected and G kept (I = S ∩ G, the paper's
      Algorithm 2), and G favours the entries several ranks selected, so where more than k entries compete step
      after step (a dominant layer) what one rank alone selected waits longer: within 4x TopkA's at the same count
      (it stays there: a plateau, not a growth)."""
    limit = (4 if row["preset"] in AT_MOST_K else 3) * row["topka_residual"]
    if row["preset"].startswith("exdyna"):
        limit = max(limit, 3 * (workers - 1) * largest_entry(REGIMES[row["regime"]], workers))
    return {"distinct": row["distinct"] >= 0.5 * row["topka_distinct"], "residual": row["residual"] <= limit}


def largest_entry(regime, workers):
    """The largest gradient entry of the regime from its event on, over the ranks."""
    return max(float(np.abs(regime.grad(t, r)).max()) for t in range(regime.event, regime.steps)
               for r in range(workers))


# -- the command ------------------------------------------------------------------------------------------------
def _names(known):
    """An argparse type: comma-separated names of ``known``; an unknown one is an argparse error."""
    def parse(text):
        names = [a.strip() for a in text.split(",") if a.strip()]
        unknown = [a for a in names if a not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
        return names
    return parse


def add_arguments(p):
    from .cli import density, positive_int
    p.add_argument("--workers", type=positive_int, default=2, help="simulated ranks P (default 2)")
    p.add_argument("--density", type=density, default=0.01, help="density (default 0.01)")
    p.add_argument("--regimes", type=_names(list(REGIMES)), default=list(REGIMES), help="comma list (default all)")
    p.add_argument("--presets", type=_names(list(PRESETS)), default=list(PRESETS), help="comma list (default all)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def main(args):
    import json
    start, rows = time.time(), []
    for name in args.regimes:
        for preset in args.presets:
            row = compare(preset, name, args.workers, args.density)
            row["within_bounds"] = all(bounds(row, args.workers).values())
            rows.append(row)
    print(markdown(rows, args.workers, args.density))
    print(f"({time.time() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": args.workers, "density": args.density, "rows": rows}, f, indent=1)
    return 0


def markdown(rows, workers, density):
    lines = [f"Threshold presets through hard regimes, P = {workers}, density {density} (TopkA: on the same data; "
             "at density / P against Ok-Topk)", "",
             "| regime | preset | distinct sent | TopkA's | largest residual | TopkA's | steps to settle | bounds |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['regime']} | {r['preset']} | {r['distinct']} | {r['topka_distinct']} | "
                     f"{r['residual']:.3g} | {r['topka_residual']:.3g} | "
                     f"{'-' if r['absorbed'] is None else r['absorbed']} | "
                     f"{'kept' if r['within_bounds'] else 'MISSED'} |")
    return "\n".join(lines)
