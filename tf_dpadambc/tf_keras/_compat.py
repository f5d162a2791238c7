"""Every use of a tf_keras internal (and of the Python stack), in one place.

The adapter needs things tf_keras does not expose publicly: the base class
of all its batch normalizations (``BatchNormalizationBase``: the v1 and v2
layers and ``SyncBatchNormalization`` derive from it), the model on whose
behalf ``Optimizer.minimize`` is called (``Model.train_step`` passes only the
loss, the variables and the tape), the graph of a traced train step, and for
the per-unit path the batch of the stock ``Model.train_step`` and the
per-output steps of its compiled loss (``LossesContainer.__call__``), the
ops a traced per-unit evaluation created (variable writes, random draws, in
nested functions too), and the model's ``make_train_function`` /
``_validate_and_get_metrics_result``, through which the host reads a
refusal after a compiled step.
``tests/test_tf_keras.py`` fails loudly if a tf_keras release breaks any of them.
"""
import collections
import sys

import keras
import tensorflow as tf
import tf_keras

from tf_dpadambc.core import graph

try:  # pylint: disable=g-import-not-at-top
  from tf_keras.src.layers.normalization.batch_normalization import (
      BatchNormalizationBase as _TFKerasBatchNorm)
except ImportError:  # a release that moved it: the public classes still work
  _TFKerasBatchNorm = (tf_keras.layers.BatchNormalization,
                       tf_keras.layers.experimental.SyncBatchNormalization)
try:  # pylint: disable=g-import-not-at-top
  from tf_keras.src.engine import compile_utils as _compile_utils
  from tf_keras.src.utils import losses_utils as _losses_utils
except ImportError:  # a release that moved them: no per-unit fit path
  _compile_utils = _losses_utils = None

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
  computes ``tensor`` (inside a traced function), or None (eager, or none).

  Not tf_keras' LayerNormalization, which computes per-row statistics with
  the same kernel on its input reshaped to [1, rows, features, 1] (NCHW:
  one statistic per row, the examples in the channels): it was refused as
  batch normalization. Whatever else such an op could do, fit evaluates
  each unit alone (its rows only), and compares the per-unit losses with
  the batch's on every step (a layer that mixes examples makes fit
  raise)."""
  if tf.executing_eagerly() or not hasattr(tensor, "graph"):
    return None
  for op in tensor.graph.get_operations():
    if (op.type in _FUSED_BATCH_NORM and op.get_attr("is_training")
        and not _per_row_normalization(op)):
      return op.name
  return None


def _per_row_normalization(op):
  """The fused kernel as tf_keras' LayerNormalization calls it."""
  shape = op.inputs[0].shape
  return (op.get_attr("data_format") in (b"NCHW", "NCHW") and shape.rank == 4
          and shape[0] == 1 and shape[3] == 1)


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


