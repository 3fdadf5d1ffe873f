"""Equal bytes on the wire: the density at which each preset sends, as measured, what a reference preset sends.

At one density the presets do not cost the same (Ok-Topk sends a fraction of what TopkA sends), and a preset's
``byte_budget=`` derives its density from a cost model that is conservative for some presets
(:mod:`hvd_sparse.core.budget`; Ok-Topk sends less than its budget). :func:`calibrate` therefore measures:
it runs each preset on P virtual ranks of the in-process simulator (:func:`hvd_sparse.testing.simulate`, ``record``
limited to the volume) over synthetic gradient-like data with the model's parameter layout
(:class:`LayoutGradients`), and takes as its bytes the mean of the volume meter's ``sent_bytes`` over the ranks and
the steps ``skip`` .. ``steps - 1``. It searches the density whose bytes are within ``tolerance`` of the reference's
at the reference density: the first try is the density the cost model gives for the reference's measured fraction
of the dense bytes, then secant steps on log bytes against log density (the first with slope 1: bytes are close to
proportional to the density), the slope clamped to [0.2, 5]. Every density tried is first rounded to 4 significant
digits (:func:`round_density`), so the density returned is the one measured, and the configuration name
``<preset>+d<density>`` carries it exactly (:func:`density_text`).

Steps. The threshold controllers take long to settle (ExDyna's bytes swing from step to step, and a mean over a
few tens of steps is not yet that over a hundred), so the default is 100 steps, steps 5.. averaged.

Size. A model larger than ``numel`` (default 1M) is simulated at ``numel`` values, its layout scaled in proportion
(:func:`scaled_layout`; every tensor keeps at least one value), and its bytes scaled back by the ratio of the sizes.
The density transfers: k = density x n for an exact top-k, and a threshold selects the same fraction of entries
whose statistics do not depend on n (the data is independent across entries, each tensor keeping its share and its
scale); only the per-step control words (counts, Ok-Topk's histogram) do not scale, and at k/P in the thousands
they are a small part (checked by calibrating at 1M and measuring the densities found at the model's full size).

Deterministic: the data is a function of ``seed`` (and the layout and P), the simulator sums in rank order. The
data is synthetic, so a preset whose count depends on the data (threshold-based selections) can send somewhat
another amount on a real model's gradients; the train benchmark reports the bytes its workers measured beside the
calibration's.

Cost: a simulation of ``steps`` steps makes steps x P gradients of n values, most of its time.

docs/benchmarks.md ("Time to accuracy of real training") has the measured figures: the bytes of the presets at one
density and against their budgets, how the controllers' bytes settle over the steps, the densities calibrated for
the digits WideNet and what they send at its full size, and the calibration's time.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .data import SyntheticGradients

#: significant digits of a calibrated density
DIGITS = 4
#: bounds of a secant step's slope (d log bytes / d log density)
SLOPES = (0.2, 5.0)


class LayoutGradients(SyntheticGradients):
    """:class:`~hvd_sparse.bench.data.SyntheticGradients` whose per-layer scales follow ``layout`` (the sizes of
    the model's parameter tensors, in order) instead of its own geometric split: one scale exp(U(-4, 0)) per
    tensor, drawn from ``seed``."""

    def __init__(self, layout, workers, seed=0):
        layout = [int(s) for s in layout]
        super().__init__(sum(layout), workers, seed, layers=len(layout))
        rng = np.random.default_rng([seed, 20])
        self.layout = layout
        self.scale = np.repeat(np.exp(rng.uniform(-4, 0, len(layout))), layout).astype(np.float32)


def sparse_presets():
    """The presets a reference or a calibration may name: every preset of :mod:`hvd_sparse.bench.presets` but
    ``dense``."""
    from . import presets

    return [p for p in presets.names() if p != "dense"]


def parse_reference(text):
    """``"PRESET@DENSITY"`` (e.g. ``topka@0.01``) -> ``(preset, density)``; a ValueError saying what is wrong."""
    preset, at, value = text.partition("@")
    if not at:
        raise ValueError(f"must be PRESET@DENSITY, e.g. topka@0.01, got {text!r}")
    if preset not in sparse_presets():
        raise ValueError(f"unknown preset {preset!r} in {text!r}: choose from {', '.join(sparse_presets())}")
    try:
        density = float(value)
    except ValueError:
        raise ValueError(f"the density of {text!r} must be a number in (0, 1], got {value!r}") from None
    if not 0 < density <= 1:
        raise ValueError(f"the density of {text!r} must be in (0, 1], got {value!r}")
    return preset, density


def density_text(density):
    """``density`` as a plain decimal with :data:`DIGITS` significant digits, trailing zeros dropped (``0.01``,
    ``0.02432``, ``1``): the form a configuration's ``+d<density>`` takes."""
    return np.format_float_positional(float(density), precision=DIGITS, unique=False, fractional=False, trim="-")


def round_density(density):
    """``density`` rounded as :func:`density_text` writes it, within (0, 1]."""
    return min(1.0, max(float(density_text(density)), 10.0 ** -12))


def scaled_layout(layout, numel):
    """``layout`` scaled to about ``numel`` values in all (each tensor rounded, at least 1); ``layout`` itself
    when it holds no more than ``numel``."""
    n = sum(layout)
    if numel is None or n <= numel:
        return [int(s) for s in layout]
    return [max(1, round(s * numel / n)) for s in layout]


def model_layout(task, image_size, hidden):
    """The sizes of the parameter tensors of the train benchmark's model (the worker's
    :func:`~hvd_sparse.bench._train_worker.build_model`, built here on the CPU), in the order its optimizer
    exchanges them."""
    import torch

    from ._train_worker import build_model

    with torch.random.fork_rng():
        return [p.numel() for p in build_model(task, image_size, hidden).parameters()]


def measure(preset, density, source, steps=30, skip=5):
    """Mean bytes a rank of ``preset`` at ``density`` sends per step on the simulator: over the ranks and the steps
    ``skip`` .. ``steps - 1`` of ``source`` (a :class:`LayoutGradients`; its layout is the engines')."""
    from hvd_sparse.testing import simulate

    res = simulate(make_spec(preset, density), source.grad, shapes=[(s,) for s in source.layout], steps=steps,
                   size=source.workers, record=("volume",))
    return float(np.mean([[v["sent_bytes"] for v in res.volume[t]] for t in range(min(skip, steps - 1), steps)]))


def make_spec(spec, density, **options):
    """The compression of a calibrated preset: ``spec`` is a preset's name, or ``oktopk+fill`` (Ok-Topk with
    ``global_fill=True``, calibrated apart as it sends more)."""
    from .presets import make

    name, _, extra = spec.partition("+")
    return make(name, density, **options, **({"global_fill": True} if extra == "fill" else {}))


def _first_guess(preset, target, workers, numel):
    """The density the cost model gives for ``target`` bytes (its budget clipped to (0, 1])."""
    from hvd_sparse.core.budget import dense_bytes

    if workers < 2:
        return 0.01
    fraction = min(1.0, max(1e-9, target / dense_bytes(numel, workers)))
    return make_spec(preset, None, byte_budget=fraction).density_for(workers)


def search(bytes_at, start, target, tolerance=0.03, max_tries=8):
    """The density (rounded, :func:`round_density`) whose ``bytes_at(density)`` is within ``tolerance`` of
    ``target``, by secant steps on log bytes against log density from ``start``; returns ``(density, bytes,
    tries)`` of the try closest to ``target`` (in log terms) after at most ``max_tries`` tries, or earlier when
    the search cannot move (the density at 1 and still too few bytes, or a density tried before)."""
    tried = []                                  # (log density, log(bytes / target), density, bytes)
    density = round_density(start)
    for _ in range(max_tries):
        b = float(bytes_at(density))
        tried.append((math.log(density), math.log(max(b, 1e-9) / target), density, b))
        x, y = tried[-1][:2]
        if abs(b / target - 1) <= tolerance or (density >= 1 and y < 0):
            break
        slope = 1.0
        if len(tried) > 1 and x != tried[-2][0]:
            slope = min(max((y - tried[-2][1]) / (x - tried[-2][0]), SLOPES[0]), SLOPES[1])
        density = round_density(math.exp(min(0.0, x - y / slope)))
        if any(density == t[2] for t in tried):
            break
    best = min(tried, key=lambda t: abs(t[1]))
    return best[2], best[3], len(tried)


def calibrate(reference, workers, layout, presets, steps=100, skip=5, numel=1_000_000, seed=0, tolerance=0.03,
              max_tries=8, say=None):
    """Densities of ``presets`` at the reference's measured bytes (module docstring).

    Args:
        reference (tuple): ``(preset, density)``, e.g. ``("topka", 0.01)``.
        workers (int): the number of ranks P.
        layout (list of int): the sizes of the model's parameter tensors (n = their sum).
        presets (iterable of str): the presets to calibrate (:func:`make_spec`; the reference's preset gets its own
            density back).
        steps, skip (int): simulated steps, and the first ones left out of the mean.
        numel (int or None): simulate at most this many values (:func:`scaled_layout`); None: n.
        seed (int): the synthetic data's seed.
        tolerance (float): the relative distance to the reference's bytes to reach.
        max_tries (int): simulations per preset at most.
        say (callable): ``say(text)`` of each preset's result, or None.

    Returns a dict: ``reference`` (``preset``, ``density``, ``sent_bytes``: its mean bytes per rank and step),
    ``presets`` (per preset: ``density``, ``sent_bytes``, ``ratio`` = sent_bytes / the reference's,
    ``within_tolerance``, ``simulations``: the new ones it took), the settings ``workers``, ``numel`` (n),
    ``simulated_numel``, ``steps``, ``skip``, ``seed``, ``tolerance``, and ``seconds``, the wall time it took.
    The bytes are the simulator's, times n / simulated_numel (the model's size).
    """
    t0 = time.monotonic()
    n = sum(int(s) for s in layout)
    source = LayoutGradients(scaled_layout(layout, numel), workers, seed)
    scale = n / source.n
    cache = {}

    def bytes_of(preset):
        def at(density):
            if (preset, density) not in cache:
                cache[preset, density] = scale * measure(preset, density, source, steps, skip)
            return cache[preset, density]
        return at

    ref_preset, ref_density = reference
    target = bytes_of(ref_preset)(ref_density)
    out = {"reference": {"preset": ref_preset, "density": ref_density, "sent_bytes": target}, "presets": {},
           "workers": workers, "numel": n, "simulated_numel": source.n, "steps": steps, "skip": skip, "seed": seed,
           "tolerance": tolerance}
    for preset in dict.fromkeys(presets):
        start = ref_density if preset == ref_preset else _first_guess(preset, target, workers, n)
        before = len(cache)
        density, b, _ = search(bytes_of(preset), start, target, tolerance, max_tries)
        out["presets"][preset] = {"density": density, "sent_bytes": b, "ratio": b / target,
                                  "within_tolerance": abs(b / target - 1) <= tolerance,
                                  "simulations": len(cache) - before}
        if say is not None:
            say(f"{preset}: density {density_text(density)}, {b / 1e6:.4g} MB per rank and step "
                f"({b / target:.3f} of {ref_preset}'s)")
    out["seconds"] = time.monotonic() - t0
    return out


def equalize(config_names, reference, workers, layout, say=None, **options):
    """``(names, calibration)``: ``config_names`` with every sparse configuration that names neither a density
    (``+d``) nor a byte budget (``+b``) given ``+d<density>``, its preset's density of :func:`calibrate` (with
    ``options``: its keyword arguments); the calibration's ``configs`` maps each renamed configuration to its new
    name."""
    from ._train_worker import parse_config

    cfgs = {name: parse_config(name) for name in config_names}
    free = [n for n, c in cfgs.items() if c["kind"] == "sparse" and "density" not in c and "byte_budget" not in c]
    spec = {n: cfgs[n]["preset"] + ("+fill" if cfgs[n].get("global_fill") else "") for n in free}
    calibration = calibrate(reference, workers, layout, [spec[n] for n in free], say=say, **options)
    renamed = {n: f"{n}+d{density_text(calibration['presets'][spec[n]]['density'])}" for n in free}
    calibration["configs"] = renamed
    return [renamed.get(n, n) for n in config_names], calibration
