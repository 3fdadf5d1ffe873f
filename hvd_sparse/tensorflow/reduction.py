"""Where TensorFlow hands gradients to the engine: :func:`engine_step`, one engine step over a list of dense
tensors inside a ``tf.py_function``, and :class:`Reduction`, grads -> reduced grads, which the tape
(:mod:`hvd_sparse.tensorflow.tape`) and the Keras optimizer (:mod:`hvd_sparse.tensorflow.keras`) call;
``sparse_allreduce`` (:mod:`hvd_sparse.tensorflow.mpi_ops`) calls :func:`engine_step` directly.

The tensors are concatenated (in the order given, the same on every rank) into one float32 buffer, and one engine
step -- the same engine code as PyTorch and the simulator: agreement, error feedback, sparsifier, sparse
allreduce -- runs on it, eagerly and inside ``tf.function`` alike. The engine computes on the TensorFlow eager tensor
itself (the TensorFlow backend of ``hvd_sparse.core.xp``; no numpy copy), and its collectives are Horovod's
TensorFlow ops (:mod:`hvd_sparse.tensorflow.comm`). The engine's state (residuals, thresholds) lives in the
preset's ``states`` (:mod:`hvd_sparse.core.state`), in Python, so it survives retracing.
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf
from horovod.tensorflow import Average

from ..compression import SparseCompression, check_compression, refuse_unused_options
from ..horovod_comm import in_process_set
from ..core.state import STATS_NAME, SparsityWindow
from ..core.validate import check_nonfinite, scale_factors
from ._xla import refuse_xla
from .comm import HorovodTFCommunicator


def engine_step(states, unit, process_set, tensors, average, prescale, postscale, nonfinite="skip", names=None,
                window=None):
    """One engine step of ``unit`` of the job ``states`` (a :class:`~hvd_sparse.core.state.UnitStates`) over
    ``tensors`` (a list of dense tf tensors) inside a ``tf.py_function``.

    What is exchanged is declared to the engine (:meth:`hvd_sparse.core.engine.Engine.declare`): ``(name, shape,
    dtype)`` per tensor, the name ``"variable #<position>"`` unless ``names`` are given -- positions, not variable
    names, because Keras names layers from a process-wide counter (a rank that built one more model earlier names the
    same variables differently). The engine's agreement, its first collective, proves every rank declared the same,
    or raises ``RankDisagreementError`` on every rank naming the first differing tensor. The layout is ``fixed``: one
    job trains one model, so other tensors at a later step are another model, an error on every rank.

    Returns ``(reduced tensors, skipped)``: ``skipped`` is a boolean tensor, True on every rank when a NaN or Inf
    on some rank skipped the step (``nonfinite="skip"``; the reduced tensors are then all NaN). ``window``: a
    :class:`~hvd_sparse.core.state.SparsityWindow` that each step's statistics are added to."""
    sizes = [int(t.shape.num_elements()) for t in tensors]
    names = names or [f"variable #{i}" for i in range(len(tensors))]
    entries = [(name, tuple(t.shape.as_list()), t.dtype.name) for name, t in zip(names, tensors)]
    flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], axis=0)

    def step(x):                                               # x: an EagerTensor, the engine runs on it
        engine = states.engine(unit, lambda: HorovodTFCommunicator(process_set, unit))
        engine.declare(entries, fixed=True)
        out = engine.step(x, average=average, prescale=prescale, postscale=postscale, nonfinite=nonfinite)
        if window is not None:
            window.add(engine.last)
        return out, tf.constant(bool(engine.last["skipped"]))

    out, skipped = tf.py_function(step, [flat], [tf.float32, tf.bool])
    out.set_shape(flat.shape)
    skipped.set_shape(())
    pieces = tf.split(out, sizes) if len(sizes) > 1 else [out]
    return [tf.cast(tf.reshape(p, t.shape), t.dtype) for p, t in zip(pieces, tensors)], skipped


