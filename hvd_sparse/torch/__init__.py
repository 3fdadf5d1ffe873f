"""hvd_sparse for PyTorch: ``import hvd_sparse.torch as hvds`` next to ``import horovod.torch as hvd``.

    optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                          compression=hvds.Compression.topka(density=0.01))
"""

from .compression import Compression
from .mpi_ops import sparse_allreduce
from .optimizer import DistributedOptimizer

__all__ = ["Compression", "DistributedOptimizer", "sparse_allreduce"]
