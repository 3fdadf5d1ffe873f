"""What one engine step knows besides the data: the context a sparsifier or reducer receives
(:class:`StepContext`, with the candidates a fused pass found: :class:`Prefiltered`), the plan the engine's stages
share (:class:`Plan`) and the statistics a step leaves (:class:`StepStats`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a sparsifier or reducer may know about the step besides the data.

    Attributes:
        rank, size: this rank and the number of ranks (== comm.rank, comm.size).
        step: 0-based count of previous steps of this unit (identical on every rank).
        layout: numels of the parameter tensors that make up the flat buffer, in order (sum == n), or
            ``None`` when unknown (then the buffer is one tensor). Per-tensor schemes (DCT) use it.
        comm: the Communicator. A sparsifier may issue collectives from ``select``/``update`` (e.g. to
            agree on a count); every rank calls them in the same order, so that is safe.
        exact_k: the sparsifier's ``exact_k`` flag: every rank selects at most k entries, so reducers
            may use fixed-size messages without exchanging counts.
        prefiltered: None, or a :class:`Prefiltered`: what ``rule`` selects from the step's accumulator at
            ``threshold``, found by error feedback's add pass because the sparsifier asked for it
            (:meth:`Sparsifier.prefilter`); saves the sparsifier a read pass over the accumulator.
        open: for the reducer (``Reducer.opens``): ``open(payload, parts, read=0)`` sends its first message in the
            step's opening (:mod:`hvd_sparse.core.comm`) and returns ``(rows, counts, host)``: every rank's payload
            as (P, m) rows, every rank's count of selected entries and the first ``read`` words of every payload,
            read on the host with the header.
        padded: the accumulator with one more entry, a zero at index n, where padded selections point.
        selected: the real entries of the selection (for the reducer: an int, or a device value; for the
            sparsifier's ``update``: this rank's, an int).
        note: for the sparsifier's ``update``: the note its ``select`` returned (an int, read with the header).
        notes: for the sparsifier's ``update``: every rank's note, in rank order, where the opening's header
            carried them (P = 1: this rank's); empty where it did not (a reducer that opens without the selection).
    """

    rank: int
    size: int
    step: int
    layout: tuple
    comm: object
    exact_k: bool = False
    prefiltered: Prefiltered = None
    open: object = None
    padded: object = None
    selected: object = None
    note: int = 0
    notes: tuple = ()


class Prefiltered(NamedTuple):
    """What ``rule`` selects from the step's accumulator at ``threshold``: ``indices`` (int64, ascending) and
    their ``values`` (float32), in the step's backend; collected by error feedback's add pass."""

    threshold: float
    rule: str
    indices: object
    values: object


class Plan(NamedTuple):
    """What one step is, fixed by its first stage (:meth:`hvd_sparse.core.engine.Engine._plan`) and read by the others: the backend and
    the gradient pieces (``n`` entries), the inputs of error feedback (the pieces, or the momentum-corrected
    velocity), the reducer of this step and whether it is a dense warm-up step, the sparsifier's and reducer's
    context, whether the accumulating pass zeroes the pieces (a sparse result written back into them), a local
    problem to report on every rank, the budget k (n for a dense step) and the step's sparsifier (the preset's, or
    its twin of a stage of the density warm-up: :mod:`hvd_sparse.core.recipe`)."""

    xp: object
    pieces: list
    n: int
    inputs: list
    reducer: object
    warm: bool
    momentum: float
    ctx: "StepContext"
    zeroed: bool
    local_error: object
    k: int
    sparsifier: object


class StepStats(dict):
    """Statistics of the last step: ``n, k, selected, density, sent_bytes, recv_bytes, sent_words,
    recv_words, collectives`` (the algorithm's traffic), ``control_bytes`` and ``control_collectives`` (the
    agreement's header words; a collective that carried nothing else), ``skipped`` (``True`` when a non-finite
    gradient skipped the step), ``nonfinite_ranks`` and ``seconds`` (the wall time of the step's parts:
    ``collectives``, the time inside them; on two levels also ``scatter``, ``across``, ``across_collectives``,
    ``gather``)."""
