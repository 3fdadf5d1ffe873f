"""Runs under elastic `horovodrun` (3 workers: 2 on host "localhost", 1 on host "127.0.0.1"): the worker on
127.0.0.1 SIGKILLs itself in the middle of step KILL_AT; the other two must restore the last commit, reset to 2
ranks and finish. Each surviving process writes <outdir>/elastic.<host>.<local_rank>.npz.

    elastic_worker.py <outdir> <keep|drop>
"""

import os
import signal
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_sparse.torch as hvds

STEPS, KILL_AT = 12, 5


def main(outdir, policy):
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.oktopk(0.1, threshold_period=3),
                                    elastic_residuals=policy)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    host = os.environ.get("HOROVOD_HOSTNAME", "?")
    records = []        # per step run: (step, size, engine steps after it, residual norm after it)
    starts = []         # per entry into train(): (step, size, residual norm)

    @hvd.elastic.run
    def train(state):
        starts.append((state.step, hvd.size(), opt.residual_norm()))
        while state.step < STEPS:
            g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            opt.zero_grad()
            model(torch.randn(8, 20, generator=g)).pow(2).mean().backward()
            if state.step == KILL_AT and host == "127.0.0.1":
                os.kill(os.getpid(), signal.SIGKILL)        # dies before the exchange the others are in
            opt.step()
            records.append((state.step, hvd.size(), opt._hvds.engine().steps, opt.residual_norm()))
            state.step += 1
            state.commit()

    train(state)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    np.savez(os.path.join(outdir, f"elastic.{host}.{os.environ.get('HOROVOD_LOCAL_RANK', '0')}.npz"),
             records=np.array(records, dtype=np.float64), starts=np.array(starts, dtype=np.float64),
             params=params)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
