"""The exceptions every adapter raises alike, their messages (what ranks disagree on) and the checksums the
consistency guard of every adapter compares. The checks of arguments are in :mod:`hvd_sparse.core.validate`, those of
a restored state's origin in :mod:`hvd_sparse.core.state`."""

from __future__ import annotations

import numpy as np


class NonFiniteGradientError(FloatingPointError):
    """A NaN or Inf reached the sparse exchange under ``nonfinite="raise"`` (raised on every rank alike)."""


class ReplicaDivergenceError(RuntimeError):
    """The consistency guard found parameters that differ across ranks (raised on every rank alike)."""


_WORD = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def checksums(values, itemsize=None):
    """The consistency guard's two int64 checksums of an array's bits: the sum of its words and a position-weighted
    sum (any single changed bit changes the first; swapped words change the second). Deterministic, wraps on
    overflow; the same for every framework.

    ``values``: a numpy array (its words are its items viewed as signed integers of their size), or its raw bytes
    (uint8) with ``itemsize`` the size of its items -- for a dtype numpy lacks, e.g. torch's bfloat16."""
    a = np.ascontiguousarray(values).reshape(-1)
    w = a.view(_WORD[itemsize or a.dtype.itemsize]).astype(np.int64)
    weights = np.arange(w.size, dtype=np.int64) % 65521 + 1
    with np.errstate(over="ignore"):
        return [int(w.sum()), int((w * weights).sum())]


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


class RankDisagreementError(ValueError):
    """The ranks were about to exchange different things (another unit, preset, argument, parameter layout or
    step): raised on every rank alike, by the agreement step that precedes every exchange
    (the agreement of :mod:`hvd_sparse.core.comm`), before any data moved."""


def _ranks(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _by_value(values):
    """``"X on rank 0, Y on rank 1"``: each distinct value with the ranks that hold it (first seen first)."""
    groups = {}
    for r, v in enumerate(values):
        groups.setdefault(repr(v), (v, []))[1].append(r)
    return ", ".join(f"{v!r} on {_ranks(rs)}" for v, rs in groups.values())


def _first_param_difference(unit, per_rank):
    """Name the first parameter that differs between rank 0 and another rank (or the count)."""
    tables = [{name: (tuple(shape), dtype) for name, shape, dtype in params} for params in per_rank]
    ref, names0 = tables[0], [p[0] for p in per_rank[0]]
    for r, (table, params) in enumerate(zip(tables[1:], per_rank[1:]), start=1):
        for name in sorted(set(ref) | set(table)):
            if name not in table or name not in ref:
                where, other = (0, r) if name in ref else (r, 0)
                return (f"the parameters of '{unit}': parameter {name!r} takes part on rank {where} but not on rank "
                        f"{other} (frozen there, or not in the optimizer's param_groups, or another model); the "
                        "parameters differ across ranks: every rank must build the same model and train the same "
                        "parameters")
            if table[name] != ref[name]:
                (s0, d0), (s1, d1) = ref[name], table[name]
                return (f"the parameters of '{unit}': parameter {name!r} is {s0} {d0} on rank 0 but {s1} {d1} on "
                        f"rank {r}; the parameters differ across ranks: every rank must build the same model")
        if [p[0] for p in params] != names0:
            return (f"the parameters of '{unit}': their order differs between rank 0 and rank {r}; the parameters "
                    "differ across ranks")
    return None


def disagreement_message(per_rank):
    """The message of :class:`RankDisagreementError` from every rank's description (rank order): the first thing
    that differs, with the ranks that hold each value. Descriptions are those of :func:`hvd_sparse.core.comm
    .describe` plus ``"step"`` and ``"local_error"``."""
    errors = [(r, d["local_error"]) for r, d in enumerate(per_rank) if d.get("local_error")]
    if errors:
        r, msg = errors[0]
        return (f"hvd_sparse: ranks disagree on the gradient of '{per_rank[r]['unit']}': on rank {r}: {msg} "
                f"(raised on every rank; {_ranks([e[0] for e in errors])} reported it)")

    def differs(key):
        return any(d.get(key) != per_rank[0].get(key) for d in per_rank[1:])

    if differs("unit"):
        return (f"hvd_sparse: ranks disagree on what is being exchanged: {_by_value([d['unit'] for d in per_rank])} "
                "(every rank must step its optimizers and call sparse_allreduce in the same order, with the same "
                "names)")
    unit = per_rank[0]["unit"]
    classes = [((d["sparsifier"] or {}).get("class"), (d["reducer"] or {}).get("class")) for d in per_rank]
    if any(c != classes[0] for c in classes[1:]):
        return (f"hvd_sparse: ranks disagree on the compression of '{unit}': "
                f"{_by_value([d['compression'] for d in per_rank])} (every rank must build the same preset)")
    if differs("compression") or differs("sparsifier") or differs("reducer"):
        for part in ("sparsifier", "reducer"):
            confs = [d[part] or {} for d in per_rank]
            for key in sorted(set().union(*confs)):
                if key != "class" and any(c.get(key) != confs[0].get(key) for c in confs[1:]):
                    return (f"hvd_sparse: ranks disagree on the compression argument {key!r} of '{unit}': "
                            f"{_by_value([c.get(key) for c in confs])} (every rank must build the same preset with "
                            "the same arguments)")
        return (f"hvd_sparse: ranks disagree on the compression of '{unit}': "
                f"{_by_value([d['compression'] for d in per_rank])} (every rank must build the same preset)")
    options = [d["options"] for d in per_rank]
    for key in sorted(set().union(*options)):
        if any(o.get(key) != options[0].get(key) for o in options[1:]):
            return (f"hvd_sparse: ranks disagree on {key!r} of '{unit}': {_by_value([o.get(key) for o in options])}")
    if differs("parameters") or differs("n"):
        what = _first_param_difference(unit, [d["parameters"] for d in per_rank])
        if what is None:
            what = f"the size of '{unit}': {_by_value([d['n'] for d in per_rank])}"
        return f"hvd_sparse: ranks disagree on {what}"
    if differs("step"):
        return (f"hvd_sparse: ranks disagree on the step count of '{unit}': {_by_value([d['step'] for d in per_rank])} "
                "(a rank skipped or repeated a step: every rank must call step()/synchronize() equally often; with "
                "a loss scaler use Horovod's recipe: optimizer.synchronize(); scaler.unscale_(optimizer); with "
                "optimizer.skip_synchronize(): scaler.step(optimizer))")
    return "hvd_sparse: ranks disagree on the agreement vector, but their descriptions are equal (a hash collision)"
