"""Argument checks, one place for every API (presets, sparsifiers, reducers, adapters), so that every error is
worded the same way: ``<public api>: <argument> <rule>, got <value>; <fix>``.

The algorithms' options are frozen dataclasses (:class:`Options`, decorated with :func:`options`) whose fields
carry their rule (:func:`integer`, :func:`real`, :func:`choice`, :func:`flag`, :func:`density`): the rules run
once, when the object is built, and ``repr`` shows the fields that differ from their defaults.
"""

from __future__ import annotations

import dataclasses
import functools
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
# enum, identical in horovod.torch and horovod.tensorflow (tests/torch/test_torch_horovod.py checks them).
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


def check_sparse_allreduce(op, nonfinite, floating, dtype, api):
    """The argument checks of every framework's ``sparse_allreduce`` beside its compression's
    (:func:`hvd_sparse.compression.check_compression`), before it touches the engine: ``op``, ``nonfinite`` and
    ``floating`` (the tensor's dtype ``dtype`` is a floating-point one)."""
    check_op(op, 1.0, api)
    check_nonfinite(nonfinite, api)
    if not floating:
        raise TypeError(f"{api}: tensor must be floating point (float16, bfloat16, float32, float64), got {dtype}; "
                        "sparsifying integers would round the average -- use hvd.allreduce")


#: ``elastic_residuals=``: what an elastic reset (ranks left or joined) does to this rank's residual
ELASTIC_RESIDUALS = ("keep", "drop")


def check_elastic_residuals(policy, api):
    """``elastic_residuals=``: ``"keep"`` or ``"drop"``."""
    if policy not in ELASTIC_RESIDUALS:
        raise ValueError(f"{api}: elastic_residuals must be 'keep' or 'drop', got {policy!r}")
    return policy


NONFINITE_POLICIES = ("skip", "raise")


def check_nonfinite(policy, api):
    """``nonfinite=``: ``"skip"`` or ``"raise"``."""
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"{api}: nonfinite must be one of {', '.join(map(repr, NONFINITE_POLICIES))}, "
                         f"got {policy!r}")
    return policy


#: the rules that select entries by a threshold: ``|x| >= th and x != 0`` (exactly k without ties) or ``|x| > th``
SELECT_RULES = ("ge_nonzero", "gt")


def check_real(value, name, api, low, low_incl=True, allow_none=False, fix="", below=None):
    """``value`` as a finite float >= ``low`` (> with ``low_incl=False``) and < ``below`` when given."""
    if value is None and allow_none:
        return None
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(float(value))
          and (float(value) >= low if low_incl else float(value) > low)
          and (below is None or float(value) < below))
    if not ok:
        rule = f"must be a finite number {'>=' if low_incl else '>'} {low:g}" + \
            (f" and < {below:g}" if below is not None else "") + (" or None" if allow_none else "")
        raise ValueError(f"{api}: {name} {rule}, got {value!r}{'; ' + fix if fix else ''}")
    return float(value)


SELECT_RULE_FIX = "use 'ge_nonzero' (exactly k without ties, library default) or 'gt' (strict >, ref-compatible)"


def check_choice(value, name, api, values, fix=""):
    if value not in values:
        raise ValueError(f"{api}: {name} must be one of {tuple(values)}, got {value!r}{'; ' + fix if fix else ''}")
    return value


def check_bool(value, name, api):
    if not isinstance(value, bool):
        raise TypeError(f"{api}: {name} must be a bool, got {value!r}")
    return value


# -- algorithm options ----------------------------------------------------------------------------------------
class Options:
    """Base of the sparsifiers' and reducers' configuration (subclasses are decorated with :func:`options`).

    Each field's rule (its ``metadata["check"]``: ``check(value, name, api) -> value``) runs once in
    ``__post_init__`` and stores the checked value; :meth:`check_together` adds the rules that tie fields
    together. Equality and hashing are by value; ``repr`` lists the fields that differ from their defaults."""

    def __post_init__(self):
        api = f"hvd_sparse.{type(self).__name__}"
        for f in dataclasses.fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(getattr(self, f.name), f.name, api))
        self.check_together(api)

    def check_together(self, api):
        """Rules across fields (raise naming them); default none."""

    def __repr__(self):
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(shown)})"


#: decorator of every :class:`Options` subclass: a frozen dataclass that keeps :meth:`Options.__repr__`
options = dataclasses.dataclass(frozen=True, repr=False)


def _field(default, check, *args, **kwargs):
    rule = functools.partial(_apply, check, args, kwargs)
    return dataclasses.field(default=default, metadata={"check": rule})


def _apply(check, args, kwargs, value, name, api):
    return check(value, name, api, *args, **kwargs)


def _density(value, name, api):
    return check_density(value, api)


def _int_or_none(value, name, api, minimum):
    return None if value is None else check_positive_int(value, name, api, minimum)


def density():
    """The required ``density`` field of a sparsifier: a number in (0, 1]."""
    return _field(dataclasses.MISSING, _density)


def integer(default, minimum=1, allow_none=False):
    """An integer field >= ``minimum`` (or None with ``allow_none``)."""
    return _field(default, _int_or_none, minimum) if allow_none else _field(default, check_positive_int, minimum)


def real(default, low, low_incl=True, allow_none=False, fix="", below=None):
    """A finite real field >= ``low`` (> with ``low_incl=False``), < ``below`` when given, or None."""
    return _field(default, check_real, low, low_incl=low_incl, allow_none=allow_none, fix=fix, below=below)


def choice(default, values, fix=""):
    """A field that takes one of ``values``."""
    return _field(default, check_choice, tuple(values), fix=fix)


def flag(default):
    """A bool field."""
    return _field(default, check_bool)
