"""Worker of ``python -m hvd_sparse.bench train``: one rank in its own network namespace, Horovod and a
``torch.distributed`` gloo process group side by side over the same shaped link.

Started by :mod:`hvd_sparse.bench.train` through :func:`hvd_sparse.bench.launcher.launch`; not meant to be run by
hand. For each configuration in turn, from the same initial weights (``torch.manual_seed(seed)``, then rank 0's
weights broadcast) and the same data order (:func:`hvd_sparse.bench.loop.epoch_order`), it trains the model of
``--task``: :class:`~hvd_sparse.bench.digits_torch.WideNet` on the digits (``digits``) or
:class:`~hvd_sparse.bench.mnist1d_torch.WideNet1D` on MNIST-1D generated from ``--seed`` (``mnist1d``,
``--train-samples`` and ``--test-samples`` sequences), with the loop of :mod:`hvd_sparse.bench.loop` (SGD with
momentum 0.9, or AdamW with ``--optimizer adamw``; cosine-decayed learning rate) and records per step and rank the
seconds of forward, backward, exchange wait and update and the bytes sent; every ``--eval-every`` steps (and after
the last) the test accuracy, outside the timed steps. With ``--stop-at ACC`` a configuration stops after the first
evaluation at or above ACC.
Configurations (:func:`parse_config`):

    compute           no communication at all: each rank trains alone (the floor of the step time; no accuracy)
    horovod           horovod.torch.DistributedOptimizer, Compression.none (allreduces start during backward)
    horovod_fp16      the same with Compression.fp16
    <preset>[+opt..]  hvd_sparse.torch.DistributedOptimizer with Compression.<preset>(density), e.g. oktopk;
                      options: +w<N> (warmup_dense_steps=N), +mc (momentum correction: the velocity is kept by
                      error feedback and the SGD optimizer runs without momentum), +d<density> (this
                      configuration's density instead of ``--density``, e.g. oktopk+d0.03), +b<budget> (no
                      density: the preset's ``byte_budget=budget``, e.g. oktopk+b0.02; not with +d), +fill
                      (oktopk only: ``global_fill=True``, K filled up to k on reuse steps), +h (two levels:
                      ``hierarchical=True``, with ``--hosts``), +s<d0>x<T> (the density warm-up:
                      ``warmup_density=d0, warmup_stage_steps=T``, e.g. +s0.25x40), +c<norm> (local gradient
                      clipping: ``local_clip_norm=norm``, e.g. +c5), +t<share> (small tensors dense:
                      ``dense_share=share``, e.g. +t0.02), +o (``overlap=True``: buckets exchanged during
                      backward), +o<MB> (the same with ``bucket_cap_mb=MB``, e.g. +o2)
    ddp               torch.nn.parallel.DistributedDataParallel over the gloo process group, no hook
    ddp_powersgd_r<R> the same with the PowerSGD hook, matrix_approximation_rank R, vanilla allreduce for the
                      first ``--powersgd-warmup`` steps (``start_powerSGD_iter``)

Rank 0 gathers every rank's records and writes them to ``--out`` (JSON); the parent computes the statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import re

from .cli import write_json

#: prefix of rank 0's progress lines (the parent forwards them to stderr)
PROGRESS = "hvd_sparse.train:"
FIXED = ("compute", "horovod", "horovod_fp16", "ddp")
TASKS = ("digits", "mnist1d")
#: ``--optimizer``: SGD with ``--momentum``, or AdamW (torch's defaults: betas (0.9, 0.999), weight decay 0.01)
OPTIMIZERS = ("sgd", "adamw")
_POWERSGD = re.compile(r"^ddp_powersgd_r([1-9]\d*)$")


def parse_config(name, presets=None):
    """``name`` -> ``{"kind", "name", ...}``: kind one of compute, horovod, sparse, ddp; raises ValueError naming
    the configuration when it is unknown."""
    from . import presets as _presets

    known = presets if presets is not None else [p for p in _presets.names() if p != "dense"]
    if name in FIXED:
        return {"kind": "horovod" if name.startswith("horovod") else name, "name": name,
                "fp16": name == "horovod_fp16"}
    m = _POWERSGD.match(name)
    if m:
        return {"kind": "ddp", "name": name, "powersgd_rank": int(m.group(1))}
    base, *opts = name.split("+")
    if base not in known:
        raise ValueError(f"unknown configuration {name!r}: choose from {', '.join(FIXED)}, ddp_powersgd_r<rank>, "
                         f"or a preset ({', '.join(known)}) with options +w<steps>, +mc, +d<density>, +b<budget>, "
                         "+s<d0>x<steps>, +c<norm>, +t<share>, +fill, +h, +o[<MB>]")
    cfg = {"kind": "sparse", "name": name, "preset": base, "warmup_dense_steps": 0, "momentum_correction": False}
    for o in opts:
        if re.fullmatch(r"w\d+", o):
            cfg["warmup_dense_steps"] = int(o[1:])
        elif o == "mc":
            cfg["momentum_correction"] = True
        elif o == "fill" and base == "oktopk":
            cfg["global_fill"] = True
        elif o == "h":
            cfg["hierarchical"] = True
        elif re.fullmatch(r"o(\d+(\.\d*)?|\.\d+)?", o) and (o == "o" or float(o[1:]) > 0):
            cfg["overlap"] = float(o[1:]) if len(o) > 1 else True
        elif re.fullmatch(r"s(0?\.\d+|1(\.0*)?)x[1-9]\d*", o) and 0 < float(o[1:].split("x")[0]) <= 1:
            d0, steps = o[1:].split("x")
            cfg["warmup_density"], cfg["warmup_stage_steps"] = float(d0), int(steps)
        elif re.fullmatch(r"c(\d+(\.\d*)?|\.\d+)", o) and float(o[1:]) > 0:
            cfg["local_clip_norm"] = float(o[1:])
        elif re.fullmatch(r"t0?\.\d+", o) and 0 < float(o[1:]) < 0.5:
            cfg["dense_share"] = float(o[1:])
        elif re.fullmatch(r"[db](0?\.\d+|1(\.0*)?)", o) and 0 < float(o[1:]) <= 1:
            cfg["density" if o[0] == "d" else "byte_budget"] = float(o[1:])
        else:
            raise ValueError(f"configuration {name!r}: unknown option {o!r} (+w<steps>: dense warm-up steps, "
                             "+mc: momentum correction, +d<density>: density in (0, 1], +b<budget>: byte budget "
                             "in (0, 1], +fill: oktopk's global_fill, +h: two levels, +s<d0>x<steps>: the density "
                             "warm-up, +c<norm>: local clipping, +t<share>: small tensors dense, +o[<MB>]: overlap "
                             "[with bucket_cap_mb=MB])")
    if "density" in cfg and "byte_budget" in cfg:
        raise ValueError(f"configuration {name!r}: give +d<density> or +b<budget>, not both")
    if cfg["momentum_correction"] and base == "spardl":
        raise ValueError(f"configuration {name!r}: momentum correction does not apply to spardl")
    return cfg


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True, help="comma-separated configurations")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--task", choices=TASKS, default="digits")
    p.add_argument("--train-samples", type=int, default=20_000, help="MNIST-1D training sequences")
    p.add_argument("--test-samples", type=int, default=10_000, help="MNIST-1D test sequences")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--floor-epochs", type=int, required=True)
    p.add_argument("--powersgd-warmup", type=int, default=None, help="start_powerSGD_iter (default: 10%% of the "
                                                                     "steps, at least 2)")
    p.add_argument("--stop-at", type=float, default=None,
                   help="stop a configuration after the evaluation at which its test accuracy reaches this")
    p.add_argument("--out", required=True, help="JSON file written by rank 0")
    return p.parse_args(argv)


@contextlib.contextmanager
def counting_allreduce(counter):
    """While active, every ``torch.distributed.all_reduce`` adds its tensor's bytes to ``counter[0]`` (the
    PowerSGD hook and DDP's default hook in Python call it; DDP without a hook allreduces in C++)."""
    import torch.distributed as dist

    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        counter[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def build_model(task, image_size, hidden):
    """A fresh model of ``task`` (its initial weights drawn from torch's global generator): WideNet1D(hidden) for
    mnist1d, WideNet(image_size, hidden) for digits."""
    if task == "mnist1d":
        from .mnist1d_torch import WideNet1D

        return WideNet1D(hidden)
    from .digits_torch import WideNet

    return WideNet(image_size, hidden)


def _load_data(args):
    """``((x_train, y_train), (x_test, y_test))`` of ``--task`` as torch tensors, the same on every rank."""
    if args.task == "mnist1d":
        from .mnist1d_torch import load_data

        return load_data(args.seed, args.train_samples, args.test_samples)
    from .digits_torch import load_data

    return load_data(args.seed, image_size=args.image_size)


def _build(args, cfg, steps_total):
    """(model to train, module to evaluate, optimizer, synchronize or None, bytes-of-last-step function, allreduce
    byte counter or None)."""
    import horovod.torch as hvd
    import torch

    import hvd_sparse.torch as hvds

    from .loop import exchange_stats, ring_allreduce_bytes

    torch.manual_seed(args.seed)
    model = build_model(args.task, args.image_size, args.hidden)
    n = sum(p.numel() for p in model.parameters())
    P = hvd.size()
    kind = cfg["kind"]
    momentum = 0.0 if cfg.get("momentum_correction") else args.momentum
    if kind in ("horovod", "sparse"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    net = model
    if kind == "ddp":
        # broadcasts rank 0's weights. PowerSGD's hook issues its second and third allreduce of a bucket from the
        # completion callback of the one before, so with several buckets the order in which a rank issues them
        # depends on timing; gloo matches collectives by issue order, and ranks that differ fail ("Received data
        # size doesn't match expected size"). One bucket holding every gradient keeps the order fixed.
        one_bucket = cfg.get("powersgd_rank") is not None
        cap = {"bucket_cap_mb": n * 4 / 2 ** 20 + 1} if one_bucket else {}
        net = torch.nn.parallel.DistributedDataParallel(model, **cap)
    optimizer = local_optimizer(model, args.optimizer, args.lr, momentum)
    if kind == "compute":
        return net, model, optimizer, None, lambda: 0.0, None
    if kind == "horovod":
        comp = hvd.Compression.fp16 if cfg["fp16"] else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=comp)
        sent = ring_allreduce_bytes(n, P, 2 if cfg["fp16"] else 4)
        return net, model, optimizer, optimizer.synchronize, lambda: sent, None
    if kind == "sparse":
        compression = sparse_compression(cfg, args.density, args.momentum)
        optimizer = hvds.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                              compression=compression, **overlap_options(cfg))
        return net, model, optimizer, optimizer.synchronize, lambda: exchange_stats(optimizer, n, P)[1], None
    if cfg.get("powersgd_rank") is None:
        sent = ring_allreduce_bytes(n, P)
        return net, model, optimizer, None, lambda: sent, None
    return (net, model, optimizer, None) + _powersgd(net, args, cfg["powersgd_rank"], steps_total, P)


