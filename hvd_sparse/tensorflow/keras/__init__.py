"""hvd_sparse for Keras (Keras 3 with the TensorFlow backend, and tf_keras with ``TF_USE_LEGACY_KERAS=1``).

    import horovod.tensorflow as hvd
    import hvd_sparse.tensorflow.keras as hvds

    opt = hvds.DistributedOptimizer(tf.keras.optimizers.SGD(0.05),
                                    compression=hvds.Compression.oktopk(density=0.01))
    model.compile(optimizer=opt, loss=...)
    model.fit(x, y, callbacks=[hvds.callbacks.BroadcastGlobalVariablesCallback(0), ...])

Why not Horovod's own: under Keras 3 (the default ``tf.keras`` of TensorFlow >= 2.16) Horovod 0.28.1's Keras
optimizer overrides Keras 2 internals that Keras 3 never calls, so it silently stops averaging gradients
(docs/design.md#tensorflow-and-keras). This optimizer intercepts the public entry point of each flavour --
``apply(grads, variables)`` in Keras 3 (``apply_gradients`` and ``model.fit`` both go through it),
``apply_gradients(grads_and_vars)`` in tf_keras -- and reduces there, with a dense Horovod allreduce for
``Compression.none``/``fp16`` and one engine step (the same engine as PyTorch) for a sparse preset.

``backward_passes_per_step=N`` accumulates the gradients of N calls locally (in ``tf.Variable`` s) and reduces
and applies them on the N-th, as Horovod does; ``sparse_state_dict()`` / ``load_sparse_state_dict()`` and
:class:`hvd_sparse.tensorflow.SparseState` checkpoint the per-rank sparse state.

``consistency_check_every=N`` (default 0: off) proves every N applied updates that all ranks hold bit-identical
variables (those the optimizer updates), or fails the step on every rank naming the first differing variable and
the ranks (``ReplicaDivergenceError``; see :meth:`check_consistency`). Inside a ``tf.function`` the check runs in a
``tf.py_function`` fed with reads of the variables (so ordered after the update), so it works the same in eager code,
in a ``tf.function`` and in ``model.fit``; elastic Horovod: :mod:`hvd_sparse.tensorflow.keras.elastic` (``KerasState``,
``elastic_residuals=``).
"""

from __future__ import annotations

import tensorflow as tf
from horovod.tensorflow import Average, global_process_set

from ...compression import SparseCompression, check_compression, check_momentum, refuse_unused_options
from ...core.validate import check_elastic_residuals, check_nonfinite, check_op, check_positive_int
from ...logs import log_stats
from .._consistency import check_now, run_check, variable_name
from .._variables import keras_flavour, same_variable
from ..checkpoint import SparseState, load_sparse_state_dict, sparse_state_dict
from ..compression import Compression
from ..reduction import Reduction
from ._aggregation import LocalAggregation, reduce_with_locals
from ._loss_scale import install as install_loss_scale_agreement
from ._loss_scale import refuse_wrapped

_API = "hvd_sparse.tensorflow.keras.DistributedOptimizer"

__all__ = ["Compression", "DistributedOptimizer", "SparseState", "callbacks"]


class _Guard:
    """Per optimizer, in a plain Python object (not tracked by Keras or tf.train.Checkpoint): the variables the
    optimizer updates (from its last call), the number of applied updates, ``consistency_check_every`` and
    ``log_stats_every``, the
    worker-local variables (``register_local_var``) and, between tf_keras's ``aggregate_gradients`` and
    ``apply_gradients``, the skip flag of the exchange that already ran."""

    def __init__(self, every, scale_local_gradients, log_every=0):
        self.every = every
        self.log_every = log_every      # log_stats_every
        self.steps = 0
        self.variables = None
        self.local = []
        self.scale_local_gradients = scale_local_gradients
        self.pre_reduced = None         # (skipped, ready) after aggregate_gradients (ready: None, or passes > 1)
        self.applying = False           # inside apply_gradients: aggregate_gradients is the inner one


