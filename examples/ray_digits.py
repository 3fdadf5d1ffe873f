"""examples/pytorch_digits.py on a Ray cluster, through Horovod's ``horovod.ray.RayExecutor`` (no horovodrun).

    pip install ".[ray]"    # in this repository: the Ray release Horovod 0.28.1 was tested with here
    python examples/ray_digits.py --workers 2 -- --density 0.01 --epochs 12      # a local Ray started for the run
    ray start --head --num-cpus 2 && python examples/ray_digits.py --address auto --workers 2   # a running cluster

Each Ray actor is one Horovod rank (``cpus_per_worker`` CPUs each); they meet through Horovod's Gloo rendezvous, which
``RayExecutor`` runs in this driver, and train exactly what ``horovodrun -np 2 python examples/pytorch_digits.py``
trains: the arguments after ``--`` are the example's. ``--elastic`` runs the sparse half of the example under
``horovod.ray.ElasticRayExecutor`` with ``hvd.elastic.TorchState`` (the optimizer's residuals and thresholds
included, see :mod:`hvd_sparse.torch.elastic`) instead: the job is re-formed from the Ray nodes' free CPUs when workers
come or go. ``--json FILE`` writes every rank's per-epoch history.

Ray's own start-up lines are kept to warnings (``HVD_SPARSE_VERBOSE=1`` shows everything).
"""

import argparse
import functools
import json
import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def train_example(argv):
    """Runs in each Ray actor: examples/pytorch_digits.py's main() as one Horovod rank."""
    sys.path.insert(0, str(HERE))
    import horovod.torch as hvd
    import pytorch_digits

    dense, sparse = pytorch_digits.main(argv)
    return {"rank": hvd.rank(), "size": hvd.size(), "dense": dense, "sparse": sparse}


def train_elastic(argv):
    """Runs in each Ray actor under ElasticRayExecutor: the example's sparse run as an elastic job, one commit per
    epoch (a reset resumes from the last commit on every rank, with hvd_sparse's per-rank state kept)."""
    sys.path.insert(0, str(HERE))
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import hvd_sparse.torch as hvds
    import pytorch_digits
    from pytorch_digits import Net, accuracy, load_data

    args = pytorch_digits.parse_args(argv)
    hvd.init()
    torch.set_num_threads(1)
    (x_tr, y_tr), test_set = load_data(args.seed)
    torch.manual_seed(args.seed)
    model = Net()
    optimizer = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.base_lr * hvd.size(),
                                                          momentum=0.9),
                                          named_parameters=model.named_parameters(),
                                          compression=pytorch_digits.make_compression(args))
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, history=[])

    @hvd.elastic.run
    def loop(state):
        while state.epoch < args.epochs:
            shard = torch.arange(hvd.rank(), len(x_tr), hvd.size())
            order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(state.epoch))]
            for s in range(len(order) // args.batch_size):
                idx = order[s * args.batch_size:(s + 1) * args.batch_size]
                optimizer.zero_grad()
                F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
                optimizer.step()
            stats = optimizer.sparse_stats(average=True)          # a collective: every rank, once per epoch
            stats.update(epoch=state.epoch + 1, size=hvd.size(), acc=accuracy(model, test_set))
            state.history.append(stats)
            if hvd.rank() == 0:
                print(f"[elastic] epoch {state.epoch + 1:2d}  {hvd.size()} workers  test acc {stats['acc'] * 100:6.2f}%"
                      f"  density {stats['density']:.4f}  residual {stats['residual_norm']:.3f}", flush=True)
            state.epoch += 1
            state.commit()

    loop(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "sparse": state.history}


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="Horovod ranks = Ray actors (default: 2)")
    p.add_argument("--cpus-per-worker", type=int, default=1, help="CPUs each actor reserves (default: 1)")
    p.add_argument("--address", default=None,
                   help="a running Ray cluster ('auto', or host:port); default: start a local one for the run")
    p.add_argument("--elastic", action="store_true", help="ElasticRayExecutor with hvd.elastic.TorchState")
    p.add_argument("--nics", default=None,
                   help="--elastic: comma-separated network interfaces the Ray nodes share (Horovod's "
                        "--network-interface; without it an elastic job waits for two nodes to compare theirs); "
                        "default: lo for the local cluster")
    p.add_argument("--json", metavar="FILE", help="write every rank's history as JSON")
    args = p.parse_args(own)
    args.example_args = rest
    return args


def main(argv=None):
    args = parse_args(argv)
    import ray

    from hvd_sparse.quiet import verbose as quiet_off

    verbose = quiet_off()

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": "1"}
    if not verbose:
        env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"     # horovod.ray's use of a deprecated Ray call
    local = args.address is None
    if local:       # the local cluster's workers inherit this environment (and start sooner without a runtime_env:
        os.environ.update(env)      # Ray then reuses the workers it starts with the cluster)
    ray.init(address=args.address, num_cpus=args.workers * args.cpus_per_worker if local else None,
             include_dashboard=False if local else None, runtime_env=None if local else {"env_vars": env},
             logging_level=logging.INFO if verbose else logging.WARNING, log_to_driver=True)
    try:
        if args.elastic:
            from horovod.ray import ElasticRayExecutor

            nics = set(args.nics.split(",")) if args.nics else ({"lo"} if local else None)
            settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=args.workers, nics=nics,
                                                          verbose=verbose)
            executor = ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=args.cpus_per_worker)
            executor.start()
            results = executor.run(functools.partial(train_elastic, args.example_args))
        else:
            from horovod.ray import RayExecutor

            settings = RayExecutor.create_settings(timeout_s=120)
            executor = RayExecutor(settings, num_workers=args.workers, cpus_per_worker=args.cpus_per_worker,
                                   use_gpu=False)
            executor.start()
            try:
                results = executor.run(train_example, args=[args.example_args])
            finally:
                executor.shutdown()
    finally:
        ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(sorted(results, key=lambda r: r["rank"])))
    return results


if __name__ == "__main__":
    main()
