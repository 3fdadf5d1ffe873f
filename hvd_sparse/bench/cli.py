"""Argument types and output helpers shared by the benchmark commands."""

from __future__ import annotations

import argparse
import json
import os

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


def positive_float(text):
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def positive_ints(text):
    """A comma-separated list of positive ints, e.g. ``8,16,32``."""
    return [positive_int(t) for t in text.split(",") if t.strip()]


def density(text):
    v = float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {v}")
    return v


def targets(text):
    """Comma-separated test accuracies in (0, 1], e.g. ``0.9,0.95`` (``--targets`` of ``bench train`` and of
    ``python -m hvd_sparse.bench.train_report``)."""
    try:
        vals = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated fractions like 0.9,0.95, got {text!r}") from None
    if not vals or not all(0 < v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"must be fractions in (0, 1], got {text!r}")
    return vals


def worker_parser(doc, seed, lr):
    """The arguments every benchmark worker that runs presets takes -- ``--algorithms``, ``--density``, ``--seed``
    (default ``seed``), ``--lr`` (default ``lr``), ``--out`` -- with the first paragraph of ``doc`` as description;
    the worker adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--algorithms", required=True, help="comma-separated preset names; dense = Horovod's")
    p.add_argument("--density", type=float, required=True)
    p.add_argument("--seed", type=int, default=seed)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--out", required=True, help="JSON file written by rank 0")
    return p


def write_json(path, report):
    """Write ``report`` as JSON to ``path`` (nothing when ``path`` is empty), atomically: a reader -- the parent
    of a benchmark worker, or anyone watching ``--json`` -- never sees half a file."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, path)


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


def bar_chart(names, values, palette, labels, label_at=None, **bar):
    """One horizontal bar per name, top to bottom, colored as :func:`color_of` colors it in ``palette``, with
    ``labels[i]`` written after bar i (at ``label_at[i]``, default its value); ``bar`` goes to ``ax.barh``.
    Returns ``(fig, ax, y)`` (y: the bars' positions) for the caller to add to, then :func:`finish_chart`."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(names) + 1.8))
    y = list(range(len(names)))[::-1]
    ax.barh(y, values, color=[color_of(n, palette) for n in names], **bar)
    for yi, x, text in zip(y, label_at or values, labels):
        ax.text(x, yi, text, va="center", fontsize=8)
    ax.set_yticks(y, names)
    return fig, ax, y


def finish_chart(fig, ax, xlabel, title, path):
    """The x label, title and grid of a :func:`bar_chart`; saved as a PNG at ``path``."""
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", which="both", alpha=0.3)
    save_png(fig, path)
