"""The PyTorch digits training loop, shared by ``examples/pytorch_digits.py``, ``bench convergence`` and
``bench train``: data-parallel SGD on each rank's shard of the training set, reshuffled every epoch.

    for epoch in range(1, epochs + 1):
        order = epoch_order(len(x_train), rank, size, seed, epoch)     # the same on every run of the seed
        run_epoch(model, optimizer, (x_train, y_train), order, batch_size, schedule, after_step=...)
        acc = accuracy(model, test_set)

One step of :func:`run_epoch`, each phase timed (``time.perf_counter``)::

    forward    optimizer.zero_grad(); loss = cross_entropy(model(x[idx]), y[idx])
    backward   loss.backward()          # Horovod's optimizer and DDP start their allreduces in here
    exchange   synchronize()            # only when given: e.g. optimizer.synchronize() of Horovod/hvd_sparse
    update     optimizer.step()         # (under optimizer.skip_synchronize() after a synchronize)

Without ``synchronize`` the optimizer's own ``step()`` does the exchange (``exchange`` is then 0 and the update
includes it), which is what a user's loop does.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def epoch_order(n_train, rank, size, seed, epoch):
    """Indices of rank ``rank``'s shard (every ``size``-th image from ``rank``) in the order of ``epoch``
    (a permutation seeded by ``seed * 1000 + epoch``: identical for every run with the same seed)."""
    shard = torch.arange(rank, n_train, size)
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    return shard[torch.randperm(len(shard), generator=g)]


def steps_per_epoch(shard_len, batch_size):
    """Full batches per epoch (at least 1): every rank runs the same number of steps."""
    return max(1, shard_len // batch_size)


def run_epoch(model, optimizer, data, order, batch_size, schedule=None, synchronize=None, after_step=None):
    """One epoch of SGD steps over ``order`` (see the module docstring).

    Args:
        data: ``(x, y)`` tensors of the training set.
        order: this rank's indices for the epoch (:func:`epoch_order`).
        schedule: a learning-rate scheduler stepped after every step, or None.
        synchronize: None, or a callable that completes the exchange before ``optimizer.step()`` (which then
            runs under ``optimizer.skip_synchronize()``).
        after_step: None, or ``after_step(s, loss, seconds)`` after each step: ``s`` the step of the epoch,
            ``loss`` the loss tensor, ``seconds`` = (forward, backward, exchange, update).
    Returns:
        the number of steps run.
    """
    x, y = data
    model.train()
    steps = steps_per_epoch(len(order), batch_size)
    clock = time.perf_counter
    for s in range(steps):
        idx = order[s * batch_size:(s + 1) * batch_size]
        t0 = clock()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        t1 = clock()
        loss.backward()
        t2 = clock()
        if synchronize is not None:
            synchronize()
            t3 = clock()
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            t3 = t2
            optimizer.step()
        t4 = clock()
        if schedule is not None:
            schedule.step()
        if after_step is not None:
            after_step(s, loss, (t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    return steps


def correct(model, test):
    """Number of correctly classified images of ``test = (x, y)`` (eval mode, no autograd; the model's mode is
    restored)."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return int((model(test[0]).argmax(1) == test[1]).sum())
    finally:
        model.train(was)


def accuracy(model, test):
    """Test accuracy (fraction) of ``model`` on ``test = (x, y)``."""
    return correct(model, test) / max(1, len(test[1]))


def ring_allreduce_bytes(numel, size, itemsize=4):
    """Bytes each rank sends in a ring allreduce of ``numel`` values of ``itemsize`` bytes: 2n(P-1)/P words."""
    return 2 * numel * (size - 1) / size * itemsize


def exchange_stats(optimizer, numel, size):
    """``(density, sent_bytes)`` of the last step on this rank: ``optimizer.sparse_stats()`` for hvd_sparse's
    optimizer; ``(1.0, ring allreduce bytes of float32)`` for Horovod's dense one (it has no traffic counter)."""
    if hasattr(optimizer, "sparse_stats"):
        st = optimizer.sparse_stats()
        return st["density"], st["sent_bytes"]
    return 1.0, ring_allreduce_bytes(numel, size)
