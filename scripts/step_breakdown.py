"""Where one rank's sparse step goes: CPU time per part of the engine step, per rank, under real Horovod.

    horovodrun -np 4 -H localhost:4 --gloo python scripts/step_breakdown.py --numel 25000000 --density 0.01

Runs the network benchmark's worker path without the network (loopback): the same synthetic gradients
(``hvd_sparse.bench.shm.write_gradient_data``, written once by rank 0 into ``--data``), the 16-layer layout,
``hvd_sparse.torch.DistributedOptimizer(SGD, compression=<preset>)``, one torch thread. Each part is timed with
``time.thread_time`` (CPU time of the main thread) by wrapping the engine's functions; ``rank CPU`` is the CPU
time of all the rank's threads (``time.process_time``: Horovod's background thread included) and ``step`` the
wall time of ``optimizer.step()``. Rank 0 prints one row per part and one column per rank (ms per step, mean over
the measured steps), and the share of the step taken by the opening that starts every step (the agreement's header
with the reducer's first message, ``hvd_sparse/core/comm.py``) plus the adapter's layout read. A diagnostic tool for docs/benchmarks.md, not a
benchmark: the wrappers cost a little.
"""

import argparse
import collections
import functools
import json
import os
import time
from pathlib import Path

import numpy as np
import torch


AGREEMENT = "the opening (incl. its allgather)"
LAYOUT = "layout read + declare"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--algorithm", default="oktopk", help="a preset of hvd_sparse.bench.presets")
    p.add_argument("--steps", type=int, default=20, help="measured steps (after 1 warm-up step)")
    p.add_argument("--data", default="/dev/shm/hvd_sparse_step_breakdown",
                   help="gradient data directory (written again when it holds another size or world size)")
    args = p.parse_args()

    import horovod.torch as hvd

    import hvd_sparse.torch as hvds
    from hvd_sparse.bench.layouts import synthetic_layout
    from hvd_sparse.bench.presets import make
    from hvd_sparse.bench.shm import SharedGradients, write_gradient_data
    from hvd_sparse import horovod_comm
    from hvd_sparse.core import engine, state
    from hvd_sparse.core.oktopk import OkTopk, ThresholdReuse
    from hvd_sparse.torch import job as torch_job
    from hvd_sparse.torch.comm import allgather_object, wait

    torch.set_num_threads(1)
    hvd.init()
    data_steps = 12
    meta = Path(args.data) / "meta.json"
    wanted = {"n": args.numel, "workers": hvd.size(), "steps": data_steps}
    written = json.loads(meta.read_text()) if meta.exists() else {}
    if hvd.rank() == 0 and any(written.get(key) != value for key, value in wanted.items()):   # none, or another run's
        Path(args.data).mkdir(parents=True, exist_ok=True)
        write_gradient_data(args.data, args.numel, hvd.size(), data_steps, 0)
    barrier = torch.zeros(1)
    wait(hvd.allreduce_async(barrier, name="breakdown.data"))
    data = SharedGradients(args.data)

    cpu = collections.defaultdict(float)

    def timed(owner, name, key):
        raw = owner.__dict__[name]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw

        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                cpu[key] += time.thread_time() - t0
        setattr(owner, name, staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper)

    def timed_collectives(self, fn, *a):
        t0 = time.thread_time()
        try:
            return guarded(self, fn, *a)
        finally:
            cpu["waiting in collectives"] += time.thread_time() - t0

    guarded = horovod_comm.HorovodCommunicator._guarded
    horovod_comm.HorovodCommunicator._guarded = timed_collectives
    timed(state.ErrorFeedback, "compensate", "residual + grad (the add pass)")
    timed(state.ErrorFeedback, "update", "zero S cap G in the residual")
    timed(ThresholdReuse, "select", "selection")
    timed(OkTopk, "reduce", "reducer (incl. its collectives)")
    timed(engine.Engine, "_emit", "write the result into p.grad")
    timed(torch.optim.SGD, "step", "SGD update")
    # the opening every step starts with (hvd_sparse/core/comm.py): the header with the agreement, in front of the
    # reducer's first message, one allgather (inside the reducer's time; its wait is also in "waiting in
    # collectives"), and the adapter's read of what is trained now
    timed(engine.Engine, "_open", AGREEMENT)
    timed(engine.Engine, "declare", LAYOUT)
    timed(torch_job.SparseJob, "params", LAYOUT)

    layout = synthetic_layout(args.numel)
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in layout]
    opt = hvds.DistributedOptimizer(torch.optim.SGD([q for _, q in params], lr=0.01), named_parameters=params,
                                    compression=make(args.algorithm, args.density))
    buf = np.empty(data.n, np.float32)
    walls = []
    for t in range(args.steps + 1):
        flat = torch.from_numpy(data.grad(t % data_steps, hvd.rank(), out=buf))
        off = 0
        for _, q in params:
            q.grad = flat[off:off + q.numel()].view(q.shape)
            off += q.numel()
        wait(hvd.allreduce_async(barrier, name="breakdown.before"))
        if t == 1:
            cpu.clear()
        c0, w0 = time.process_time(), time.perf_counter()
        opt.step()
        if t >= 1:
            walls.append(time.perf_counter() - w0)
            cpu["rank CPU (all threads)"] += time.process_time() - c0
        wait(hvd.allreduce_async(barrier, name="breakdown.after"))
    mine = {k: v / args.steps for k, v in cpu.items()}
    mine["step (wall, median)"] = float(np.median(walls))
    rows = allgather_object(mine, "breakdown.result", hvd.global_process_set)
    if hvd.rank() == 0:
        print(f"{args.algorithm}, n = {args.numel:,}, density {args.density}, P = {hvd.size()}: ms per step "
              f"(mean of {args.steps}; CPU time of the main thread unless said)")
        for key in sorted(rows[0]):
            print(f"  {key:36s}" + "".join(f"{r.get(key, 0.0) * 1e3:9.1f}" for r in rows))
        share = [100 * (r.get(AGREEMENT, 0.0) + r.get(LAYOUT, 0.0)) / r["step (wall, median)"] for r in rows]
        print(f"  {'opening + layout, % of step':36s}" + "".join(f"{s:9.2f}" for s in share))
    hvd.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
