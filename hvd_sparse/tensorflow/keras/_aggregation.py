"""The Keras optimizer's gradient path between Keras and the reduction: Horovod's worker-local variables
(``register_local_var``) and Horovod's local gradient aggregation (``backward_passes_per_step``)."""

from __future__ import annotations

import tensorflow as tf

from .._variables import same_variable


def reduce_with_locals(reduction, grads, variables, local, scale_local_gradients):
    """``reduction.reduce_flagged`` over the gradients of the variables not in ``local``; the gradients of ``local``
    variables stay as they are (divided by the number of ranks with ``scale_local_gradients``), as Horovod's
    ``register_local_var``. Returns ``(grads, skipped)`` in the order of ``variables``."""
    if not local:
        return reduction.reduce_flagged(list(grads), list(variables))
    keep = [i for i, v in enumerate(variables) if not any(same_variable(v, lv) for lv in local)]
    out, skipped = reduction.reduce_flagged([grads[i] for i in keep], [variables[i] for i in keep])
    result = list(grads)
    for i, g in zip(keep, out):
        result[i] = g
    if scale_local_gradients:
        size = reduction.process_set.size()
        kept = set(keep)
        for i, g in enumerate(result):
            if i in kept or g is None:
                continue
            result[i] = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape) \
                if isinstance(g, tf.IndexedSlices) else g / size
    return result, skipped


class LocalAggregation:
    """Horovod's local gradient aggregation (``backward_passes_per_step``, ``horovod/tensorflow/
    gradient_aggregation_eager.py``), eager and inside ``tf.function`` alike.

    Per call of the optimizer, on every rank:
        1. sums[i] += grad[i];  counter += 1                        (tf.Variables: they survive retracing)
        2. if counter == passes:  g = reduce(sums)  (one engine step, or Horovod's dense allreduce)
                                  g /= passes if average_aggregated_gradients
                                  apply g (the optimizer's own update; it counts one iteration)
                                  sums = 0;  counter = 0
           else:                  optimizer.iterations += 1          (no variable changes, as Horovod)
    The branch is a ``tf.cond`` on the counter, so one traced function serves every call. The variables are
    created once, outside any trace (``tf.init_scope``), from the model variables' shapes; they are not part of
    the optimizer's variables (not broadcast, not checkpointed: a checkpoint taken between two reductions loses
    the passes accumulated since the last one, as in Horovod). Worker-local variables (``register_local_var``)
    are summed too and left out of the reduction only.
    """

    def __init__(self, passes, average):
        self.passes = passes
        self.average = average
        self.counter = None
        self.sums = None

    def accumulate(self, grads, variables, api):
        """Step 1; returns the predicate of step 2 (a boolean tensor)."""
        if self.sums is None:
            with tf.init_scope():
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_sparse_passes")
                self.sums = [tf.Variable(tf.zeros(tuple(v.shape), dtype=g.dtype), trainable=False,
                                         name="hvd_sparse_grad_sum") for g, v in zip(grads, variables)]
        if len(grads) != len(self.sums) or any(tuple(s.shape) != tuple(g.shape) for s, g in zip(self.sums, grads)):
            raise ValueError(f"{api}: with backward_passes_per_step > 1 every call must update the same variables "
                             f"(the accumulators hold {len(self.sums)} gradients, got {len(grads)} of other shapes); "
                             "use one DistributedOptimizer per model")
        for s, g in zip(self.sums, grads):
            s.assign_add(g)
        self.counter.assign_add(1)
        return tf.equal(self.counter, self.passes)

    def reduced(self, reduce, variables):
        """Step 2, first half: ``reduce(sums, variables)`` -> ``(grads, skipped)``, averaged over the passes by
        option."""
        out, skipped = reduce([s.read_value() for s in self.sums], variables)
        if self.average:
            out = [g / tf.cast(self.passes, g.dtype) for g in out]
        return out, skipped

    def clear(self):
        for s in self.sums:
            s.assign(tf.zeros_like(s))
        self.counter.assign(0)
