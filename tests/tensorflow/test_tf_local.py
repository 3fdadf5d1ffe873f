"""TensorFlow/Keras adapter in one process (Horovod size 1): argument handling and the size-1 semantics
(sparsification and error feedback run at P = 1 too, with no collective)."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
pytest.importorskip("horovod.tensorflow")

import hvd_sparse.tensorflow as hvds  # noqa: E402
import hvd_sparse.tensorflow.keras as hvdk  # noqa: E402
from hvd_sparse.testing import simulate  # noqa: E402

from horovod_helpers import HERE, ROOT  # noqa: E402

pytestmark = pytest.mark.usefixtures("horovod")  # hvd.init() in this process (conftest.py)


def test_distributed_optimizer_forwards_keras_optimizers_and_rejects_v1():
    opt = hvds.DistributedOptimizer(tf.keras.optimizers.Adam(0.01), compression=hvds.Compression.oktopk(0.01))
    assert type(opt).__name__ == "Adam" and isinstance(opt, tf.keras.optimizers.Adam)
    assert opt.sparse_stats() == {} and opt.residual_norm() == 0.0
    assert type(type(opt).from_config(opt.get_config())) is type(opt)
    with pytest.raises(NotImplementedError, match="tf.compat.v1"):
        hvds.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(ValueError, match="already a distributed optimizer"):
        hvdk.DistributedOptimizer(opt)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), backward_passes_per_step=0)


def test_single_process_fit_sparsifies_with_error_feedback_like_the_simulator():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((5,)), tf.keras.layers.Dense(3)])
    comp = hvdk.Compression.topka(0.2)
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.0), compression=comp)   # lr 0: fixed weights
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    y = np.zeros((4, 3), np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    g = np.concatenate([t.numpy().reshape(-1) for t in tape.gradient(loss, model.trainable_variables)])
    model.fit(x, y, batch_size=4, epochs=3, verbose=0)             # the same gradient three times
    stats = opt.sparse_stats()
    assert stats["selected"] == stats["k"] == 3 and stats["collectives"] == 0
    sim = simulate(hvdk.Compression.topka(0.2), np.stack([g[None]] * 3), shapes=[(15,), (3,)])
    np.testing.assert_allclose(opt.residual_norm(), np.linalg.norm(sim.residuals[-1, 0]), rtol=1e-5)


@pytest.mark.parametrize("eager", [False, True])
def test_backward_passes_per_step_accumulates_then_applies_once(eager):
    """P = 1, a custom loop through apply_gradients: weights move only on every 3rd call, by the sum of the 3
    gradients (average_aggregated_gradients=False), and iterations count every call, as in Horovod."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), backward_passes_per_step=3)
    xs = [tf.constant(np.random.default_rng(i).standard_normal((5, 4)).astype(np.float32)) for i in range(6)]

    def grads(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x)))
        return tape.gradient(loss, model.trainable_variables)

    def step(x):
        opt.apply_gradients(zip(grads(x), model.trainable_variables))

    step = step if eager else tf.function(step)
    w0 = [w.numpy() for w in model.trainable_variables]
    total = [np.zeros_like(w) for w in w0]
    for i, x in enumerate(xs[:3]):
        total = [t + g.numpy() for t, g in zip(total, grads(x))]
        step(x)
        assert int(opt.iterations) == i + 1
        moved = [not np.array_equal(w.numpy(), a) for w, a in zip(model.trainable_variables, w0)]
        assert any(moved) == (i == 2), f"call {i}: the weights must move on the 3rd call only"
    for w, a, t in zip(model.trainable_variables, w0, total):
        np.testing.assert_allclose(w.numpy(), a - 0.5 * t, rtol=1e-5, atol=1e-6)
    for x in xs[3:]:
        step(x)
    assert int(opt.iterations) == 6


