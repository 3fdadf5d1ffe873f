"""The Communicator of the PyTorch adapter: Horovod's torch collectives, named and process-set aware.

Every collective is named ``hvd_sparse.<bucket>.<phase>``: the same on every rank and stable across steps
(Horovod's response cache hits), never the order-dependent ``noname`` Horovod would pick. ``alltoall``
splits go as int32 tensors, which Horovod requires. Volume is counted as in ``hvd_sparse.core.comm``.
"""

from __future__ import annotations

import pickle

import torch

from ..core.comm import MAX, SUM, VolumeMeter, meter_allgather, meter_allreduce, meter_alltoall, \
    meter_broadcast


class HorovodTorchCommunicator:
    def __init__(self, process_set, bucket):
        import horovod.torch as hvd

        self._hvd = hvd
        self.process_set = process_set
        self.bucket = bucket
        self.rank = process_set.rank()
        self.size = process_set.size()
        self.meter = VolumeMeter()

    def _name(self, phase):
        return f"hvd_sparse.{self.bucket}.{phase}"

    def allreduce(self, x, op, phase):
        hop = {SUM: self._hvd.Sum, MAX: self._hvd.Max}[op]
        out = self._hvd.allreduce(x, op=hop, name=self._name(phase), process_set=self.process_set)
        meter_allreduce(self.meter, self.size, x.numel(), x.element_size(), phase)
        return out

    def allgather(self, x, phase):
        out = self._hvd.allgather(x, name=self._name(phase), process_set=self.process_set)
        # Horovod does not return the per-rank sizes; only ours and the total matter for the meter.
        mine, total = x.numel(), out.numel()
        sizes = [0] * self.size
        sizes[self.rank] = mine
        sizes[(self.rank + 1) % self.size] += total - mine
        meter_allgather(self.meter, self.rank, sizes, x.element_size(), phase)
        return out

    def alltoall(self, x, splits, phase):
        sp = torch.tensor([int(s) for s in splits], dtype=torch.int32)
        out, recv = self._hvd.alltoall(x, splits=sp, name=self._name(phase), process_set=self.process_set)
        recv_splits = [int(s) for s in recv.tolist()]
        row_words = x.numel() // x.shape[0] if x.numel() else 1
        meter_alltoall(self.meter, self.rank, list(map(int, splits)), recv_splits, x.element_size(), phase,
                       row_words=row_words)
        return out, recv_splits

    def broadcast(self, x, root, phase):
        out = self._hvd.broadcast(x, root_rank=root, name=self._name(phase), process_set=self.process_set)
        meter_broadcast(self.meter, self.rank, root, self.size, x.numel(), x.element_size(), phase)
        return out


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
