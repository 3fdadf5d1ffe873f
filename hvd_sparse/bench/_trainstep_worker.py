"""Worker of ``python -m hvd_sparse.bench trainstep``: one Horovod rank timing training steps (run by horovodrun).

For each configuration in turn, on the same model and data: a fresh MLP (``--layers``, float32, seed ``--seed``) on
``--device`` (``cuda``: GPU ``local_rank % device_count``), SGD(lr, momentum 0.9), a fixed random batch per rank;
``--warmup`` steps, then ``--steps`` timed steps:

    hvd.allreduce(one value)              # barrier: the ranks start the step together (not timed)
    t0; zero_grad; forward; backward; optimizer.step(); synchronize the device; seconds = now - t0

Configurations: ``compute`` (the torch optimizer alone: the floor), ``wire`` (the wire floor: compute plus one
``hvd.allgather`` per step of what TopkA sends, k indices and the bits of k gradient values in one int32 tensor of
the same shape every step, no selection, no other collective, no host read), ``wire_pinned`` (the same, staged
through pinned host buffers by the caller: :class:`WireFloor`), ``dense`` (Horovod's own optimizer,
``Compression.none``) and the presets of :mod:`hvd_sparse.bench.presets` through ``hvd_sparse.torch``. Rank 0
gathers every rank's step times (and, for presets, bytes received per step) and writes ``--out`` (JSON).
"""

from __future__ import annotations

import time

from .cli import worker_parser, write_json
from ._convergence_worker import PROGRESS
from .presets import overlapped, torch_compression


def parse_args(argv=None):
    p = worker_parser(__doc__, seed=0, lr=0.01)
    p.add_argument("--layers", required=True, help="comma-separated MLP widths, input first")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--device", required=True)
    return p.parse_args(argv)


def mlp(widths, seed, device):
    import torch

    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(device)


class WireFloor:
    """The ``wire`` configuration: before the torch optimizer's step, one allgather of TopkA's payload (k indices, then
    the bits of the first k gradient values, int32), its shape the same every step, its result on the device.

    ``pinned``: the ``wire_pinned`` configuration, the same payload staged by the caller through reused pinned host
    buffers (the allgather then runs on CPU tensors, and the result goes back by an asynchronous copy). Without it,
    Horovod's build without GPU operations stages a CUDA tensor itself: an asynchronous copy to the host, the
    collective, then the result copied to the device from pageable memory."""

    def __init__(self, opt, model, density, pinned=False):
        import torch

        self.opt, self.params = opt, list(model.parameters())
        n = sum(p.numel() for p in self.params)
        self.k = max(1, int(density * n))
        self.device = self.params[0].device
        self.index = torch.arange(self.k, dtype=torch.int32, device=self.device)
        self.pinned = pinned and self.device.type == "cuda"
        self.send = torch.empty(2 * self.k, dtype=torch.int32, pin_memory=True) if self.pinned else None
        self.recv = None

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        import horovod.torch as hvd
        import torch

        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        payload = torch.cat([self.index, flat[:self.k].view(torch.int32)])
        if not self.pinned:
            hvd.allgather(payload, name="hvd_sparse.bench.wire")
        else:
            self.send.copy_(payload)            # one DMA; it waits for the recv copy of the step before too
            out = hvd.allgather(self.send, name="hvd_sparse.bench.wire_pinned")
            if self.recv is None:
                self.recv = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self.recv.copy_(out)
            self.recv.to(self.device, non_blocking=True)
        self.opt.step()


def measure(name, args, widths, device):
    """Step seconds (list) and mean bytes received per step of configuration ``name`` on this rank."""
    import horovod.torch as hvd
    import torch

    import hvd_sparse.torch as hvds

    model = mlp(widths, args.seed, device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if name in ("wire", "wire_pinned"):
        opt = WireFloor(opt, model, args.density, pinned=name == "wire_pinned")
    elif name != "compute":
        preset, overlap = overlapped(name)          # <preset>+o: overlap=True
        opt = hvds.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        compression=torch_compression(preset, args.density),
                                        **({"overlap": True} if overlap else {}))
    g = torch.Generator().manual_seed(args.seed + 1 + hvd.rank())
    x = torch.randn(args.batch_size, widths[0], generator=g).to(device)
    y = torch.randint(0, widths[-1], (args.batch_size,), generator=g).to(device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    seconds, recv = [], []
    for t in range(args.warmup + args.steps):
        hvd.allreduce(torch.zeros(1), name="hvd_sparse.bench.barrier")
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sync()
        if t >= args.warmup:
            seconds.append(time.perf_counter() - t0)
            stats = opt.sparse_stats() if hasattr(opt, "sparse_stats") else {}
            recv.append(stats.get("recv_bytes", 0))
    return seconds, sum(recv) / len(recv)


def main(argv=None):
    import horovod.torch as hvd
    import torch

    args = parse_args(argv)
    hvd.init()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    widths = [int(w) for w in args.layers.split(",")]
    runs = []
    for name in args.algorithms.split(","):
        seconds, recv = measure(name, args, widths, device)
        every = hvd.allgather_object({"seconds": seconds, "recv_bytes": recv}, name=f"hvd_sparse.bench.{name}")
        if hvd.rank() == 0:
            print(f"{PROGRESS} [{name}] median step {sorted(seconds)[len(seconds) // 2] * 1e3:.2f} ms", flush=True)
            runs.append({"algorithm": name, "ranks": every})
    if hvd.rank() == 0:
        numel = sum(p.numel() for p in mlp(widths, args.seed, "cpu").parameters())
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        write_json(args.out, {"workers": hvd.size(), "numel": numel, "device": name, "torch": torch.__version__,
                              "cuda": torch.version.cuda, "runs": runs})
    hvd.shutdown()


if __name__ == "__main__":
    main()
