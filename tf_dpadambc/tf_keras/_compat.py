"""Every use of a tf_keras internal (and of the Python stack), in one place.

The adapter needs three things tf_keras does not expose publicly: the base
class of all its batch normalizations (``BatchNormalizationBase``: the v1 and
v2 layers and ``SyncBatchNormalization`` derive from it), the model on whose
behalf ``Optimizer.minimize`` is called (``Model.train_step`` passes only the
loss, the variables and the tape), and the graph of a traced train step.
``tests/test_tf_keras.py`` fails loudly if a tf_keras release breaks any of them.
"""
import sys

import keras
import tensorflow as tf
import tf_keras

try:  # pylint: disable=g-import-not-at-top
  from tf_keras.src.layers.normalization.batch_normalization import (
      BatchNormalizationBase as _TFKerasBatchNorm)
except ImportError:  # a release that moved it: the public classes still work
  _TFKerasBatchNorm = (tf_keras.layers.BatchNormalization,
                       tf_keras.layers.experimental.SyncBatchNormalization)

# Layers whose output for one example depends on the other examples of the
# batch (and whose moving statistics learn from the data without noise).
CROSS_EXAMPLE_LAYERS = (_TFKerasBatchNorm, keras.layers.BatchNormalization)

_MODELS = (tf_keras.Model, keras.Model)
# Frames searched above minimize(): tf_keras' train_step is 1 frame up when
# run eagerly and ~10 up inside a traced (autograph) train function.
_MAX_FRAMES = 40
# Batch normalization in training mode in a traced graph (the fused kernels
# tf_keras uses for 4-D and 5-D inputs).
_FUSED_BATCH_NORM = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")


def calling_model(optimizer, variables):
  """The model on whose behalf ``optimizer.minimize`` runs, or None.

  Walks up the Python stack from the caller of ``minimize`` and returns the
  first Keras model (tf_keras or Keras 3) held in a frame's locals that is
  compiled with ``optimizer`` or owns every variable in ``variables``: the
  ``self`` of ``Model.train_step``, or the ``model`` of a custom loop.
  """
  wanted = {id(v) for v in variables}
  frame = sys._getframe(2)  # pylint: disable=protected-access
  for _ in range(_MAX_FRAMES):
    if frame is None:
      return None
    for value in list(frame.f_locals.values()):
      if isinstance(value, _MODELS) and _drives(value, optimizer, wanted):
        return value
    frame = frame.f_back
  return None


def _drives(model, optimizer, wanted):
  if getattr(model, "optimizer", None) is optimizer:
    return True
  owned = {id(v) for v in model.trainable_variables}
  return bool(wanted) and wanted <= owned


def all_layers(model):
  """The model and every layer it contains, recursively (tf.Module walk).

  Keras 3 layers called from a tf_keras model are found too: they are
  attributes of a tf_keras layer, and Keras 3 flattens its own.
  """
  found = [model] + list(model.submodules)
  keras3 = []
  for module in found:
    for value in vars(module).values():
      if isinstance(value, keras.layers.Layer):
        keras3 += list(value._flatten_layers(include_self=True,  # pylint: disable=protected-access
                                             recursive=True))
  return found + keras3


def traced_batch_norm(tensor):
  """Name of a training-mode fused batch normalization op in the graph that
  computes ``tensor`` (inside a traced function), or None (eager, or none)."""
  if tf.executing_eagerly() or not hasattr(tensor, "graph"):
    return None
  for op in tensor.graph.get_operations():
    if op.type in _FUSED_BATCH_NORM and op.get_attr("is_training"):
      return op.name
  return None
