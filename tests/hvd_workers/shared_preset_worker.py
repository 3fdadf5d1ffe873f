"""One preset object serving every kind of job in one process (argv: the output directory): two
``hvd_sparse.torch.DistributedOptimizer`` of two models of the same shape, Horovod's own torch
``DistributedOptimizer``, a Keras ``DistributedOptimizer`` and ``sparse_allreduce`` in torch and TensorFlow, stepped
in turn -- then the same jobs again, each with a preset of its own. Both Horovod frameworks are initialized (each
keeps its own runtime). Writes per rank, for both runs, every job's parameters (or results) after the steps and the
residual norms of hvd_sparse's optimizers."""

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import horovod.tensorflow as hvd_tf  # noqa: E402
import horovod.torch as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import hvd_sparse.tensorflow as hvds_tf  # noqa: E402
import hvd_sparse.torch as hvds  # noqa: E402

STEPS = 4


def torch_job(seed, make_optimizer):
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 3)
    return model, make_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())


def run(presets):
    """Every job STEPS times, in turn; ``presets()`` gives the preset of the next job."""
    rng = np.random.default_rng(hvd.rank())
    xs = [rng.standard_normal((STEPS, 8, 6)).astype(np.float32) for _ in range(6)]
    ours = [torch_job(seed, lambda o, named: hvds.DistributedOptimizer(o, named_parameters=named,
                                                                       compression=presets()))
            for seed in (3, 4)]
    horovods = torch_job(5, lambda o, named: hvd.DistributedOptimizer(o, named_parameters=named,
                                                                      compression=presets()))
    tf.keras.utils.set_random_seed(0)
    keras_model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(3)])
    keras_opt = hvds_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=presets())
    torch_preset, tf_preset = presets(), presets()
    out = {}
    for t in range(STEPS):
        for i, (model, opt) in enumerate(ours + [horovods]):
            opt.zero_grad()
            model(torch.from_numpy(xs[i][t])).pow(2).mean().backward()
            opt.step()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(keras_model(xs[3][t])))
        variables = keras_model.trainable_variables
        keras_opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        out["torch.allreduce"] = hvds.sparse_allreduce(torch.from_numpy(xs[4][t]), compression=torch_preset,
                                                       name="torch.x").numpy()
        out["tf.allreduce"] = hvds_tf.sparse_allreduce(tf.constant(xs[5][t]), compression=tf_preset,
                                                       name="tf.x").numpy()
    for name, (model, _) in zip(["ours.0", "ours.1", "horovod"], ours + [horovods]):
        out[name] = np.concatenate([p.detach().numpy().reshape(-1) for p in model.parameters()])
    out["keras"] = np.concatenate([v.numpy().reshape(-1) for v in keras_model.trainable_variables])
    out["residual_norms"] = np.array([opt.residual_norm() for _, opt in ours] + [keras_opt.residual_norm()])
    return out


def main():
    hvd.init()
    hvd_tf.init()
    shared = hvds.Compression.oktopk(0.3)
    results = {f"shared.{k}": v for k, v in run(lambda: shared).items()}
    results.update({f"separate.{k}": v for k, v in run(lambda: hvds.Compression.oktopk(0.3)).items()})
    np.savez(os.path.join(sys.argv[1], f"shared.rank{hvd.rank()}.npz"), **results)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
