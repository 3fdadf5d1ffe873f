"""The sparsifier interface: how one rank chooses which entries of its accumulator to send.

A sparsifier is configuration only (a frozen dataclass of its options, checked once when it is built,
:class:`hvd_sparse.core.validate.Options`); everything that changes from step to step lives
in the per-rank ``state`` dict the engine passes in, so it can be checkpointed (``state_dict``).

    idx = sparsifier.select(xp, acc, k, state, ctx)   # sorted int64 indices into acc, no duplicates
    sparsifier.update(xp, state, info, ctx)           # after the reducer: controllers (thresholds, ...)

``ctx`` is a :class:`hvd_sparse.core.context.StepContext` (rank, size, step, layout, comm); ``info`` is
the dict the reducer returned (e.g. global counts).

``acc`` is the float32 accumulator (residual + gradient), ``k = max(1, floor(density * n))`` the target.
A sparsifier must never select a zero entry and must be deterministic (same input, same state -> same
indices), so that the simulator and a Horovod run agree bit for bit.

**Capacity.** A selection travels in a message of a fixed size (docs/algorithms.md#the-wire): ``capacity(k, n)``
indexes, k for an exact-k sparsifier, ``floor(capacity_ratio·k)`` for the others. ``select``
may return its indices exactly sized, or padded to the capacity with the sentinel n after the real ones (the
built-in sparsifiers do: no count leaves the device), alone or as ``(indices, count)``; the engine pads a shorter
selection and cuts a longer one to its ``capacity`` largest magnitudes (:func:`fit_selection`). What is cut stays
in the residual.
"""

from __future__ import annotations

from ..validate import Options, options
from ..validate import density as density_option


def ladder_factors(f, rungs):
    """``(1, f, f², ..., f^rungs)``, each the previous times f (the same floats on every backend)."""
    out = [1.0]
    for _ in range(rungs):
        out.append(out[-1] * f)
    return tuple(out)


#: the ladder a threshold sparsifier's threshold climbs when its selection exceeds the capacity: th·1.03^j up to
#: 1.03^60 (5.9x); one counting pass finds the first rung that fits (``xp.select_capped``)
CLIMB = ladder_factors(1.03, 60)


@options
class Sparsifier(Options):
    """Base class. Subclasses (decorated with :func:`~hvd_sparse.core.validate.options`, their options as fields)
    set ``name`` and implement :meth:`select`.

    Args:
        density (float): target fraction of entries to select, in (0, 1]; ``k = max(1, floor(density*n))``.
    """

    name = "base"
    #: True when ``select`` returns exactly min(k, nnz(acc)) indices; reducers may then skip size exchanges.
    exact_k = False
    #: True when the ranks' selections are disjoint parts of one global selection (ExDyna): the achieved
    #: density is then the sum over ranks, not the mean.
    partitioned = False

    #: the capacity of a selection that is not exact-k, in units of k (the built-in ones set theirs, measured)
    capacity_ratio = 2.0

    density: float = density_option()

    def k_for(self, n):
        """The target count for a buffer of ``n`` entries: ``max(1, floor(density * n))``."""
        return max(1, int(self.density * n))

    def capacity(self, k, n, size=1):
        """The size of this sparsifier's selection in a message over ``size`` ranks: k when it is exact-k, else
        floor(ratio·k) (at least 1, at most n)."""
        return k if self.exact_k else max(1, min(n, int(self.capacity_ratio * k)))

    def communicates(self, state, ctx):
        """Whether ``select`` issues a collective at this step (the engine then opens the step's agreement before
        it); default False."""
        return False

    def initial_state(self):
        return {}

    def select(self, xp, acc, k, state, ctx):  # pragma: no cover - interface
        raise NotImplementedError

    def prefilter(self, state, ctx):
        """``(threshold, rule)`` when this step's selection will start from the entries of the accumulator that
        ``rule`` (one of ``hvd_sparse.core.native.RULES``) selects at ``threshold``, known before the step; else
        None (default). The engine then collects them while it builds the accumulator and passes them in
        ``ctx.prefiltered`` (when the fused CPU kernel ran). Must not change ``state``."""
        return None

    def update(self, xp, state, info, ctx):
        """Called after the reducer with its ``info``; default: nothing."""


def fit_selection(xp, idx, n, capacity, acc):
    """``(indexes, count, note)``: the ascending selection ``idx`` (of indexes into the n entries of ``acc``; or
    ``(indexes, count)`` or ``(indexes, count, note)`` as a sparsifier may return it) in exactly ``capacity`` slots:
    padded with n when shorter, cut to its ``capacity`` largest magnitudes (ties by the lower index) when longer;
    ``count`` of them are real (an int, or a device value); ``note`` (default 0): the word the sparsifier's
    ``update`` gets back (``ctx.note``). A selection of exactly the capacity is taken as it is (the padding at its
    end, if any, counted on the device unless the sparsifier gave the count)."""
    count, note = None, 0
    if isinstance(idx, tuple):
        idx, count, note = idx if len(idx) == 3 else (*idx, 0)
    m = xp.numel(idx)
    if m == capacity:
        return idx, xp.count_below(idx, n) if count is None else count, note
    if m < capacity:
        fill = xp.full(capacity - m, n, xp.index_dtype, like=acc)
        return xp.concat([idx, fill], like=acc), m if count is None else count, note
    pos = xp.topk_padded(xp.take(acc, idx), capacity)[0]
    kept = xp.take(xp.concat([idx, xp.full(1, n, xp.index_dtype, like=acc)], like=acc), pos)
    return kept, xp.count_below(kept, n), note
