"""Runs under `horovodrun -np P --gloo`; each rank writes <outdir>/<scenario>.rank<r>.npz for the test to check.

Scenarios:
  optimizer   hvd_sparse.torch.DistributedOptimizer(topka) for 50 steps: raw grads, reduced grads, final params
  stash       horovod.torch.DistributedOptimizer(compression=hvd_sparse preset): raw and reduced grads
  none        hvd_sparse DistributedOptimizer(Compression.none / fp16) vs Horovod's own: final params of both
  op          hvd_sparse.torch.sparse_allreduce on a 2-D tensor: inputs and outputs
  errors      misuse raises clear errors on every rank (Adasum, sparse_as_dense via horovod, models that differ)
  options     presets with the training options (SGD without momentum), 12 steps each
"""

import json

import horovod.torch as hvd
import numpy as np
import torch

import hvd_sparse.torch as hvds

from worker_helpers import run_scenarios

STEPS = 50
DENSITY = 0.05


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 8)
        self.c = torch.nn.Conv1d(1, 2, 3)

    def forward(self, x):
        y = torch.tanh(self.a(x))
        z = self.c(y.unsqueeze(1)).flatten(1)
        return self.b(y) .sum(1) + z.sum(1)


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1000 + hvd.rank())
    xs = [torch.randn(8, 12, generator=g) for _ in range(STEPS)]
    return model, xs


def flat_grads(model):
    return torch.cat([p.grad.reshape(-1) for _, p in sorted(model.named_parameters())]).numpy().copy()


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for _, p in sorted(model.named_parameters())]).numpy().copy()


def run_recorded(opt, model, xs, explicit_sync):
    raw, red = [], []
    for x in xs:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        raw.append(flat_grads(model))
        if explicit_sync:
            opt.synchronize()
            red.append(flat_grads(model))
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
            red.append(flat_grads(model))
    return np.array(raw), np.array(red)


def scenario_optimizer(out):
    model, xs = model_and_data()
    base = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.5)
    opt = hvds.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.topka(DENSITY))
    assert type(opt).__name__ == "SGD" and isinstance(opt, torch.optim.SGD)
    raw, red = run_recorded(opt, model, xs, explicit_sync=hvd.rank() % 2 == 0)
    stats = opt.sparse_stats()
    np.savez(out, raw=raw, red=red, params=flat_params(model), selected=stats["selected"],
             recv_words=stats["recv_words"], k=stats["k"])


def scenario_presets(out):
    """Every preset of hvd_sparse.bench.presets through the optimizer, 12 steps each."""
    from hvd_sparse.bench.presets import make, names

    res = {}
    for name in names():
        model, xs = model_and_data(seed=5)
        base = torch.optim.SGD(model.parameters(), lr=0.01)
        opt = hvds.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        compression=make(name, DENSITY))
        raw, red = run_recorded(opt, model, xs[:12], explicit_sync=False)
        res[f"{name}.raw"], res[f"{name}.red"], res[f"{name}.params"] = raw, red, flat_params(model)
    res["layout"] = np.array([p.numel() for _, p in sorted(model.named_parameters())])
    np.savez(out, **res)


#: presets with the training options, by name (saved with the results: the test builds the same for the simulator);
#: the density warm-up's stages end within the 12 steps, and the clipping threshold lies among the gradients' norms
#: (175-230 on a rank: some steps clipped, some not)
CLIP = 300.0
OPTIONS = {"oktopk": dict(warmup_dense_steps=3, momentum_correction=0.5, few_collectives_from=1, warmup_density=0.2,
                          warmup_stage_steps=3, local_clip_norm=CLIP),
           "topka": dict(warmup_dense_steps=2, momentum_correction=0.9, warmup_density=0.4, warmup_stage_steps=3,
                         local_clip_norm=CLIP),
           "exdyna": dict(momentum_correction=0.9, warmup_density=0.2, warmup_stage_steps=4, local_clip_norm=CLIP)}
#: small tensors dense: the biases and the convolution (32 of 352 entries) allreduced dense, TopkA on the two weights
DENSE_SHARE = 0.1


def scenario_options(out):
    """Presets with the training options (OPTIONS) through the optimizer (SGD without momentum)."""
    from hvd_sparse.bench.presets import make

    res = {}
    for name, options in OPTIONS.items():
        model, xs = model_and_data(seed=7)
        opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters(),
                                        compression=make(name, DENSITY, **options))
        raw, red = run_recorded(opt, model, xs[:12], explicit_sync=hvd.rank() % 2 == 1)
        res[f"{name}.raw"], res[f"{name}.red"], res[f"{name}.params"] = raw, red, flat_params(model)
        res[f"{name}.options"] = np.array(json.dumps(options))
    model, xs = model_and_data(seed=7)
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    compression=make("topka", DENSITY, dense_share=DENSE_SHARE))
    raw, red = run_recorded(opt, model, xs[:12], explicit_sync=hvd.rank() % 2 == 1)
    res["dense_share.raw"], res["dense_share.red"], res["dense_share.params"] = raw, red, flat_params(model)
    res["dense_share.dense_entries"] = np.array(opt.sparse_stats()["dense_entries"])
    res["layout"] = np.array([p.numel() for _, p in sorted(model.named_parameters())])
    np.savez(out, **res)


