"""hvd_sparse for PyTorch: ``import hvd_sparse.torch as hvds`` next to ``import horovod.torch as hvd``.

    optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                          compression=hvds.Compression.topka(density=0.01))
    hvds.broadcast_parameters(model.state_dict(), root_rank=0)      # Horovod's, for every dtype (bf16 too)
    hvds.broadcast_optimizer_state(optimizer, root_rank=0)
"""

from . import elastic
from .amp import GradScaler
from ..compression import register_horovod_adapter
from .compression import Compression
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import sparse_allreduce
from .optimizer import DistributedOptimizer

from . import stash  # noqa: E402

register_horovod_adapter("torch", stash.compress)   # a preset as compression= of horovod.torch.DistributedOptimizer
elastic.register()      # hvd.elastic.TorchState keeps hvd_sparse optimizers' per-rank state (see elastic.py)

__all__ = ["Compression", "DistributedOptimizer", "GradScaler", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters", "sparse_allreduce"]
