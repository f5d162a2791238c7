"""Every use of a tf_keras internal (and of the Python stack), in one place.

The adapter needs things tf_keras does not expose publicly: the base class
of all its batch normalizations (``BatchNormalizationBase``: the v1 and v2
layers and ``SyncBatchNormalization`` derive from it), the model on whose
behalf ``Optimizer.minimize`` is called (``Model.train_step`` passes only the
loss, the variables and the tape), the graph of a traced train step, and for
the vectorized path the batch of the stock ``Model.train_step`` and the
per-output steps of its compiled loss (``LossesContainer.__call__``).
``tests/test_tf_keras.py`` fails loudly if a tf_keras release breaks any of them.
"""
import collections
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
try:  # pylint: disable=g-import-not-at-top
  from tf_keras.src.engine import base_layer as _base_layer
  from tf_keras.src.engine import compile_utils as _compile_utils
  from tf_keras.src.utils import losses_utils as _losses_utils
except ImportError:  # a release that moved them: the jacobian path only
  _base_layer = _compile_utils = _losses_utils = None

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


# ------------------------------------------------------ the vectorized path
# The batch of one stock tf_keras ``Model.train_step`` call.
TrainStep = collections.namedtuple(
    "TrainStep", ["model", "x", "y", "sample_weight"])

# Functions (not source lines) identify the stock step: a subclass that
# overrides train_step runs other code, whose locals mean something else.
_TRAIN_STEP = tf_keras.Model.train_step
_COMPUTE_LOSS = tf_keras.Model.compute_loss
_CALL = tf_keras.Model.__call__


def stock_train_step(optimizer, loss, tape):
  """The batch of the stock ``Model.train_step`` calling ``minimize``.

  Returns ``(TrainStep, None)`` when a frame on the stack runs tf_keras'
  own ``Model.train_step`` (its code object) and that frame's ``loss`` and
  ``tape`` are the very objects ``minimize`` received, its model is compiled
  with ``optimizer`` and computes its loss with the stock ``compute_loss``:
  then ``loss`` is ``compiled_loss(y, self(x, training=True), sample_weight)``
  of that frame's ``x, y, sample_weight``. Otherwise ``(None, reason)``.
  """
  found = None
  frame = sys._getframe(1)  # pylint: disable=protected-access
  for _ in range(_MAX_FRAMES):
    if frame is None:
      break
    if frame.f_code is _TRAIN_STEP.__code__:
      found = frame.f_locals
      break
    frame = frame.f_back
  del frame  # no reference cycle through the stack
  if found is None:
    return None, "not called from tf_keras' stock Model.train_step"
  model = found.get("self")
  if found.get("loss") is not loss or found.get("tape") is not tape:
    return None, "minimize's loss or tape is not train_step's"
  if getattr(model, "optimizer", None) is not optimizer:
    return None, "the model is not compiled with this optimizer"
  if type(model).compute_loss is not _COMPUTE_LOSS:
    return None, "the model overrides compute_loss"
  if type(model).__call__ is not _CALL:
    return None, "the model overrides __call__"
  return TrainStep(model, found.get("x"), found.get("y"),
                   found.get("sample_weight")), None


def single_loss(model, y, sample_weight):
  """``(loss_fn, None)``: ``loss_fn(y, y_pred, sample_weight)`` is the
  per-example loss the model's compiled loss returns, or ``(None, reason)``.

  Supported: one output, one loss object with ``reduction=NONE``, no
  regularization losses (tf_keras cannot add them to a loss vector anyway).
  ``loss_fn`` repeats ``LossesContainer.__call__`` for that case, without its
  metric updates; the caller checks that its values match.
  """
  container = getattr(model, "compiled_loss", None)
  stock = _compile_utils and _compile_utils.LossesContainer
  if type(container) is not stock:  # pylint: disable=unidiomatic-typecheck
    return None, "no stock compiled loss"
  losses = getattr(container, "_losses", None)
  weights = getattr(container, "_loss_weights", None)
  if (not getattr(container, "_built", False) or not isinstance(losses, list)
      or len(losses) != 1 or losses[0] is None or len(weights or [None]) != 1):
    return None, "not exactly one compiled loss"
  if tf.nest.is_nested(y) or tf.nest.is_nested(sample_weight) or isinstance(
      y, tf.RaggedTensor):
    return None, "nested or ragged targets or sample weights"
  if model.losses:
    return None, "regularization losses"
  loss_obj, loss_weight = losses[0], (weights or [None])[0]
  if getattr(loss_obj, "reduction", None) != (
      tf_keras.losses.Reduction.NONE):
    return None, "the compiled loss is reduced"

  def loss_fn(y_t, y_p, sw):
    y_t, y_p, sw = _compile_utils.match_dtype_and_rank(y_t, y_p, sw)
    sw = _losses_utils.apply_mask(y_p, sw, _losses_utils.get_mask(y_p))
    value = loss_obj(y_t, y_p, sample_weight=sw)
    return value if loss_weight is None else value * loss_weight
  return loss_fn, None


def stochastic_layer(model):
  """A layer that draws random numbers in training (dropout, noise), or None.

  Evaluated per unit it would draw other values than in the batch.
  """
  random_layers = (_base_layer.BaseRandomLayer,) if _base_layer else ()
  for layer in all_layers(model):
    if isinstance(layer, random_layers) or (
        isinstance(layer, keras.layers.Layer)
        and any(isinstance(v, keras.random.SeedGenerator)
                for v in vars(layer).values())):
      return layer
  return None