def test_tape_checkpoint_with_sparse_state_resumes_bit_for_bit(tmp_path):
    """P = 1 (sparsification and error feedback run at P = 1 too): a tape inside tf.function with an Ok-Topk
    preset, 6 steps -> tf.train.Checkpoint(SparseState(preset)) -> a fresh preset and variables restored before
    their first step -> 6 more == 12 uninterrupted steps; dense compressions have nothing to save."""
    rng = np.random.default_rng(0)
    xs = [tf.constant(rng.standard_normal((6, 7)).astype(np.float32)) for _ in range(12)]

    def run(steps, comp, w):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(tf.tanh(tf.matmul(x, w))))
            (g,) = hvds.DistributedGradientTape(tape, compression=comp).gradient(loss, [w])
            w.assign_sub(0.1 * g)

        for x in steps:
            step(x)

    def fresh(seed):
        return tf.Variable(np.random.default_rng(seed).standard_normal((7, 5)).astype(np.float32))

    w = fresh(1)
    run(xs, hvds.Compression.oktopk(0.1, threshold_period=3), w)
    straight = w.numpy()
    comp, w = hvds.Compression.oktopk(0.1, threshold_period=3), fresh(1)
    run(xs[:6], comp, w)
    path = tf.train.Checkpoint(w=w, sparse=hvds.SparseState(comp)).write(str(tmp_path / "ckpt"))
    comp, w = hvds.Compression.oktopk(0.1, threshold_period=3), fresh(2)
    tf.train.Checkpoint(w=w, sparse=hvds.SparseState(comp)).read(path).assert_consumed()
    assert hvds.SparseState(comp).state_dict()["units"]["model"]["steps"] == 6     # pending until the 1st step
    run(xs[6:], comp, w)
    assert w.numpy().tobytes() == straight.tobytes()
    cold_comp, w = hvds.Compression.oktopk(0.1, threshold_period=3), fresh(2)
    tf.train.Checkpoint(w=w).read(path).expect_partial()
    run(xs[6:], cold_comp, w)
    assert w.numpy().tobytes() != straight.tobytes()                 # the restored state mattered
    with pytest.raises(TypeError, match="no sparse state"):
        hvds.SparseState(hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))
    with pytest.raises(ValueError, match="saved with"):
        tf.train.Checkpoint(sparse=hvds.SparseState(hvds.Compression.topka(0.1))).read(path).expect_partial()


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_nonfinite_gradients_skip_the_keras_update_or_raise(flavour):
    """nonfinite="skip": no variable changes (not even iterations), eagerly and in tf.function, then training goes
    on; "raise" names the rank; the tape returns all-NaN gradients; integer tensors are refused."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, TF_USE_LEGACY_KERAS="1" if flavour == "tf_keras" else "0",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(HERE / "hvd_workers" / "tf_nonfinite_worker.py")],
                          capture_output=True, text=True, timeout=300, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(line[7:])
    for mode in ("eager", "function"):
        assert res[mode] == {"unchanged": True, "moves_after": True, "warned": True, "skipped": 1}, mode
    assert "non-finite gradient (NaN or Inf) on rank 0" in res["raise"]
    assert res["tape_all_nan"]
    assert "tensor must be floating point" in res["int_error"]


def test_indexed_slices_need_sparse_as_dense():
    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))

    def grads(**kw):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [1, 4]))          # an embedding lookup: tf.IndexedSlices
        return hvds.DistributedGradientTape(tape, compression=hvds.Compression.topka(0.5), **kw).gradient(
            loss, [table])

    with pytest.raises(ValueError, match="IndexedSlices.*sparse_as_dense=True"):
        grads()
    g = grads(sparse_as_dense=True)[0].numpy()
    assert g.shape == (6, 2) and np.isfinite(g).all() and g[[1, 4]].any()


def test_the_tape_declares_its_layout_to_the_engine_and_refuses_another_model():
    """What the tape exchanges is declared to the engine's agreement -- ("variable #<position>", shape, dtype) per
    source, its only layout check -- and fixed: the preset owns the state, so a second model with other shapes
    (here the same number of entries) raises instead of mixing the two models' residuals, and the first model
    steps on. sparse_allreduce declares its tensor under its name."""
    comp = hvds.Compression.topka(0.5)

    def grads(*shapes):
        ws = [tf.Variable(tf.ones(s)) for s in shapes]
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.square(w)) for w in ws])
        return hvds.DistributedGradientTape(tape, compression=comp).gradient(loss, ws)

    grads((2, 3), (3,))
    engine = comp.shared_state().get("model")
    assert engine.entries == (("variable #0", (2, 3), "float32"), ("variable #1", (3,), "float32"))
    with pytest.raises((ValueError, tf.errors.OpError), match="cannot serve two models") as err:
        grads((3, 2), (3,))
    assert "position 0 is 'variable #0' (3, 2) float32 now but was 'variable #0' (2, 3) float32" in str(err.value)
    assert engine.steps == 1
    grads((2, 3), (3,))
    assert engine.steps == 2
    hvds.sparse_allreduce(tf.ones((2, 2)), compression=comp, name="op.x")
    assert comp.shared_state().get("op.x").entries == (("op.x", (2, 2), "float32"),)


def test_a_preset_whose_state_a_keras_optimizer_keeps_points_the_checkpoint_to_the_optimizer():
    comp = hvdk.Compression.topka(0.5)
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=comp)
    with pytest.raises(TypeError, match="pass the optimizer"):
        hvds.SparseState(comp)
    assert hvds.SparseState(opt).state_dict()["units"] == {}
    with pytest.raises(AttributeError, match="frozen"):
        comp.momentum_correction = 0.9
    v = tf.Variable([1.0, -2.0, 3.0, -4.0])
    opt.apply_gradients([(tf.constant([0.5, -1.0, 0.25, 2.0]), v)])
    saved = opt.sparse_state_dict()                      # the optimizer's own job, not the preset's
    assert saved["units"]["model"]["steps"] == 1 and comp.shared_state().empty()
    again = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=comp)
    again.load_sparse_state_dict(saved)
    assert again.residual_norm() == opt.residual_norm() > 0
    with pytest.raises(ValueError, match="saved by rank 1 of 2"):
        again.load_sparse_state_dict({**saved, "rank": 1, "size": 2})


def test_keras_imports_no_private_name_of_the_tensorflow_package():
    """hvd_sparse.tensorflow.keras uses public names of hvd_sparse.tensorflow, or the package's role modules."""
    import ast
    from pathlib import Path

    for path in sorted((Path(hvds.__file__).parent / "keras").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and ((node.level == 2 and node.module is None)
                                                     or node.module == "hvd_sparse.tensorflow"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"keras/{path.name} imports {private} from hvd_sparse.tensorflow"
