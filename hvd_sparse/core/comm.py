"""How ranks talk: the Communicator protocol, the volume meter (docs/algorithms.md#volume) and the opening every
engine step starts with: its header, the agreement it proves.

A reducer talks to the other ranks only through a :class:`Communicator`. Two implementations exist:
:class:`hvd_sparse.core.sim.SimulatedCommunicator` (P virtual ranks in one process, the test oracle) and
the Horovod communicators of the framework adapters (:mod:`hvd_sparse.horovod_comm`: ``hvd.allreduce`` /
``allgather`` / ``alltoall`` / ``broadcast`` with explicit names ``hvd_sparse.<unit>.<phase>`` and the process set).
The core imports no Horovod.

Every collective takes a ``phase`` (``"values"``, ``"indices"``, ``"count"``, ...) that names the
collective and keys the volume meter. Collectives are issued by every rank of the process set in the
same order (the engine guarantees it); nothing here is called from an autograd hook.

Volume accounting is *logical*: Horovod and Gloo expose no traffic counters, so each communicator counts
from its own sizes what a direct exchange would move, per rank and phase, self-copies excluded:

=============  ==========================================  ==========================================
collective     sent by rank r                              received by rank r
=============  ==========================================  ==========================================
allgather      ``len(x_r) * (P-1)``                        ``sum_{s != r} len(x_s)``
alltoall       ``sum_{q != r} splits_r[q]``                ``sum_{s != r} splits_s[r]``
allreduce      ``2 n (P-1) / P`` (ring / Rabenseifner)     same
broadcast      root: ``n (P-1)``, others 0                 root 0, others ``n``
=============  ==========================================  ==========================================

One *word* is one element (one value or one index, paper Table 1); bytes use the dtype on the wire.

**The wire: one negotiation per phase** (docs/algorithms.md#the-wire).

Every Horovod collective pays a negotiation with the coordinator unless Horovod's response cache serves it, and the
cache serves a collective only when its name, shape, dtype and device repeat. So a step sends, per phase, one
contiguous int32 message whose shape depends only on (n, k, P, the preset), never on the data: the same every step.

**The opening.** A step's first collective is an allgather of every rank's message under one name shared by every
unit of the process set (``hvd_sparse.agree``): a header, then the reducer's first payload (TopkA's pairs,
ExDyna's indices; empty for reducers whose first phase is another collective):

====  ===========================================================================================================
word  header (:data:`AGREE_WORDS` int32)
====  ===========================================================================================================
0     the non-finite flag: the bits of sum(acc·0) as a float32, 0 (or -0.0's) when every entry of this rank's
      accumulator is finite, a NaN's otherwise (computed on the device, never read alone: :func:`finite`)
1     how many entries of the selection are real (the rest is padding)
2     the sparsifier's note: a word its controllers need on the host after the step (ThresholdReuse: how many
      rungs its threshold climbed), so that it crosses in this read instead of one of its own
3     1 if this rank found a local problem to report on every rank; 2 in an adapter's gather
4     the unit's step counter (mod 2^31)
5-8   a 128-bit fingerprint of the unit, its preset with every argument, the options and the layout
====  ===========================================================================================================

Every rank reads the gathered headers once (the step's one host read before the data is used) and decides alike:
another message length or fingerprint anywhere is a disagreement, explained and raised on every rank
(:class:`~hvd_sparse.core.errors.RankDisagreementError`, :func:`explain`); a non-finite flag
anywhere discards the step on every rank (:class:`SkipStep`). An allgather tolerates messages of different sizes,
so ranks that run different presets, densities or models still meet in it and raise together instead of hanging.

**Capacities and padding.** A selection travels as exactly ``capacity`` indexes: the real ones ascending, then the
sentinel n (one past the last index), whose value is 0 (the accumulator has a zero at index n,
:attr:`~hvd_sparse.core.state.ErrorFeedback`), so receivers add it into a spare slot and drop it. A selection
larger than the capacity is cut where its sparsifier says (the largest magnitudes stay) and what is not sent stays
in the residual, as everything unsent does. The volume meter counts the padding as sent.

Why a disagreement cannot hang: the opening has the same name on every rank, whatever the rank is about to do, so
any two ranks that reach *an* hvd_sparse step meet in it -- even two different optimizers stepped in a different
order, or two presets whose data collectives differ -- and every data collective of the step comes after it. When
the headers differ (:func:`agreed`), every rank sees the same gathered table, so every rank takes the same error
path: one more exchange (:func:`explain`, phases ``agree.sizes`` / ``agree.detail``, also shared names) of the full
descriptions (:func:`describe`: the unit, its preset with every argument, op and scaling, the non-finite policy, n
and the name, shape and dtype of every tensor in exchange order), and
:class:`~hvd_sparse.core.errors.RankDisagreementError` on every rank naming the first thing that differs and the
ranks. What it cannot catch is a rank that never reaches an hvd_sparse step at all (it returned, or waits in another
library's collective): the others then wait in the opening until Horovod's stall check reports it or the job is
ended -- as with any collective.

Cost on a steady step: the fingerprint is computed only when what it covers changes (:class:`Agreement` keeps it,
keyed on the layout object and the step's options), so the agreement costs a steady step 36 bytes in a collective
it makes anyway and a tuple comparison.
"""

