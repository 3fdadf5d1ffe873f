"""One sparse step of one sparsification unit on one rank: where sparsifier, error feedback, reducer and
communicator meet (docs/design.md#engine). Framework adapters and the simulator both drive this class.

    step(grad), one method per stage:
        1. _plan        what this step is: pieces, reducer, k = max(1, floor(d·n)), a local problem
        2. _accumulate  acc = residual + grad                         # state.py (float32)
        3. _agreement   every rank exchanges the same thing, or all raise; a NaN/Inf anywhere -> _skip
        4. _reduce      S = sparsifier.select(acc, k, ctx)            # sparsifiers/<scheme>.py
                        u, I, info = reducer.reduce(acc, S, comm)     # reducers/<scheme>.py: global sum, included set
        5. _commit      residual = acc with acc[I] = 0                # state.py (or info["residual"], e.g. SparDL)
                        sparsifier.update(info, ctx)                  # threshold / partition controllers, if any
        6. _emit        u · prescale · postscale / P                  # average (op=Average) or u (op=Sum), grad dtype

The modes are data of the plan, not branches of the step: the dense reducer (the ``dense`` preset, and warm-up
steps) skips selection and residual; an empty gradient and a local problem stop after the agreement. Two options
of the compression change the step:

* ``warmup_dense_steps = N``: the first N steps are a dense allreduce of ``acc`` (every entry is included, so the
  residual stays empty); the sparsifier and reducer neither run nor change state, and their step counter
  (``ctx.step``) starts at 0 on the first sparse step, on every rank alike;
* ``momentum_correction = m``: the velocity ``u = m·u + grad`` replaces ``grad`` above and is zeroed where the
  step's included set was sent (state.py: ErrorFeedback); the user's optimizer then runs without momentum.

Per-step statistics (selected count, achieved density, words and bytes sent and received) are kept in
:attr:`Engine.last`.

Agreement: before any data collective every rank takes part in the agreement step (:mod:`hvd_sparse.core.comm`)
(one allgather of a 7-word vector, Horovod name ``hvd_sparse.agree``, phase ``nonfinite``; P = 1: none): a
non-finite flag, a local-problem flag, the step counter and a fingerprint of the unit, its preset and arguments
and the layout (:meth:`Engine.declare`). A difference raises
:class:`~hvd_sparse.core.errors.RankDisagreementError` on every rank, naming what differs and the ranks.

Layout changes (:meth:`Engine.declare` with other entries: a parameter group added, a parameter frozen or
unfrozen): the engine starts afresh -- thresholds, partitions and the step counter as at step 0 of a run, on
every rank alike -- and the residual follows the tensors by name: a tensor that stays keeps its residual, a new
one starts from zeros, the residual of one that left is dropped. A unit declared ``fixed`` (TensorFlow, whose tape
is created anew every step, so the preset owns the state) refuses a change instead: another layout is another
model, reported on every rank.

Non-finite gradients (``nonfinite=``): the agreement tells every rank which ranks hold a NaN or Inf. Then, on
every rank alike,

* ``"skip"`` (default, like AMP's ``GradScaler``): the step is skipped -- residual, thresholds, partitions and
  the step counter are left untouched, nothing is selected or exchanged, :attr:`Engine.last` says
  ``skipped=True`` and names the ranks (as does a ``RuntimeWarning``), and the returned gradient is all NaN on
  every rank, so a loss scaler that inspects it backs off on every rank and the adapters skip the optimizer update;
* ``"raise"``: :class:`NonFiniteGradientError` names the ranks and the step, on every rank.

The agreement's 28 bytes are reported as ``control_bytes`` and not added to the algorithm's volume.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np

from .comm import (AGREE_GATHER, AGREE_PHASE, AGREE_WORDS, agreed, agreement_vector, describe, explain,
                   fingerprint)
from .context import Plan, Prefiltered, StepContext, StepStats
from .errors import NonFiniteGradientError, RankDisagreementError, disagreement_message
from .state import ErrorFeedback
from .reducers.base import SparseSum
from .reducers.dense import Dense
from .xp import backend_of


#: the reducer of the dense warm-up steps (``warmup_dense_steps``)
_DENSE = Dense()


def _offsets(xp, arrays):
    """[0, n_0, n_0 + n_1, ..., n]: where each array starts in the flat buffer (and the end)."""
    offs = [0]
    for a in arrays:
        offs.append(offs[-1] + xp.numel(a))
    return offs


def _carry_by_name(flat, old, entries):
    """``flat`` (a per-entry buffer laid out as ``old``, or None) laid out as ``entries``: the part of every
    parameter that stays (same name and shape) is kept, new ones start from zeros."""
    if flat is None:
        return None
    xp = backend_of(flat)
    offs, where = 0, {}
    for name, shape, _ in old:
        m = int(np.prod(shape))
        where[name] = (offs, shape)
        offs += m
    parts = []
    for name, shape, _ in entries:
        m = int(np.prod(shape))
        at = where.get(name)
        parts.append(flat[at[0]:at[0] + m] if at is not None and at[1] == shape
                     else xp.zeros(m, xp.float32, like=flat))
    return xp.concat(parts, like=flat) if parts else None


def _first_change(old, new):
    """How declared ``new`` entries differ from ``old`` ones: the first position that differs, or the count."""
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            return (f"the tensors exchanged differ from those its state was built for: position {i} is {b[0]!r} "
                    f"{b[1]} {b[2]} now but was {a[0]!r} {a[1]} {a[2]}")
    return (f"the tensors exchanged differ from those its state was built for: {len(new)} tensors now but "
            f"{len(old)} then")


class Engine:
    """State and step of one sparsification unit on one rank.

    Args:
        compression (SparseCompression): the sparsifier/reducer pair and its knobs.
        comm (Communicator): this rank's view of the process set.
        name (str): the unit's name, used in messages and state.
    """

    def __init__(self, compression, comm, name="model"):
        self.compression = compression
        self.comm = comm
        self.name = name
        self.memory = ErrorFeedback()
        self.sparsifier_state = compression.sparsifier.initial_state() if compression.sparsifier else {}
        self.reducer_state = compression.reducer.initial_state()
        self.steps = 0
        self.numel = None
        self.layout = None      # numels of the tensors in the flat buffer (set by adapters / simulate)
        self.last = StepStats()
        self.skipped_steps = 0  # steps skipped for non-finite gradients (not counted in ``steps``)
        self.notes = ()         # declared (key, value) pairs the ranks must also agree on
        self.entries = None     # declared layout: ((name, shape, dtype), ...) in exchange order, or None
        self.refused = None     # why the last declare(fixed=True) was refused, reported by the next step
        self._agree = (None, None, None)     # (key, description, fingerprint) of the last agreement

    def declare(self, entries, notes=(), fixed=False):
        """Declare what the next steps exchange: ``entries``, a tuple of ``(name, shape, dtype)`` in the order of
        the flat gradient, and ``notes``, ``(key, value)`` pairs that every rank must also agree on (e.g. which
        parameters an adapter exchanges elsewhere). Cheap when unchanged. A change of ``entries`` after the first
        declaration starts the unit afresh and carries the residual by name (module docstring); every rank must
        declare the same (the agreement checks).

        ``fixed=True``, for a unit whose state belongs to the preset itself rather than to an optimizer (TensorFlow's
        tape, which is created anew every step): the entries first declared (or restored) stay, and other entries
        mean another model -- a problem the next step reports on every rank (``RankDisagreementError``; P = 1:
        ValueError) instead of starting afresh."""
        self.notes = tuple(notes)
        entries = tuple((str(n), tuple(int(d) for d in s), str(t)) for n, s, t in entries)
        self.refused = None
        if entries == self.entries:
            return
        if fixed and self.entries is not None:
            self.refused = (f"hvd_sparse unit '{self.name}': {_first_change(self.entries, entries)}; one "
                            "compression object cannot serve two models (create one per model/optimizer)")
            return
        old, self.entries = self.entries, entries
        self.layout = [int(np.prod(s)) for _, s, _ in entries]
        if old is None:
            return
        self.memory.replace(_carry_by_name(self.memory.residual, old, entries))
        self.memory.velocity = _carry_by_name(self.memory.velocity, old, entries)
        self.sparsifier_state = self.compression.sparsifier.initial_state() if self.compression.sparsifier else {}
        self.reducer_state = self.compression.reducer.initial_state()
        self.steps = 0
        self.numel = None

    @property
    def unit(self):
        """The unit's identity across ranks (agreement, messages): the communicator's collective prefix when it
        has one (unique per optimizer / ``sparse_allreduce`` name), else its name."""
        return getattr(self.comm, "unit", None) or self.name

    # -- one step ------------------------------------------------------------------------------------
    def step(self, grad, average=True, prescale=1.0, postscale=1.0, nonfinite="skip", out=None):
        """Run one step on the flat gradient ``grad``, in the stages of the module docstring:

        1. check -- what this step is (:meth:`_plan`: its pieces, its mode and reducer, a local problem);
        2. accumulate -- ``acc = residual + grad`` (:meth:`_accumulate`);
        3. agree -- the agreement (:meth:`_agreement`), or the skip of a non-finite step (:meth:`_skip`);
        4. reduce -- selection and the reducer's exchange (:meth:`_reduce`);
        5. commit -- residual, controllers and counters (:meth:`_commit`);
        6. emit -- the result, scaled, in the gradient's dtype (:meth:`_emit`).

        Args:
            grad: a 1-D numpy array / torch tensor / TF tensor, or a list of 1-D ones: the pieces of the flat
                gradient in layout order (e.g. views of every ``p.grad``; read once, never modified, not copied).
            out: None (default), or a list of 1-D arrays, one per piece and of its size (they may be the very
                pieces of ``grad``): the result is written into them, cast to each one's dtype. When they are the
                pieces and the reducer's result is sparse (``Reducer.sparse_result``), the pieces are zeroed as
                they are read, so they hold zeros if the step then raises.
        Returns:
            the reduced flat gradient in ``grad``'s dtype (``out`` None), or ``out``; bit-identical on every
            rank (all NaN when a non-finite gradient on any rank skipped the step: see the module docstring).
        """
        plan = self._plan(grad, out)
        agree_args = (average, prescale, postscale, nonfinite)
        if plan.local_error is not None:     # reported on every rank: nothing is read, nothing sent
            self._agreement(plan, True, plan.local_error, *agree_args)
        if plan.n == 0:                      # an empty gradient: agreed on, nothing to select or send
            self._agreement(plan, True, None, *agree_args)
            self.steps += 1
            self.last = StepStats(n=0, k=0, selected=0, density=0.0, info={}, skipped=False, nonfinite_ranks=[],
                                  control_bytes=self.comm.meter.totals()["sent_bytes"], sent_bytes=0, recv_bytes=0,
                                  sent_words=0, recv_words=0, collectives=0)
            return self._emit(plan.xp, plan.xp.zeros(0, plan.xp.float32, like=plan.pieces[0]), 1.0, plan.pieces, out)
        acc, finite, plan = self._accumulate(plan)
        bad = self._agreement(plan, plan.xp.all_finite(acc) if finite is None else finite, None, *agree_args)
        control = self.comm.meter.totals()["sent_bytes"]
        self.comm.meter.reset()
        if bad:
            return self._skip(plan, acc, bad, nonfinite, control, out)
        u, included, info, selected = self._reduce(plan, acc)
        self._commit(plan, acc, included, info)
        self.last = StepStats(n=plan.n, k=plan.k, selected=selected, density=selected / plan.n, info=info,
                              skipped=False, nonfinite_ranks=[], control_bytes=control, **self.comm.meter.totals())
        scale = float(prescale) * float(postscale) / (self.comm.size if average else 1)
        return self._emit(plan.xp, u, scale, plan.pieces, out, plan.zeroed)

    def _plan(self, grad, out):
        """Stage 1, check: the step's :class:`~hvd_sparse.core.context.Plan` -- its pieces, the reducer (the
        preset's, or the dense one of a warm-up step), the context of the sparsifier and reducer, and a local problem
        to report on every rank (a gradient of another size than declared). At P = 1 a local problem raises at once."""
        pieces = list(grad) if isinstance(grad, (list, tuple)) else [grad]
        if not pieces:
            raise ValueError(f"hvd_sparse unit '{self.name}': no gradient pieces")
        xp = backend_of(pieces[0])
        sizes = [xp.numel(p) for p in pieces]
        n = sum(sizes)
        if out is not None and [xp.numel(o) for o in out] != sizes:
            raise ValueError(f"hvd_sparse unit '{self.name}': out must hold one array per gradient piece, "
                             f"of sizes {sizes}")
        local_error = self._local_error(n)
        if local_error is not None and self.comm.size == 1:
            raise ValueError(local_error)
        if local_error is None and self.numel is None:
            self.numel = n
        comp = self.compression
        warmup = getattr(comp, "warmup_dense_steps", 0)
        momentum = getattr(comp, "momentum_correction", 0.0)
        warm = self.steps < warmup
        reducer = _DENSE if warm else comp.reducer
        inputs = self.memory.next_velocity(xp, pieces, momentum) if momentum else pieces
        self.comm.meter.reset()
        sparsifier = comp.sparsifier
        ctx = StepContext(self.comm.rank, self.comm.size, self.steps - (0 if warm else warmup),
                          tuple(self.layout) if self.layout is not None else (n,), self.comm,
                          bool(sparsifier is not None and sparsifier.exact_k))
        # A sparse result that goes into the very gradient buffers lets the accumulating pass zero them, too.
        zeroed = bool(reducer.sparse_result and out is not None and inputs is pieces
                      and all(o is p for o, p in zip(out, pieces)))
        return Plan(xp, pieces, n, inputs, reducer, warm, momentum, ctx, zeroed, local_error,
                     sparsifier.k_for(n) if reducer.sparse else n)

    def _local_error(self, n):
        """What this rank alone knows is wrong with a gradient of ``n`` entries, or None."""
        if self.refused is not None:
            return self.refused
        if self.entries is not None and sum(self.layout) != n:
            return f"the gradient has {n} entries, but the declared layout holds {sum(self.layout)}"
        if self.numel is not None and n != self.numel:
            return (f"hvd_sparse unit '{self.name}': the gradient has {n} entries, but this compression state "
                    f"was built for {self.numel}; one compression object cannot serve two models (create one per "
                    "model/optimizer)")
        return None

    def _accumulate(self, plan):
        """Stage 2: ``(acc, finite, plan)``. Sparse reducers read the gradient once, into ``acc = residual + grad``
        in error feedback's spare buffer (the residual itself is untouched until the step succeeds), with the
        candidates of a sparsifier that knows its threshold before the step (Ok-Topk's reuse steps: one read pass
        less; ``plan.ctx.prefiltered``). A warm-up step's ``acc`` is a fresh array (the allreduce reads it), a dense
        preset's the gradient itself. ``finite``: whether ``acc`` is finite when the pass could tell, else None."""
        xp, reducer = plan.xp, plan.reducer
        if reducer.sparse:
            sparsifier = self.compression.sparsifier
            pre = sparsifier.prefilter(self.sparsifier_state, plan.ctx) if reducer.uses_selection else None
            acc, finite, found = self.memory.compensate(xp, plan.inputs, zero_pieces=plan.zeroed,
                                                        select=None if pre is None else (*pre, plan.k))
            if found is not None:
                ctx = dataclasses.replace(plan.ctx, prefiltered=Prefiltered(*pre, *map(xp.from_numpy, found)))
                plan = plan._replace(ctx=ctx)
            return acc, finite, plan
        if plan.warm:
            flat = xp.astype(plan.inputs[0] if len(plan.inputs) == 1 else xp.concat(plan.inputs), xp.float32)
            r = self.memory.residual
            return (flat if r is None else xp.add(xp.asarray(r, xp.float32, like=flat), flat)), None, plan
        pieces = plan.pieces
        return xp.astype(pieces[0] if len(pieces) == 1 else xp.concat(pieces), xp.float32), None, plan

    def _skip(self, plan, acc, bad, nonfinite, control, out):
        """Stage 3, a non-finite gradient on the ranks ``bad``: raise, or skip the step on every rank alike (no
        state changes; the result is all NaN)."""
        where = f"rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"
        if nonfinite == "raise":
            raise NonFiniteGradientError(
                f"hvd_sparse unit '{self.name}': non-finite gradient (NaN or Inf) on {where} at step "
                f"{self.steps}; raised on every rank (nonfinite='raise'). Pass nonfinite='skip' to skip such "
                "steps, or lower the learning rate / use a loss scaler")
        self.skipped_steps += 1
        warnings.warn(f"hvd_sparse unit '{self.name}': non-finite gradient on {where} at step {self.steps}: "
                      "this step is skipped on every rank (nonfinite='skip'); sparse state is unchanged",
                      RuntimeWarning, stacklevel=4)
        self.last = StepStats(n=plan.n, k=0, selected=0, density=0.0, info={}, skipped=True,
                              nonfinite_ranks=bad, control_bytes=control, **self.comm.meter.totals())
        return self._emit(plan.xp, plan.xp.full(plan.n, float("nan"), plan.xp.float32, like=acc), 1.0, plan.pieces,
                          out)

    def _reduce(self, plan, acc):
        """Stage 4: ``(u, included, info, selected)`` -- the sparsifier's selection (unless the reducer chooses
        its own entries, as SparDL), then the reducer's exchange; a dense step reduces everything."""
        xp, reducer = plan.xp, plan.reducer
        if not reducer.sparse:
            u, included, info = reducer.reduce(xp, acc, None, plan.n, self.comm, self.reducer_state, plan.ctx)
            return u, included, dict(info, warmup=True) if plan.warm else info, plan.n
        idx, selected = None, plan.k
        if reducer.uses_selection:
            idx = self.compression.sparsifier.select(xp, acc, plan.k, self.sparsifier_state, plan.ctx)
            selected = xp.numel(idx)
        u, included, info = reducer.reduce(xp, acc, idx, plan.k, self.comm, self.reducer_state, plan.ctx)
        return u, included, info, selected

    def _commit(self, plan, acc, included, info):
        """Stage 5: the residual (``acc`` with the included entries zeroed, or the reducer's own), the sparsifier's
        controllers, the momentum-correction velocity, the step counter."""
        xp = plan.xp
        if plan.reducer.sparse:
            if "residual" in info:
                self.memory.replace(info.pop("residual"))
            else:
                self.memory.update(xp, acc, included)
            self.compression.sparsifier.update(xp, self.sparsifier_state, info, plan.ctx)
        elif plan.warm:
            self.memory.update(xp, acc, included)
        if plan.momentum:
            self.memory.commit_velocity(xp, plan.inputs[0], included)
        self.steps += 1

    @staticmethod
    def _emit(xp, u, scale, pieces, out, zeroed=False):
        """``u · scale`` (dense, or a :class:`SparseSum`) as the flat result in the gradient's dtype, or written
        into ``out``. A sparse sum is scaled on its K values only and scattered into zeroed outputs (``zeroed``:
        they are already)."""
        dtype = xp.dtype_of(pieces[0])
        n = sum(xp.numel(p) for p in pieces)
        if isinstance(u, SparseSum):
            val = xp.mul(u.val, scale) if scale != 1.0 else u.val
            if out is None:
                dense = xp.zeros(n, xp.float32, like=val)
                return xp.astype(xp.put_(dense, u.idx, val) if xp.numel(u.idx) else dense, dtype)
            bounds = xp.to_numpy(xp.searchsorted(u.idx, xp.asarray(_offsets(xp, out), xp.index_dtype, like=u.idx)))
            off = 0
            for j, o in enumerate(out):
                lo, hi = int(bounds[j]), int(bounds[j + 1])
                if not zeroed:
                    xp.fill_(o, 0.0)
                if hi > lo:
                    xp.put_(o, u.idx[lo:hi] - off, xp.astype(val[lo:hi], xp.dtype_of(o)))
                off += xp.numel(o)
            return out
        if out is None:
            return xp.astype(xp.mul(u, scale) if scale != 1.0 else xp.copy(u), dtype)
        off = 0
        for o in out:
            m = xp.numel(o)
            xp.mul_into(u[off:off + m], scale, o)
            off += m
        return out

    def _agreement(self, plan, finite, local_error, average, prescale, postscale, nonfinite):
        """The agreement step (:mod:`hvd_sparse.core.comm`): the ranks (sorted) whose gradient holds a NaN or
        Inf, after proving that every rank exchanges the same thing at the same step; raises
        :class:`RankDisagreementError` on every rank otherwise (and for a ``local_error`` of any rank)."""
        xp, pieces, n = plan.xp, plan.pieces, plan.n
        if self.comm.size == 1:
            return [] if finite else [self.comm.rank]
        options = (("average", bool(average)), ("prescale", float(prescale)), ("postscale", float(postscale)),
                    ("nonfinite", nonfinite)) + self.notes
        entries = self.entries
        if entries is None:             # undeclared: one tensor of the gradient's size and dtype
            entries = ((self.name, (n,), str(xp.dtype_of(pieces[0]))),)
        key = (entries, options)
        if self._agree[0] != key:       # only when the layout or the options changed
            desc = describe(self.unit, self.compression, entries, options)
            self._agree = (key, desc, fingerprint(desc))
        _, desc, fp = self._agree
        mine = agreement_vector(not finite, local_error is not None, self.steps, fp)
        rows = xp.to_numpy(self.comm.allgather(xp.asarray(mine, xp.int32, like=pieces[0]), AGREE_PHASE))
        table = rows.reshape(self.comm.size, AGREE_WORDS).tolist()
        if not agreed(table):
            per_rank = explain(xp, self.comm, dict(desc, step=self.steps, local_error=local_error), pieces[0])
            raise RankDisagreementError(disagreement_message(per_rank))
        return [r for r, row in enumerate(table) if row[0]]

    def gather(self, obj, like):
        """Every rank's JSON-able ``obj`` (rank order), exchanged before this unit's next step under the agreement's
        protection (what an adapter must learn from the other ranks to build the step, e.g. which gradients are
        sparse): the ranks first meet in the agreement's collective; if all are in a gather of this unit at this
        step they exchange ``obj`` (two allgathers), else all raise :class:`RankDisagreementError` together, as a
        failed agreement does. ``like``: an array of the step's backend and device. P = 1: ``[obj]``."""
        if self.comm.size == 1:
            return [obj]
        xp = backend_of(like)
        # the gather proves the unit and the step; the step's agreement proves the rest (with its precise message)
        mine = [0, AGREE_GATHER, self.steps & 0x7FFFFFFF, *fingerprint({"unit": self.unit})]
        rows = xp.to_numpy(self.comm.allgather(xp.asarray(mine, xp.int32, like=like), AGREE_PHASE))
        if agreed(rows.reshape(self.comm.size, AGREE_WORDS).tolist(), flag=AGREE_GATHER):
            return explain(xp, self.comm, obj, like)
        desc = describe(self.unit, self.compression, self.entries or (), {"gather": True})
        per_rank = explain(xp, self.comm, dict(desc, step=self.steps, local_error=None), like)
        raise RankDisagreementError(disagreement_message(per_rank))

    # -- state -------------------------------------------------------------------------------------
    def residual_norm(self):
        xp = backend_of(self.memory.residual) if self.memory.residual is not None else None
        return 0.0 if xp is None else self.memory.norm(xp)

    def state_dict(self):
        """This rank's state: residual (numpy float32 or None), sparsifier/reducer state, step count (and the
        velocity, with momentum correction)."""
        r, v = self.memory.residual, self.memory.velocity
        state = {
            "unit": self.name,
            "numel": self.numel,
            "entries": None if self.entries is None else [list(e) for e in self.entries],
            "steps": self.steps,
            "residual": None if r is None else backend_of(r).to_numpy(r).copy(),
            "sparsifier": copy.deepcopy(self.sparsifier_state),
            "reducer": copy.deepcopy(self.reducer_state),
        }
        if v is not None:               # momentum correction's velocity (per rank, like the residual)
            state["velocity"] = backend_of(v).to_numpy(v).copy()
        return state

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned (this rank's own: residuals are per rank)."""
        unit = state.get("unit", state.get("bucket"))        # "bucket": what earlier states call it
        if unit != self.name:
            raise ValueError(f"hvd_sparse unit '{self.name}': the state is of unit {unit!r}")
        self.numel = state["numel"]
        self.steps = state["steps"]
        if state.get("entries") is not None:
            self.entries = tuple((n, tuple(s), t) for n, s, t in state["entries"])
            self.layout = [int(np.prod(s)) for _, s, _ in self.entries]
        r = state["residual"]
        v = state.get("velocity")
        self.memory.velocity = None if v is None else np.array(v, dtype=np.float32)
        self.memory.residual = None if r is None else np.array(r, dtype=np.float32)   # moved to the gradient's
        self.sparsifier_state = copy.deepcopy(state["sparsifier"])                      # backend at the next step
        self.reducer_state = copy.deepcopy(state["reducer"])
