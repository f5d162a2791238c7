"""The per-layer fallback: per-unit gradients of one layer's own weights."""
import keras
import tensorflow as tf

from tf_dpadambc.core import per_example
from tf_dpadambc.keras.rules import base


class PerLayer(base.Materialized):
  """Per-unit gradients of one layer's own weights, vectorized over units.

  Re-runs only this layer on each unit's recorded input, with its output
  gradient δ: ∇_w ⟨layer_w(x_u), δ_u⟩, each unit alone (``vectorized_map``
  over the stacked calls: exact by construction).
  """
  pre_activation = False

  def __init__(self, layer, original_call, values, variables):
    super().__init__(layer)
    self.original_call = original_call
    self.variables = list(variables)
    self.values = values

  def _unit_grads(self, deltas):
    total = None
    for call, delta in zip(self.calls, deltas):
      values = [self.values[id(v)] for v in self.variables]

      def unit_grads(unit, values=values, kwargs=call.kwargs):
        x, d = unit
        with tf.GradientTape() as tape:
          tape.watch(values)
          with keras.StatelessScope(list(zip(self.variables, values)),
                                    initialize_variables=False):
            y = self.original_call(x, **kwargs)
          inner = tf.reduce_sum(y * tf.cast(d, y.dtype))
        return tape.gradient(inner, values,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)
      # The layer's own code, per unit: nothing but the unit's records,
      # the weights and constants (per_example.unit_local).
      unit_grads, check = per_example.unit_local(unit_grads,
                                                 (call.inputs, delta))
      grads = tf.vectorized_map(unit_grads, (call.inputs, delta),
                                fallback_to_while_loop=False)
      check()
      total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total

  def plan(self):
    if getattr(self.layer, "lora_enabled", False):
      return ("per-layer vectorized per-unit gradients (LoRA "
              f"r={self.layer.lora_rank}, no ghost rule for this layer)")
    return "per-layer vectorized per-unit gradients (no ghost rule)"
