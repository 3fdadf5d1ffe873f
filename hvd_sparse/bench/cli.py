"""Argument types and output helpers shared by the benchmark commands."""

from __future__ import annotations

import argparse
import json

from . import presets


def algorithms(text):
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in presets.names()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {', '.join(unknown)}; "
                                         f"choose from {', '.join(presets.names())}")
    return names


def positive_int(text):
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def positive_ints(text):
    """A comma-separated list of positive ints, e.g. ``8,16,32``."""
    return [positive_int(t) for t in text.split(",") if t.strip()]


def density(text):
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
    return v


def write_json(path, report):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
