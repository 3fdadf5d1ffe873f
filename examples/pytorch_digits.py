"""Dense vs sparse data-parallel training of a small CNN on scikit-learn's digits, with Horovod.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py [--density 0.01]

Trains the same model from the same initial weights twice: once with Horovod's dense allreduce
(``Compression.none``), once with a sparse preset (default TopkA at density 0.01). Prints per epoch the
training loss, test accuracy, achieved density and bytes sent per step for each run (for the sparse run also the
error-feedback residual's norm, from ``optimizer.sparse_stats(average=True)``), then one line comparing them.
``--tensorboard DIR`` also writes those statistics with ``SummaryWriter.add_scalars`` (needs the tensorboard
package). Digits (1,797 8x8 images) ships with scikit-learn: nothing is downloaded.
"""

import argparse
import time

import horovod.torch as hvd
import torch

import hvd_sparse.torch as hvds
from hvd_sparse.bench.digits_torch import Net, load_data   # the CNN and the 80/20 split of sklearn's digits
from hvd_sparse.bench.loop import accuracy, epoch_order, exchange_stats, run_epoch   # the benchmarks' loop

PRESETS = {"topka": hvds.Compression.topka}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="topka", choices=sorted(PRESETS),
                   help="sparse preset compared with dense (default: topka)")
    p.add_argument("--density", type=float, default=0.01, help="fraction of gradient entries sent (default: 0.01)")
    p.add_argument("--epochs", type=int, default=12, help="epochs per run (default: 12)")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default: 32)")
    p.add_argument("--lr", type=float, default=0.05, help="initial SGD learning rate, cosine-decayed to 0 (default: 0.05)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--tensorboard", metavar="DIR", help="write the sparse statistics for TensorBoard into DIR")
    return p.parse_args(argv)


def train(args, compression, train_set, test_set, label, writer=None):
    torch.manual_seed(args.seed)
    model = Net()
    n = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                          compression=compression)
    # Horovod's recipe, through hvds: the same functions, for every dtype (Horovod's own refuse bfloat16)
    hvds.broadcast_parameters(model.state_dict(), root_rank=0)
    hvds.broadcast_optimizer_state(optimizer, root_rank=0)
    # each rank takes its own shard of the training set, reshuffled every epoch (same seed on all ranks)
    x_tr, _ = train_set
    steps_per_epoch = len(epoch_order(len(x_tr), hvd.rank(), hvd.size(), args.seed, 0)) // args.batch_size
    # cosine decay to 0 over the run: both runs end on a settled model, not on one noisy SGD step
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)
    sums = {}

    def after_step(s, loss, seconds):
        # hvd_sparse counts its bytes; for Horovod's dense ring allreduce: 2n(P-1)/P float32 words per rank
        density, sent = exchange_stats(optimizer, n, hvd.size())
        sums["loss"] += loss.item()
        sums["density"] += density
        sums["bytes"] += sent

    history = []
    for epoch in range(1, args.epochs + 1):
        order = epoch_order(len(x_tr), hvd.rank(), hvd.size(), args.seed, epoch)
        sums.update(loss=0.0, density=0.0, bytes=0.0)
        t0 = time.perf_counter()
        run_epoch(model, optimizer, train_set, order, args.batch_size, schedule, after_step=after_step)
        loss_sum, density_sum, bytes_sum = sums["loss"], sums["density"], sums["bytes"]
        stats = dict(
            loss=hvd.allreduce(torch.tensor(loss_sum / steps_per_epoch), name=f"{label}.loss").item(),
            acc=accuracy(model, test_set),
            density=density_sum / steps_per_epoch,
            bytes=hvd.allreduce(torch.tensor(bytes_sum / steps_per_epoch), name=f"{label}.bytes").item(),
            seconds=time.perf_counter() - t0)
        residual = ""
        if hasattr(optimizer, "sparse_stats"):    # hvd_sparse's sparse optimizer (Horovod's dense one has none)
            sparse = optimizer.sparse_stats(average=True)   # a collective: every rank calls it, once per epoch
            residual = f"  residual {sparse['residual_norm']:.3f}"
            if writer is not None:
                writer.add_scalars(f"{label}/sparse", sparse, epoch)
        history.append(stats)
        if hvd.rank() == 0:
            print(f"[{label:>6}] epoch {epoch:2d}  loss {stats['loss']:.4f}  test acc {stats['acc'] * 100:6.2f}%  "
                  f"density {stats['density']:.4f}  sent/step {stats['bytes'] / 1024:8.1f} KiB{residual}  "
                  f"({stats['seconds']:.2f} s)", flush=True)
    return n, history


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    train_set, test_set = load_data(args.seed)
    sparse = PRESETS[args.compression](args.density)
    if hvd.rank() == 0:
        print(f"digits: {len(train_set[0])} train / {len(test_set[0])} test images, {hvd.size()} workers; "
              f"dense (Horovod) vs {sparse!r}", flush=True)
    writer = None
    if args.tensorboard and hvd.rank() == 0:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.tensorboard)
    n, dense_hist = train(args, hvds.Compression.none, train_set, test_set, "dense")
    _, sparse_hist = train(args, sparse, train_set, test_set, "sparse", writer)
    if writer is not None:
        writer.close()
    if hvd.rank() == 0:
        d, s = dense_hist[-1], sparse_hist[-1]
        print(f"after {args.epochs} epochs ({n} parameters): dense {d['acc'] * 100:.2f}% vs "
              f"{args.compression} {s['acc'] * 100:.2f}% test accuracy "
              f"({(s['acc'] - d['acc']) * 100:+.2f} points), sent per step {d['bytes'] / 1024:.1f} KiB vs "
              f"{s['bytes'] / 1024:.1f} KiB ({d['bytes'] / max(s['bytes'], 1):.1f}x less)", flush=True)
    return dense_hist, sparse_hist


if __name__ == "__main__":
    main()
