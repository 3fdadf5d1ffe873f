"""Runs under elastic `horovodrun` (3 workers: 2 on host "localhost", 1 on host "127.0.0.1") with a Keras model and
hvd_sparse's Keras DistributedOptimizer (Keras 3, or tf_keras with TF_USE_LEGACY_KERAS=1): the worker on 127.0.0.1
SIGKILLs itself at step KILL_AT, before the exchange the others are in; the other two must restore the last commit,
reset to 2 ranks and finish. The update runs in a tf.function (the engine inside its tf.py_function); the consistency
guard checks every 2 updates, before and after the reset. Each surviving process writes
<outdir>/elastic.<host>.<local_rank>.npz.

    keras_elastic_worker.py <outdir> <keep|drop>
"""

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import horovod.tensorflow as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_sparse.tensorflow.keras as hvdk  # noqa: E402
from hvd_sparse.tensorflow.keras import elastic  # noqa: E402

STEPS, KILL_AT = 8, 4
keras = tf.keras


def main(outdir, policy):
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                    compression=hvdk.Compression.oktopk(0.1, threshold_period=3),
                                    elastic_residuals=policy, consistency_check_every=2)
    state = elastic.KerasState(model, opt, step=0)
    host = os.environ.get("HOROVOD_HOSTNAME", "?")
    comp = opt._hvds_reduce.compression

    def residual():      # this rank's residual: the engine's, or the state kept for the next step after a reset
        r = opt.sparse_state_dict()["units"].get("model", {}).get("residual")
        return np.zeros(0, np.float32) if r is None else np.asarray(r, np.float32)

    @tf.function
    def train_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    records = []        # per step run: (step, size, engine steps after it, residual norm after it)
    starts = []         # per entry into train(): (step, size, residual norm)
    committed = {}      # step -> residual after it (committed)
    resumed = []        # the residual at each entry into train()
    errors = []         # how the failure reached the training loop

    @elastic.run
    def train(state):
        starts.append((state.step, hvd.size(), opt.residual_norm()))
        resumed.append(residual())
        while state.step < STEPS:
            x = np.random.default_rng(1000 * state.step + hvd.rank()).standard_normal((8, 20)).astype(np.float32)
            if state.step == KILL_AT and host == "127.0.0.1":
                os.kill(os.getpid(), signal.SIGKILL)        # dies before the exchange the others are in
            try:
                train_step(x)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                raise
            records.append((state.step, hvd.size(), opt._hvds_reduce.states.get("model").steps, opt.residual_norm()))
            committed[state.step] = residual()
            state.step += 1
            state.commit()

    train(state)
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    np.savez(os.path.join(outdir, f"elastic.{host}.{os.environ.get('HOROVOD_LOCAL_RANK', '0')}.npz"),
             records=np.array(records, dtype=np.float64), starts=np.array(starts, dtype=np.float64),
             weights=weights, iterations=int(opt.iterations.numpy()),
             committed_before_kill=committed[KILL_AT - 1], resumed=resumed[-1], errors=np.array(errors),
             guard_steps=opt._hvds_guard.steps)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
