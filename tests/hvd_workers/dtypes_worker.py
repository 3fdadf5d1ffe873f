"""Half-precision and mixed-dtype models through real `horovodrun`, on the CPU or on CUDA.

    horovodrun -np 2 ... python dtypes_worker.py OUTDIR DEVICE        # DEVICE: cpu or cuda

Each rank writes OUTDIR/dtypes.rank<r>.npz (tensors as float32, which holds bf16/fp16 values exactly, or float64).
Scenarios, for each model dtype of MODELS (float32, bfloat16, float16, float64, mixed: bfloat16 + float16 + float32
layers):

  start       ranks build different models and optimizer states (rank 0 took one local Adam step with another
              learning rate); hvds.broadcast_parameters + hvds.broadcast_optimizer_state: parameters and Adam
              state right after them (must equal rank 0's everywhere)
  <preset>    SGD with momentum, every preset of hvd_sparse.bench.presets (and oktopk with dense warm-up steps) through
              hvds.DistributedOptimizer for STEPS steps: raw and reduced gradients, final parameters
  horovod     horovod.torch.DistributedOptimizer(compression=<topka preset>) (the stash adapter)
  op          hvds.sparse_allreduce of a tensor of the model's first dtype: inputs and outputs
  guard       consistency_check_every=1 and check_consistency() pass; sparse_stats(average=True)
  resume      STEPS steps straight vs STEPS // 2, a checkpoint written to a real file and read back, the rest

and once: ``wire``, hvds.broadcast_parameters of bool, complex, float8 and int16 tensors, and Horovod's own
broadcast_parameters refusing a bfloat16 tensor.
"""

import copy
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_sparse.torch as hvds
from hvd_sparse.bench.presets import make, names

STEPS = 6
DENSITY = 0.05
#: model dtype name -> dtype of each layer (a, b, c, d)
MODELS = {"float32": (torch.float32,) * 4, "bfloat16": (torch.bfloat16,) * 4, "float16": (torch.float16,) * 4,
          "float64": (torch.float64,) * 4, "mixed": (torch.bfloat16, torch.float16, torch.float32, torch.float32)}
#: runs of the optimizer: name -> (preset, training options)
RUNS = {name: (name, {}) for name in names()}
RUNS["oktopk.warmup"] = ("oktopk", {"warmup_dense_steps": 2})


class Net(torch.nn.Module):
    def __init__(self, dtypes):
        super().__init__()
        self.a = torch.nn.Linear(12, 16).to(dtypes[0])
        self.b = torch.nn.Linear(16, 16).to(dtypes[1])
        self.c = torch.nn.Conv1d(1, 2, 3).to(dtypes[2])
        self.d = torch.nn.Linear(16, 4).to(dtypes[3])

    def forward(self, x):
        y = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        y = torch.tanh(self.b(y.to(self.b.weight.dtype)))
        z = self.c(y.to(self.c.weight.dtype).unsqueeze(1)).flatten(1)
        return self.d(y.to(self.d.weight.dtype)).float().sum(1) + z.float().sum(1)


def f32(t):
    """``t`` as a numpy array that holds it exactly: float32 for the half dtypes, float64 for float64."""
    t = t.detach().cpu()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy().copy()


def flat(model, what):
    return np.concatenate([f32(what(p)).reshape(-1) for _, p in sorted(model.named_parameters())])


def batches(device, steps=STEPS):
    g = torch.Generator().manual_seed(1000 + hvd.rank())
    return [torch.randn(8, 12, generator=g).to(device) for _ in range(steps)]


def built(model_dtype, device, seed, compression, lr=1e-2, factory=None, **kwargs):
    """Model and wrapped SGD with momentum, started as a Horovod script starts: broadcast parameters and optimizer
    state. (Not Adam: in float16 its eps rounds to 0, and an entry whose gradient stays 0 -- most, with a sparse
    update -- becomes 0/0.)"""
    torch.manual_seed(seed)
    model = Net(MODELS[model_dtype]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    factory = factory or hvds.DistributedOptimizer
    opt = factory(opt, named_parameters=model.named_parameters(), compression=compression, **kwargs)
    hvds.broadcast_parameters(model.state_dict(), root_rank=0)
    hvds.broadcast_optimizer_state(opt, root_rank=0)
    return model, opt


def train(model, opt, xs):
    raw, red = [], []
    for x in xs:
        opt.zero_grad()
        model(x).tanh().pow(2).mean().backward()         # bounded: float16 neither overflows nor diverges
        raw.append(flat(model, lambda p: p.grad))
        opt.synchronize()
        red.append(flat(model, lambda p: p.grad))
        with opt.skip_synchronize():
            opt.step()
    return np.array(raw), np.array(red)


def scenario_start(res, model_dtype, device):
    torch.manual_seed(hvd.rank())                           # a different model on every rank
    model = Net(MODELS[model_dtype]).to(device)
    inner = torch.optim.Adam(model.parameters(), lr=0.5 if hvd.rank() else 0.01)
    if hvd.rank() == 0:                                     # rank 0 resumes: it has Adam state, the others none
        model(batches(device, 1)[0]).pow(2).mean().backward()
        inner.step()
        checkpoint = copy.deepcopy(inner.state_dict())
    opt = hvds.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.topka(DENSITY))
    if hvd.rank() == 0:
        opt.load_state_dict(checkpoint)
    before = flat(model, lambda p: p)
    hvds.broadcast_parameters(model.state_dict(), root_rank=0)
    hvds.broadcast_optimizer_state(opt, root_rank=0)
    res["start.before"] = before
    res["start.params"] = flat(model, lambda p: p)
    state = opt.state_dict()
    res["start.state"] = np.concatenate([f32(v).reshape(-1) for pid in sorted(state["state"])
                                         for _, v in sorted(state["state"][pid].items())])
    res["start.lr"] = np.array(opt.param_groups[0]["lr"])
    res["start.dtypes"] = np.array(sorted({str(p.dtype) for p in model.parameters()}))


