"""The Communicator of the PyTorch adapter: Horovod's torch collectives, named and process-set aware.

Every collective is named ``hvd_sparse.<bucket>.<phase>``: the same on every rank and stable across steps
(Horovod's response cache hits), never the order-dependent ``noname`` Horovod would pick. ``alltoall``
splits go as int32 tensors, which Horovod requires. Volume is counted as in ``hvd_sparse.core.comm``.
"""

from __future__ import annotations

import pickle

import torch

from ..core.comm import HorovodCommunicator


class HorovodTorchCommunicator(HorovodCommunicator):
    def __init__(self, process_set, bucket):
        import horovod.torch as hvd

        super().__init__(hvd, process_set, bucket)

    def _allreduce(self, x, op, kw):
        return self._hvd.allreduce(x, op=op, **kw)

    def _allgather(self, x, kw):
        return self._hvd.allgather(x, **kw)

    def _alltoall(self, x, splits, kw):
        out, recv = self._hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32), **kw)
        return out, [int(s) for s in recv.tolist()]

    def _broadcast(self, x, root, kw):
        return self._hvd.broadcast(x, root_rank=root, **kw)


def allgather_object(obj, name, process_set):
    """Every rank's picklable ``obj``, in rank order (Horovod 0.28.1's torch version takes no process set)."""
    import horovod.torch as hvd

    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = hvd.allgather(torch.tensor([data.numel()]), name=f"{name}.sizes", process_set=process_set)
    blob = hvd.allgather(data, name=f"{name}.data", process_set=process_set)
    out, off = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(blob[off:off + n].numpy().tobytes()))
        off += n
    return out
