"""The agreement step: every rank proves it is about to exchange the same thing before any data moves.

Each engine step starts with ONE collective shared by every engine, optimizer and ``sparse_allreduce`` of a
process set: an allgather of a fixed-size int32 vector (:data:`WORDS` words, Horovod name ``hvd_sparse.agree``,
meter phase ``nonfinite``) holding

====  ===========================================================================================================
word  meaning
====  ===========================================================================================================
0     1 if this rank's gradient (or accumulator) holds a NaN or Inf
1     1 if this rank found a local problem it must report on every rank (e.g. a gradient of another size); 2 if
      it is in an :meth:`~hvd_sparse.core.engine.Engine.gather` (an adapter's exchange before the step)
2     the unit's step counter (mod 2^31)
3-6   a 128-bit fingerprint of :func:`describe`: the unit (owner) name, the preset and every argument of its
      sparsifier and reducer (density, periods, ...), op and scaling, the non-finite policy, n and the layout
      (name, shape and dtype of every tensor that takes part, in exchange order)
====  ===========================================================================================================

Why this cannot hang on a disagreement: the collective has the same name and the same size on every rank,
whatever the rank is about to do, so any two ranks that reach *an* hvd_sparse step meet in it -- even two
different optimizers stepped in a different order, or two presets whose data collectives differ. Every data
collective of the step comes after it. When the vectors differ, every rank sees the same gathered table, so every
rank takes the same error path: one more exchange (:func:`explain`, phases ``agree.sizes`` / ``agree.detail``,
also shared names) of the full descriptions, and :class:`~hvd_sparse.core.errors.RankDisagreementError` on every
rank naming the first thing that differs and the ranks. What it cannot catch is a rank that never reaches an
hvd_sparse step at all (it returned, or waits in another library's collective): the others then wait in the
agreement until Horovod's stall check reports it or the job is ended -- as with any collective.

Cost on a steady step: the fingerprint is computed only when what it covers changes (the engine keeps it, keyed
on the layout object and the step's options), so a steady step pays one 28-byte allgather (which already carried
the non-finite flag) and a tuple comparison.
"""

from __future__ import annotations

import hashlib
import json
import numbers

import numpy as np

#: meter phase of the agreement (the Horovod name is ``hvd_sparse.agree``); kept as the non-finite flag's phase
PHASE = "nonfinite"
#: meter phases of the error path's detail exchange
DETAIL_SIZES, DETAIL = "agree.sizes", "agree.detail"
#: phases whose Horovod collective name is shared by every unit (``hvd_sparse.<name>``, no unit prefix)
SHARED_NAMES = {PHASE: "agree", DETAIL_SIZES: DETAIL_SIZES, DETAIL: DETAIL}
WORDS = 7
#: word 1 of a rank that meets the others for :meth:`~hvd_sparse.core.engine.Engine.gather` rather than for a step
GATHER = 2


def _plain(v):
    if isinstance(v, (bool, str)) or v is None:
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)                # JSON writes floats exactly (shortest round-trip repr)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return None


def config_of(obj):
    """``{"class": ..., <argument>: <value>}`` of a sparsifier or reducer: its scalar attributes (its arguments;
    per-step state lives in the engine, not here)."""
    if obj is None:
        return None
    out = {"class": type(obj).__name__}
    for key, value in sorted(vars(obj).items()):
        plain = _plain(value)
        if plain is not None or value is None:
            out[key] = plain
    return out


def describe(unit, compression, entries, options):
    """What the ranks must agree on, as a JSON-able dict (see the module docstring)."""
    return {
        "unit": unit,
        "compression": repr(compression),
        "sparsifier": config_of(compression.sparsifier),
        "reducer": config_of(compression.reducer),
        "options": dict(options),
        "n": sum(int(np.prod(shape)) for _, shape, _ in entries),
        "parameters": [[name, list(shape), str(dtype)] for name, shape, dtype in entries],
    }


def fingerprint(desc):
    """4 int32 words of a 128-bit hash of ``desc``."""
    digest = hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16).digest()
    return np.frombuffer(digest, dtype="<i4").tolist()


def vector(nonfinite, local_error, step, fp):
    return [int(bool(nonfinite)), int(bool(local_error)), int(step) & 0x7FFFFFFF, *fp]


def agreed(table, flag=0):
    """``table``: the gathered (P, WORDS) int rows. True when every rank reported the same step and fingerprint
    and word 1 equal to ``flag`` (0: no local problem; :data:`GATHER`: every rank is in a gather)."""
    first = table[0]
    return all(row[1] == flag for row in table) and all(row[2:] == first[2:] for row in table)


def explain(xp, comm, desc, like):
    """The error path (every rank is on it): gather every rank's description (two allgathers with shared names)
    and return them, in rank order."""
    blob = json.dumps(desc, sort_keys=True).encode()
    padded = blob + b" " * (-len(blob) % 4)
    sizes = xp.to_numpy(comm.allgather(xp.asarray([len(padded) // 4], xp.int32, like=like), DETAIL_SIZES)).tolist()
    words = np.frombuffer(padded, dtype="<i4").copy()          # writable: torch warns on a read-only array
    data = xp.to_numpy(comm.allgather(xp.asarray(words, xp.int32, like=like), DETAIL)).astype("<i4")
    out, off = [], 0
    for m in sizes:
        out.append(json.loads(data[off:off + m].tobytes().decode()))
        off += m
    return out
