"""Variables of a Keras model and optimizer, the same under Keras 3 and tf_keras, and their broadcast.

Shared by the Keras callbacks (``BroadcastGlobalVariablesCallback``) and the elastic states
(:mod:`hvd_sparse.tensorflow.elastic`, :mod:`hvd_sparse.tensorflow.keras.elastic`). Touches variables only through
what both flavours (and plain ``tf.Variable`` s) share: ``.numpy()``, ``.assign()``, ``.shape``, ``.dtype``.
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow import global_process_set

# dtypes Horovod's TensorFlow collectives accept (horovod/common/message.h, TF ops)
HVD_DTYPES = {tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64,
              tf.bool}


def keras_flavour(obj):
    """``"tf_keras"``, ``"keras"`` (Keras 3) or ``None``: the module of ``type(obj)`` (or of ``obj`` if it is a
    class) or, for a user's subclass (``class MyModel(tf.keras.Model)`` in ``__main__``), of its first Keras base."""
    cls = obj if isinstance(obj, type) else type(obj)
    for klass in cls.__mro__:
        module = klass.__module__ or ""
        if module.startswith("tf_keras"):
            return "tf_keras"
        if module.startswith("keras"):
            return "keras"
    return None


def optimizer_variables(optimizer):
    """``optimizer.variables`` (Keras 3, a list) or ``optimizer.variables()`` (tf_keras, a method)."""
    if optimizer is None:
        return []
    variables = getattr(optimizer, "variables", [])
    if callable(variables):
        variables = variables()
    return list(variables)


def same_variable(a, b):
    """Identity, also across a Keras 3 variable and the tf.Variable it wraps (``.value``)."""
    if a is b:
        return True
    for x, y in ((a, b), (b, a)):
        inner = getattr(x, "_value", None)      # Keras 3 KerasVariable -> backend tf.Variable
        if inner is not None and inner is y:
            return True
    return False


def unique_variables(candidates, exclude=()):
    """``candidates`` in order, each variable once (a Keras 3 variable and its tf.Variable count as one), minus
    those in ``exclude``."""
    def keys(var):
        inner = getattr(var, "_value", None)
        return {id(var)} if inner is None else {id(var), id(inner)}

    seen, out = set(), []
    excluded = set().union(*(keys(v) for v in exclude))
    for var in candidates:
        mine = keys(var)
        if mine & seen or mine & excluded:
            continue
        seen |= mine
        out.append(var)
    return out


def wire_dtype(dtype):
    """What a tensor of ``dtype`` is broadcast as: itself where Horovod has it, else the integer dtype of its item size
    (bfloat16 -> int16, uint32 -> int32, ...), which :func:`tf.bitcast` reaches and leaves without changing a bit."""
    dtype = tf.as_dtype(dtype)
    return dtype if dtype in HVD_DTYPES else _BITS[dtype.size]


_BITS = {1: tf.uint8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def broadcastable(variables):
    """The variables the callbacks and elastic states broadcast: those of a dtype Horovod has, and bfloat16 ones (as
    their bits); others, e.g. Keras 3's uint32 seed states, stay worker-local."""
    return [v for v in variables if tf.as_dtype(v.dtype) in HVD_DTYPES or tf.as_dtype(v.dtype) == tf.bfloat16]


def broadcast_variables(variables, root_rank, tag, api, device="", process_set=global_process_set):
    """Assign ``root_rank``'s values of ``variables`` on every rank (collective, eager).

    First one allgather of (count, total size) proves every rank has the same variables (else ValueError on every
    rank, instead of pairing wrong tensors or hanging); then one broadcast per dtype of the concatenated variables
    (sorted dtype names: the same order everywhere), named ``<tag>.<dtype>``; a dtype Horovod lacks (bfloat16) travels
    as its bits (:func:`wire_dtype`).
    """
    variables = list(variables)
    sig = np.array([len(variables), sum(int(np.prod(v.shape)) for v in variables)], dtype=np.int64)
    with tf.device(device):
        gathered = hvd.allgather(tf.constant(sig[None, :]), name=f"{tag}.signature", ignore_name_scope=True,
                                 process_set=process_set).numpy()
    if not (gathered == gathered[0]).all():
        raise ValueError(f"{api}: the ranks have different variables (count, total size per rank: "
                         f"{gathered.tolist()}); build the same model and optimizer on every rank")
    by_dtype = {}
    for var in variables:
        by_dtype.setdefault(tf.as_dtype(var.dtype).name, []).append(var)
    for dtype in sorted(by_dtype):
        group = by_dtype[dtype]
        wire = wire_dtype(dtype)
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in group], axis=0)
        with tf.device(device):
            flat = hvd.broadcast(tf.bitcast(flat, wire) if wire != flat.dtype else flat, root_rank,
                                 name=f"{tag}.{dtype}", ignore_name_scope=True, process_set=process_set)
        flat = tf.bitcast(flat, tf.as_dtype(dtype)) if wire != tf.as_dtype(dtype) else flat
        pieces = tf.split(flat, [int(np.prod(v.shape)) for v in group]) if len(group) > 1 else [flat]
        for var, piece in zip(group, pieces):
            var.assign(tf.reshape(piece, var.shape))