def _count_iteration(optimizer):
    """A call that only accumulates: the optimizer counts it (Horovod's ``increment_optimizer_iteration``)."""
    optimizer.iterations.assign_add(1)


def _unless(skipped, apply, after):
    """Run ``apply()`` then ``after()`` unless ``skipped`` (the engine's non-finite flag, the same on every rank): a
    skipped step changes no variable, not even ``iterations`` (as hvd_sparse.torch's ``step()``). ``skipped is None``:
    the dense path, apply."""
    if skipped is None:
        apply()
        after()
        return

    def run():
        apply()
        after()
        return tf.constant(True)

    tf.cond(skipped, lambda: tf.constant(False), run)


class _Keras3Methods:
    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        self._hvds_guard.variables = variables
        agg = self._hvds_agg
        if agg is None:
            grads, skipped = self._hvds_reduce_grads(list(grads), variables)
            if skipped is None:
                out = self._hvds_inner.apply(self, grads, trainable_variables)
                self._hvds_updated()
                return out
        if not self.built:                    # create the slots here, not inside a branch of a tf.cond
            import keras

            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        if agg is None:
            _unless(skipped, lambda: self._hvds_inner.apply(self, grads, trainable_variables), self._hvds_updated)
            return
        ready = agg.accumulate(self._hvds_reduce.densify(list(grads), variables), variables, _API)

        def reduce_and_apply():
            grads, skipped = agg.reduced(self._hvds_reduce_grads, variables)
            _unless(skipped, lambda: self._hvds_inner.apply(self, grads, variables), self._hvds_updated)
            agg.clear()

        tf.cond(ready, reduce_and_apply, lambda: _count_iteration(self))


