"""Runs under `horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo` (two hosts of two ranks on one machine) with
HOROVOD_DYNAMIC_PROCESS_SETS=1; each rank writes <outdir>/<scenario>.rank<r>.npz for the test to check.

Scenarios:
  presets   every preset of hvd_sparse.bench.presets through hvd_sparse.torch.DistributedOptimizer with
            hierarchical=True, 8 steps each: raw and reduced gradients, final parameters, words across and inside
  auto      hierarchical left at None, under HOROVOD_HIERARCHICAL_ALLREDUCE=1 (horovodrun --hierarchical-allreduce):
            two levels; and hierarchical=False beside it: flat
  uneven    (-np 3 on hosts of 2 and 1) hierarchical=True raises on every rank, naming the hosts: the message
  overlap   TopkA on two levels with overlap=True, a tensor a bucket (the 4 biases of the last layer dense): as
            presets, with the plan
"""

import json


import horovod.torch as hvd
import numpy as np
import torch

import hvd_sparse.torch as hvds
from hvd_sparse.bench.presets import make, names

from worker_helpers import data, mlp, run_scenarios

STEPS = 8
DENSITY = 0.05


def run(compression, **options):
    """8 steps of SGD through the optimizer (with ``options``) on this rank's data: (raw, reduced) gradients per step,
    the parameters, the layout and the optimizer."""
    model = mlp(seed=5)
    params = sorted(model.named_parameters())
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                    named_parameters=model.named_parameters(), compression=compression, **options)
    raw, red = [], []
    for t in range(STEPS):
        opt.zero_grad()
        model(data(t)).pow(2).mean().backward()
        raw.append(torch.cat([p.grad.reshape(-1) for _, p in params]).numpy().copy())
        opt.step()
        red.append(torch.cat([p.grad.reshape(-1) for _, p in params]).numpy().copy())
    flat = torch.cat([p.detach().reshape(-1) for _, p in params]).numpy().copy()
    return np.array(raw), np.array(red), flat, [p.numel() for _, p in params], opt


def scenario_presets(out):
    res = {}
    for name in names():
        raw, red, params, layout, opt = run(make(name, DENSITY, hierarchical=True))
        last = opt._hvds.engine().last
        res[f"{name}.raw"], res[f"{name}.red"], res[f"{name}.params"] = raw, red, params
        res[f"{name}.across"] = last.get("across", {}).get("recv_words", -1)
        res[f"{name}.inside"] = last.get("inside", {}).get("recv_words", -1)
        res["layout"] = np.array(layout)
    np.savez(out, **res)


def scenario_auto(out):
    kinds = {}
    for label, hierarchical in (("auto", None), ("flat", False)):
        *_, opt = run(make("topka", DENSITY, hierarchical=hierarchical))
        kinds[label] = type(opt._hvds.engine()).__name__
    np.savez(out, auto=kinds["auto"], flat=kinds["flat"])


def scenario_overlap(out):
    raw, red, params, _, opt = run(make("topka", DENSITY, hierarchical=True), overlap=True, bucket_cap_mb=0.0002,
                                   min_compression_rate=3.0)
    buckets = opt._hvds.overlap.buckets
    plan = [{"names": [n for n, _ in b.params], "dense": b.dense} for b in buckets]
    layout = sorted((n, p.numel()) for b in buckets for n, p in b.params)        # the order of raw and red
    np.savez(out, raw=raw, red=red, params=params, plan=np.array(json.dumps(plan)),
             layout=np.array(json.dumps(layout)))


def scenario_uneven(out):
    try:
        run(make("topka", DENSITY, hierarchical=True))
        message = ""
    except ValueError as e:
        message = str(e)
    np.savez(out, message=message)


if __name__ == "__main__":
    run_scenarios(hvd, "", globals())
