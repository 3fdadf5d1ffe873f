"""Horovod timelines for tests/bench/test_timeline.py (run with ``HOROVOD_TIMELINE=DYNAMIC``):
``timeline_worker.py <out> <name> ...`` records each name's steps in its own timeline, ``<out>/<name>.json``
(``hvd.start_timeline`` / ``stop_timeline``). ``probe``: 20 steps of two plain allgathers, one of a fixed shape and
one that grows every step; a preset's name: 12 steps of a small MLP trained with it (momentum SGD, density 0.05)."""

import sys
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_sparse.torch as hvds

PROBE_STEPS, STEPS = 20, 12


def probe():
    for step in range(PROBE_STEPS):
        hvd.allgather(torch.arange(8, dtype=torch.int32), name="fixed")
        hvd.allgather(torch.arange(8 + step, dtype=torch.int32), name="varying")


def train(preset):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    compression=getattr(hvds.Compression, preset)(0.05))
    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(STEPS):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def main(out, names):
    hvd.init()
    for name in names:
        hvd.start_timeline(str(Path(out) / f"{name}.json"), mark_cycles=False)
        probe() if name == "probe" else train(name)
        hvd.stop_timeline()
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
