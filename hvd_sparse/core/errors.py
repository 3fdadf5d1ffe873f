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


# Horovod's reduce-op constants (``hvd.Average``, ``hvd.Sum``, ``hvd.Adasum``): values of the C library's
# enum, identical in horovod.torch and horovod.tensorflow (tests/test_torch_horovod.py checks them).
HVD_AVERAGE, HVD_SUM, HVD_ADASUM = 0, 1, 2


def check_op(op, gradient_predivide_factor, api):
    """Shared validation of ``op`` and ``gradient_predivide_factor`` for the sparse path."""
    if op == HVD_ADASUM:
        raise NotImplementedError(f"{api}: op=hvd.Adasum cannot be combined with sparse compression "
                                  "(Adasum combines whole dense deltas); use op=hvd.Average or hvd.Sum")
    if op not in (HVD_AVERAGE, HVD_SUM):
        raise ValueError(f"{api}: op must be hvd.Average or hvd.Sum, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != HVD_AVERAGE:
        raise ValueError(f"{api}: gradient_predivide_factor is only valid with op=hvd.Average, "
                         f"got op={op!r} and gradient_predivide_factor={gradient_predivide_factor!r}")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"{api}: gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")


def scale_factors(op, gradient_predivide_factor):
    """Horovod's split of the average: (prescale, postscale, average?)."""
    if op == HVD_AVERAGE:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor, True
    return 1.0, 1.0, False


def check_same_layout(per_rank, api):
    """Raise on every rank when the ranks' parameter layouts differ.

    ``per_rank``: one list of ``(name, shape)`` per rank (gathered with ``allgather_object``), in each rank's
    exchange order. The exchange concatenates gradients in that order, so any difference in names, shapes, count
    or order would pair different entries across ranks -- silently, or with a hang -- instead of averaging.
    """
    ref = per_rank[0]
    for r, mine in enumerate(per_rank[1:], start=1):
        if mine == ref:
            continue
        for i, (a, b) in enumerate(zip(ref, mine)):
            if a != b:
                raise ValueError(f"{api}: the parameters differ across ranks: position {i} is {a[0]!r} "
                                 f"{tuple(a[1])} on rank 0 but {b[0]!r} {tuple(b[1])} on rank {r}; every rank "
                                 "must build the same model (same names, shapes and order)")
        raise ValueError(f"{api}: the parameters differ across ranks: rank 0 has {len(ref)}, rank {r} has "
                         f"{len(mine)}; every rank must build the same model")


NONFINITE_POLICIES = ("skip", "raise")


class NonFiniteGradientError(FloatingPointError):
    """A NaN or Inf reached the sparse exchange under ``nonfinite="raise"`` (raised on every rank alike)."""


def check_nonfinite(policy, api):
    """``nonfinite=``: ``"skip"`` or ``"raise"``."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"{api}: nonfinite must be one of {', '.join(map(repr, NONFINITE_POLICIES))}, "
                         f"got {policy!r}")
    return policy


class ReplicaDivergenceError(RuntimeError):
    """The consistency guard found parameters that differ across ranks (raised on every rank alike)."""


def check_replicas_agree(names, per_rank, step, api):
    """Raise :class:`ReplicaDivergenceError` on every rank when the ranks' parameter checksums differ.

    ``per_rank``: one row per rank (gathered), each a list with one checksum tuple per name in ``names``
    (the canonical order, identical on every rank). Names the first differing parameter and the ranks that
    differ from rank 0.
    """
    ref = per_rank[0]
    differing = [i for i in range(len(names)) if any(row[i] != ref[i] for row in per_rank[1:])]
    if differing:
        i = differing[0]
        ranks = [r for r, row in enumerate(per_rank) if row[i] != ref[i]]
        raise ReplicaDivergenceError(
            f"{api}: the replicas diverged: after step {step} parameter {names[i]!r} differs on rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} from rank 0 ({len(differing)} of "
            f"{len(names)} parameters differ). Something changed parameters on some ranks only (a rank-dependent "
            "update, a missed broadcast, nondeterministic ops)")