from __future__ import annotations

import collections
import hashlib
import json
import numbers
from typing import Protocol, runtime_checkable

import numpy as np

from .errors import RankDisagreementError, disagreement_message
from .xp import backend_of

SUM = "sum"
MAX = "max"


class VolumeMeter:
    """Counts words and bytes this rank sends and receives, per phase, since the last :meth:`reset`; ``seconds``:
    the wall time spent inside the collectives (the wire and the wait for the other ranks; a communicator that
    runs real collectives adds it, the simulator's stay at 0)."""

    __slots__ = ("sent_words", "recv_words", "sent_bytes", "recv_bytes", "calls", "seconds")

    def __init__(self):
        self.reset()

    def reset(self):
        self.sent_words = collections.Counter()
        self.recv_words = collections.Counter()
        self.sent_bytes = collections.Counter()
        self.recv_bytes = collections.Counter()
        self.calls = collections.Counter()
        self.seconds = 0.0

    def add(self, phase, sent_words, recv_words, itemsize, calls=1):
        """Record what ``phase`` moved; ``calls``: the negotiated collectives it took (0 for the second and later
        tensors of a grouped collective, which ride in the first one's negotiation)."""
        self.sent_words[phase] += int(sent_words)
        self.recv_words[phase] += int(recv_words)
        self.sent_bytes[phase] += int(sent_words) * int(itemsize)
        self.recv_bytes[phase] += int(recv_words) * int(itemsize)
        self.calls[phase] += calls

    def totals(self, exclude=()):
        """``{"sent_words", "recv_words", "sent_bytes", "recv_bytes", "collectives"}`` summed over the phases not in
        ``exclude``."""
        def total(counter):
            return sum(v for phase, v in counter.items() if phase not in exclude)

        return {"sent_words": total(self.sent_words), "recv_words": total(self.recv_words),
                "sent_bytes": total(self.sent_bytes), "recv_bytes": total(self.recv_bytes),
                "collectives": total(self.calls)}

    def stats(self):
        """Per-phase counters as plain dicts (for logs and JSON)."""
        return {
            "sent_words": dict(self.sent_words),
            "recv_words": dict(self.recv_words),
            "sent_bytes": dict(self.sent_bytes),
            "recv_bytes": dict(self.recv_bytes),
            "calls": dict(self.calls),
        }


