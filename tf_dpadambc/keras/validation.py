"""Refuse models whose training cannot be made private per example."""
import keras

from tf_dpadambc.keras import _compat

# Layers that mix examples of a batch (their output for one example depends on
# the others) or update state from the data without noise.
_CROSS_EXAMPLE_LAYERS = (keras.layers.BatchNormalization,)


def check_model(model):
  """Raises ValueError for layers that break per-example sensitivity, and for
  what private training does not support yet (mixed precision)."""
  for layer in _compat.flatten_layers(model):
    policy = layer.dtype_policy
    if policy.compute_dtype != policy.variable_dtype:
      raise ValueError(
          f"Layer '{layer.name}' uses the mixed-precision policy "
          f"'{policy.name}' (computes in {policy.compute_dtype}, keeps "
          f"{policy.variable_dtype} weights). Private training does not "
          "support mixed precision yet: build the model under "
          "keras.mixed_precision.set_global_policy('float32') (or pass "
          "dtype='float32' to its layers).")
    if isinstance(layer, _CROSS_EXAMPLE_LAYERS):
      raise ValueError(
          f"Layer '{layer.name}' ({layer.__class__.__name__}) normalizes with "
          "statistics of the whole batch and updates its moving statistics "
          "from the data without noise: one example's influence is not "
          "bounded by clipping, so differentially private training cannot "
          "use it. Replace it with keras.layers.GroupNormalization or "
          "keras.layers.LayerNormalization (per-example normalizations).")
