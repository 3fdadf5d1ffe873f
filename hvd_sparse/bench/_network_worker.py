"""Worker of ``python -m hvd_sparse.bench network``: one Horovod rank in its own network namespace.

Started by :mod:`hvd_sparse.bench.network` with ``ip netns exec`` and the environment ``horovodrun --gloo``
would give it (rendezvous address and port, rank, size, ``HOROVOD_GLOO_IFACE``); not meant to be run by hand.

For each algorithm in turn, on the same gradients (:class:`SharedGradients`, bit-identical to
``SyntheticGradients(n, P, seed).grad(t, rank)``):

    params    = zeros in the layout of --numel or --model; SGD(lr) wrapped by hvd_sparse.torch.DistributedOptimizer
                (dense: Compression.none -> Horovod's own optimizer; else the preset of bench/presets.py)
    for t in range(warmup + steps):
        p.grad  = views of grad(t, rank)                     # backward-free
        hvd.allreduce(one value)                             # barrier: the ranks start the step together
        t0; optimizer.step(); seconds[t] = now - t0          # exchange + write-back + SGD update
        hvd.allreduce(one value)                             # nobody draws the next gradient meanwhile

With ``--backward S`` the gradients come through a synthetic backward instead (:func:`synthetic_backward`: a sleep of
S·n_i/n per layer, in reverse layer order, then the layer's gradient, so that the optimizer's hooks fire as in
training), and the step is timed from the start of backward: ``seconds[t]`` = backward + what the step still adds.

The barriers wait without spinning (``hvd_sparse.torch.comm.wait``): a rank that is done would otherwise spin in
Horovod's ``synchronize`` and take the cores of ranks still inside their timed step (on 2 cores for 4 ranks).
        recv_bytes[t], selected[t] = optimizer.sparse_stats()   (sparse presets)

Each host's local rank 0 reads its namespace's shaped link's byte counters before the first measured step and
after the last (:func:`link_bytes`); a sparse step's parts come from ``sparse_stats()["seconds"]``.
Rank 0 gathers every rank's records and writes them to ``--out`` (JSON); the parent computes the statistics.
"""

from __future__ import annotations

import contextlib
import gc
import time
from pathlib import Path

import numpy as np

from .cli import worker_parser, write_json
from .layouts import model_layout, synthetic_layout
from .network import PROGRESS
from .network_report import DENSE_POLL
from .presets import overlapped, torch_compression
from .shm import SharedGradients


def parse_args(argv=None):
    p = worker_parser(__doc__, seed=0, lr=0.01)
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--numel", type=int)
    size.add_argument("--model")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--data", required=True, help="directory written by shm.write_gradient_data")
    p.add_argument("--profile", default=None, help="write cProfile top functions to <PROFILE>.rank<r>.txt")
    p.add_argument("--backward", type=float, default=0.0, help="seconds of the synthetic backward (0: none)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="bucket_cap_mb of the overlapped runs")
    return p.parse_args(argv)


def synthetic_backward(params, grads, seconds):
    """Run a backward of ``seconds`` that uses no CPU: one autograd node per parameter of ``params`` (``(name, p)``
    in layer order), chained so that backward visits them in reverse order; each sleeps its share of ``seconds``
    (in proportion to its size) and hands its parameter the gradient of ``grads`` (same order), through the
    parameter's gradient accumulator (whose hooks fire as in training)."""
    import torch

    class Layer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, p, grad, delay):
            ctx.grad, ctx.delay = grad, delay
            return h.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(ctx.delay)
            return g, ctx.grad, None, None

    n = sum(p.numel() for _, p in params)
    h = torch.zeros(())
    for (_, p), grad in zip(params, grads):
        h = Layer.apply(h, p, grad, seconds * p.numel() / n)
    h.backward()


@contextlib.contextmanager
def polling_synchronize(enabled):
    """While active (``enabled``), Horovod's torch optimizer waits for its allreduces with
    :func:`hvd_sparse.torch.comm.wait` (poll and sleep) instead of ``synchronize``'s yield loop."""
    if not enabled:
        yield
        return
    import horovod.torch.optimizer as hvd_optimizer

    from hvd_sparse.torch.comm import wait

    original = hvd_optimizer.synchronize
    hvd_optimizer.synchronize = wait
    try:
        yield
    finally:
        hvd_optimizer.synchronize = original


def link_bytes():
    """``(sent, received)`` bytes so far on this namespace's shaped link (``HOROVOD_GLOO_IFACE``: the veth the
    launcher gave it; its kernel counters, which see every packet that crosses it), or None (no such link)."""
    import os

    link = os.environ.get("HOROVOD_GLOO_IFACE")
    try:
        stats = Path("/sys/class/net") / link / "statistics"
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())
    except (OSError, TypeError, ValueError):
        return None


