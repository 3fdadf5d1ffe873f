"""Achieved density over a real training run: does each preset send what it was asked for while the model learns?

    python -m hvd_sparse.bench density --workers 4 --steps 200 --density 0.01 --json density.json

P virtual ranks of the in-process simulator (:class:`hvd_sparse.core.sim.SimulatedWorld`) train the digits CNN
(:class:`hvd_sparse.bench.digits_torch.WideNet` at 8x8 and ``--hidden`` units: 283,786 parameters at the default
256) as ``horovodrun`` ranks would: each rank its own replica and its own batches of 32, its gradient through the
preset's engine, the averaged update into SGD (momentum 0.9, learning rate 0.05). Every preset starts from the same
weights and sees the same batches. Gradients shrink and error feedback grows as the model learns, so a threshold
set on one step can pass many more (or fewer) entries some steps later: synthetic data of constant statistics
(``bench volume``) does not show it.

Reported per preset, over the steps from ``--skip`` on (the first steps set the thresholds):
    density_ratio          achieved density / asked, mean over those steps: a rank's selected entries / n, averaged
                           over the ranks; for a partitioned preset (ExDyna: the ranks' selections are disjoint
                           parts of one global selection of about k) their sum
    density_ratio_min/max  the same per step, its least and its most
    recv_words_per_k       words received per rank per step / k (the volume meter's count, padding included),
                           mean over the ranks; recv_words_max_per_k: the busiest rank's (gTop-k's tree: the root)
    readme_words_per_k     what the presets' table (docs/reference.md) says a rank receives, / k (None: a range)
    applied_per_k          entries the step's averaged update changes (its nonzeros, the same on every rank) / k,
                           mean over the steps: TopkA applies the union of the ranks' selections (up to Pk),
                           Ok-Topk the largest of their sum (at most k), ExDyna the ranks' disjoint parts (about k)
    final_loss             the training loss of the last step (mean over the ranks)

Cost: mostly the engines' steps; docs/benchmarks.md ("While the model trains") has the measured seconds per
preset.
"""

from __future__ import annotations

import math
import time

import numpy as np

#: docs/reference.md's "words received per rank per step" of each preset, in units of k (n >> k; None: a range or none)
README_WORDS = {
    "topka": lambda P: 2 * (P - 1), "gaussiank": lambda P: 4 * (P - 1), "dct": lambda P: 4 * (P - 1),
    "exdyna": lambda P: 6 * (P - 1) / P, "oktopk": lambda P: 6 * (P - 1) / P, "spardl": lambda P: 4 * (P - 1) / P,
    "gtopk": lambda P: 2 * math.ceil(math.log2(P)), "topk_dsa": lambda P: None,
}


def train(compression, workers, steps, hidden=256, seed=0):
    """Train the digits CNN on ``workers`` virtual ranks for ``steps`` steps with ``compression``; per step and rank
    (arrays (steps, workers)): ``selected``, ``recv_words``, ``applied``, ``loss``; and ``n``."""
    import torch
    import torch.nn.functional as F

    from ..core.sim import SimulatedWorld
    from .digits_torch import WideNet, load_data

    (x, y), _ = load_data(seed, image_size=8)
    models = []
    for _ in range(workers):
        torch.manual_seed(seed)
        models.append(WideNet(8, hidden))
    layout = [p.numel() for p in models[0].parameters()]
    world = SimulatedWorld(workers)
    comms = world.communicators()
    record = {f: np.zeros((steps, workers)) for f in ("selected", "recv_words", "applied", "loss")}

    def rank(comm):
        r, model = comm.rank, models[comm.rank]
        engine = compression.new_engine(comm)
        engine.layout = layout
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        batches = torch.Generator().manual_seed(seed * 1000 + r)
        for t in range(steps):
            pick = torch.randint(0, len(x), (32,), generator=batches)
            model.zero_grad()
            loss = F.cross_entropy(model(x[pick]), y[pick])
            loss.backward()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            update = torch.from_numpy(engine.step(grad.numpy()))        # the engine on numpy: its C kernels
            for p, u in zip(model.parameters(), torch.split(update, layout)):
                p.grad.copy_(u.view_as(p))
            opt.step()
            for f, v in (("selected", engine.last["selected"]), ("recv_words", engine.last["recv_words"]),
                         ("applied", int(torch.count_nonzero(update))), ("loss", loss.item())):
                record[f][t, r] = v

    world.run(rank, comms)
    return dict(record, n=sum(layout))