def local_optimizer(model, name, lr, momentum):
    """The optimizer each rank steps (``--optimizer``): ``torch.optim.SGD`` with ``momentum`` or
    ``torch.optim.AdamW`` at its defaults, learning rate ``lr``."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def overlap_options(cfg):
    """The optimizer's overlap options of a sparse configuration: ``+o`` and ``+o<MB>``."""
    overlap = cfg.get("overlap")
    if not overlap:
        return {}
    return {"overlap": True, **({} if overlap is True else {"bucket_cap_mb": overlap})}


def sparse_compression(cfg, density, momentum):
    """The preset of a sparse configuration (:func:`parse_config`), with its options; ``density`` where the
    configuration names neither a density nor a byte budget, ``momentum`` for ``+mc``."""
    from .presets import make

    options = {}
    if cfg["warmup_dense_steps"]:
        options["warmup_dense_steps"] = cfg["warmup_dense_steps"]
    if cfg["momentum_correction"]:
        options["momentum_correction"] = momentum
    if cfg.get("global_fill"):
        options["global_fill"] = True
    for key in ("hierarchical", "warmup_density", "warmup_stage_steps", "local_clip_norm", "dense_share"):
        if cfg.get(key):
            options[key] = cfg[key]
    if "byte_budget" in cfg:                                # +b<budget>: the preset derives its density
        return make(cfg["preset"], None, byte_budget=cfg["byte_budget"], **options)
    return make(cfg["preset"], cfg.get("density", density), **options)