def compiled_loss_fn(model, y, sample_weight):
  """``(loss_fn, None)``: ``loss_fn(y, y_pred, sample_weight)`` is the
  per-example loss vector the model's compiled loss returns, or
  ``(None, reason)``.

  Supported: the stock ``LossesContainer``, every loss with
  ``reduction=NONE`` (one output or several, with loss weights), no
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
  if not getattr(container, "_built", False) or not isinstance(losses, list):
    return None, "the compiled loss is not built"
  weights = list(weights) if isinstance(weights, (list, tuple)) else (
      [weights] * len(losses))
  if len(weights) != len(losses) or all(obj is None for obj in losses):
    return None, "no compiled loss"
  leaves = tf.nest.flatten(y) + (
      [] if sample_weight is None else tf.nest.flatten(sample_weight))
  if any(t is None or isinstance(t, tf.RaggedTensor) for t in leaves):
    return None, "missing or ragged targets or sample weights"
  if model.losses:
    return None, "regularization losses"
  if any(obj is not None and getattr(obj, "reduction", None) != (
      tf_keras.losses.Reduction.NONE) for obj in losses):
    return None, "the compiled loss is reduced"

  def loss_fn(y_true, y_pred, sw):
    y_true = container._conform_to_outputs(y_pred, y_true)  # pylint: disable=protected-access
    sw = container._conform_to_outputs(y_pred, sw)  # pylint: disable=protected-access
    values = []
    for y_t, y_p, s, obj, weight in zip(
        tf.nest.flatten(y_true), tf.nest.flatten(y_pred),
        tf.nest.flatten(sw), losses, weights):
      if y_t is None or obj is None:
        continue
      y_t, y_p, s = _compile_utils.match_dtype_and_rank(y_t, y_p, s)
      s = _losses_utils.apply_mask(y_p, s, _losses_utils.get_mask(y_p))
      value = obj(y_t, y_p, sample_weight=s)
      values.append(value if weight is None else value * weight)
    return tf.add_n(_losses_utils.cast_losses_to_common_dtype(values))
  return loss_fn, None


# -------------------------------------------- guards of per-unit evaluation
_resolve_handle = graph.resolve_handle


def _seed_state_handles(model):
  """Handles of the keras.random.SeedGenerator states of a model's Keras 3
  layers: their writes advance data-independent randomness."""
  handles = []
  for layer in all_layers(model):
    if isinstance(layer, keras.layers.Layer):
      for value in vars(layer).values():
        if isinstance(value, keras.random.SeedGenerator):
          handles.append(getattr(value.state.value, "handle", None))
  return [h for h in handles if h is not None]


def state_writes(ops, model, data=()):
  """Names of the ops among ``ops`` (and the functions they call) that write
  state (``graph.state_effects``: variables, tables, generators, ...), other
  than the random state of a Keras 3 SeedGenerator advanced from itself: a
  value computed from ``data`` (the units' inputs) written there is state
  too (a review: a unit's example written into the state, read back by the
  next units, 17.5C at B = 16)."""
  seeds = _seed_state_handles(model) if model is not None else []
  data = {(id(t.graph), t.name) for t in data if tf.is_symbolic_tensor(t)}

  def from_data(op):
    stack, seen = list(op.inputs[1:]), set()
    while stack:
      tensor = stack.pop()
      if (id(tensor.graph), tensor.name) in data:
        return True
      if id(tensor.op) not in seen:
        seen.add(id(tensor.op))
        stack.extend(tensor.op.inputs)
    return False

  def seed_state(op):
    handle = _resolve_handle(op.inputs[0]) if op.inputs else None
    return (handle is not None and any(handle is s for s in seeds)
            and not from_data(op))
  return graph.state_effects(ops, allowed=seed_state)


draws_random = graph.draws_random


# ------------------------------------------ the host's check after a step
_HOST_CHECK = "_tf_dpadambc_host_check"


def install_host_check(model, check):
  """Makes the host call ``check()`` around every call of
  ``model.train_function`` and before each epoch's metrics are read.

  A refused step happens inside a compiled function, where no Python (and,
  under XLA, no assert op) runs: the step records the refusal in a variable
  and ``check`` reads it and raises. Installed while ``fit`` traces its
  first call, whose own refusal the next call (or the end of the epoch:
  ``_validate_and_get_metrics_result``) reports.
  """
  object.__setattr__(model, _HOST_CHECK, check)
  if getattr(model, "_tf_dpadambc_hooked", False):
    return
  object.__setattr__(model, "_tf_dpadambc_hooked", True)

  def run_check():
    getattr(model, _HOST_CHECK)()

  def wrap(function):
    if function is None or getattr(function, "_tf_dpadambc_checked", False):
      return function

    first = [True]

    def checked(*args, **kwargs):
      if first[0]:  # the traced call that installed this check
        run_check()
        first[0] = False
      outputs = function(*args, **kwargs)
      run_check()
      return outputs
    checked._tf_dpadambc_checked = True  # pylint: disable=protected-access
    checked.wrapped = function
    return checked

  make = model.make_train_function

  def make_train_function(force=False):
    function = wrap(make(force))
    object.__setattr__(model, "train_function", function)
    return function

  validate = model._validate_and_get_metrics_result  # pylint: disable=protected-access

  def validate_and_get_metrics_result(logs):
    run_check()
    return validate(logs)

  object.__setattr__(model, "make_train_function", make_train_function)
  object.__setattr__(model, "_validate_and_get_metrics_result",
                     validate_and_get_metrics_result)
  object.__setattr__(model, "train_function", wrap(model.train_function))
