"""hvd_sparse for TensorFlow 2 and Keras: not available yet.

The engine (``hvd_sparse.core``) is framework-agnostic; the TensorFlow adapter (DistributedGradientTape,
DistributedOptimizer, the Keras optimizer and callbacks) is tracked as its own issue. Importing this
package raises instead of offering a partial API.
"""

raise ImportError("hvd_sparse.tensorflow is not implemented yet: the TensorFlow/Keras adapter is tracked as "
                  "its own work item. Use hvd_sparse.torch, or hvd_sparse.testing.simulate for the algorithms.")
