"""tf_keras (Keras 2, ``TF_USE_LEGACY_KERAS=1``) adapters of the optimizers.

Drop-in replacements for TF-Privacy's ``DPKerasSGDOptimizer``,
``DPKerasAdamOptimizer`` and ``DPKerasAdagradOptimizer`` in code written for
Keras 2, plus one tf_keras class per Keras 3 optimizer (``DPAdamBC``, ...)::

    from tf_dpadambc.tf_keras import DPKerasAdamOptimizer   # or DPAdamBC
    loss = tf.keras.losses.CategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
    model.compile(optimizer=DPKerasAdamOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=250,
        learning_rate=1e-3), loss=loss, metrics=["accuracy"])
    model.fit(x, y, batch_size=250, epochs=3)

Every class drives one of our Keras 3 optimizers, which holds all state and
formulas (see :class:`TFKerasDPOptimizer`). ``import tf_dpadambc`` does not
import this package (nor tf_keras).
"""
try:
  import tf_keras  # noqa: F401  pylint: disable=unused-import
except ImportError as error:  # pragma: no cover (tested by the skip)
  raise ImportError(
      "tf_dpadambc.tf_keras needs the tf_keras package (Keras 2 for "
      'TensorFlow 2.16+): pip install "tf-keras>=2.16" matching your '
      "TensorFlow version.") from error

# pylint: disable=wrong-import-position
from tf_dpadambc.tf_keras.callbacks import PrivacyBudget
from tf_dpadambc.tf_keras.callbacks import PrivacyTensorBoard
from tf_dpadambc.tf_keras.optimizers import *  # noqa: F401,F403
from tf_dpadambc.tf_keras.optimizers import __all__ as _OPTIMIZERS

__all__ = list(_OPTIMIZERS) + ["PrivacyBudget", "PrivacyTensorBoard"]
