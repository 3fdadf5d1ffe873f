"""Argument types and output helpers shared by the benchmark commands."""

from __future__ import annotations

import argparse
import json

from . import presets


def algorithms(text, extra=()):
    """Comma-separated preset names (plus the names in ``extra``) -> list; unknown names are an argparse error."""
    known = presets.names() + list(extra)
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {', '.join(unknown)}; choose from {', '.join(known)}")
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


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (PNG files, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def color_of(name, names):
    """A stable color for ``name``: its position in ``names`` on the tab10/tab20 cycle (same name, same color
    in every plot that passes the same ``names``)."""
    import matplotlib

    names = list(names)
    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    i = names.index(name) if name in names else len(names)
    return cmap(i % cmap.N)


def save_png(fig, path):
    """Save ``fig`` as a PNG at ``path`` and close it."""
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
