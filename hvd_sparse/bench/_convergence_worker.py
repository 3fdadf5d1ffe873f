"""Worker of ``python -m hvd_sparse.bench convergence``: one Horovod rank (run it under ``horovodrun``).

    horovodrun -np 2 -H localhost:2 --gloo python -m hvd_sparse.bench._convergence_worker \
        --algorithms dense,topka --epochs 12 --density 0.01 --out result.json

Trains the digits CNN (:mod:`hvd_sparse.bench.digits_torch`) once per algorithm, every run from the same initial
weights, with the recipe of ``examples/pytorch_digits.py`` and its loop (:mod:`hvd_sparse.bench.loop`): SGD with
momentum 0.9, learning rate decayed to 0 by a cosine over the run, each rank on its own shard of the training
set reshuffled every epoch.
"dense" is Horovod's own dense allreduce (``hvd_sparse.torch.Compression.none``); every other name is a
preset of :mod:`hvd_sparse.bench.presets`.

Rank 0 prints one progress line per epoch, prefixed with :data:`PROGRESS` (the parent forwards them), and
writes the per-epoch records of every run to ``--out`` as JSON.
"""

from __future__ import annotations

import time

from .cli import worker_parser, write_json

#: prefix of rank 0's per-epoch progress lines on stdout
PROGRESS = "hvd_sparse.convergence:"


def parser(description):
    """The arguments of both workers (this one and the Keras one)."""
    p = worker_parser(description, seed=42, lr=0.05)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=32)
    return p


def run_all(args, train, train_set, test_set, rank, size, **extra):
    """``train(args, name, train_set, test_set) -> (n, history)`` for each of ``args.algorithms`` in order;
    rank 0 then writes ``{"workers", "numel", "train_images", "test_images", **extra, "runs"}`` to ``args.out``
    (atomically: the parent never reads half a file)."""
    runs, n = [], 0
    for name in [a for a in args.algorithms.split(",") if a]:
        n, history = train(args, name, train_set, test_set)
        runs.append({"algorithm": name, "epochs": history})
    if rank == 0:
        write_json(args.out, {"workers": size, "numel": n, "train_images": len(train_set[0]),
                              "test_images": len(test_set[0]), **extra, "runs": runs})


def train(args, name, train_set, test_set):
    """One run; returns the per-epoch records (identical on every rank except ``seconds``)."""
    import horovod.torch as hvd
    import torch

    import hvd_sparse.torch as hvds

    from .digits_torch import Net
    from .loop import accuracy, epoch_order, exchange_stats, run_epoch, steps_per_epoch
    from .presets import torch_compression

    compression = torch_compression(name, args.density)
    partitioned = getattr(getattr(compression, "sparsifier", None), "partitioned", False)
    torch.manual_seed(args.seed)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    n = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                          compression=compression)
    x_tr, _ = train_set
    steps = steps_per_epoch(len(range(hvd.rank(), len(x_tr), hvd.size())), args.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps)
    history = []
    for epoch in range(1, args.epochs + 1):
        order = epoch_order(len(x_tr), hvd.rank(), hvd.size(), args.seed, epoch)
        sums = {"loss": 0.0, "density": 0.0, "bytes": 0.0}

        def after_step(s, loss, seconds):
            density, sent = exchange_stats(optimizer, n, hvd.size())
            sums["loss"] += loss.item()
            sums["density"] += density
            sums["bytes"] += sent

        t0 = time.perf_counter()
        run_epoch(model, optimizer, train_set, order, args.batch_size, schedule, after_step=after_step)
        loss_sum, density_sum, bytes_sum = sums["loss"], sums["density"], sums["bytes"]
        seconds = time.perf_counter() - t0
        acc = accuracy(model, test_set)
        tag = f"hvd_sparse.convergence.{name}"
        loss = hvd.allreduce(torch.tensor(loss_sum / steps, dtype=torch.float64), name=f"{tag}.loss").item()
        sent = hvd.allreduce(torch.tensor(bytes_sum / steps, dtype=torch.float64), name=f"{tag}.bytes").item()
        # a partitioned sparsifier (ExDyna) splits one global selection between the ranks: add them up
        dens = hvd.allreduce(torch.tensor(density_sum / steps, dtype=torch.float64), name=f"{tag}.density",
                             op=hvd.Sum if partitioned else hvd.Average).item()
        rec = dict(epoch=epoch, loss=loss, accuracy=acc, seconds=seconds, density=dens, sent_bytes=sent)
        history.append(rec)
        if hvd.rank() == 0:
            print(f"{PROGRESS} [{name}] epoch {epoch}/{args.epochs}  loss {loss:.4f}  "
                  f"test acc {acc * 100:6.2f}%  density {dens:.4f}  sent/step {sent / 1024:8.1f} KiB  "
                  f"({seconds:.2f} s)", flush=True)
    return n, history


def main(argv=None):
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    import horovod.torch as hvd
    import torch

    from .digits_torch import load_data

    hvd.init()
    torch.set_num_threads(1)
    train_set, test_set = load_data(args.seed)
    run_all(args, train, train_set, test_set, hvd.rank(), hvd.size())
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    main()
