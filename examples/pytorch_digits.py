"""Dense vs sparse data-parallel training of a small CNN on scikit-learn's digits, with Horovod.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py [--compression oktopk] [--byte-budget 0.05]

Trains the same model from the same initial weights twice: once with Horovod's dense allreduce
(``Compression.none``), once with a sparse preset (``--compression``, any of ``hvd_sparse.torch.Compression``'s,
at ``--density`` or ``--byte-budget``). Prints per epoch the training loss, test accuracy, achieved density and
bytes sent per step for each run (for the sparse run also the error-feedback residual's norm, from
``optimizer.sparse_stats(average=True)``), then one line comparing them. ``--log-stats-every N`` also logs the
sparse statistics every N steps through Python's ``logging``; ``--tensorboard DIR`` writes them with
``SummaryWriter.add_scalars`` (needs the tensorboard package). Digits (1,797 8x8 images) ships with scikit-learn:
nothing is downloaded. The file stands alone: copy it into a project.
"""

import argparse
import logging
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_sparse.torch as hvds

#: the sparse presets ``--compression`` takes
PRESETS = ("topka", "oktopk", "exdyna", "topk_dsa", "gtopk", "gaussiank", "dct", "spardl")


class Net(nn.Module):
    """conv 3x3 (16) -> conv 3x3 (32) -> max-pool 2 -> dense 64 -> dense 10 (logits); input (N, 1, 8, 8)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_data(seed):
    """Digits split 80/20 by a fixed permutation (the same on every rank), pixels in [0, 1]: ((x, y), (x, y))."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(seed).permutation(len(x))
    x = torch.from_numpy((x[perm] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8))
    y = torch.from_numpy(y[perm].astype(np.int64))
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="topka", choices=PRESETS, help="sparse preset compared with dense")
    p.add_argument("--density", type=float, default=0.01, help="fraction of gradient entries sent (default: 0.01)")
    p.add_argument("--byte-budget", type=float, help="fraction of a dense allreduce's bytes sent, instead of --density")
    p.add_argument("--epochs", type=int, default=12, help="epochs per run (default: 12)")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default: 32)")
    p.add_argument("--base-lr", type=float, default=0.025,
                   help="SGD learning rate per worker, scaled by the number of workers and cosine-decayed to 0")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-stats-every", type=int, default=0, help="log the sparse statistics every N steps")
    p.add_argument("--tensorboard", metavar="DIR", help="write the sparse statistics for TensorBoard into DIR")
    return p.parse_args(argv)


def make_compression(args):
    """The sparse preset of ``--compression`` at ``--byte-budget`` if given, else at ``--density``."""
    preset = getattr(hvds.Compression, args.compression)
    return preset(byte_budget=args.byte_budget) if args.byte_budget is not None else preset(args.density)


def epoch_order(n, seed, epoch):
    """This rank's shard of the training set (every size-th image from its rank), shuffled for ``epoch`` alike on
    every rank; every rank gets the same number of full batches (hvd.join() is not supported with a sparse preset)."""
    shard = torch.arange(hvd.rank(), n, hvd.size())
    return shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(seed * 1000 + epoch))]


def accuracy(model, test_set):
    model.eval()
    with torch.no_grad():
        x, y = test_set
        correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


def train(args, compression, train_set, test_set, label, writer=None):
    torch.manual_seed(args.seed)
    model = Net()
    n = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr * hvd.size(), momentum=0.9)
    sparse = compression is not hvds.Compression.none
    options = {"log_stats_every": args.log_stats_every} if sparse else {}
    optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                          compression=compression, **options)
    # Horovod's recipe, through hvds: the same functions, for every dtype (Horovod's own refuse bfloat16)
    hvds.broadcast_parameters(model.state_dict(), root_rank=0)
    hvds.broadcast_optimizer_state(optimizer, root_rank=0)
    x_tr, y_tr = train_set
    steps = len(epoch_order(len(x_tr), args.seed, 0)) // args.batch_size
    # cosine decay to 0 over the run: both runs end on a settled model, not on one noisy SGD step
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps)
    dense_bytes = 2 * n * (hvd.size() - 1) / hvd.size() * 4     # Horovod's ring allreduce of float32 gradients
    history = []
    for epoch in range(1, args.epochs + 1):
        order = epoch_order(len(x_tr), args.seed, epoch)
        loss_sum = density_sum = bytes_sum = 0.0
        t0 = time.perf_counter()
        for s in range(steps):
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            optimizer.step()
            schedule.step()
            last = optimizer.sparse_stats() if sparse else {"density": 1.0, "sent_bytes": dense_bytes}
            loss_sum, density_sum, bytes_sum = (loss_sum + loss.item(), density_sum + last["density"],
                                                bytes_sum + last["sent_bytes"])
        stats = dict(loss=hvd.allreduce(torch.tensor(loss_sum / steps), name=f"{label}.loss").item(),
                     acc=accuracy(model, test_set), density=density_sum / steps,
                     bytes=hvd.allreduce(torch.tensor(bytes_sum / steps), name=f"{label}.bytes").item(),
                     seconds=time.perf_counter() - t0)
        residual = ""
        if sparse:
            averaged = optimizer.sparse_stats(average=True)   # a collective: every rank calls it, once per epoch
            residual = f"  residual {averaged['residual_norm']:.3f}"
            if writer is not None:
                writer.add_scalars(f"{label}/sparse", averaged, epoch)
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
    if args.log_stats_every:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    train_set, test_set = load_data(args.seed)
    sparse = make_compression(args)
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
