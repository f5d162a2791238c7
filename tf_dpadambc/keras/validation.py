"""Refuse models whose training cannot be made private per example."""
import keras
import tensorflow as tf

from tf_dpadambc.core import graph
from tf_dpadambc.keras import _compat

# Layers that mix examples of a batch (their output for one example depends on
# the others) or update state from the data without noise.
_CROSS_EXAMPLE_LAYERS = (keras.layers.BatchNormalization,)


def check_model(model):
  """Raises ValueError for layers that break per-example sensitivity.

  Mixed precision is supported (``make_private``: float32 variables, norms,
  clipping and noise; a static loss scale under float16).
  """
  for layer in _compat.flatten_layers(model):
    if isinstance(layer, _CROSS_EXAMPLE_LAYERS):
      raise ValueError(
          f"Layer '{layer.name}' ({layer.__class__.__name__}) normalizes with "
          "statistics of the whole batch and updates its moving statistics "
          "from the data without noise: one example's influence is not "
          "bounded by clipping, so differentially private training cannot "
          "use it. Replace it with keras.layers.GroupNormalization or "
          "keras.layers.LayerNormalization (per-example normalizations).")


def check_forward(model, inputs):
  """Raises ValueError if the model's forward pass writes state.

  Per-unit evaluation keeps examples apart only through values: a variable
  written in the forward pass carries one unit's data to the others (under
  ``tf.vectorized_map`` they share it) and into later steps, without noise.
  Traced on zeros shaped like one example of ``inputs``, in training and
  in inference mode: Keras variables assigned from the data (other than the
  random state of a SeedGenerator) in training mode, and raw ``tf.Variable``
  writes in either (any write op: Keras variables write no op inside a
  StatelessScope), are refused.
  """
  seeds = {id(sg.state) for sg in _compat.seed_generators(model)}
  assigned = []

  def trace(probe, training):
    params = [tf.zeros(v.shape, v.dtype) for v in model.trainable_variables]
    state = [tf.zeros(v.shape, v.dtype)
             for v in model.non_trainable_variables]
    _, updated = model.stateless_call(params, state, probe, training=training)
    if training:  # (inference-mode Keras writes are discarded, as here)
      assigned.extend(v.path for v, new, old in zip(
          model.non_trainable_variables, updated, state)
                      if new is not old and id(v) not in seeds)
    return 0

  spec = tf.nest.map_structure(
      lambda t: tf.TensorSpec([1] + list(t.shape[1:]), t.dtype), inputs)
  writes = []
  # Both modes: the train step also runs the model in inference mode (its
  # first-step check), and a raw write there would persist.
  for training in (True, False):
    traced = tf.function(lambda p, t=training: trace(p, t), autograph=False
                         ).get_concrete_function(spec).graph
    writes += graph.variable_writes(traced.get_operations())
  if assigned or writes:
    what = (f"assigns {assigned}" if assigned
            else f"writes a tf.Variable ({writes[:3]})")
    raise ValueError(
        f"The forward pass of model '{model.name}' {what} in training mode. "
        "State written from the data is not bounded by per-example clipping "
        "and leaks into other examples and later steps without noise (like "
        "BatchNormalization's moving statistics). Private training refuses "
        "it: compute the value from the example itself, or keep the state "
        "out of the training forward pass (update it only when "
        "training=False).")
