"""The two-level step's phases inside one host against Horovod's own collectives of the same sizes.

    horovodrun -np 2 -H localhost:2 --gloo python scripts/host_phases.py --numel 25000000 --repeat 5

On the ranks of one host (one job: every rank is local), the median over ``--repeat`` calls of rank 0's wall time
of: Horovod's ``allreduce`` of n float32, its ``reducescatter`` of n and ``allgather`` of n/L (what
a dense two-level step would call), and the two phases of hvd_sparse's two-level step (``TwoLevelEngine``: the
scatter -- one alltoall of the shards behind their headers and the local-rank-order sums -- and the gather), run on a
single host (N = 1, the step's dense case) so that nothing crosses hosts, and the two phases together beside
Horovod's reducescatter and allgather together (the gather starts when this rank's sums are done and waits for the
other ranks' there, where Horovod's allgather starts after a barrier). A barrier (an allreduce of one value)
starts every call alike. docs/benchmarks.md ("Two levels on emulated hosts") has the numbers of this machine.
"""

import argparse
import statistics
import time

import horovod.torch as hvd
import torch

from hvd_sparse.bench.presets import make
from hvd_sparse.core.hierarchy import Topology, TwoLevelEngine
from hvd_sparse.core.sim import SimulatedWorld
from hvd_sparse.torch.comm import HorovodTorchCommunicator


def timed(fn, repeat):
    """The median of ``repeat`` wall times of ``fn()``, each after a barrier."""
    out = []
    for _ in range(repeat):
        hvd.allreduce(torch.zeros(1), name="host_phases.barrier")
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    x = torch.randn(args.numel) * (hvd.rank() + 1)
    shard = x[: args.numel // hvd.size()].clone()
    horovod = {"allreduce": timed(lambda: hvd.allreduce(x, name="host_phases.ar", op=hvd.Sum), args.repeat),
               "reducescatter": timed(lambda: hvd.reducescatter(x, name="host_phases.rs", op=hvd.Sum), args.repeat),
               "allgather": timed(lambda: hvd.allgather(shard, name="host_phases.ag"), args.repeat)}
    local = HorovodTorchCommunicator(hvd.global_process_set, "host_phases")
    one_host = Topology(local, SimulatedWorld(1).communicators()[0])
    engine = TwoLevelEngine(make("topka", 0.01), one_host, "host_phases", comm=local)
    parts = []
    for _ in range(args.repeat):
        hvd.allreduce(torch.zeros(1), name="host_phases.barrier")
        engine.step(x)
        parts.append(engine.last["seconds"])
    ours = {phase: statistics.median(p[phase] for p in parts) for phase in ("scatter", "gather")}
    ours["both"] = statistics.median(p["scatter"] + p["gather"] for p in parts)
    horovod["reducescatter+allgather"] = horovod["reducescatter"] + horovod["allgather"]
    if hvd.rank() == 0:
        print(f"n = {args.numel:,}, {hvd.size()} ranks on one host, median of {args.repeat}, seconds: Horovod "
              + ", ".join(f"{k} {v:.3f}" for k, v in horovod.items()) + "; two levels "
              + ", ".join(f"{k} {v:.3f}" for k, v in ours.items()), flush=True)


if __name__ == "__main__":
    main()
