"""Elastic Horovod with hvd_sparse's optimizer: ``hvd.elastic.TorchState`` / ``hvd.elastic.run`` work unchanged.

    opt = hvds.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.oktopk(0.01), elastic_residuals="keep")
    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)

    @hvd.elastic.run
    def train(state): ...

Importing ``hvd_sparse.torch`` registers :class:`SparseOptimizerStateHandler` in Horovod's public handler registry
(``horovod.torch.elastic.state.set_handler_registry``), ahead of Horovod's optimizer handler, so a ``TorchState``
that holds an hvd_sparse optimizer keeps its sparse state right:

* ``commit()`` / ``save()``: the inner optimizer's ``state_dict()`` as Horovod does, plus this rank's own sparse
  state (residual, thresholds, partitions, counters) -- per rank, never broadcast;
* ``restore()`` (after a failure): both are rolled back to the last commit, on every surviving rank;
* ``sync()`` (at start and after every reset): rank 0's optimizer state is broadcast as Horovod does; when the
  world changed (a rank left or joined, or this process got another rank), the engine is rebuilt over the new
  process set: Ok-Topk's partitions and thresholds, ExDyna's partition and threshold, every step counter start
  afresh (the first step re-evaluates thresholds exactly, as step 0 of a run), and the residuals follow the
  optimizer's ``elastic_residuals`` policy:

  ``"keep"`` (default)  each surviving process keeps its own residual (gradient mass it has not sent yet);
                        joining processes start from zero; the residual of a process that left is lost with it.
  ``"drop"``            every residual is zeroed: all ranks restart from the same (empty) memory.

After a graceful host removal Horovod resets without calling ``sync()``; the optimizer then notices at its next
exchange that its engine was built for another rank or size and rebuilds it the same way.
"""

from __future__ import annotations

import copy

from horovod.torch.elastic import state as _state

from .base import SparseOptimizer
from .functions import broadcast_optimizer_state


class SparseOptimizerStateHandler(_state.StateHandler):
    """Horovod elastic state handler of an hvd_sparse optimizer (see the module docstring)."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.save()

    def save(self):
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())
        self._saved_sparse_state = self.value._hvds_snapshot()

    def restore(self):
        self.value.load_state_dict(self._saved_optimizer_state)
        if self._saved_sparse_state is not None:
            self.value._hvds_restore(self._saved_sparse_state)

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)
        self.value._hvds_elastic_reset()


def register():
    """Put :class:`SparseOptimizerStateHandler` first in Horovod's handler registry (idempotent)."""
    registry = _state.get_handler_registry()
    if not any(cls is SparseOptimizerStateHandler for _, cls in registry):
        _state.set_handler_registry([(SparseOptimizer, SparseOptimizerStateHandler)] + list(registry))
