"""The base class of every optimizer :func:`hvd_sparse.torch.DistributedOptimizer` builds for a sparse preset: the
optimizer's sparse state (checkpoints, elastic commits) and statistics; ``isinstance(opt, SparseOptimizer)`` tells
such an optimizer.

Checkpoints: :meth:`~hvd_sparse.core.state.UnitStates.state_dict` holds numpy arrays (the residual, the momentum
correction's velocity) beside plain Python values; ``torch.load`` has refused numpy arrays by default since PyTorch
2.6 (``weights_only=True``: ``Unsupported global: numpy._core.multiarray._reconstruct``), so ``sparse_state_dict()``
hands them out as CPU tensors (:func:`to_tensors`) and ``load_sparse_state_dict()`` takes either form.
"""

from __future__ import annotations

import numpy as np
import torch

from .stats import averaged_stats

_API = "hvd_sparse.torch.DistributedOptimizer"


class SparseOptimizer:
    """Mixed into the optimizer class :func:`~hvd_sparse.torch.DistributedOptimizer` builds (which sets
    ``process_set`` and ``_hvds``, its :class:`~hvd_sparse.torch.job.SparseJob`)."""

    def sparse_stats(self, average=False):
        """Statistics of the last exchange on this rank: ``n, k, selected, density, sent_bytes,
        recv_bytes, sent_words, recv_words, collectives`` (empty before the first step); no communication. With
        ``overlap=True`` the buckets' counts summed (``density`` of the sums) and ``buckets``, each bucket's own.

        ``average=True``: a collective (every rank, same point of the loop) that returns ``density``,
        ``sent_bytes``, ``recv_bytes`` and ``residual_norm`` as floats averaged over the exchanges since the previous
        such call and over the ranks, for ``SummaryWriter.add_scalars`` (see :mod:`hvd_sparse.torch.stats`)."""
        if average:
            return averaged_stats(self)
        return dict(self._hvds.last) if self._hvds.exchanges else {}

    def residual_norm(self):
        """L2 norm of this rank's error-feedback residual."""
        return self._hvds.residual_norm()

    def sparse_state_dict(self):
        """This rank's sparsification state (residual, thresholds, partitions, counters) for a checkpoint.

        Per rank: save it next to ``state_dict()`` on *every* rank (not only rank 0) and load each rank's own;
        it is deliberately not part of ``state_dict()``, which Horovod's ``broadcast_optimizer_state`` would
        overwrite with rank 0's residuals. Arrays are CPU tensors, so ``torch.load`` reads the file with its defaults
        (``weights_only=True``)."""
        self._hvds.engines()                     # the state of step 0 before the first step
        state = self._hvds.states.state_dict(self.process_set.rank(), self.process_set.size())
        if self._hvds.overlap is not None:
            state["clock"] = self._hvds.clock      # where the buckets' budget split is in its period
        return to_tensors(state)

    def skipped_steps(self):
        """Steps skipped on this rank (and every other) because a gradient was not finite."""
        return self._hvds.skipped_steps()

    def load_sparse_state_dict(self, state):
        """Restore :meth:`sparse_state_dict`; the run then continues bit for bit as if never interrupted.
        Raises ValueError (restoring nothing) for a state of another rank, another number of ranks or another
        compression (scheme, density, periods), as ``hvd_sparse.tensorflow.SparseState`` does."""
        state = to_arrays(state)
        if isinstance(state, dict) and isinstance(state.get("units"), dict):
            self._hvds.check_units(state["units"], f"{_API}.load_sparse_state_dict")
        self._hvds.states.load_state_dict(state, self.process_set.rank(), self.process_set.size(),
                                          f"{_API}.load_sparse_state_dict")
        self._hvds.loaded(state["units"])
        self._hvds.clock = int(state.get("clock", 0))

    def _hvds_snapshot(self):
        """This rank's units, unchecked (hvd_sparse.torch.elastic's commit); None before the first step."""
        return self._hvds.states.snapshot() or None

    def _hvds_restore(self, units):
        """Roll back to :meth:`_hvds_snapshot` unchecked (hvd_sparse.torch.elastic, across a world change)."""
        self._hvds.states.restore(units)
        self._hvds.loaded(units)


def to_tensors(state):
    """``state`` with every numpy array replaced by a CPU tensor of the same values (dicts, lists, tuples walked)."""
    if isinstance(state, np.ndarray):
        return torch.from_numpy(state.copy())
    if isinstance(state, dict):
        return {k: to_tensors(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_tensors(v) for v in state)
    return state


def to_arrays(state):
    """The inverse of :func:`to_tensors`: every tensor back to a numpy array."""
    if torch.is_tensor(state):
        return state.detach().cpu().numpy()
    if isinstance(state, dict):
        return {k: to_arrays(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_arrays(v) for v in state)
    return state
