"""A short CUDA job for any Horovod build (scripts/gpu_check.sh runs it against the NCCL build): a dense allreduce of
a CUDA tensor, a bfloat16 model started with hvds.broadcast_parameters, three steps of hvds.DistributedOptimizer with
Ok-Topk and one sparse_allreduce, all on the GPU. Prints one line per rank: ``gpu_smoke ok rank R/P ...``; raises
(non-zero exit) if the replicas differ.
"""

import horovod.torch as hvd
import torch

import hvd_sparse.torch as hvds

if __name__ == "__main__":
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    total = hvd.allreduce(torch.ones(4, device="cuda"), op=hvd.Sum, name="smoke.dense")
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).cuda()
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.oktopk(0.05))
    hvds.broadcast_parameters(model.state_dict(), root_rank=0)
    hvds.broadcast_optimizer_state(opt, root_rank=0)
    g = torch.Generator(device="cuda").manual_seed(10 + hvd.rank())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 64, device="cuda", generator=g)).pow(2).mean().backward()
        opt.step()
    opt.check_consistency()
    out = hvds.sparse_allreduce(torch.randn(1000, device="cuda", generator=g).bfloat16(),
                                compression=hvds.Compression.topka(0.1), name="smoke")
    print(f"gpu_smoke ok rank {hvd.rank()}/{hvd.size()}: dense allreduce {total.tolist()}, "
          f"{opt.sparse_stats()['recv_bytes']} bytes received in the last sparse step, sparse_allreduce "
          f"{out.dtype} {out.device}", flush=True)
    hvd.shutdown()