def measure(args, name, layout, data):
    """Run one algorithm; returns this rank's per-step records, and (local rank 0 of each host) the bytes its
    host's link carried over the measured steps."""
    import horovod.torch as hvd
    import torch

    import hvd_sparse.torch as hvds
    from hvd_sparse.torch.comm import wait

    rank = hvd.rank()
    preset, overlap = overlapped(name)
    compression = torch_compression(preset, args.density, horovod=("dense", DENSE_POLL))
    partitioned = bool(getattr(getattr(compression, "sparsifier", None), "partitioned", False))
    params = [(pname, torch.nn.Parameter(torch.zeros(shape))) for pname, shape in layout]
    optimizer = torch.optim.SGD([p for _, p in params], lr=args.lr)
    optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=params, compression=compression,
                                          **({"overlap": True, "bucket_cap_mb": args.bucket_cap_mb} if overlap else {}))
    sparse = hasattr(optimizer, "sparse_stats")
    T = args.warmup + args.steps
    seconds, recv, selected, special, backward = [0.0] * T, [0.0] * T, [0] * T, [False] * T, [0.0] * T
    # a sparse step's parts: the time inside its collectives; on two levels the host's and the hosts' phases
    parts = {k: [0.0] * T for k in ("collectives", "scatter", "across", "across_collectives", "gather")}
    link_start = None
    barrier = torch.zeros(1)
    profiler = None
    buf = np.empty(data.n, np.float32)              # this rank's gradient, rewritten every step
    for t in range(T):
        flat = torch.from_numpy(data.grad(t, rank, out=buf))
        off, grads = 0, []
        for _, p in params:                         # the optimizer's order (sorted by name): no copy
            m = p.numel()
            grads.append(flat[off:off + m].view(p.shape))
            p.grad = None if args.backward else grads[-1]
            off += m
        if args.profile and t == args.warmup:
            import cProfile
            profiler = cProfile.Profile()
        wait(hvd.allreduce_async(barrier, name="hvd_sparse.bench.network.barrier"))
        if t == args.warmup:
            link_start = link_bytes()
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        if args.backward:
            synthetic_backward(params, grads, args.backward)
            backward[t] = time.perf_counter() - t0
        optimizer.step()
        seconds[t] = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
        # a rank that is done must not draw its next gradient while others are still inside the timed step, nor
        # spin in Horovod's synchronize() (a yield loop) and take their cores: it waits politely
        wait(hvd.allreduce_async(barrier, name="hvd_sparse.bench.network.barrier_after"))
        if sparse:
            st = optimizer.sparse_stats()
            recv[t], selected[t] = float(st["recv_bytes"]), int(st["selected"])
            info = st.get("info") or {}
            special[t] = bool(info.get("reeval") or info.get("repartition"))
            for phase, secs in (st.get("seconds") or {}).items():
                parts[phase][t] = float(secs)
        if rank == 0:
            print(f"{PROGRESS} [{name}] step {t + 1}/{T}{' (warm-up)' if t < args.warmup else ''}  "
                  f"{seconds[t]:.3f} s (rank 0)", flush=True)
    end = link_bytes()
    carried = [-1, -1] if link_start is None or end is None or hvd.local_rank() else \
        [end[0] - link_start[0], end[1] - link_start[1]]
    if profiler is not None:
        _write_profile(profiler, f"{args.profile}.{name}.rank{rank}.txt", name, rank, args.steps)
    tag = f"hvd_sparse.bench.network.{name}"
    gathered = {}
    for key, values, dtype in (("seconds", seconds, torch.float64), ("backward", backward, torch.float64),
                               ("recv_bytes", recv, torch.float64),
                               ("selected", selected, torch.int64), ("link_bytes", carried, torch.int64),
                               *((f"seconds_{phase}", v, torch.float64) for phase, v in parts.items())):
        g = hvd.allgather(torch.tensor([values], dtype=dtype), name=f"{tag}.{key}")
        gathered[key] = g.tolist()
    del optimizer, params, flat, buf, grads
    gc.collect()
    return {"algorithm": name, "partitioned": partitioned, "special": special, **gathered}


def private_peak_bytes():
    """Peak resident memory of this process minus the shared gradient data it maps now (VmHWM - RssFile -
    RssShmem from /proc/self/status): about the largest private memory it has used so far; 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            st = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in
                  ("VmHWM", "RssFile", "RssShmem")}
        return max(0, st["VmHWM"] - st.get("RssFile", 0) - st.get("RssShmem", 0))
    except (OSError, KeyError, ValueError):
        return 0


def _write_profile(profiler, path, name, rank, steps):
    import io
    import pstats

    s = io.StringIO()
    s.write(f"{name}, rank {rank}, {steps} measured steps (optimizer.step only)\n")
    pstats.Stats(profiler, stream=s).sort_stats("cumulative").print_stats(35)
    Path(path).write_text(s.getvalue())


def main(argv=None):
    args = parse_args(argv)
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    layout = model_layout(args.model) if args.model else synthetic_layout(args.numel)
    n = sum(int(np.prod(s)) for _, s in layout)
    data = SharedGradients(args.data)
    if data.n != n:
        raise ValueError(f"network worker: the gradient data has {data.n} values, the model {n}")
    runs = []
    for name in args.algorithms.split(","):
        if name:
            with polling_synchronize(name == DENSE_POLL):
                runs.append(measure(args, name, layout, data))
    peak = hvd.allgather(torch.tensor([private_peak_bytes()], dtype=torch.int64),
                         name="hvd_sparse.bench.network.memory").tolist()
    if hvd.rank() == 0:
        write_json(args.out, {"workers": hvd.size(), "numel": n, "torch_threads": torch.get_num_threads(),
                              "runs": runs, "private_peak_bytes": peak})
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    main()