class _TFKerasMethods:
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        variables = [v for _, v in grads_and_vars]
        grads = [g for g, _ in grads_and_vars]
        guard = self._hvds_guard
        guard.variables = variables
        pre, guard.pre_reduced = guard.pre_reduced, None
        agg = self._hvds_agg

        def inner(gs):
            return lambda: self._hvds_inner.apply_gradients(self, list(zip(gs, variables)), *args, **kwargs)

        guard.applying = True
        try:
            ready = None
            if pre is not None and kwargs.get("skip_gradients_aggregation"):
                (skipped, ready), agg = pre, None   # exchanged already, in aggregate_gradients (a LossScaleOptimizer)
            elif agg is None:
                grads, skipped = self._hvds_reduce_grads(grads, variables)
            if agg is None and skipped is None:
                out = inner(grads)()
                self._hvds_updated()
                return out
            with tf.init_scope():                 # the slots: here, not inside a branch of a tf.cond
                create = getattr(self, "_create_all_weights", None) or self.build
                create(variables)
            if agg is None and ready is None:
                _unless(skipped, inner(grads), self._hvds_updated)
                return self.iterations
            if agg is None:                       # passes > 1 under a LossScaleOptimizer: apply on the reducing call
                tf.cond(ready, lambda: _unless(skipped, inner(grads), self._hvds_updated),
                        lambda: _count_iteration(self))
                return self.iterations
            ready = agg.accumulate(self._hvds_reduce.densify(grads, variables), variables, _API)

            def reduce_and_apply():
                reduced, skipped = agg.reduced(self._hvds_reduce_grads, variables)
                _unless(skipped, inner(reduced), self._hvds_updated)
                agg.clear()

            tf.cond(ready, reduce_and_apply, lambda: _count_iteration(self))
            return self.iterations
        finally:
            guard.applying = False

    def aggregate_gradients(self, grads_and_vars):
        """tf_keras's cross-replica hook, which a ``LossScaleOptimizer`` calls before it checks the gradients: the
        exchange runs here, so the loss scaler sees the reduced gradients, the same on every rank; the
        ``apply_gradients(..., skip_gradients_aggregation=True)`` that follows does not exchange again.

        With ``backward_passes_per_step = N > 1`` the gradients are summed locally and only every N-th call reduces
        them; the other calls hand the loss scaler zeros (finite: it lets them through, and the update that follows
        only counts the iteration), so a NaN or Inf in any pass on any rank reaches the loss scaler at the reducing
        call, through the reduced gradients, on every rank alike: that step is skipped and the scale halved
        everywhere."""
        guard = self._hvds_guard
        if guard.applying:                    # our own apply_gradients -> the inner one: reduced already
            return self._hvds_inner.aggregate_gradients(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        variables = [v for _, v in grads_and_vars]
        guard.variables = variables
        grads = [g for g, _ in grads_and_vars]
        agg = self._hvds_agg
        if agg is None:
            grads, skipped = self._hvds_reduce_grads(grads, variables)
            guard.pre_reduced = (skipped, None)
            return list(zip(grads, variables))
        grads = self._hvds_reduce.densify(grads, variables)
        ready = agg.accumulate(grads, variables, _API)

        def reduce_now():
            reduced, skipped = agg.reduced(self._hvds_reduce_grads, variables)
            agg.clear()
            return reduced, tf.constant(False) if skipped is None else skipped

        grads, skipped = tf.cond(ready, reduce_now, lambda: ([tf.zeros_like(g) for g in grads], tf.constant(False)))
        guard.pre_reduced = (skipped, ready)
        return list(zip(grads, variables))


class _CommonMethods:
    def __init__(self, *args, **kwargs):
        """The wrapped class's ``__init__``, then hvd_sparse's settings: so ``type(opt).from_config(config)`` (Keras
        and Horovod rebuild optimizers this way) gives a working distributed optimizer too -- with a sparse preset,
        its own sparse state (``compression.reify()``: its own residuals), as the copy has its own slots."""
        self._hvds_inner.__init__(self, *args, **kwargs)
        _setup(self, type(self)._hvds_settings)

    def register_local_var(self, var):
        """Horovod's ``register_local_var``: ``var``'s gradient is not reduced but kept local (divided by the number
        of ranks with ``scale_local_gradients=True``, Horovod's default); with ``backward_passes_per_step > 1`` it
        is summed locally like the others. Every rank must register the same variables (the reduced ones form the
        exchange's layout, which is checked across ranks)."""
        local = self._hvds_guard.local
        if not any(same_variable(var, v) for v in local):
            local.append(var)

    def _hvds_reduce_grads(self, grads, variables):
        guard = self._hvds_guard
        return reduce_with_locals(self._hvds_reduce, grads, variables, guard.local, guard.scale_local_gradients)

    def _hvds_updated(self):
        """After an applied update (not a skipped or an only-accumulating call): with ``consistency_check_every=N``
        or ``log_stats_every=M`` count it, check every N-th and log the statistics every M-th. Eagerly the check
        runs at once; in a ``tf.function`` (``model.fit``) it runs
        eagerly inside a ``tf.py_function`` fed with reads of the variables, which TensorFlow orders after the
        update's writes, so it sees the updated values. (A py_function without those inputs is ordered with
        nothing: under Keras 3 it ran before the update.)"""
        guard = self._hvds_guard
        if not guard.every and not guard.log_every:
            return
        variables = guard.variables
        names = [variable_name(v) for v in variables]

        def count_and_check(values):
            guard.steps += 1
            if guard.every and guard.steps % guard.every == 0:
                self._hvds_check(names, values)
            if guard.log_every and guard.steps % guard.log_every == 0:
                stats = self.sparse_stats(average=True)         # a collective: every rank, at the same step
                if self._hvds_reduce.process_set.rank() == 0:
                    log_stats(guard.steps, stats)

        run_check(variables, count_and_check)

    def _hvds_check(self, names, values):
        check_now(names, values, self._hvds_reduce.process_set, self._hvds_guard.steps,
                  "hvd_sparse.model.consistency", _API)

    def _hvds_elastic_reset(self):
        """After an elastic reset (:mod:`hvd_sparse.tensorflow.keras.elastic`): the sparse engine starts afresh over
        the new process set at the next step (partitions, thresholds, counters), this rank's residual kept or
        dropped by ``elastic_residuals``; gradients accumulated locally (``backward_passes_per_step > 1``) since
        the last reduction are dropped; the consistency guard counts from 0 again."""
        if self._hvds_reduce.sparse:
            self._hvds_reduce.states.reset(self._hvds_elastic_residuals == "keep")
        if self._hvds_agg is not None and self._hvds_agg.sums is not None:
            self._hvds_agg.clear()
        self._hvds_guard.steps = 0         # as on a joining process: every rank checks at the same steps again

    def check_consistency(self, variables=None):
        """Collective: raise :class:`hvd_sparse.ReplicaDivergenceError` on every rank unless all ranks hold
        bit-identical variables (two 64-bit checksums of each variable's bits, one allgather), naming the first
        differing variable (Keras 3 ``path``, else ``name``) and the ranks that differ from rank 0.

        Runs by itself every ``consistency_check_every`` applied updates; call it at any point every rank reaches
        (e.g. from a callback). ``variables``: default, those of the optimizer's last update (pass e.g.
        ``model.trainable_variables`` before the first one). Eagerly it raises ``ReplicaDivergenceError``; inside a
        ``tf.function`` (the automatic check in ``model.fit``) the step fails with a ``tf.errors.UnknownError``
        that carries the same message (TensorFlow converts exceptions of a ``tf.py_function``)."""
        api = f"{_API}.check_consistency"
        if variables is None:
            variables = self._hvds_guard.variables
            if variables is None:
                raise ValueError(f"{api}: this optimizer has not updated any variable yet, so it does not know which "
                                 "to check; pass variables=model.trainable_variables")
        variables = list(variables)
        names = [variable_name(v) for v in variables]
        return run_check(variables, lambda values: self._hvds_check(names, values))

    def sparse_stats(self, average=False):
        """Statistics of this rank's last sparse step: ``n, k, selected, density, sent_bytes, recv_bytes,
        sent_words, recv_words, collectives``; empty with a dense compression or before the first step.

        ``average=True``: a collective (every rank, at the same point) that returns ``density``, ``sent_bytes``,
        ``recv_bytes`` and ``residual_norm`` as floats averaged over the sparse steps since the previous such call
        and over the ranks, as torch's optimizer does (``{}`` when no rank made one)."""
        if average:
            return self._hvds_reduce.averaged_stats(self.residual_norm())
        states = self._hvds_reduce.states
        return {} if states is None else states.last_stats("model")

    def skipped_steps(self):
        """Steps skipped on this rank (and every other) because a gradient was not finite (0 on the dense path)."""
        engine = self._hvds_sparse_engine()
        return 0 if engine is None else engine.skipped_steps

    def _hvds_sparse_engine(self):
        """The sparse preset's engine of this optimizer, or None (a dense compression, or before the first step)."""
        states = self._hvds_reduce.states
        return None if states is None else states.get("model")

    def residual_norm(self):
        """L2 norm of this rank's error-feedback residual (0.0 with a dense compression)."""
        states = self._hvds_reduce.states
        return 0.0 if states is None else states.residual_norm("model")     # restored / kept: the next step's

    def sparse_state_dict(self):
        """This rank's sparsification state (residual, thresholds, partitions, counters) for a checkpoint: a dict
        of numpy arrays and Python values (see :func:`hvd_sparse.tensorflow.sparse_state_dict`).

        Per rank: save it on *every* rank, next to the model and optimizer, and load each rank's own. It is not
        among the optimizer's variables (``BroadcastGlobalVariablesCallback`` would overwrite it with rank 0's);
        :class:`hvd_sparse.tensorflow.SparseState` (``SparseState(optimizer)``) puts it into a
        ``tf.train.Checkpoint``. Raises TypeError with a dense compression (nothing to save)."""
        return sparse_state_dict(self, None, f"{_API}.sparse_state_dict")

    def load_sparse_state_dict(self, state):
        """Restore :meth:`sparse_state_dict` (of this rank); the run then continues bit for bit as if never
        interrupted. Works before the first step too (the state is applied at that step). Raises ValueError for
        a state of another rank, another number of ranks or another compression."""
        load_sparse_state_dict(self, state, None, f"{_API}.load_sparse_state_dict")


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True, *,
                         nonfinite="skip", consistency_check_every=0, elastic_residuals="keep", log_stats_every=0):
    """Wrap a Keras optimizer so that every update first averages the gradients over Horovod ranks -- sparsely,
    when ``compression`` is a sparse preset. Horovod's signature (``horovod.tensorflow.keras``), in its order.

    The result is an instance of a subclass of your optimizer's class (same name; the Keras flavour is taken from
    the class's bases, so a subclass defined in your script works), rebuilt with
    ``cls.from_config(optimizer.get_config())`` as Horovod does -- ``type(opt).from_config(config)`` gives another
    working distributed optimizer (with its own sparse state) --, with Horovod's ``register_local_var``,
    ``sparse_stats()``, ``residual_norm()``, ``sparse_state_dict()`` and ``load_sparse_state_dict()``
    (checkpoints: also ``SparseState(optimizer)``).

    Mixed precision: put Keras's ``LossScaleOptimizer`` around this optimizer (``model.compile`` does it under the
    ``mixed_float16`` policy); every rank then skips the same steps and keeps the same loss scale
    (:mod:`hvd_sparse.tensorflow.keras._loss_scale`). ``jit_compile=True`` is refused (ValueError naming the fix):
    the exchange runs Python and Horovod collectives, which XLA cannot compile.

    Args:
        optimizer: a Keras 3 or tf_keras optimizer (not yet wrapped).
        compression: ``Compression.none`` (dense Horovod allreduce), ``Compression.fp16``, or a sparse preset
            such as ``Compression.oktopk(density=0.01)``.
        op: ``hvd.Average`` (default) or ``hvd.Sum``. ``hvd.Adasum`` is not supported.
        gradient_predivide_factor, process_set, sparse_as_dense: as in Horovod.
        backward_passes_per_step (int): as in Horovod: the gradients of this many calls (``apply`` in Keras 3,
            ``apply_gradients`` in tf_keras; one per batch in ``model.fit``) are summed locally, and only every
            ``backward_passes_per_step``-th call reduces the sum (one engine step for a sparse preset: the
            residual, threshold and step counter advance once per reduction) and applies it. The other calls
            change no variable and only count ``optimizer.iterations``. Default 1.
        average_aggregated_gradients (bool): with ``backward_passes_per_step > 1``, divide the reduced sum by
            ``backward_passes_per_step`` (Horovod's option). Default False (the sum, as in Horovod).
        scale_local_gradients (bool): as in Horovod: divide the gradients of the variables registered with
            ``register_local_var`` by the number of ranks. Default True.
        name, device_dense, device_sparse, num_groups, groups: accepted for compatibility; the sparse path
            reduces the model as one unit.
        nonfinite (str, keyword-only): when any rank's gradient holds a NaN or Inf (sparse presets):
            ``"skip"`` (default: on every rank the update is skipped -- no variable changes, not even
            ``iterations`` -- and the sparse state is untouched) or ``"raise"`` (the step fails on every rank
            with hvd_sparse.NonFiniteGradientError's message). With ``Compression.none`` or ``fp16`` another
            value than the default raises (Horovod's dense path passes the NaN on), as ``elastic_residuals`` does.
        consistency_check_every (int, keyword-only): every that many applied updates (counted since the start or
            the last elastic reset), check that all ranks hold bit-identical variables (one small allgather; see
            :meth:`check_consistency`); 0 (default) turns it off. Works with every compression (the dense path
            included), eagerly, in ``tf.function`` and ``model.fit``.
        elastic_residuals (str, keyword-only): under elastic Horovod (:class:`hvd_sparse.tensorflow.keras.elastic.
            KerasState`), what a reset (a rank left or joined) does to this rank's residual: ``"keep"`` (default)
            or ``"drop"``; partitions, thresholds and counters always start afresh.
        log_stats_every (int, keyword-only): every that many applied updates, average the sparse statistics over
            the ranks (a collective) and log them on rank 0 at INFO on the logger ``hvd_sparse``
            (:mod:`hvd_sparse.logs`), in ``model.fit`` too; 0 (default): off.

    Raises:
        ValueError: an optimizer that is already distributed (by hvd_sparse or Horovod), a ``LossScaleOptimizer``
            (wrap its inner optimizer instead), or bad arguments.
        NotImplementedError: ``op=hvd.Adasum``.
    """
    if getattr(optimizer, "_hvds_reduce", None) is not None \
            or type(optimizer).__module__.startswith("horovod"):
        raise ValueError(f"{_API}: {type(optimizer).__name__} is already a distributed optimizer (wrapped by "
                         "hvd_sparse or Horovod); wrap the plain Keras optimizer once")
    refuse_wrapped(optimizer, _API)
    check_compression(compression, _API)
    check_op(op, gradient_predivide_factor, _API)
    if isinstance(compression, SparseCompression):
        check_momentum(compression, _momentum(optimizer), _API)
    passes = check_positive_int(backward_passes_per_step, "backward_passes_per_step", _API)
    every = check_positive_int(consistency_check_every, "consistency_check_every", _API, minimum=0)
    log_every = check_positive_int(log_stats_every, "log_stats_every", _API, minimum=0)
    check_elastic_residuals(elastic_residuals, _API)
    check_nonfinite(nonfinite, _API)
    refuse_unused_options(compression, _API, nonfinite=nonfinite, elastic_residuals=elastic_residuals,
                          log_stats_every=log_every)
    # The flavour from the class's bases (a user's `class MySGD(tf.keras.optimizers.SGD)` lives in __main__)
    tf_keras = keras_flavour(optimizer) == "tf_keras"
    if not tf_keras:
        install_loss_scale_agreement()
    methods = dict(_TFKerasMethods.__dict__ if tf_keras else _Keras3Methods.__dict__)
    methods.update({k: v for k, v in _CommonMethods.__dict__.items() if not k.startswith("__")})
    methods = {k: v for k, v in methods.items() if not k.startswith("__")}
    settings = {"compression": compression, "passes": passes, "every": every, "log_every": log_every,
                "reduction": (op, gradient_predivide_factor, sparse_as_dense, process_set, _API, nonfinite),
                "average": bool(average_aggregated_gradients), "elastic_residuals": elastic_residuals,
                "scale_local_gradients": bool(scale_local_gradients)}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(methods, __init__=_CommonMethods.__init__, _hvds_inner=optimizer.__class__,
                    _hvds_settings=settings, __module__=optimizer.__class__.__module__))
    return cls.from_config(optimizer.get_config())


def _momentum(optimizer):
    """The Keras optimizer's momentum (SGD's, RMSprop's; 0 when it has none), Keras 3 or tf_keras alike."""
    try:
        return float(getattr(optimizer, "momentum", 0.0) or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _setup(opt, settings):
    """hvd_sparse's state of one optimizer instance (see ``_CommonMethods.__init__``)."""
    compression = settings["compression"]
    states = compression.reify() if isinstance(compression, SparseCompression) else None     # this optimizer's job
    opt._hvds_reduce = Reduction(compression, *settings["reduction"], states=states)
    passes = settings["passes"]
    opt._hvds_agg = LocalAggregation(passes, settings["average"]) if passes > 1 else None
    opt._hvds_guard = _Guard(settings["every"], settings["scale_local_gradients"], settings["log_every"])
    opt._hvds_elastic_residuals = settings["elastic_residuals"]


def __getattr__(name):          # ``hvds.callbacks`` without importing Keras callbacks eagerly
    if name == "callbacks":     # (``from . import callbacks`` here would recurse through hasattr)
        import importlib

        return importlib.import_module(__name__ + ".callbacks")
    raise AttributeError(name)
