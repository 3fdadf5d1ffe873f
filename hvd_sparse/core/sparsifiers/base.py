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
"""

from __future__ import annotations

from ..validate import Options, options
from ..validate import density as density_option


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

    density: float = density_option()

    def k_for(self, n):
        """The target count for a buffer of ``n`` entries: ``max(1, floor(density * n))``."""
        return max(1, int(self.density * n))

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
