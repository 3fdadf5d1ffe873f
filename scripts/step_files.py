"""The files of hvd_sparse that one steady Ok-Topk ``optimizer.step()`` runs in, in the order it first enters them
(README, "Where is what"), for momentum SGD (an optimizer with state) and plain SGD (without). Run on two ranks:

    horovodrun -np 2 -H localhost:2 python scripts/step_files.py

A profile hook (``sys.setprofile``) records every call into hvd_sparse during the sixth step of a small MLP.
"""

import sys

import horovod.torch as hvd
import torch

import hvd_sparse.torch as hvds


def files_of_a_step(momentum):
    """The files entered during the sixth step, in order of first entry."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                    named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.oktopk(0.05))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    seen = {}

    def hook(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and "/hvd_sparse/" in name:
            seen.setdefault(name.split("/hvd_sparse/", 1)[1], None)

    sys.setprofile(hook)
    step()
    sys.setprofile(None)
    return list(seen)


def main():
    hvd.init()
    for momentum in (0.9, 0.0):
        seen = files_of_a_step(momentum)
        if hvd.rank() == 0:
            backend = [f for f in seen if f.startswith(("core/xp/", "core/native/"))]
            print(f"SGD(momentum={momentum}): " + " -> ".join(f for f in seen if f not in backend))
            print(f"{len(seen) - len(backend)} files, and {len(backend)} of the array backend: {', '.join(backend)}")


if __name__ == "__main__":
    main()
