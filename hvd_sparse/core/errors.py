"""Shared argument checks and exceptions (one place, so every API words its errors the same way).

Message shape: ``<public api>: <argument> <rule>, got <value>; <fix>``.
"""

from __future__ import annotations

import math
import numbers


def check_density(density, api):
    """``density`` as a float in (0, 1], or a ValueError/TypeError naming it."""
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"{api}: density must be a number in (0, 1], got {density!r} "
                        f"({type(density).__name__}); pass e.g. density=0.01 to keep 1%")
    d = float(density)
    if not math.isfinite(d) or not 0.0 < d <= 1.0:
        hint = f"; pass density={d / 100:g} to keep {d:g}%" if 1.0 < d <= 100.0 else ""
        raise ValueError(f"{api}: density must be in (0, 1], got {density!r}{hint}")
    return d


def check_positive_int(value, name, api, minimum=1):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{api}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
