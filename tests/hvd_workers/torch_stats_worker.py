"""Runs under `horovodrun -np P --gloo`: ``optimizer.sparse_stats(average=True)`` of the torch optimizer.

Each rank trains the model of torch_worker.py with topka for 3 + 5 steps, records its local per-step statistics
(``sparse_stats()``) and its residual norm just before each averaged call, calls ``sparse_stats(average=True)``
after step 3 and after step 8 (and once more right after, with no step in between); then a second optimizer with
``log_stats_every=3`` for 6 steps: its local per-step statistics and the lines logged on the logger ``hvd_sparse``.
Writes <outdir>/stats.rank<r>.json.
"""

import json
import logging
import sys
from pathlib import Path

import horovod.torch as hvd
import torch

import hvd_sparse.torch as hvds
from torch_worker import model_and_data


def main(outdir):
    hvd.init()
    torch.set_num_threads(1)
    model, xs = model_and_data()
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.topka(0.05))
    rec = {"local": [], "norms": [], "reports": []}
    for t in range(8):
        opt.zero_grad()
        model(xs[t]).pow(2).mean().backward()
        opt.step()
        st = opt.sparse_stats()
        rec["local"].append([st["density"], st["sent_bytes"], st["recv_bytes"]])
        if t in (2, 7):
            rec["norms"].append(opt.residual_norm())
            rec["reports"].append(opt.sparse_stats(average=True))
    rec["empty"] = opt.sparse_stats(average=True)
    rec["logged"], rec["local_logged"] = [], []
    handler = logging.Handler()
    handler.emit = lambda record: rec["logged"].append(record.getMessage())
    logging.getLogger("hvd_sparse").addHandler(handler)
    logging.getLogger("hvd_sparse").setLevel(logging.INFO)
    model, xs = model_and_data()            # a fresh model: the first optimizer's hooks stay on the old one
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.topka(0.05), log_stats_every=3)
    for t in range(6):
        opt.zero_grad()
        model(xs[t]).pow(2).mean().backward()
        opt.step()
        rec["local_logged"].append(opt.sparse_stats()["density"])
    Path(outdir, f"stats.rank{hvd.rank()}.json").write_text(json.dumps(rec))


if __name__ == "__main__":
    main(sys.argv[1])
