"""One sparse step of one sparsification unit on one rank: where sparsifier, error feedback, reducer and
communicator meet (docs/design.md#engine). Framework adapters and the simulator both drive this class.

    step(grad), one method per stage:
        1. _plan        what this step is: pieces, reducer, k = max(1, floor(d·n)), a local problem
        2. _accumulate  acc = residual + grad                         # state.py (float32)
        3. _reduce      S = sparsifier.select(acc, k, ctx)            # sparsifiers/<scheme>.py, at its capacity
                        _open: the agreement's header, in front of the reducer's first message (or alone);
                               every rank exchanges the same thing, or all raise; a NaN/Inf anywhere -> _skip
                        u, I, info = reducer.reduce(acc, S, comm)     # reducers/<scheme>.py: global sum, included set
        4. _commit      residual = acc with acc[I] = 0                # state.py (or info["residual"], e.g. SparDL)
                        sparsifier.update(info, ctx)                  # threshold / partition controllers, if any
        5. _emit        u · prescale · postscale / P                  # average (op=Average) or u (op=Sum), grad dtype

The modes are data of the plan, not branches of the step: the dense reducer (the ``dense`` preset, and warm-up
steps) skips selection and residual; an empty gradient and a local problem stop after the opening. Four options
of the compression change the step (docs/algorithms.md, "The training recipe"):

* ``warmup_dense_steps = N``: the first N steps are a dense allreduce of ``acc`` (every entry is included, so the
  residual stays empty); the sparsifier and reducer neither run nor change state, and their step counter
  (``ctx.step``) starts at 0 on the first sparse step, on every rank alike;
* ``warmup_density = d0`` (the density warm-up, recipe.py): the sparse steps run in stages of the preset's
  sparsifier at d0, d0/f, ... down to its own density (:meth:`_stage`); a stage's first step starts the scheme
  afresh, as the first sparse step does;
* ``momentum_correction = m``: the velocity ``u = m·u + grad`` replaces ``grad`` above and is zeroed where the
  step's included set was sent (state.py: ErrorFeedback); the user's optimizer then runs without momentum;
* ``local_clip_norm = c`` (recipe.py): ``grad`` is first scaled by min(1, c / (sqrt(P)·||grad||)), on every step.

An adapter may set :attr:`Engine.dense` on a unit too small to gain from sparsity (a bucket of the torch optimizer's
``overlap``): then every step is such a dense step. An adapter that splits one budget over several units (the
buckets: :mod:`hvd_sparse.core.allocation`) sets each unit's share with :meth:`Engine.set_share` -- the factor on
the density of every sparse step from the next one on, which starts the scheme afresh as a warm-up stage does -- and
asks a step for a ``tally`` of its accumulator's magnitudes (``last["tally"]``).

Per-step statistics (selected count, achieved density, words and bytes sent and received) are kept in
:attr:`Engine.last`.

The opening (:mod:`hvd_sparse.core.comm`, docs/algorithms.md#the-wire): a step's first collective is one allgather,
Horovod name ``hvd_sparse.agree`` (P = 1: none), of a 9-word header -- a non-finite flag, the selection's count
and the sparsifier's note, a local-problem flag, the step counter and a fingerprint of the unit, its preset and
arguments and the layout (:meth:`Engine.declare`) -- followed by the reducer's first message when it ``opens`` the
step (TopkA's pairs, ExDyna's indices, Ok-Topk's proposals or histogram), else alone before the reducer's first
collective. Every rank reads the headers once; a difference raises
:class:`~hvd_sparse.core.errors.RankDisagreementError` on every rank, naming what differs and the ranks. A
sparsifier that communicates in its selection (``communicates``) has the step open before it.

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

The header's 36 bytes are reported as ``control_bytes`` and not added to the algorithm's volume.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings

import numpy as np

from . import budget
from .comm import (AGREE_GATHER, AGREE_PHASE, AGREE_WORDS, COUNT, NOTE, SUM, Agreement, SkipStep, describe,
                   explain, fingerprint, finite)
from .context import Plan, Prefiltered, StepContext, StepStats
from .errors import NonFiniteGradientError
from .recipe import clip_local, dense_tensors, stage_at
from .state import ErrorFeedback
from .reducers.base import SparseSum
from .reducers.dense import Dense
from .sparsifiers.base import fit_selection
from .xp import backend_of


#: the reducer of the dense warm-up steps (``warmup_dense_steps``)
_DENSE = Dense()


def _offsets(xp, arrays):
    """[0, n_0, n_0 + n_1, ..., n]: where each array starts in the flat buffer (and the end)."""
    offs = [0]
    for a in arrays:
        offs.append(offs[-1] + xp.numel(a))
    return offs


def _per_tensor(flat, layout):
    """``flat`` (one 1-D array, or a list of them, laid end to end) as one 1-D slice per tensor of ``layout``
    (views where the backend has them); a list that already holds one piece per tensor is returned as a list."""
    pieces = list(flat) if isinstance(flat, (list, tuple)) else [flat]
    xp = backend_of(pieces[0])
    if [xp.numel(p) for p in pieces] == list(layout):
        return pieces
    whole = pieces[0] if len(pieces) == 1 else xp.concat(pieces)
    offs = np.concatenate([[0], np.cumsum(layout)]).astype(int)
    return [whole[offs[i]:offs[i + 1]] for i in range(len(layout))]


def _others(count, dense):
    """The indexes of ``range(count)`` that are not in ``dense``, in order: the tensors of the sparse step."""
    skip = set(dense)
    return [i for i in range(count) if i not in skip]


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



def _host_values(state):
    """A deep copy of ``state`` with every array (a statistic a step left on its device: a threshold, a count)
    turned into a Python number or list: checkpoints hold no device tensor."""
    if isinstance(state, dict):
        return {key: _host_values(v) for key, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_host_values(v) for v in state)
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    if isinstance(state, np.generic):
        return state.item()
    a = backend_of(state).to_numpy(state)
    return a.item() if a.ndim == 0 else a.tolist()


def fresh_start(unit, saved, now):
    """A state saved under the topology ``saved`` (None: a flat step) meets ``now``: the residuals are another
    cut of the gradient, so the unit starts afresh (its error feedback empty, its thresholds and counters as at step
    0), with a warning; every rank meets the same and starts afresh alike."""
    def text(where):
        return ("a flat step (one rank a host)" if where is None else
                f"{where['hosts']} hosts of {where['ranks_per_host']} ranks")
    warnings.warn(f"hvd_sparse unit '{unit}': the sparse state was saved under {text(saved)} and is restored under "
                  f"{text(now)}: its residuals are another cut of the gradient, so the unit's error feedback and "
                  "thresholds start afresh", RuntimeWarning, stacklevel=3)


def gather_over(comm, agreement, unit, compression, entries, steps, obj, like):
    """:meth:`Engine.gather` of ``unit`` over ``comm`` (its :class:`~hvd_sparse.core.comm.Agreement`, preset, entries
    and step counter): every rank's ``obj``, in rank order."""
    if comm.size == 1:
        return [obj]
    xp = backend_of(like)
    # the gather proves the unit and the step; the step's agreement proves the rest (with its precise message)
    desc = describe(unit, compression, entries or (), {"gather": True})
    agreement.open(comm, xp, like, desc, fingerprint({"unit": unit}), steps, flag=AGREE_GATHER)
    return explain(xp, comm, obj, like)


