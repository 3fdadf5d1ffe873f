"""``python -m hvd_sparse.bench <command>``: benchmarks that write JSON (``--json``), print a Markdown table
and, where it applies, save a PNG plot (``--plot``).

    python -m hvd_sparse.bench volume --workers 256 --numel 1000000 --density 0.01 --steps 6 --json out.json

Each command lives in its own module of ``hvd_sparse.bench`` with ``add_arguments(parser)`` and
``main(args) -> int``; ``COMMANDS`` lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: command name -> (module of hvd_sparse.bench, one-line help)
COMMANDS = {
    "volume": ("volume", "words received per rank per step, every reducer, simulated ranks"),
    "select": ("select", "seconds of each sparsifier's selection vs torch.topk and one streaming pass"),
    "convergence": ("convergence", "train the digits CNN with each algorithm under horovodrun"),
    "network": ("network", "seconds per step of P Horovod workers on a tc-shaped network (root)"),
    "train": ("train", "time to accuracy of real training vs Horovod, DDP, PowerSGD on a tc-shaped network (root)"),
    "engine": ("engine", "one rank's engine step per preset (P = 1), CPU or GPU: wall, GPU kernel time, syncs"),
    "trainstep": ("trainstep", "training step of a 25M MLP under horovodrun: compute only, Horovod dense, presets"),
    "latency": ("latency", "one small Horovod collective's latency by ranks, cycle time and wait mode"),
    "advise": ("advise", "under horovodrun: your model's step with Horovod dense, fp16 and presets, a verdict"),
    "density": ("density", "achieved density and words per step of each preset over a real training run, simulated"),
    "timeline": ("timeline", "per collective of a HOROVOD_TIMELINE: calls negotiated in full vs served by the cache"),
    "regimes": ("regimes", "threshold presets through gradients that strain a capacity, against TopkA, simulated"),
}


def _load(name):
    try:
        return importlib.import_module(f"hvd_sparse.bench.{COMMANDS[name][0]}")
    except ModuleNotFoundError as e:
        if e.name == f"hvd_sparse.bench.{COMMANDS[name][0]}":
            return None
        raise


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hvd_sparse.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, (_, helptext) in COMMANDS.items():
        mod = _load(name)
        if mod is not None:
            mod.add_arguments(sub.add_parser(name, help=helptext, description=helptext))
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    return _load(args.command).main(args)


if __name__ == "__main__":
    sys.exit(main())
