"""XLA (``jit_compile=True``) and hvd_sparse: refused while tracing, with the fix, before XLA's own error.

hvd_sparse's sparse exchange is one engine step that runs in Python (a ``tf.py_function``), and the dense path
calls Horovod's TensorFlow collectives; XLA compiles neither (Horovod's XLA ops exist only with
``HOROVOD_ENABLE_XLA_OPS=1`` on GPUs). Without this check the user gets XLA's "Detected unsupported operations ...
EagerPyFunc" from deep inside Keras, which names neither hvd_sparse nor the fix. The check runs while the function
is traced, before any collective, so every rank that compiles the same function raises the same error and none
waits in a collective.
"""

from __future__ import annotations

import os

import tensorflow as tf
from tensorflow.python.ops import control_flow_util


def in_xla_context():
    """True while tracing a function that XLA will compile (``tf.function(jit_compile=True)``, Keras
    ``model.compile(jit_compile=True)``)."""
    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def refuse_xla(api, sparse=True):
    """Raise ValueError naming ``api`` and the fix when called while tracing for XLA. ``sparse=False`` (Horovod's
    dense allreduce) lets it through when Horovod's XLA ops are enabled (``HOROVOD_ENABLE_XLA_OPS=1``)."""
    if not sparse and os.environ.get("HOROVOD_ENABLE_XLA_OPS") == "1":
        return
    if in_xla_context():
        raise ValueError(
            f"{api}: hvd_sparse cannot run under XLA (jit_compile=True): its gradient exchange runs Python in a "
            "tf.py_function and Horovod collectives, which XLA cannot compile. Compile without XLA: "
            "model.compile(..., jit_compile=False) for Keras, tf.function(..., jit_compile=False) for a custom "
            "training step")
