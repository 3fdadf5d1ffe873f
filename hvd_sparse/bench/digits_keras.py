"""The digits CNN in Keras (38,282 parameters, the layers of :class:`hvd_sparse.bench.digits_torch.Net`),
channels last, for both Keras flavours that ``tf.keras`` can be: Keras 3, or tf_keras with
``TF_USE_LEGACY_KERAS=1``. The data is :func:`hvd_sparse.bench.digits.load_arrays` with
``layout="channels_last"``.

No import at load time: TensorFlow is imported by :func:`make_model` only when no Keras module is passed.
"""


def make_model(keras=None):
    """A new, uncompiled ``keras.Sequential``: input (N, 8, 8, 1) -> 10 logits.

        conv 3x3, 16 ch, ReLU -> conv 3x3, 32 ch, ReLU -> max-pool 2 -> flatten -> dense 64, ReLU -> dense 10

    Args:
        keras: the Keras module to build with (``tf.keras``, ``keras`` or ``tf_keras``). Default: ``tf.keras``
            as resolved now (tf_keras when ``TF_USE_LEGACY_KERAS=1`` was set before TensorFlow was imported).
    Returns:
        keras.Sequential: initialised from Keras's global RNG (``keras.utils.set_random_seed`` fixes it).
    """
    if keras is None:
        import tensorflow as tf

        keras = tf.keras
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
