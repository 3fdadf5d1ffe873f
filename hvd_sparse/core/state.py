"""What a rank keeps between steps: error feedback's residual (:class:`ErrorFeedback`), the statistics of its
exchanges (:class:`SparsityWindow`) and the state of one training job: the engines of its units (:class:`UnitStates`).

**Error feedback** (docs/algorithms.md#error-feedback), the residual each rank carries between steps:

Per step, on every rank:  1. acc = residual + grad          (float32, in a spare buffer of the same size)
                          2. the reducer returns the included set I (S, or S ∩ G for Ok-Topk and gTopk)
                          3. residual = acc with residual[I] = 0

Invariant (mass conservation, not gTopk): P·Σ updates + Σ residuals over ranks == Σ grads, exact on integer data.
The residual stays float32 whatever the gradient dtype, and is per rank: never broadcast, never averaged.

Momentum correction (Deep Gradient Compression, Lin et al., ICLR 2018), when the compression asks for it
(``momentum_correction = m > 0``): the optimizer's momentum moves into error feedback, so that what is
accumulated and selected is the velocity, not the raw gradient --

    0. u = m·u + grad                             (the velocity, float32, per rank; then acc = residual + u)
    3'. u[I] = 0  on sparse steps                 (momentum factor masking: an entry that was sent restarts
                                                   its velocity, as its residual does)

Without it, a sent entry's stale momentum keeps pushing it with the optimizer's velocity while the residual of
the other entries lags behind. Dense steps (the warm-up) do not mask: their result is the exact average of the
velocities, i.e. plain momentum SGD. The invariant becomes P·Σ updates + Σ residuals == Σ u (the velocities fed).

**The statistics window**: what Keras' ``SparsityCallback`` logs and what
``hvd_sparse.torch.DistributedOptimizer.sparse_stats(average=True)`` returns, averaged over a window of steps and
over the ranks.

Every rank adds the statistics of each of its exchanges (``Engine.last``) to a :class:`SparsityWindow`. A report is
one collective: every rank contributes :meth:`SparsityWindow.local` (five float64 numbers) to a *sum* allreduce,
and :func:`averaged` turns the sum into

    density        selected / n of the exchanged gradient: mean over the window's steps, then over the ranks
    sent_bytes     bytes a rank sent per step, same averaging
    recv_bytes     bytes a rank received per step, same averaging
    residual_norm  L2 norm of the error-feedback residual at the time of the report, mean over the ranks

identical on every rank. A window without any sparse step on any rank (Horovod's dense optimizer) reports Horovod's
ring allreduce instead: density 1 and ``2 n (P - 1) / P * 4`` bytes each way (float32 gradients of n weights), so
that dense and sparse runs plot on the same axes.

**The state of a job**: a :class:`~hvd_sparse.compression.SparseCompression` is frozen configuration (sparsifier,
reducer, options); a :class:`UnitStates` is the state one training job keeps on this rank, made from it by
``compression.reify()`` -- one engine per unit (``"model"`` for an optimizer or tape, the name of a
``sparse_allreduce``), each with its residual, thresholds, partitions and step counters. An optimizer reifies its
own; the call sites without an object of their own (a TensorFlow tape, ``sparse_allreduce``) share the preset's
``shared_state()``. As PyTorch's ``PowerSGDState`` beside its hook, every framework adapter goes through the public
methods below, so checkpoints have one format and one set of checks, and elastic Horovod's commit/restore/reset are
written once:

* :meth:`UnitStates.engine` -- the engine of a unit, created at its first use (a restored state applied then);
* :meth:`UnitStates.state_dict` / :meth:`UnitStates.load_state_dict` -- a checkpoint of this rank, checked for
  rank, number of ranks and preset on load (the layout is checked by the engine at its next step);
* :meth:`UnitStates.snapshot` / :meth:`UnitStates.restore` / :meth:`UnitStates.reset` -- elastic Horovod.
"""

from __future__ import annotations

import copy

import numpy as np

from .comm import config_of
from .reducers.base import ALL


