"""Runs under `horovodrun -np P --gloo`; each rank writes <outdir>/tf_<scenario>.rank<r>.npz.

Scenarios:
  tape     every preset through hvd_sparse.tensorflow.DistributedGradientTape, eagerly and inside tf.function
  none     Compression.none: the tape is Horovod's own (same result as horovod.tensorflow's tape)
  op       sparse_allreduce on a 2-D tensor, eager and tf.function (TopkA; Ok-Topk on a load that moves, so
           that its regions follow it)
  two_levels  (two hosts: -H localhost:2,127.0.0.1:2) TopkA, Ok-Topk and ExDyna with hierarchical=True through the
           tape, eagerly and inside tf.function
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse.tensorflow as hvds  # noqa: E402
from hvd_sparse.bench.presets import make, names  # noqa: E402

from worker_helpers import run_scenarios  # noqa: E402

STEPS = 8
DENSITY = 0.05


def variables(seed=0):
    rng = np.random.default_rng(seed)
    return [tf.Variable(rng.standard_normal(shape).astype(np.float32) * 0.3, name=name)
            for name, shape in (("w1", (12, 16)), ("b1", (16,)), ("w2", (16, 8)))]


def data():
    rng = np.random.default_rng(1000 + hvd.rank())
    return [tf.constant(rng.standard_normal((8, 12)).astype(np.float32)) for _ in range(STEPS)]


def loss_fn(vs, x):
    w1, b1, w2 = vs
    return tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2)))


def run(compression, graph):
    vs = variables()

    def step(x):
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(vs, x)
        raw = tape.gradient(loss, vs)
        red = hvds.DistributedGradientTape(tape, compression=compression).gradient(loss, vs)
        for v, g in zip(vs, red):
            v.assign_sub(0.05 * g)
        return [tf.reshape(g, [-1]) for g in raw], [tf.reshape(g, [-1]) for g in red]

    fn = tf.function(step) if graph else step
    raws, reds = [], []
    for x in data():
        raw, red = fn(x)
        raws.append(np.concatenate([g.numpy() for g in raw]))
        reds.append(np.concatenate([g.numpy() for g in red]))
    params = np.concatenate([v.numpy().reshape(-1) for v in vs])
    return np.array(raws), np.array(reds), params


def scenario_tape(out):
    res = {}
    wanted = os.environ.get("HVD_SPARSE_TEST_PRESETS")
    for name in (wanted.split(",") if wanted else names()):
        for graph in (False, True):
            raw, red, params = run(make(name, DENSITY), graph)
            tag = f"{name}.{'graph' if graph else 'eager'}"
            res[f"{tag}.raw"], res[f"{tag}.red"], res[f"{tag}.params"] = raw, red, params
    res["layout"] = np.array([int(np.prod(v.shape)) for v in variables()])
    np.savez(out, **res)


def scenario_two_levels(out):
    res = {}
    for name in ("topka", "oktopk", "exdyna"):
        for graph in (False, True):
            raw, red, params = run(make(name, DENSITY, hierarchical=True), graph)
            tag = f"{name}.{'graph' if graph else 'eager'}"
            res[f"{tag}.raw"], res[f"{tag}.red"], res[f"{tag}.params"] = raw, red, params
    res["layout"] = np.array([int(np.prod(v.shape)) for v in variables()])
    np.savez(out, **res)


def scenario_none(out):
    res = {}
    for impl, tape_factory in (("hvd_sparse", hvds.DistributedGradientTape), ("horovod", hvd.DistributedGradientTape)):
        vs = variables(seed=2)
        for x in data():
            with tf.GradientTape() as tape:
                loss = loss_fn(vs, x)
            grads = tape_factory(tape, compression=hvds.Compression.none if impl == "hvd_sparse"
                                 else hvd.Compression.none).gradient(loss, vs)
            for v, g in zip(vs, grads):
                v.assign_sub(0.05 * g)
        res[impl] = np.concatenate([v.numpy().reshape(-1) for v in vs])
    np.savez(out, **res)


def scenario_op(out):
    rng = np.random.default_rng(7 + hvd.rank())
    res = {}
    for graph in (False, True):
        f = allreduce_op(hvds.Compression.topka(0.1), "op.test", graph)
        ins, outs = [], []
        for _ in range(4):
            t = tf.constant(rng.standard_normal((6, 11)).astype(np.float32))
            r = f(t)
            assert r.shape == t.shape and r.dtype == t.dtype
            ins.append(t.numpy().reshape(-1))
            outs.append(r.numpy().reshape(-1))
        tag = "graph" if graph else "eager"
        res[f"{tag}.ins"], res[f"{tag}.outs"] = np.array(ins), np.array(outs)
        f = allreduce_op(hvds.Compression.oktopk(0.1), "op.oktopk", graph)
        res[f"{tag}.oktopk.ins"] = moving_load(hvd.rank())
        res[f"{tag}.oktopk.outs"] = np.array([f(tf.constant(x.reshape(6, 11))).numpy().reshape(-1)
                                              for x in res[f"{tag}.oktopk.ins"]])
    np.savez(out, **res)


def allreduce_op(compression, name, graph):
    """``sparse_allreduce`` with ``compression`` under ``name`` -- a new string object at every call, equal by value,
    as a script builds it (f"grad.{i}") --, inside a tf.function when ``graph``."""
    def op(t):
        return hvds.sparse_allreduce(t, compression=compression, name=(name + ".")[:-1])
    return tf.function(op) if graph else op


def moving_load(rank, steps=4, n=66):
    """Small noise and, on every rank, 12 large entries whose place moves from step to step: the step's load falls
    away from where Ok-Topk's regions (placed from the last steps' load) expect it."""
    rng = np.random.default_rng(7 + rank)
    g = (rng.standard_normal((steps, n)) * 0.1).astype(np.float32)
    for t, hot in enumerate([50, 0, 30, 10][:steps]):
        g[t, hot:hot + 12] += (3.0 + rng.standard_normal(12)).astype(np.float32)
    return g


if __name__ == "__main__":
    run_scenarios(hvd, "tf_", globals())