def _powersgd(net, args, rank, steps_total, P):
    """PowerSGD's hook of rank ``rank`` on the DDP model ``net``: ``(bytes-of-last-step function, allreduce byte
    counter)``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    from .loop import ring_allreduce_bytes

    warm = args.powersgd_warmup if args.powersgd_warmup is not None else max(2, steps_total // 10)
    state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=warm,
                                   random_seed=args.seed)
    net.register_comm_hook(state, powerSGD.powerSGD_hook)
    counter = [0]                                               # bytes allreduced since the last step

    def sent_bytes():
        b, counter[0] = counter[0], 0
        return ring_allreduce_bytes(b, P, 1)

    return sent_bytes, counter


class _Reached(Exception):
    """Raised after the evaluation that reaches ``--stop-at``: the accuracy is allreduced, so every rank raises it
    after the same step."""


def train(args, cfg, train_set, test_shard):
    """One configuration; returns this rank's records and the gathered ones (rank 0)."""
    import horovod.torch as hvd
    import torch

    from hvd_sparse.torch.comm import wait

    from .loop import correct, epoch_order, run_epoch, steps_per_epoch

    rank, P = hvd.rank(), hvd.size()
    x_tr = train_set[0]
    spe = steps_per_epoch(len(range(rank, len(x_tr), P)), args.batch_size)
    epochs = args.floor_epochs if cfg["kind"] == "compute" else args.epochs
    total = epochs * spe
    net, model, optimizer, synchronize, sent_bytes, counter = _build(args, cfg, total)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    rec = {"forward": [], "backward": [], "exchange": [], "update": [], "sent_bytes": []}
    evals = []
    tag = f"hvd_sparse.bench.train.{cfg['name']}"
    barrier = torch.zeros(1)

    def evaluate(step):
        c = torch.tensor([correct(model, test_shard), len(test_shard[1])], dtype=torch.float64)
        c = hvd.allreduce(c, op=hvd.Sum, name=f"{tag}.eval.{step}")
        evals.append((step, float(c[0] / c[1])))
        wait(hvd.allreduce_async(barrier, name=f"{tag}.eval_barrier.{step}"))     # start the next step together

    def after_step(s, loss, seconds):
        for key, v in zip(("forward", "backward", "exchange", "update"), seconds):
            rec[key].append(v)
        rec["sent_bytes"].append(float(sent_bytes()))
        step = len(rec["forward"])
        if cfg["kind"] != "compute" and (step % args.eval_every == 0 or step == total):
            evaluate(step)
            if args.stop_at is not None and evals[-1][1] >= args.stop_at and step < total:
                raise _Reached
        if rank == 0 and (step % spe == 0):
            acc = f"  test acc {evals[-1][1] * 100:6.2f}%" if evals else ""
            print(f"{PROGRESS} [{cfg['name']}] epoch {step // spe}/{epochs}  step {sum(seconds):.3f} s "
                  f"(rank 0){acc}", flush=True)

    wait(hvd.allreduce_async(barrier, name=f"{tag}.start"))
    stopped = False
    with counting_allreduce(counter) if counter is not None else contextlib.nullcontext():
        try:
            for epoch in range(1, epochs + 1):
                order = epoch_order(len(x_tr), rank, P, args.seed, epoch)
                run_epoch(net, optimizer, train_set, order, args.batch_size, schedule, synchronize=synchronize,
                          after_step=after_step)
        except _Reached:
            stopped = True
            if rank == 0:
                step, acc = evals[-1]
                print(f"{PROGRESS} [{cfg['name']}] stopped at step {step} of {total}: test acc {acc * 100:6.2f}%",
                      flush=True)
    gathered = {}
    for key, values in rec.items():
        g = hvd.allgather(torch.tensor([values], dtype=torch.float64), name=f"{tag}.{key}")
        gathered[key] = g.tolist()
    return {"config": cfg["name"], "kind": cfg["kind"], "numel": sum(p.numel() for p in model.parameters()),
            "steps_per_epoch": spe, "epochs": epochs, "evals": evals, "stopped": stopped, **gathered}


def main(argv=None):
    args = parse_args(argv)
    import horovod.torch as hvd
    import torch

    torch.set_num_threads(1)
    hvd.init()
    configs = [parse_config(c) for c in args.configs.split(",") if c]
    ddp = any(c["kind"] == "ddp" for c in configs)
    if ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://", rank=hvd.rank(), world_size=hvd.size())
    train_set, (x_te, y_te) = _load_data(args)
    test_shard = (x_te[hvd.rank()::hvd.size()], y_te[hvd.rank()::hvd.size()])
    runs = [train(args, cfg, train_set, test_shard) for cfg in configs]
    if hvd.rank() == 0:
        write_json(args.out, {"workers": hvd.size(), "torch_threads": torch.get_num_threads(),
                              "train_images": len(train_set[0]), "test_images": len(y_te), "runs": runs})
    if ddp:
        dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    main()