# -- error feedback -----------------------------------------------------------------------------------------------
class ErrorFeedback:
    """The residual of one sparsification unit on one rank ("gradient mode": raw gradients, no lr).

    Two float32 buffers of n + 1 values, reused across steps on numpy and torch (no allocation, no page faults
    after the first steps): the residual and a spare that receives ``acc = residual + grad``. The last value of each
    is a zero at index n, where the padding of a fixed-size selection points (``core/comm.py``): it is read as 0 and
    written with 0, so a reducer reads and clears padded selections without cutting them first. :attr:`residual`
    and the ``acc`` that :meth:`compensate` returns are the first n values; :attr:`padded` is the whole spare.
    The residual is not touched until :meth:`update`, so a step that is abandoned after :meth:`compensate` (a
    non-finite gradient somewhere) leaves it exactly as it was; :meth:`update` zeroes the included entries of
    ``acc`` and swaps the two buffers. TensorFlow tensors are immutable: there each step makes new ones.
    """

    __slots__ = ("residual", "velocity", "padded", "_base", "_spare", "_found", "_views", "_velocity_base",
                 "_velocity_spare")

    def __init__(self):
        self.residual = None    # the first n values of _base (or an array of n, restored or replaced)
        self.velocity = None    # momentum correction's u (None: off, or before the first step)
        self.padded = None      # the step's acc with its zero at index n (the spare, while a step runs)
        self._base = None       # the residual's buffer of n + 1, when it is one of ours
        self._spare = None
        self._found = ()        # entries the last add pass selected, per piece (sizes the next one's output)
        self._views = {}        # id of a buffer of n + 1 -> (the buffer, its first n values): made once each
        self._velocity_base = None    # (buffer of n + 1, its first n values) that holds the velocity, when ours
        self._velocity_spare = None   # the same, that the next step's velocity is written into

    def _first_n(self, buf, n):
        """``buf[:n]``, the same view every step (a device pays for each view it makes)."""
        held = self._views.get(id(buf))
        if held is None or held[0] is not buf:
            if len(self._views) > 2:
                self._views.clear()
            held = self._views[id(buf)] = (buf, buf[:n])
        return held[1]

    def next_velocity(self, xp, pieces, momentum):
        """``[momentum·u + concat(pieces)]`` (float32), the input of :meth:`compensate` in place of the gradient
        pieces; ``u`` itself changes only in :meth:`commit_velocity` (a skipped step leaves it). Where arrays are
        mutable it is written into the spare of two buffers of n + 1 (the other holds ``u``), in the two passes
        ``u·momentum``, then ``+ grad``, the same bits as new arrays."""
        flat = xp.astype(pieces[0] if len(pieces) == 1 else xp.concat(pieces), xp.float32)
        u = self.velocity
        if u is None:
            return [xp.copy(flat)]
        if type(u) is not type(flat):                       # restored from a checkpoint (numpy)
            u = xp.asarray(np.array(u, copy=True), xp.float32, like=flat)
        if not xp.mutable:
            return [xp.add(xp.mul(u, momentum), flat)]
        n = xp.numel(flat)
        spare = self._velocity_spare
        if spare is None or type(spare[0]) is not type(flat) or xp.numel(spare[0]) != n + 1 \
                or getattr(spare[0], "device", None) != getattr(flat, "device", None):
            buf = xp.stream_buffer(n + 1, flat)
            spare = self._velocity_spare = (buf, buf[:n])
            self._velocity_base = None
        out = spare[1]
        xp.mul_into(u, momentum, out)
        return [xp.add_into(out, flat, out)]

    def commit_velocity(self, xp, velocity, included):
        """``u = velocity`` with momentum factor masking: ``u[included] = 0`` (``included`` may hold the padding
        index n), except when every entry was sent (``included`` is ALL: a dense step). A velocity written into the
        spare buffer (:meth:`next_velocity`) is masked there, with its zero at index n, and the buffers swap."""
        n = xp.numel(velocity)
        spare = self._velocity_spare
        if spare is not None and velocity is spare[1]:
            if included is not ALL:
                xp.put_(spare[0], included, 0.0)
            if self._velocity_base is None:
                buf = xp.stream_buffer(n + 1, velocity)
                self._velocity_base = (buf, buf[:n])
            self._velocity_base, self._velocity_spare = spare, self._velocity_base
            self.velocity = velocity
            return
        if included is ALL:
            self.velocity = velocity
            return
        ext = xp.put_(xp.concat([velocity, xp.zeros(1, xp.float32, like=velocity)], like=velocity), included, 0.0)
        self.velocity = ext[:n]

    def compensate(self, xp, pieces, zero_pieces=False, select=None):
        """``acc = residual + concat(pieces)`` (float32; the pieces are 1-D, of any float dtype, read once and
        not modified, unless ``zero_pieces``: then they are zeroed in the same pass -- for a caller whose output
        goes into them and is sparse). ``acc`` is a buffer of this object: read it, do not keep it past the step;
        :attr:`padded` is the same with a zero at index n.

        ``select``: None, or ``(threshold, rule, expect)`` (rule one of ``native.RULES``, expect the count the
        caller expects): then the same pass also collects the entries of ``acc`` that the rule selects
        (the backend's ``accumulate_``), when the fused CPU kernel runs for every piece. The output
        room of each piece follows the larger of its share of ``expect`` and what the last such pass found in it (a
        threshold that trails a growing accumulator finds a few times k, unevenly across the layers: ThresholdReuse's
        guard then raises it on the candidates).

        Returns ``(acc, finite, selected)``: ``finite`` is whether every entry of ``acc`` is finite when the pass
        could tell on the way (the fused CPU kernel, float32 pieces), else None; ``selected`` is ``(indices,
        values)`` (numpy int64 ascending, float32: exactly ``xp.scan(acc).select(threshold, rule, values=True)``)
        or None (not asked for, or not every piece took the kernel)."""
        n = sum(xp.numel(p) for p in pieces)
        like = pieces[0]
        r = self.residual
        if r is not None and type(r) is not type(like):     # restored from a checkpoint (numpy)
            r = self.residual = xp.asarray(np.array(r, copy=True), xp.float32, like=like)
            self._base = None
        if not xp.mutable:
            flat = xp.astype(pieces[0] if len(pieces) == 1 else xp.concat(pieces), xp.float32)
            acc = xp.copy(flat) if r is None else xp.add(r, flat)
            self.padded = xp.concat([acc, xp.zeros(1, xp.float32, like=like)], like=like)
            return acc, None, None
        spare = self._spare
        if spare is None or type(spare) is not type(like) or xp.numel(spare) != n + 1 or spare is self._base:
            spare = self._spare = xp.stream_buffer(n + 1, like)
            xp.fill_(spare[n:], 0.0)
        acc = self._first_n(spare, n)
        sel = None
        if select is not None:                          # each piece's output room
            th, rule, expect = select
            last = self._found if len(self._found) == len(pieces) else (0,) * len(pieces)
            sel = (th, rule, [max(int(expect) * xp.numel(p) // max(n, 1), last[j] + last[j] // 4)
                              for j, p in enumerate(pieces)])
        finite, found = xp.accumulate_(r, pieces, acc, zero_g=zero_pieces, select=sel)
        selected = None
        if found is not None:
            selected = found[0] if len(found) == 1 else (np.concatenate([i for i, _ in found]),
                                                          np.concatenate([v for _, v in found]))
            self._found = tuple(int(i.size) for i, _ in found)
        self.padded = spare
        return acc, finite, selected

    def update(self, xp, acc, included):
        """``residual = acc`` with the ``included`` entries zeroed (``acc`` from :meth:`compensate`; ``included``
        may hold the padding index n)."""
        padded, self.padded = self.padded, None
        if included is ALL:
            self.residual, self._base = None, None
            return
        n = xp.numel(acc)
        if not xp.mutable:
            self.residual = xp.put_(padded, included, 0.0)[:n]
            return
        base = xp.put_(padded, included, 0.0)
        self._spare, self._base = self._base, base
        self.residual = self._first_n(base, n)

    def replace(self, residual):
        """Take ``residual`` (a reducer's own, e.g. SparDL's global residual collection) as the residual."""
        self._spare = self._base = self.padded = None
        self._views = {}
        self.residual = residual

    def norm(self, xp):
        """L2 norm of the residual (0.0 before the first step)."""
        if self.residual is None:
            return 0.0
        r = xp.to_numpy(self.residual).astype("float64")
        return float((r * r).sum() ** 0.5)


# -- the statistics window ---------------------------------------------------------------------------------------
FIELDS = ("density", "sent_bytes", "recv_bytes", "across_sent_bytes", "across_recv_bytes")
KEYS = FIELDS + ("residual_norm",)
#: what an ``across_`` field is where a step does not tell the hosts apart (a flat step: all its bytes)
ACROSS_OF = {"across_sent_bytes": "sent_bytes", "across_recv_bytes": "recv_bytes"}


def dense_bytes(n, size):
    """Bytes a rank sends (and receives) per step in Horovod's ring allreduce of n float32 values."""
    return 2.0 * n * (size - 1) / size * 4 if size > 1 else 0.0


#: the Horovod name of the sum-allreduce of ``sparse_stats(average=True)``, torch's and TensorFlow's alike
STATS_NAME = "hvd_sparse.model.sparse_stats"


class SparsityWindow:
    """This rank's running sums of :data:`FIELDS` since the last :meth:`clear`."""

    def __init__(self):
        self.clear()

    def clear(self):
        self.steps = 0
        self.sums = [0.0] * len(FIELDS)

    def add(self, stats):
        """Add one step's statistics (a dict with :data:`FIELDS`, the ``across_`` ones of a two-level step: what
        crossed between the hosts; a flat step's: all its bytes; empty: no sparse step, ignored)."""
        if not stats:
            return
        self.steps += 1
        for i, key in enumerate(FIELDS):
            self.sums[i] += float(stats.get(key, stats.get(ACROSS_OF.get(key), 0.0)))

    def local(self, residual_norm=0.0):
        """This rank's contribution to the sum allreduce: [1 if it made a sparse step else 0, the means of
        :data:`FIELDS` over its steps, its residual norm]."""
        s = self.steps
        return [1.0 if s else 0.0] + [v / s if s else 0.0 for v in self.sums] + [float(residual_norm)]

    def average(self, residual_norm, size, sum_over_ranks):
        """``sparse_stats(average=True)``: this window's statistics averaged over its steps and over the ``size``
        ranks, ``{}`` when no rank made a sparse step; the window then starts afresh. ``sum_over_ranks(local)``:
        the framework's float64 sum-allreduce of :meth:`local` (named :data:`STATS_NAME`) as a list, called
        when ``size > 1``: a collective, so every rank calls this at the same point."""
        local = self.local(residual_norm)
        total = sum_over_ranks(local) if size > 1 else local
        self.clear()
        return averaged(total, size) if total[0] > 0 else {}


def averaged(total, size, numel=None):
    """The report (a dict of :data:`KEYS` -> float) from the sum over ``size`` ranks of their :meth:`local`
    vectors; ``numel`` (an int, or a callable returning it) is only needed when no rank made a sparse step."""
    total = [float(v) for v in total]
    ranks = total[0]
    if ranks > 0:
        out = {key: total[1 + i] / ranks for i, key in enumerate(FIELDS)}
    else:
        n = numel() if callable(numel) else (numel or 0)
        out = {"density": 1.0, **{key: dense_bytes(n, size) for key in FIELDS[1:]}}
    out["residual_norm"] = total[1 + len(FIELDS)] / size
    return out


# -- the engines of a preset -------------------------------------------------------------------------------------
#: version of the :meth:`UnitStates.state_dict` format
STATE_VERSION = 1


class UnitStates:
    """The state of one training job on this rank: its engines, by unit, and the states restored but not yet used
    by a step. Made by ``SparseCompression.reify()`` (or ``shared_state()``).

    Args:
        compression (SparseCompression): the configuration the engines are made from.
    """

    def __init__(self, compression):
        self.compression = compression
        self._engines = {}          # unit -> Engine
        self._pending = {}          # unit -> Engine.state_dict(), applied at the unit's next step

    # -- engines --------------------------------------------------------------------------------------------
    def engine(self, unit, make_comm):
        """The engine of ``unit``, created on first use over ``make_comm()``; a state restored or kept for the unit
        (load_state_dict, restore, reset) is loaded into it then."""
        engine = self._engines.get(unit)
        if engine is None:
            engine = self._engines[unit] = self.compression.new_engine(make_comm(), unit)
            if unit in self._pending:
                engine.load_state_dict(self._pending.pop(unit))
        return engine

    def get(self, unit):
        """The engine of ``unit`` if it exists, else None; creates nothing."""
        return self._engines.get(unit)

    def empty(self):
        """True while no unit has an engine or a state restored for its first step."""
        return not self._engines and not self._pending

    def last_stats(self, unit):
        """The statistics of ``unit``'s last step on this rank (``Engine.last`` without the reducer's ``info`` and
        the budget split's ``tally``), or ``{}`` before its first step."""
        engine = self.get(unit)
        if engine is None or not engine.steps:
            return {}
        return {key: value for key, value in engine.last.items() if key not in ("info", "tally")}

    def residual_norm(self, unit):
        """L2 norm of the residual of ``unit``: its engine's, or the one restored for its next step; 0.0 if none."""
        engine = self.get(unit)
        if engine is not None:
            return engine.residual_norm()
        r = self._pending.get(unit, {}).get("residual")
        return 0.0 if r is None else float((np.asarray(r, dtype=np.float64) ** 2).sum() ** 0.5)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def snapshot(self):
        """A copy of this rank's state of every unit (engine ``state_dict()`` s, states restored but not yet used
        included): what an elastic commit keeps. No collective and no check, so that it can be restored while
        Horovod is down (after a failure, before the reset)."""
        units = {unit: engine.state_dict() for unit, engine in self._engines.items()}
        for unit, state in self._pending.items():
            units.setdefault(unit, copy.deepcopy(state))
        return units

    def restore(self, units):
        """Roll every unit back to ``units`` (a :meth:`snapshot`): loaded into the engines that exist, applied at
        their first step for the others; an engine created after the snapshot is dropped (it starts afresh)."""
        for unit in [u for u in self._engines if u not in units]:
            del self._engines[unit]
        pending = {}
        for unit, state in units.items():
            engine = self._engines.get(unit)
            if engine is not None:
                engine.load_state_dict(copy.deepcopy(state))
            else:
                pending[unit] = copy.deepcopy(state)
        self._pending = pending

    def reset(self, keep_residuals):
        """After an elastic reset (ranks left or joined): every unit starts afresh at its next step -- a new engine
        over the new process set, partitions, thresholds and step counters from scratch, as at step 0 of a run --
        with this rank's residual carried over (``keep_residuals``) or zero."""
        units = self.snapshot()
        self._engines.clear()
        pending = {}
        for unit, state in units.items():
            if keep_residuals and state.get("residual") is not None:
                fresh = self.compression.new_engine(None, unit).state_dict()       # the state of step 0
                fresh.update(numel=state["numel"], residual=state["residual"])
                pending[unit] = fresh
        self._pending = pending

    def state_dict(self, rank, size):
        """This rank's checkpoint: ``{"version", "rank", "size", "compression", "units": {unit:
        Engine.state_dict()}}`` (numpy arrays and Python values), the same for every framework."""
        return {"version": STATE_VERSION, "rank": rank, "size": size,
                "compression": state_signature(self.compression), "units": self.snapshot()}

    def load_state_dict(self, state, rank, size, api):
        """Restore :meth:`state_dict`: at once into the units that exist, at their first step into the others.
        Raises ValueError (and restores nothing) for something else, or a state of another rank, another number
        of ranks or another preset."""
        check_state_format(state, api)
        check_state_origin(state, rank, size, self.compression, api)
        pending = {}
        for unit, state_u in state["units"].items():
            engine = self.get(unit)
            if engine is not None:
                engine.load_state_dict(state_u)
            else:
                pending[unit] = state_u
        self._pending = pending


def state_signature(compression):
    """What a sparse state must have been saved with: the sparsifier's and reducer's full configuration (the
    density and every period included) and the byte budget, if any (a budget's sparsifier carries the density for one
    rank, which a preset with that density would share)."""
    reducer = config_of(compression.reducer)
    args = ", ".join(f"{k}={v!r}" for k, v in reducer.items() if k != "class")
    budget = getattr(compression, "byte_budget", None)
    return f"{compression.sparsifier!r} + {reducer['class']}({args})" + \
        (f" within byte_budget={budget!r}" if budget is not None else "")


def check_state_origin(state, rank, size, compression, api):
    """Raise ValueError unless ``state`` (with ``rank``, ``size`` and ``compression`` keys) was saved by this
    rank, with this number of ranks and this compression (shared by the torch and TensorFlow checkpoints)."""
    if state["size"] != size or state["rank"] != rank:
        raise ValueError(f"{api}: this sparse state was saved by rank {state['rank']} of {state['size']}, but this "
                         f"is rank {rank} of {size}; residuals are per rank: every rank must restore the "
                         "checkpoint it wrote itself (put hvd.rank() in the checkpoint path), with the same number "
                         "of ranks")
    if state["compression"] != state_signature(compression):
        raise ValueError(f"{api}: this sparse state was saved with {state['compression']}, but it is being restored "
                         f"into {state_signature(compression)}; rebuild the same compression preset (same scheme and "
                         "arguments) before restoring")


def check_state_format(state, api):
    """Raise ValueError unless ``state`` is a :meth:`UnitStates.state_dict`."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "units" not in state:
        keys = sorted(state) if isinstance(state, dict) else ""
        raise ValueError(f"{api}: not a sparse state saved by hvd_sparse (sparse_state_dict() or SparseState), got "
                         f"{type(state).__name__} with keys {keys}")