class Reduction:
    """grads, variables -> reduced grads: Horovod's dense allreduce per tensor (``Compression.none``/``fp16``)
    or one whole-model engine step (a sparse preset). Shared by the tape and the Keras optimizer.

    No ``.ref()`` on variables (Keras 3 variables have none), no Keras-2 internals: works with tf.Variables,
    Keras 3 and tf_keras variables alike.

    Attributes:
        compression, process_set: as given; ``sparse``: whether ``compression`` is a sparse preset; ``states``:
        the sparse job's state (``compression.reify()`` for the Keras optimizer, which keeps it; by default the
        preset's ``shared_state()``, for the tape, which is built anew every step), None on the dense path.
    """

    def __init__(self, compression, op, gradient_predivide_factor, sparse_as_dense, process_set, api,
                 nonfinite="skip", states=None):
        self.nonfinite = check_nonfinite(nonfinite, api)
        self.compression = check_compression(compression, api)
        refuse_unused_options(compression, api, nonfinite=nonfinite)
        self.sparse = isinstance(compression, SparseCompression)
        self.states = None if not self.sparse else states if states is not None else compression.shared_state()
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.prescale, self.postscale, self.average = scale_factors(op, gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.api = api
        self.window = SparsityWindow()      # the sparse steps since the last averaged_stats()

    def averaged_stats(self, residual_norm):
        """Collective (one float64 sum-allreduce over the process set, every rank at the same point): the statistics
        of the sparse steps since the previous call, averaged over them and over the ranks, as torch's
        ``sparse_stats(average=True)`` (:mod:`hvd_sparse.torch.stats`); ``{}`` when no rank made one."""
        ps = self.process_set
        if not in_process_set(ps, hvd.rank()):
            return {}

        def sum_over_ranks(local):
            return hvd.allreduce(tf.constant(local, tf.float64), op=hvd.Sum, name=STATS_NAME,
                                 process_set=ps).numpy().tolist()

        return self.window.average(residual_norm, ps.size(), sum_over_ranks)

    def densify(self, grads, variables):
        """Dense gradients: zeros for ``None`` (unused on this rank, as in Horovod), ``tf.IndexedSlices``
        converted with ``sparse_as_dense=True`` (an error otherwise)."""
        dense = []
        for g, v in zip(grads, variables):
            if g is None:
                g = tf.zeros_like(v)
            elif isinstance(g, tf.IndexedSlices):
                if not self.sparse_as_dense:
                    raise ValueError(f"{self.api}: the gradient of {v.name} is a tf.IndexedSlices (an embedding "
                                     "lookup); pass sparse_as_dense=True")
                g = tf.convert_to_tensor(g)
            dense.append(g)
        return dense

    def __call__(self, grads, variables):
        return self.reduce_flagged(grads, variables)[0]

    def reduce_flagged(self, grads, variables):
        """``(reduced grads, skipped)``; ``skipped`` is a boolean tensor (True on every rank when a non-finite
        gradient skipped a sparse step) or ``None`` on the dense path (a dense allreduce spreads a NaN to every
        rank by itself)."""
        dense = self.densify(grads, variables)
        if not dense or not in_process_set(self.process_set, hvd.rank()):
            return dense, None
        if self.sparse:
            refuse_xla(self.api)
            return engine_step(self.states, "model", self.process_set, dense, self.average, self.prescale,
                               self.postscale, self.nonfinite, window=self.window)
        if self.process_set.size() == 1:
            return dense, None
        refuse_xla(self.api, sparse=False)
        # Horovod's own dense path: one named allreduce per tensor, in the (rank-consistent) order of sources
        if self.op == Average:
            pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        else:
            pre = post = 1.0
        return [hvd.allreduce(g, op=self.op, compression=self.compression, prescale_factor=pre,
                              postscale_factor=post, name=f"hvd_sparse.dense.{i}", ignore_name_scope=True,
                              process_set=self.process_set) for i, g in enumerate(dense)], None