def scenario_resume(out):
    """20 steps straight vs 10 steps, checkpoint (model, optimizer, sparse state per rank), new objects, 10 more."""
    import copy

    def build():
        model, xs = model_and_data(seed=9)
        opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                        named_parameters=model.named_parameters(),
                                        compression=hvds.Compression.oktopk(0.1, threshold_period=4,
                                                                            repartition_period=8))
        return model, opt, xs

    def train(model, opt, xs):
        for x in xs:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    model, opt, xs = build()
    train(model, opt, xs[:20])
    straight = flat_params(model)
    model, opt, xs = build()
    train(model, opt, xs[:10])
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sparse": opt.sparse_state_dict()})
    model, opt, xs = build()                     # fresh objects, as after a restart
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    opt.load_sparse_state_dict(ckpt["sparse"])
    train(model, opt, xs[10:20])
    np.savez(out, straight=straight, resumed=flat_params(model))


def scenario_stash(out):
    model, xs = model_and_data(seed=1)
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=hvds.Compression.topka(DENSITY))
    raw, red = run_recorded(opt, model, xs[:10], explicit_sync=False)
    np.savez(out, raw=raw, red=red, params=flat_params(model))


def scenario_none(out):
    res = {}
    for comp_name in ("none", "fp16"):
        for impl in ("hvd_sparse", "horovod"):
            model, xs = model_and_data(seed=2)
            base = torch.optim.Adam(model.parameters(), lr=0.01)
            factory = hvds.DistributedOptimizer if impl == "hvd_sparse" else hvd.DistributedOptimizer
            comp = getattr(hvds.Compression if impl == "hvd_sparse" else hvd.Compression, comp_name)
            opt = factory(base, named_parameters=model.named_parameters(), compression=comp,
                          backward_passes_per_step=2)
            for i in range(0, 40, 2):
                opt.zero_grad()
                for x in xs[i:i + 2]:
                    model(x).pow(2).mean().backward()
                opt.step()
            res[f"{comp_name}_{impl}"] = flat_params(model)
    np.savez(out, **res)


def scenario_op(out):
    g = torch.Generator().manual_seed(7 + hvd.rank())
    comp = hvds.Compression.topka(0.1)
    ins, outs = [], []
    for _ in range(5):
        t = torch.randn(6, 11, generator=g)
        r = hvds.sparse_allreduce(t, compression=comp, name="op.test")
        assert r.shape == t.shape and r.dtype == t.dtype
        ins.append(t.reshape(-1).numpy().copy())
        outs.append(r.reshape(-1).numpy().copy())
    scaled = hvds.sparse_allreduce(torch.from_numpy(ins[0]).reshape(6, 11), compression=hvds.Compression.topka(1.0),
                                   op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25, name="op.scaled")
    np.savez(out, ins=np.array(ins), outs=np.array(outs), scaled=scaled.reshape(-1).numpy())


def scenario_errors(out):
    msgs = []
    for kwargs, exc in [(dict(op=hvd.Adasum), NotImplementedError),
                        (dict(gradient_predivide_factor=2.0, op=hvd.Sum), ValueError),
                        (dict(backward_passes_per_step=0), ValueError)]:
        model, _ = model_and_data()
        try:
            hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      compression=hvds.Compression.topka(0.1), **kwargs)
        except exc as e:
            msgs.append(str(e))
        else:
            raise AssertionError(f"no error for {kwargs}")
    # Horovod's own optimizer with sparse_as_dense=True and a sparse preset: raises in the first compress()
    model, xs = model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvds.Compression.topka(0.1), sparse_as_dense=True)
    try:
        model(xs[0]).pow(2).mean().backward()
        opt.step()
    except ValueError as e:
        msgs.append(str(e))
    else:
        raise AssertionError("sparse_as_dense with a sparse preset in horovod's optimizer did not raise")
    # ranks that build different models: a clear error on every rank at the first step, naming the parameter
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3 if hvd.rank() == 0 else 2)
    opt = hvds.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression=hvds.Compression.topka(0.5))
    model(torch.ones(1, 4)).sum().backward()
    try:
        opt.step()
    except ValueError as e:
        msgs.append(str(e))
    else:
        raise AssertionError("different models on different ranks did not raise")
    np.savez(out, msgs=np.array(msgs))


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_scenarios(hvd, "", globals())
    hvd.shutdown()