@runtime_checkable
class Communicator(Protocol):
    """What a reducer may call. Arrays are of the engine's backend (numpy or torch)."""

    rank: int
    size: int
    meter: VolumeMeter

    def allreduce(self, x, op, phase, bucket=None):
        """Elementwise ``op`` (``"sum"`` or ``"max"``) of ``x`` over all ranks; same shape everywhere. ``bucket``:
        None, or the rung of ``x``'s size in a ladder of sizes (``reducers.base.size_bucket``): it goes into the
        collective's name, so that each size has a name of its own (the meter keeps ``phase``)."""

    def allgather(self, x, phase, parts=None):
        """Concatenation along dim 0 of every rank's ``x`` in rank order (first dims may differ). ``parts``: None, or
        the (phase, words) that make up ``x`` (a message of several parts: the opening, a reducer's header and pairs), each metered apart."""

    def grouped_allgather(self, xs, phases):
        """``[allgather(x, phase) for x, phase in zip(xs, phases)]`` in one negotiated collective (the arrays may
        differ in dtype and length; the meter keeps one phase per array)."""

    def alltoall(self, x, splits, phase, parts=None):
        """Send ``splits[q]`` consecutive rows of ``x`` to rank ``q``; returns ``(received, recv_splits)``.

        ``splits`` is a Python list of ``size`` ints; ``received`` is ordered by source rank. ``parts``: None, or a
        function of a message's rows that returns its (phase, rows) parts (a message of several parts: Ok-Topk's
        gather, a header and pairs), each metered apart.
        """

    def broadcast(self, x, root, phase):
        """``x`` of rank ``root`` on every rank."""


def meter_allgather(meter, rank, sizes, itemsize, phase, calls=1):
    """Record one allgather whose per-rank first-dim element counts are ``sizes``."""
    P = len(sizes)
    mine = sizes[rank]
    meter.add(phase, mine * (P - 1), sum(sizes) - mine, itemsize, calls)


def meter_alltoall(meter, rank, splits, recv_splits, itemsize, phase, row_words=1, parts=None):
    """Record one alltoall: what it sends to and receives from the other ranks (the rows a rank sends itself stay
    in its memory). ``parts``: :meth:`Communicator.alltoall`'s; the collective counts once, in the first part."""
    if parts is None:
        sent = (sum(splits) - splits[rank]) * row_words
        recv = (sum(recv_splits) - recv_splits[rank]) * row_words
        meter.add(phase, sent, recv, itemsize)
        return
    calls = 1
    for q, (out, got) in enumerate(zip(splits, recv_splits)):
        if q != rank:
            for (part, sent), (_, recv) in zip(parts(out), parts(got)):
                meter.add(part, sent * row_words, recv * row_words, itemsize, calls)
                calls = 0


def meter_allreduce(meter, P, n, itemsize, phase):
    w = 2 * n * (P - 1) // P if P > 1 else 0
    meter.add(phase, w, w, itemsize)


def meter_broadcast(meter, rank, root, P, n, itemsize, phase):
    if P == 1:
        meter.add(phase, 0, 0, itemsize)
    elif rank == root:
        meter.add(phase, n * (P - 1), 0, itemsize)
    else:
        meter.add(phase, 0, n, itemsize)


def meter_parts(meter, P, parts, itemsize):
    """Record an allgather of a message made of ``parts`` ((phase, words) in order, the same on every rank): each
    rank sends its words to P - 1 ranks and receives theirs. The collective counts once, in its second part when
    the first is the opening's header (whose phase reports control words apart) and has a payload after it."""
    first = 1 if len(parts) > 1 and parts[0][0] == AGREE_PHASE else 0
    for i, (phase, words) in enumerate(parts):
        meter.add(phase, words * (P - 1), words * (P - 1), itemsize, int(i == first))


# -- the opening every step starts with ---------------------------------------------------------------------------
#: meter phase of the opening's header and of an opening that carries nothing else (Horovod name
#: ``hvd_sparse.agree``): control words, reported apart from the algorithm's volume
AGREE_PHASE = "agree"
#: header words of the opening message (module docstring)
AGREE_WORDS = 9
#: the header words that count the real entries of the selection and carry the sparsifier's note
COUNT, NOTE = 1, 2
#: the bits of a float32 -0.0 as an int32: a finite flag too
_NEGATIVE_ZERO = -2**31
#: meter phases of the error path's detail exchange
DETAIL_SIZES, DETAIL = "agree.sizes", "agree.detail"
#: phases whose Horovod collective name is shared by every unit (``hvd_sparse.<name>``, no unit prefix)
SHARED_NAMES = {AGREE_PHASE: "agree", DETAIL_SIZES: DETAIL_SIZES, DETAIL: DETAIL}
#: word 1 of a rank that meets the others for :meth:`~hvd_sparse.core.engine.Engine.gather` rather than for a step
AGREE_GATHER = 2


