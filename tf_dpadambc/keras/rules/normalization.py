"""Normalization layers whose output is affine in each weight, the weights
broadcast along trailing axes: LayerNormalization, GroupNormalization,
RMSNormalization (Keras, KerasHub, Gemma's z = x̂ ⊙ (1 + scale))."""
import keras
import tensorflow as tf

from tf_dpadambc.core import ghost
from tf_dpadambc.keras.rules import base
from tf_dpadambc.keras.rules import registry


def _trailing(layer, axis):
  """True if ``axis`` (int or list) names the trailing axes of the input."""
  axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
  if all(a < 0 for a in axes):
    return sorted(axes) == list(range(-len(axes), 0))
  rank = None
  try:
    rank = len(layer.input.shape)
  except (AttributeError, ValueError):  # never called symbolically
    shapes = getattr(layer, "_build_shapes_dict", None) or {}
    for shape in shapes.values():
      rank = len(shape)
  if rank is None:
    return False
  axes = sorted(a % rank for a in axes)
  return axes == list(range(rank - len(axes), rank))


class Affine(base.Materialized):
  """z = c(x) + Σ_v J_v(x) ⊙ v, each weight v broadcast along trailing axes.

  J_v = call(v = 1, the others 0) − call(all 0), by the layer's own call on
  the recorded input (it normalizes within a row: row by row is the same);
  the per-unit gradients Σ_t δ_t ⊙ J_v,t are materialized (the weights'
  size per unit).
  """
  pre_activation = False

  def __init__(self, layer, original_call, variables):
    super().__init__(layer)
    self.original_call = original_call
    self.variables = list(variables)

  def _run(self, call, ones):
    mapping = [(v, (tf.ones if v is ones else tf.zeros)(v.shape, v.dtype))
               for v in self.variables]
    with keras.StatelessScope(mapping, initialize_variables=False):
      return self.original_call(call.merged(call.inputs), **call.kwargs)

  def _unit_grads(self, deltas):
    total = None
    for call, delta in zip(self.calls, deltas):
      zero = self._run(call, None)
      delta = call.merged(delta)
      grads = [base.per_unit_sum(ghost.broadcast_grads(
          delta * tf.cast(self._run(call, v) - zero, delta.dtype), v.shape),
                                 call.rows) for v in self.variables]
      total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total

  def plan(self):
    return "materialized per unit (normalized x recomputed)"


def _layer_norm(layer, original_call, values):
  del values
  if isinstance(layer, keras.layers.GroupNormalization):
    if not _trailing(layer, layer.axis):
      return None
  elif not _trailing(layer, layer.axis):
    return None
  return Affine(layer, original_call,
                [v for v in (layer.gamma, layer.beta) if v is not None])


def _scale_norm(layer, original_call, values):
  del values
  axis = getattr(layer, "axis", -1)
  if not _trailing(layer, axis):
    return None
  return Affine(layer, original_call, [layer.scale])


registry.register_builtin(keras.layers.LayerNormalization, _layer_norm)
registry.register_builtin(keras.layers.GroupNormalization, _layer_norm)
registry.register_builtin(keras.layers.RMSNormalization, _scale_norm)
for _module in ("keras_hub.src.models.gemma.rms_normalization",
                "keras_hub.src.layers.modeling.rms_normalization"):
  registry.register_builtin_lazy(_module, "RMSNormalization", _scale_norm)
