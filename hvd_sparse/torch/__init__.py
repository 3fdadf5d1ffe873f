"""hvd_sparse for PyTorch: ``import hvd_sparse.torch as hvds`` next to ``import horovod.torch as hvd``.

    optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                          compression=hvds.Compression.topka(density=0.01))
"""

from . import elastic
from ..compression import register_horovod_adapter
from .compression import Compression
from .mpi_ops import sparse_allreduce
from .optimizer import DistributedOptimizer

from .stash import StashAdapter  # noqa: E402

register_horovod_adapter("torch", StashAdapter)   # a preset as compression= of horovod.torch.DistributedOptimizer
elastic.register()      # hvd.elastic.TorchState keeps hvd_sparse optimizers' per-rank state (see elastic.py)

__all__ = ["Compression", "DistributedOptimizer", "sparse_allreduce"]
