"""``python -m hvd_sparse.bench``: benchmarks that write JSON and print a Markdown table.

    python -m hvd_sparse.bench volume --workers 256 --numel 1000000 --density 0.01 --steps 10 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

from . import presets


def _algorithms(text):
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in presets.names()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {', '.join(unknown)}; "
                                         f"choose from {', '.join(presets.names())}")
    return names


def _positive_int(text):
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _density(text):
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
    return v


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hvd_sparse.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("volume", help="words received per rank per step, every reducer, simulated ranks")
    v.add_argument("--workers", type=_positive_int, required=True, help="number of (simulated) ranks P")
    v.add_argument("--numel", type=_positive_int, default=1_000_000,
                   help="gradient size n for synthetic data (recorded data uses the digits CNN's n)")
    v.add_argument("--density", type=_density, default=0.01, help="k / n (default: 0.01)")
    v.add_argument("--steps", type=_positive_int, default=10, help="steps per algorithm (default: 10)")
    v.add_argument("--algorithms", type=_algorithms, default=None,
                   help=f"comma-separated subset (default: all of {','.join(presets.names())})")
    v.add_argument("--data", choices=["synthetic", "recorded"], default="synthetic")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--json", metavar="FILE", help="write the report as JSON")
    v.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "volume":
        from . import data, volume

        if args.data == "synthetic":
            src = data.SyntheticGradients(args.numel, args.workers, seed=args.seed)
        else:
            src = data.RecordedGradients(args.workers, args.steps, seed=args.seed)
        report = volume.run(args.algorithms or presets.names(), src, args.workers, args.steps, args.density,
                            verbose=not args.quiet)
        report["data"] = args.data
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        print(volume.markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