class Engine:
    """State and step of one sparsification unit on one rank.

    Args:
        compression (SparseCompression): the sparsifier/reducer pair and its knobs.
        comm (Communicator): this rank's view of the process set.
        name (str): the unit's name, used in messages and state.
        clip (bool): whether this engine applies the preset's ``local_clip_norm`` (False: its caller clipped each
            rank's gradient already, as the two-level step does before the host's sum).
    """

    def __init__(self, compression, comm, name="model", clip=True):
        self.compression = compression
        self.comm = comm
        self.name = name
        self.stages = compression.stage_sparsifiers()   # the density warm-up's sparsifiers (core/recipe.py)
        self.clip = compression.local_clip_norm if clip else None
        self.memory = ErrorFeedback()
        self.sparsifier_state = compression.sparsifier.initial_state() if compression.sparsifier else {}
        self.reducer_state = compression.reducer.initial_state()
        self.steps = 0
        self.numel = None
        self.layout = None      # numels of the tensors in the flat buffer (set by adapters / simulate)
        self.last = StepStats()
        self.skipped_steps = 0  # steps skipped for non-finite gradients (not counted in ``steps``)
        self.dense = False      # every step dense, as a warm-up step (a bucket too small to gain from sparsity)
        self.share = 1.0        # the factor on the density of the sparse steps (set_share)
        self.share_since = 0    # the step the share was set at: the scheme starts afresh there
        self.tally = False      # the next steps count |acc| in bins of magnitude (last["tally"]; core/allocation.py)
        self._split = (None, ())  # (layout, dense_share) -> the indexes of its tensors sent dense (_dense_part)
        self._budgeted = (None, None)  # (layout, dense tensors, P) -> the sparse part's compression (_within_budget)
        self._shared = {}       # (sparsifier, share) -> the sparsifier at the shared density
        self.notes = ()         # declared (key, value) pairs the ranks must also agree on
        self.entries = None     # declared layout: ((name, shape, dtype), ...) in exchange order, or None
        self.refused = None     # why the last declare(fixed=True) was refused, reported by the next step
        self._agreement = Agreement()
        self._options = ()      # the step's options the ranks agree on (op, scaling, non-finite policy, notes)
        self._nonfinite = False  # the step's non-finite flag (a host bool, or a device value)
        self._opened = False     # whether the step's opening happened
        self._selection = (0, 0)  # the step's selection: its count and note (ints, or device values)
        self._mine = None        # the same, as host ints (from the opening's header)
        self._notes = ()         # every rank's note (from the opening's header)

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
                            "compression object cannot serve two models through a tape (a tape keeps its state in "
                            "its preset): give each model its own preset")
            return
        old, self.entries = self.entries, entries
        self.layout = [int(np.prod(s)) for _, s, _ in entries]
        if old is None:
            return
        was, now = self._sparse_entries(old), self._sparse_entries(entries)    # the residual's tensors
        self.memory.replace(_carry_by_name(self.memory.residual, was, now))
        self.memory.velocity = _carry_by_name(self.memory.velocity, was, now)
        self.sparsifier_state = self.compression.sparsifier.initial_state() if self.compression.sparsifier else {}
        self.reducer_state = self.compression.reducer.initial_state()
        self.steps = 0
        self.share_since = 0
        self.numel = None

    def _dense_part(self, layout):
        """The indexes of the tensors of ``layout`` that the compression's ``dense_share`` sends dense on every step
        (core/recipe.py, dense_tensors), or () -- none, or a unit that is dense anyway."""
        share = getattr(self.compression, "dense_share", 0.0)
        if not share or self.dense or layout is None or len(layout) < 2:
            return ()
        if self._split[0] != (tuple(layout), share):
            self._split = ((tuple(layout), share), dense_tensors(list(layout), share))
        return self._split[1]

    def _sparse_entries(self, entries):
        """``entries`` less those exchanged dense (``dense_share``): the tensors the residual holds."""
        dense = self._dense_part([int(np.prod(s)) for _, s, _ in entries])
        return tuple(entries[i] for i in _others(len(entries), dense))

    def spread(self, flat):
        """``flat`` (numpy: a buffer of the residual's tensors, e.g. the residual) over the whole layout, zeros at
        the tensors exchanged dense (``dense_share``); ``flat`` itself when there are none."""
        layout = self.layout
        dense = self._dense_part(layout)
        if not dense:
            return flat
        out = np.zeros(sum(layout), np.float32)
        parts, sparse = _per_tensor(out, layout), _others(len(layout), dense)
        for i, part in zip(sparse, _per_tensor(flat, [layout[i] for i in sparse])):
            parts[i][:] = part
        return out

    def set_share(self, share):
        """From the next step on, the sparse steps run at ``share`` times the density they would run at (clipped to
        1; k = max(1, ⌊d·share·n⌋)); a new share starts the scheme afresh at the next step -- thresholds, partitions
        and ``ctx.step`` as at step 0, the residual kept -- on every rank alike (every rank sets the same)."""
        share = float(share)
        if share != self.share:
            self.share, self.share_since = share, self.steps

    @property
    def unit(self):
        """The unit's identity across ranks (agreement, messages): the communicator's collective prefix when it
        has one (unique per optimizer / ``sparse_allreduce`` name), else its name."""
        return getattr(self.comm, "unit", None) or self.name

    # -- one step ------------------------------------------------------------------------------------
    def step(self, grad, average=True, prescale=1.0, postscale=1.0, nonfinite="skip", out=None, flagged=False):
        """Run one step on the flat gradient ``grad``, in the stages of the module docstring:

        1. check -- what this step is (:meth:`_plan`: its pieces, its mode and reducer, a local problem);
        2. accumulate -- ``acc = residual + grad`` (:meth:`_accumulate`);
        3. reduce -- selection, the opening (:meth:`_open`: the agreement, or the skip of a non-finite step,
           :meth:`_skip`) and the reducer's exchange (:meth:`_reduce`);
        4. commit -- residual, controllers and counters (:meth:`_commit`);
        5. emit -- the result, scaled, in the gradient's dtype (:meth:`_emit`).

        Args:
            grad: a 1-D numpy array / torch tensor / TF tensor, or a list of 1-D ones: the pieces of the flat
                gradient in layout order (e.g. views of every ``p.grad``; read once, never modified, not copied).
            out: None (default), or a list of 1-D arrays, one per piece and of its size (they may be the very
                pieces of ``grad``): the result is written into them, cast to each one's dtype. When they are the
                pieces and the reducer's result is sparse (``Reducer.sparse_result``), the pieces are zeroed as
                they are read, so they hold zeros if the step then raises.
            flagged: True when this rank knows of a NaN or Inf that ``grad`` does not hold (the two-level step: in
                another shard of its host, :mod:`hvd_sparse.core.hierarchy`): its header then says non-finite.
        Returns:
            the reduced flat gradient in ``grad``'s dtype (``out`` None), or ``out``; bit-identical on every
            rank (all NaN when a non-finite gradient on any rank skipped the step: see the module docstring).
        """
        dense = self._dense_part(self.layout)
        if dense:
            return self._step_split(dense, grad, average, prescale, postscale, nonfinite, out, flagged)
        return self._step(grad, average, prescale, postscale, nonfinite, out, flagged)

    def _step(self, grad, average, prescale, postscale, nonfinite, out, flagged):
        """:meth:`step` of the tensors the sparse step exchanges (all of them unless ``dense_share`` says)."""
        plan = self._plan(grad, out)
        self._options = (("average", bool(average)), ("prescale", float(prescale)),
                         ("postscale", float(postscale)), ("nonfinite", nonfinite)) + self.notes
        if plan.local_error is not None:     # reported on every rank: nothing is read, nothing sent
            self._open(plan, False, local_error=plan.local_error)
        if plan.n == 0:                      # an empty gradient: agreed on, nothing to select or send
            self._open(plan, False)
            self.steps += 1
            self.last = StepStats(n=0, k=0, selected=0, density=0.0, info={}, skipped=False, nonfinite_ranks=[],
                                  **self._traffic())
            return self._emit(plan.xp, plan.xp.zeros(0, plan.xp.float32, like=plan.pieces[0]), 1.0, plan.pieces, out)
        acc, finite, plan = self._accumulate(plan)
        tally = plan.xp.magnitude_counts(acc) if self.tally else None
        # the non-finite flag: a host bool, or on a device a device value that the opening's header carries unread
        self._nonfinite = True if flagged else (not finite) if finite is not None else plan.xp.nonfinite(acc)
        saved = dict(self.sparsifier_state), dict(self.reducer_state)
        try:
            u, included, info, selected = self._reduce(plan, acc)
        except SkipStep as skip:              # a NaN or Inf on some rank, known to every rank alike
            self.sparsifier_state, self.reducer_state = saved
            return self._skip(plan, acc, skip.bad, nonfinite, out)
        self._commit(plan, acc, included, info)
        self.last = StepStats(n=plan.n, k=plan.k, selected=selected, density=selected / plan.n, info=info,
                              skipped=False, nonfinite_ranks=[], **self._traffic())
        if tally is not None:
            self.last["tally"] = tally
        return self._emit(plan.xp, u, self._scale(prescale, postscale, average), plan.pieces, out, plan.zeroed)

    def _scale(self, prescale, postscale, average):
        """What a step's sum is multiplied by: the two scales, and 1/P for an average."""
        return float(prescale) * float(postscale) / (self.comm.size if average else 1)

    def _step_split(self, dense, grad, average, prescale, postscale, nonfinite, out, flagged):
        """:meth:`step` with the tensors ``dense`` (indexes into the layout) allreduced dense beside the sparse step
        of the others (``dense_share``; core/recipe.py): the gradient is clipped whole (``local_clip_norm``), the
        dense ones are read first (a NaN or Inf among them flags this rank in the sparse step's opening, so that both
        parts skip together), then the sparse step runs on the others, with their layout, then one allreduce sums
        the dense ones (none when the step was skipped: they are NaN as the rest). A byte budget covers both parts
        (:meth:`_within_budget`). The statistics count both parts:
        ``n`` and ``selected`` include the dense entries, ``dense_entries`` says how many, and the traffic includes
        the allreduce."""
        pieces, outs, layout = _per_tensor(grad, self.layout), out, self.layout
        if outs is not None:
            outs = _per_tensor(outs, layout) if len(outs) != len(layout) else list(outs)
        xp = backend_of(pieces[0])
        if self.clip is not None:            # the unit's whole gradient, before the split
            pieces = _per_tensor(clip_local(xp, pieces, self.clip, self.comm.size), layout)
        sparse = _others(len(layout), dense)
        tail = [pieces[i] for i in dense]
        flat = xp.astype(xp.concat(tail) if len(tail) > 1 else xp.copy(tail[0]), xp.float32)
        flagged = bool(flagged) or not xp.all_finite(flat)
        comp = self.compression
        self.layout, clip, self.clip = [layout[i] for i in sparse], self.clip, None
        self.compression = self._within_budget(layout, dense)
        try:
            head = self._step([pieces[i] for i in sparse], average, prescale, postscale, nonfinite,
                              None if outs is None else [outs[i] for i in sparse], flagged)
        finally:
            self.layout, self.clip, self.compression = layout, clip, comp
        last = self.last
        if last["skipped"]:
            u, scale = xp.full(xp.numel(flat), float("nan"), xp.float32, like=flat), 1.0
        else:
            u = flat if self.comm.size == 1 else self.comm.allreduce(flat, SUM, "dense_part")
            scale = self._scale(prescale, postscale, average)
            last.update(self._traffic())
        nd = xp.numel(flat)
        last.update(n=last["n"] + nd, selected=last["selected"] + (0 if last["skipped"] else nd), dense_entries=nd)
        last["density"] = last["selected"] / last["n"]
        rest = self._emit(xp, u, scale, tail, None if outs is None else [outs[i] for i in dense])
        if outs is not None:
            return out
        parts = [None] * len(layout)
        for i, part in zip(sparse, _per_tensor(head, [layout[i] for i in sparse])):
            parts[i] = part
        for i, part in zip(dense, _per_tensor(rest, [layout[i] for i in dense])):
            parts[i] = part
        return xp.concat(parts)

    def _within_budget(self, layout, dense):
        """The compression the sparse part runs: the engine's, or with a byte budget b a twin whose density spends
        what the dense tensors leave of it -- the fraction (b·n − n_dense) / n_sparse of the sparse part's own dense
        allreduce (at most 1) -- so that both parts together send b of the unit's dense bytes; a budget that cannot
        cover the dense tensors raises, on every rank alike (they share the layout)."""
        comp = self.compression
        budget_ = getattr(comp, "byte_budget", None)
        if budget_ is None:
            return comp
        key = (tuple(layout), tuple(dense), self.comm.size)
        if self._budgeted[0] != key:
            n, nd = sum(layout), sum(layout[i] for i in dense)
            left = (budget_ * n - nd) / (n - nd)
            if left <= 0:
                raise ValueError(f"hvd_sparse unit '{self.name}': byte_budget={budget_:g} does not cover the {nd} "
                                 f"entries that dense_share={comp.dense_share:g} sends dense ({nd / n:.3g} of the "
                                 f"{n}): raise byte_budget above {nd / n:.3g} or lower dense_share")
            twin = copy.copy(comp)
            object.__setattr__(twin, "sparsifier", budget.sparsifier_for(min(1.0, left), comp.sparsifier,
                                                                         comp.reducer, self.comm.size, repr(comp)))
            self._budgeted = (key, twin)
        return self._budgeted[1]

    def _plan(self, grad, out):
        """Stage 1, check: the step's :class:`~hvd_sparse.core.context.Plan` -- its pieces, the reducer (the
        preset's, or the dense one of a warm-up step), the context of the sparsifier and reducer, and a local problem
        to report on every rank (a gradient of another size than declared). At P = 1 a local problem raises at once."""
        self._opened, self._selection, self._mine, self._notes = False, (0, 0), None, ()
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
        warm = self.dense or self.steps < warmup
        reducer = _DENSE if warm else comp.reducer
        sparsifier, since = self._stage(warm, warmup)
        inputs = pieces if self.clip is None else clip_local(xp, pieces, self.clip, self.comm.size)
        inputs = self.memory.next_velocity(xp, inputs, momentum) if momentum else inputs
        self.comm.meter.reset()
        ctx = StepContext(self.comm.rank, self.comm.size, self.steps - since,
                          tuple(self.layout) if self.layout is not None else (n,), self.comm,
                          bool(sparsifier is not None and sparsifier.exact_k))
        # A sparse result that goes into the very gradient buffers lets the accumulating pass zero them, too.
        sparse = reducer.sparse_result is True or (reducer.sparse_result == "host" and not xp.on_device(pieces[0]))
        zeroed = bool(sparse and out is not None and inputs is pieces and all(o is p for o, p in zip(out, pieces)))
        return Plan(xp, pieces, n, inputs, reducer, warm, momentum, ctx, zeroed, local_error,
                     sparsifier.k_for(n) if reducer.sparse else n, sparsifier)

    def _stage(self, warm, warmup):
        """``(sparsifier, since)``: the sparsifier of this step's stage of the density warm-up (the preset's own
        after it; :mod:`hvd_sparse.core.recipe`) and the step its stage (or the dense warm-up) began at. The first
        step of a later stage starts the scheme afresh, as the first sparse step does: thresholds, partitions and
        ``ctx.step`` as at step 0, on every rank alike (the residual stays)."""
        comp = self.compression
        if warm:
            return comp.sparsifier, 0
        index, since = stage_at(self.steps, warmup, getattr(comp, "warmup_stage_steps", 0), len(self.stages))
        sparsifier = self.stages[index] if index < len(self.stages) else comp.sparsifier
        fresh = index and self.steps == since
        if self.share_since > since:            # a share set since the stage began (set_share)
            since = self.share_since
            fresh = self.steps == since
        if self.share != 1.0:
            sparsifier = self._at_share(sparsifier)
        if fresh:
            self.sparsifier_state = sparsifier.initial_state()
            self.reducer_state = comp.reducer.initial_state()
        return sparsifier, since

    def _at_share(self, sparsifier):
        """``sparsifier`` at :attr:`share` times its density (at most 1), made once per stage and share."""
        key = (id(sparsifier), self.share)
        if key not in self._shared:
            self._shared = {key: dataclasses.replace(sparsifier, density=min(1.0, sparsifier.density * self.share))}
        return self._shared[key]

    def _local_error(self, n):
        """What this rank alone knows is wrong with a gradient of ``n`` entries, or None."""
        if self.refused is not None:
            return self.refused
        if self.entries is not None and sum(self.layout) != n:
            return f"the gradient has {n} entries, but the declared layout holds {sum(self.layout)}"
        if self.numel is not None and n != self.numel:
            return (f"hvd_sparse unit '{self.name}': the gradient has {n} entries, but this compression state "
                    f"was built for {self.numel}; one compression object cannot serve two models through a tape "
                    "(a tape keeps its state in its preset): give each model its own preset")
        return None

    def _accumulate(self, plan):
        """Stage 2: ``(acc, finite, plan)``. Sparse reducers read the gradient once, into ``acc = residual + grad``
        in error feedback's spare buffer (the residual itself is untouched until the step succeeds), with the
        candidates of a sparsifier that knows its threshold before the step (Ok-Topk's reuse steps: one read pass
        less; ``plan.ctx.prefiltered``). A warm-up step's ``acc`` is a fresh array (the allreduce reads it), a dense
        preset's the gradient itself. ``finite``: whether ``acc`` is finite when the pass could tell, else None."""
        xp, reducer = plan.xp, plan.reducer
        if reducer.sparse:
            sparsifier = plan.sparsifier
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

    def _skip(self, plan, acc, bad, nonfinite, out):
        """The opening found a non-finite gradient on the ranks ``bad``: raise, or skip the step on every rank alike (no
        state changes; the result is all NaN)."""
        where = f"rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"
        if nonfinite == "raise":
            raise NonFiniteGradientError(
                f"hvd_sparse unit '{self.name}': non-finite gradient (NaN or Inf) on {where} at step "
                f"{self.steps}; raised on every rank (nonfinite='raise'). Pass nonfinite='skip' to skip such "
                "steps, or lower the learning rate / use a loss scaler")
        self.skipped_steps += 1
        self.memory.padded = None
        warnings.warn(f"hvd_sparse unit '{self.name}': non-finite gradient on {where} at step {self.steps}: "
                      "this step is skipped on every rank (nonfinite='skip'); sparse state is unchanged",
                      RuntimeWarning, stacklevel=4)
        self.last = StepStats(n=plan.n, k=0, selected=0, density=0.0, info={}, skipped=True,
                              nonfinite_ranks=bad, **self._traffic())
        return self._emit(plan.xp, plan.xp.full(plan.n, float("nan"), plan.xp.float32, like=acc), 1.0, plan.pieces,
                          out)

    def _reduce(self, plan, acc):
        """Stage 3: ``(u, included, info, selected)`` -- the sparsifier's selection (unless the reducer chooses
        its own entries, as SparDL), then the reducer's exchange; a dense step reduces everything. The agreement
        opens the step: in the reducer's first collective when it carries it (``Reducer.opens``: the selection
        stays in its fixed size, padded), else alone before anything else is sent (the selection then trimmed to
        its real entries). The selection's count and note (``fit_selection``) ride in the opening's header and come
        back to the host with it (``self._mine``)."""
        xp, reducer, n = plan.xp, plan.reducer, plan.n
        ctx = dataclasses.replace(plan.ctx, open=functools.partial(self._open, plan, self._nonfinite),
                                  padded=self.memory.padded)
        if not reducer.sparse:
            self._open(plan, self._nonfinite)
            u, included, info = reducer.reduce(xp, acc, None, n, self.comm, self.reducer_state, ctx)
            return u, included, dict(info, warmup=True) if plan.warm else info, n
        sparsifier = plan.sparsifier
        if not reducer.opens or sparsifier.communicates(self.sparsifier_state, ctx):
            self._open(plan, self._nonfinite)
        idx = None
        if reducer.uses_selection:
            idx = sparsifier.select(xp, acc, plan.k, self.sparsifier_state, ctx)
            idx, count, note = fit_selection(xp, idx, n, sparsifier.capacity(plan.k, n, self.comm.size), acc)
            if not reducer.opens:
                count = int(xp.item(count))
                idx = idx[:count]                       # the real entries (ascending, the padding after them)
            self._selection = (count, note)
            ctx = dataclasses.replace(ctx, selected=count)
        u, included, info = reducer.reduce(xp, acc, idx, plan.k, self.comm, self.reducer_state, ctx)
        if not reducer.uses_selection:
            return u, included, info, plan.k
        if self._mine is None:                          # not from the opening's header: read them
            self._mine = tuple(int(xp.item(v)) for v in self._selection)
        return u, included, info, self._mine[0]

    def _commit(self, plan, acc, included, info):
        """Stage 4: the residual (``acc`` with the included entries zeroed, or the reducer's own), the sparsifier's
        controllers (with this rank's count and note on the host), the momentum-correction velocity, the step
        counter."""
        xp = plan.xp
        if plan.reducer.sparse:
            if "residual" in info:
                self.memory.replace(info.pop("residual"))
            else:
                self.memory.update(xp, acc, included)
            selected, note = self._mine or (plan.k, 0)
            notes = self._notes or ((note,) if self.comm.size == 1 else ())
            ctx = dataclasses.replace(plan.ctx, selected=selected, note=note, notes=notes)
            plan.sparsifier.update(xp, self.sparsifier_state, info, ctx)
        elif plan.warm:
            self.memory.update(xp, acc, included)
        if plan.momentum:
            self.memory.commit_velocity(xp, plan.inputs[0], included)
        self.steps += 1

    def _traffic(self):
        """The step's traffic from the meter: the algorithm's words, bytes and collectives, and apart the
        agreement's (``control_bytes``: the header words; ``control_collectives``: an opening that carried nothing
        else); ``seconds``: ``{"collectives": the wall time inside them}`` (0 in the simulator)."""
        meter = self.comm.meter
        return dict(meter.totals(exclude=(AGREE_PHASE,)), control_bytes=meter.sent_bytes[AGREE_PHASE],
                    control_collectives=meter.calls[AGREE_PHASE], seconds={"collectives": meter.seconds})

    @staticmethod
    def _emit(xp, u, scale, pieces, out, zeroed=False):
        """``u · scale`` (dense, or a :class:`SparseSum`) as the flat result in the gradient's dtype, or written
        into ``out``. A sparse sum is scaled on its K values only; its support may end in padding (index n, value
        0). Where reading its positions is free (the host) it is scattered into zeroed outputs (``zeroed``: they
        are already); on a device it goes through one dense buffer (no read of where the pieces start in it)."""
        dtype = xp.dtype_of(pieces[0])
        n = sum(xp.numel(p) for p in pieces)
        if isinstance(u, SparseSum):
            val = xp.mul(u.val, scale) if scale != 1.0 else u.val
            if out is None or xp.on_device(u.idx):
                dense = xp.zeros(n + 1, xp.float32, like=val)
                dense = xp.put_(dense, u.idx, val) if xp.numel(u.idx) else dense
                if out is None:
                    return xp.astype(dense[:n], dtype)
                u, scale = dense[:n], 1.0
            else:
                bounds = xp.to_numpy(xp.searchsorted(u.idx, xp.asarray(_offsets(xp, out), xp.index_dtype,
                                                                          like=u.idx)))
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

    def _open(self, plan, nonfinite, payload=None, parts=(), read=0, local_error=None):
        """The step's opening (:mod:`hvd_sparse.core.comm`): one allgather of this rank's header (with the count
        and note of its selection, ``self._selection``) and ``payload`` (the reducer's first message, or the list of
        its pieces, whose ``parts`` are metered apart; None: the header alone), after which every rank knows that
        all exchange the same thing at the same step -- or all raise :class:`RankDisagreementError` -- and which
        ranks hold a NaN or Inf (:class:`SkipStep` on every rank). Returns ``(rows, counts, host)``: the P payloads
        as (P, m) rows (P = 1: this rank's), every rank's count and the first ``read`` words of every payload (host
        ints, read with the headers). Called again in a step (a sparsifier's collective made the agreement open
        first), it is a plain allgather of the payload, and the counts are read on their own."""
        xp, like, P = plan.xp, plan.pieces[0], self.comm.size
        count, note = self._selection
        if self._opened or P == 1:
            if P == 1 and not self._opened and (nonfinite is True or not isinstance(nonfinite, bool)
                                                and not finite(int(xp.item(nonfinite)))):
                raise SkipStep([0])
            self._opened = True
            if payload is None:
                return None, None, None
            if isinstance(payload, list):
                payload = xp.concat(payload, like=like)
            if P == 1:
                rows, counts = xp.reshape(payload, (1, -1)), [int(xp.item(count))]
            else:
                counts = self.comm.allgather(xp.reshape(xp.asarray(count, xp.int32, like=like), (1,)), "count")
                rows = xp.reshape(self.comm.allgather(payload, "open", parts=parts or None), (P, -1))
                counts = [int(c) for c in xp.to_numpy(counts)]
            return rows, counts, (xp.to_list(xp.columns(rows, 0, read)) if read else [[]] * P)
        self._opened = True
        entries = self.entries or ((self.name, (plan.n,), str(xp.dtype_of(like))),)
        desc, fp = self._agreement.describe(self.unit, self.compression, entries, self._options)
        table, rows = self._agreement.open(self.comm, xp, like, desc, fp, self.steps, nonfinite=nonfinite,
                                           local_error=local_error, payload=payload, count=count, note=note,
                                           parts=parts, read=read)
        if payload is not None:
            self._mine = (table[self.comm.rank][COUNT], table[self.comm.rank][NOTE])
            self._notes = tuple(row[NOTE] for row in table)
        bad = [r for r, row in enumerate(table) if not finite(row[0])]
        if bad:
            raise SkipStep(bad)
        return rows, [row[COUNT] for row in table], [row[AGREE_WORDS:] for row in table]

    def gather(self, obj, like):
        """Every rank's JSON-able ``obj`` (rank order), exchanged before this unit's next step under the agreement's
        protection (what an adapter must learn from the other ranks to build the step, e.g. which gradients are
        sparse): the ranks first meet in the agreement's collective; if all are in a gather of this unit at this
        step they exchange ``obj`` (two allgathers), else all raise :class:`RankDisagreementError` together, as a
        failed agreement does. ``like``: an array of the step's backend and device. P = 1: ``[obj]``."""
        return gather_over(self.comm, self._agreement, self.unit, self.compression, self.entries, self.steps, obj,
                           like)

    # -- state -------------------------------------------------------------------------------------
    def residual_norm(self):
        xp = backend_of(self.memory.residual) if self.memory.residual is not None else None
        return 0.0 if xp is None else self.memory.norm(xp)

    def state_dict(self):
        """This rank's state: residual (numpy float32 or None), sparsifier/reducer state (plain Python values: the
        statistics a step leaves on a device are read here), step count (and the velocity, with momentum
        correction)."""
        r, v = self.memory.residual, self.memory.velocity
        state = {
            "unit": self.name,
            "numel": self.numel,
            "entries": None if self.entries is None else [list(e) for e in self.entries],
            "steps": self.steps,
            "residual": None if r is None else backend_of(r).to_numpy(r).copy(),
            "sparsifier": _host_values(self.sparsifier_state),
            "reducer": _host_values(self.reducer_state),
        }
        if v is not None:               # momentum correction's velocity (per rank, like the residual)
            state["velocity"] = backend_of(v).to_numpy(v).copy()
        if self.share != 1.0 or self.share_since:       # a share of a split budget (set_share)
            state["share"], state["share_since"] = self.share, self.share_since
        if getattr(self.compression, "dense_share", 0.0):  # the residual then holds the sparse tensors only
            state["dense_share"] = self.compression.dense_share
        return state

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned (this rank's own: residuals are per rank). A two-level step's
        state (a shard's, :mod:`hvd_sparse.core.hierarchy`) starts the unit afresh instead."""
        unit = state.get("unit")
        if unit != self.name:
            raise ValueError(f"hvd_sparse unit '{self.name}': the state is of unit {unit!r}")
        if state.get("topology") is not None:
            fresh_start(self.name, state["topology"], None)
            return
        saved, now = float(state.get("dense_share", 0.0)), float(getattr(self.compression, "dense_share", 0.0))
        if saved != now:
            raise ValueError(f"hvd_sparse unit '{self.name}': the state was written with dense_share={saved:g} and "
                             f"this compression has dense_share={now:g} (its residual holds other tensors): load it "
                             "into a preset with the same dense_share")
        self.numel = state["numel"]
        self.steps = state["steps"]
        self.share, self.share_since = float(state.get("share", 1.0)), int(state.get("share_since", 0))
        if state.get("entries") is not None:
            self.entries = tuple((n, tuple(s), t) for n, s, t in state["entries"])
            self.layout = [int(np.prod(s)) for _, s, _ in self.entries]
        r = state["residual"]
        v = state.get("velocity")
        self.memory.velocity = None if v is None else np.array(v, dtype=np.float32)
        self.memory.residual = None if r is None else np.array(r, dtype=np.float32)   # moved to the gradient's
        self.sparsifier_state = copy.deepcopy(state["sparsifier"])                      # backend at the next step
        self.reducer_state = copy.deepcopy(state["reducer"])