def summarize(name, compression, record, density, skip):
    """The report's row of one preset (see the module docstring)."""
    P = record["selected"].shape[1]
    k = max(1, int(density * record["n"]))
    sel = record["selected"][skip:]
    sparsifier = getattr(compression, "sparsifier", None)
    per_step = (sel.sum(1) if getattr(sparsifier, "partitioned", False) else sel.mean(1)) / k
    words = README_WORDS.get(name, lambda P: None)(P)
    return {"preset": name, "density": density, "k": k, "n": record["n"], "density_ratio": float(per_step.mean()),
            "density_ratio_min": float(per_step.min()), "density_ratio_max": float(per_step.max()),
            "recv_words_per_k": float(record["recv_words"][skip:].mean() / k),
            "recv_words_max_per_k": float(record["recv_words"][skip:].max(1).mean() / k),
            "readme_words_per_k": words, "applied_per_k": float(record["applied"][skip:].mean() / k),
            "final_loss": float(record["loss"][-1].mean())}


def run(names, workers, steps, density, skip, hidden=256, seed=0, progress=None):
    """Every preset of ``names`` trained and summarized: the report's rows."""
    from . import presets

    rows = []
    for name in names:
        started = time.perf_counter()
        compression = presets.make(name, density)
        rows.append(summarize(name, compression, train(compression, workers, steps, hidden, seed), density, skip))
        if progress:
            progress(f"{name}: density x{rows[-1]['density_ratio']:.2f} of asked, "
                     f"{time.perf_counter() - started:.1f} s")
    return rows


def markdown(rows):
    lines = ["| preset | achieved / asked density: mean (min, max per step) | words received / k: mean rank, "
             "busiest | the table's | entries applied / k | final loss |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        readme = "--" if r["readme_words_per_k"] is None else f"{r['readme_words_per_k']:.2f}"
        lines.append(f"| {r['preset']} | {r['density_ratio']:.2f} ({r['density_ratio_min']:.2f}, "
                     f"{r['density_ratio_max']:.2f}) | {r['recv_words_per_k']:.2f}, "
                     f"{r['recv_words_max_per_k']:.2f} | {readme} | {r['applied_per_k']:.2f} | "
                     f"{r['final_loss']:.3f} |")
    return "\n".join(lines)


def add_arguments(p):
    from . import cli

    p.add_argument("--workers", type=cli.positive_int, default=4, help="virtual ranks P (default: 4)")
    p.add_argument("--steps", type=cli.positive_int, default=200, help="training steps (default: 200)")
    p.add_argument("--skip", type=int, default=10, help="steps left out of the means (default: 10)")
    p.add_argument("--density", type=cli.density, default=0.01, help="the density asked of every preset")
    p.add_argument("--hidden", type=cli.positive_int, default=256, help="units of the CNN's dense layer")
    p.add_argument("--algorithms", type=cli.algorithms, default=None,
                   help="comma-separated presets (default: every sparse preset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")


def main(args):
    import sys

    from . import cli, presets

    if not 0 <= args.skip < args.steps:
        raise SystemExit(f"hvd_sparse.bench density: --skip must be in [0, --steps), got {args.skip}")
    names = [a for a in (args.algorithms or presets.names()) if a != "dense"]
    rows = run(names, args.workers, args.steps, args.density, args.skip, args.hidden, args.seed,
               progress=lambda line: print(line, file=sys.stderr, flush=True))
    cli.write_json(args.json, {"workers": args.workers, "steps": args.steps, "skip": args.skip,
                               "density": args.density, "hidden": args.hidden, "seed": args.seed, "presets": rows})
    print(markdown(rows))
    return 0