def scenario_presets(res, model_dtype, device):
    xs = batches(device)
    for run, (preset, options) in RUNS.items():
        model, opt = built(model_dtype, device, 5, make(preset, DENSITY, **options))
        res[f"{run}.raw"], res[f"{run}.red"] = train(model, opt, xs)
        res[f"{run}.params"] = flat(model, lambda p: p)
    res["layout"] = np.array([p.numel() for _, p in sorted(model.named_parameters())])
    res["piece_dtypes"] = np.array([str(p.dtype).split(".")[1] for _, p in sorted(model.named_parameters())])


def scenario_horovod(res, model_dtype, device):
    model, opt = built(model_dtype, device, 6, hvds.Compression.topka(DENSITY), factory=hvd.DistributedOptimizer)
    res["horovod.raw"], res["horovod.red"] = train(model, opt, batches(device))
    res["horovod.params"] = flat(model, lambda p: p)


def scenario_op(res, model_dtype, device):
    g = torch.Generator().manual_seed(7 + hvd.rank())
    comp = hvds.Compression.topka(0.1)
    ins, outs = [], []
    for _ in range(4):
        t = torch.randn(6, 11, generator=g).to(device=device, dtype=MODELS[model_dtype][0])
        r = hvds.sparse_allreduce(t, compression=comp, name="op.test")
        assert r.shape == t.shape and r.dtype == t.dtype and r.device == t.device
        ins.append(f32(t).reshape(-1))
        outs.append(f32(r).reshape(-1))
    res["op.ins"], res["op.outs"] = np.array(ins), np.array(outs)


def scenario_guard(res, model_dtype, device):
    model, opt = built(model_dtype, device, 8, hvds.Compression.oktopk(DENSITY), consistency_check_every=1)
    train(model, opt, batches(device))
    opt.check_consistency()
    stats = opt.sparse_stats(average=True)
    res["guard.stats"] = np.array([stats[k] for k in ("density", "sent_bytes", "recv_bytes", "residual_norm")])


def scenario_resume(res, model_dtype, device, outdir):
    def build():
        return built(model_dtype, device, 9, hvds.Compression.oktopk(0.1, threshold_period=2, repartition_period=4))

    xs = batches(device)
    model, opt = build()
    train(model, opt, xs)
    res["resume.straight"] = flat(model, lambda p: p)
    model, opt = build()
    train(model, opt, xs[:STEPS // 2])
    path = f"{outdir}/{model_dtype}.rank{hvd.rank()}.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sparse": opt.sparse_state_dict()}, path)
    model, opt = build()                                    # fresh objects, as after a restart
    ckpt = torch.load(path)                                # its defaults: weights_only=True
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    opt.load_sparse_state_dict(ckpt["sparse"])
    train(model, opt, xs[STEPS // 2:])
    res["resume.resumed"] = flat(model, lambda p: p)


def scenario_wire(res, device):
    """hvds.broadcast_parameters of tensors of dtypes Horovod lacks (their bytes before and after), and what
    Horovod's own broadcast_parameters says to a bfloat16 tensor."""
    g = torch.Generator().manual_seed(hvd.rank())
    tensors = {"bfloat16": torch.randn(5, generator=g).bfloat16(), "bool": torch.rand(6, generator=g) > 0.5,
               "complex64": torch.randn(3, dtype=torch.complex64, generator=g),
               "complex128": torch.randn(3, dtype=torch.complex128, generator=g),
               "float8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
               "int16": torch.randint(-99, 99, (4,), generator=g, dtype=torch.int16)}
    tensors = {k: v.to(device) for k, v in tensors.items()}

    def raw(t):
        return t.cpu().reshape(-1).view(torch.uint8).numpy().copy()

    res.update({f"wire.before.{k}": raw(t) for k, t in tensors.items()})
    hvds.broadcast_parameters(tensors, root_rank=0)
    res.update({f"wire.after.{k}": raw(t) for k, t in tensors.items()})
    try:
        hvd.broadcast_parameters({"w": torch.zeros(2, dtype=torch.bfloat16, device=device)}, root_rank=0)
    except ValueError as e:
        res["wire.horovod_error"] = np.array(str(e))


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    outdir, device = sys.argv[1], sys.argv[2]
    if device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    out = {}
    scenario_wire(out, device)
    for model_dtype in MODELS:
        res = {}
        scenario_start(res, model_dtype, device)
        scenario_presets(res, model_dtype, device)
        scenario_horovod(res, model_dtype, device)
        scenario_op(res, model_dtype, device)
        scenario_guard(res, model_dtype, device)
        scenario_resume(res, model_dtype, device, outdir)
        out.update({f"{model_dtype}/{k}": v for k, v in res.items()})
    np.savez(f"{outdir}/dtypes.rank{hvd.rank()}.npz", **out)
    hvd.shutdown()
