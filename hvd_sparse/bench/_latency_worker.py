"""Worker of ``python -m hvd_sparse.bench latency``: one Horovod rank timing small collectives (run by horovodrun).

For each collective (``allreduce`` of one float32 value, ``allgather`` of 7 int32 words: the agreement's size) and
each wait mode (``poll``: hvd_sparse's communicator, poll and sleep up to 500 us; ``spin``: Horovod's
``synchronize``), ``--warmup`` calls, then ``--repeat`` timed calls, each after a barrier, under a fixed name (the
response cache hits after the first). Then, after a barrier, every rank sleeps ``--idle`` seconds and measures
the CPU time its process spent meanwhile: Horovod's background thread, which runs a coordination round every
cycle even when no collective is pending. Rank 0 writes every rank's seconds to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import os
import time

from .cli import write_json

MODES = {"poll": 500e-6, "spin": None}


def main(argv=None):
    import horovod.torch as hvd
    import torch

    from ..torch.comm import wait

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--idle", type=float, default=1.0, help="seconds of the idle measurement")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    calls = {"allreduce": lambda: hvd.allreduce_async(torch.ones(1), name="lat.allreduce", op=hvd.Sum),
             "allgather": lambda: hvd.allgather_async(torch.ones(7, dtype=torch.int32), name="lat.allgather")}
    rows = []
    for coll, start in calls.items():
        for mode, max_sleep in MODES.items():
            secs = []
            for i in range(args.warmup + args.repeat):
                hvd.allreduce(torch.zeros(1), name="lat.barrier")
                t0 = time.perf_counter()
                wait(start(), max_sleep)
                if i >= args.warmup:
                    secs.append(time.perf_counter() - t0)
            rows.append({"collective": coll, "wait": mode,
                         "ranks": hvd.allgather_object(secs, name=f"lat.{coll}.{mode}")})
    hvd.allreduce(torch.zeros(1), name="lat.barrier")
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(args.idle)
    idle = (time.process_time() - c0) / (time.perf_counter() - t0)         # CPU seconds per second, idle
    idle = hvd.allgather_object(idle, name="lat.idle")
    if hvd.rank() == 0:
        write_json(args.out, {"workers": hvd.size(), "cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME", "default"),
                              "cpus": os.cpu_count(), "results": rows, "idle_cpu": idle})
    hvd.shutdown()


if __name__ == "__main__":
    main()