class SkipStep(Exception):
    """The opening found a NaN or Inf on the ranks ``bad`` (every rank raises it alike): the step is discarded."""

    def __init__(self, bad):
        super().__init__(bad)
        self.bad = bad


def finite(word):
    """Whether a header's word 0 says the rank's accumulator was finite."""
    return word in (0, _NEGATIVE_ZERO)


def header(xp, like, flag, count, note, words, dtype):
    """The opening's header as the pieces of a message of ``dtype`` (int32, or the payload's int64) on ``like``'s
    device: words 0-2, ``flag`` (a host bool: True for non-finite; or a device int32 word, ``xp.nonfinite``),
    ``count`` and ``note``, may be device scalars (written without a host read); ``words``: the host words 3-8."""
    head = [flag, count, note]
    while head and isinstance(head[-1], (bool, int)):   # the host words after the last device one: one copy
        words = [int(head.pop()), *words]
    host = [xp.asarray(list(words), dtype, like=like)]
    return host if not head else [xp.astype(xp.stack([xp.asarray(w, xp.int32, like=like) for w in head]), dtype)] + host


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


def agreement_words(local_error, step, fp):
    """Words 3-8 of the opening's header (module docstring): the local-problem flag (or :data:`AGREE_GATHER`), the
    step counter and the fingerprint."""
    return [int(local_error), int(step) & 0x7FFFFFFF, *fp]


def agreed(table, flag=0):
    """``table``: the gathered (P, AGREE_WORDS) int rows. True when every rank reported the same step and fingerprint
    and word 1 equal to ``flag`` (0: no local problem; :data:`AGREE_GATHER`: every rank is in a gather)."""
    first = table[0]
    return all(row[3] == flag for row in table) and all(row[4:9] == first[4:9] for row in table)


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


class Agreement:
    """One unit's side of the agreement: the description its ranks must share (computed only when what it covers
    changes: keyed on the layout and the step's options) and the opening collective that proves it
    (:meth:`open`, the module docstring)."""

    def __init__(self):
        self._cache = (None, None, None)        # (key, description, fingerprint)

    def describe(self, unit, compression, entries, options):
        """``(description, fingerprint)`` of the unit's ``entries`` (layout) and step ``options``."""
        key = (unit, entries, options)
        if self._cache[0] != key:
            desc = describe(unit, compression, entries, options)
            self._cache = (key, desc, fingerprint(desc))
        return self._cache[1], self._cache[2]

    @staticmethod
    def open(comm, xp, like, desc, fp, step, *, nonfinite=False, local_error=None, flag=0, payload=None, count=0,
             note=0, parts=(), read=0):
        """The opening (P > 1): one allgather of ``[header | payload]`` (``payload``: an array, or the list of the
        pieces it is made of) under the shared name; returns ``(table, rows)``: the P headers and the first ``read``
        words of each payload as host lists (the one read) and the P payloads, (P, m) on ``like``'s device.
        Raises :class:`RankDisagreementError` on every rank when a message length, the step, the fingerprint or
        word 1 (``flag``: 0, or :data:`AGREE_GATHER`) differs, or a rank reports a ``local_error`` (its text)."""
        pieces = [] if payload is None else payload if isinstance(payload, list) else [payload]
        dtype = xp.dtype_of(pieces[0]) if pieces else xp.int32
        words = agreement_words(flag or local_error is not None, step, fp)
        msg = xp.concat(header(xp, like, nonfinite, count, note, words, dtype) + pieces, like=like)
        L = xp.numel(msg)
        out = comm.allgather(msg, AGREE_PHASE, parts=[(AGREE_PHASE, AGREE_WORDS), *parts])
        if xp.numel(out) == comm.size * L:
            rows = xp.reshape(out, (comm.size, L))
            table = xp.to_list(xp.columns(rows, 0, AGREE_WORDS + read))
            if agreed(table, flag):
                return table, xp.columns(rows, AGREE_WORDS, L - AGREE_WORDS)
        per_rank = explain(xp, comm, dict(desc, step=step, local_error=local_error), like)
        raise RankDisagreementError(disagreement_message(per_rank))
