"""Stage 2 of the pipeline: bound every unit's contribution by C.

    clip_C(g) = g · min(1, C / ‖g‖₂)

so that the sum over units has L2 sensitivity C under add/remove-one-unit
adjacency (Abadi et al. 2016). A unit whose gradient is not finite contributes
exactly zero (it stays bounded) and is counted, so one bad example cannot
poison a step.

Two ways to get Σ_u clip_C(g_u), both exact:

* ``materialized``: per-unit gradients (U x model size), clipped and summed.
* ``reweighted``: per-unit norms first, then one backward pass of the
  re-weighted batch loss Σ_u c_u ℓ_u with c_u = min(1, C/‖g_u‖) held constant,
  whose gradient is Σ_u c_u g_u (the trick behind ghost clipping, Goodfellow
  2015; Li et al. 2022). Valid only when the batched forward pass computes the
  same per-unit losses as the per-unit one: no randomness in the forward pass
  and no data-dependent extra losses.
"""
import collections

import tensorflow as tf

from tf_dpadambc.core import per_example

ClippedSum = collections.namedtuple(
    "ClippedSum",
    ["grads", "norms", "num_clipped", "num_nonfinite", "mismatch"])
ClippedSum.__doc__ = """Σ_u clip_C(g_u) with what the clipping did.

grads: list of tensors shaped like the parameters, Σ_u clip_C(g_u).
norms: [U] per-unit gradient norms before clipping (inf/nan where not finite).
num_clipped: number of units with ‖g_u‖ > C (scaled down).
num_nonfinite: number of units whose gradient was not finite (zeroed).
mismatch: True if the re-weighted pass could not be verified (the batched
  losses differ from the per-unit ones); ``grads`` are then all zero.
"""


def clip_factors(norms, l2_norm_clip):
  """c_u = min(1, C/‖g_u‖), and 0 where ‖g_u‖ is not finite."""
  norms = tf.convert_to_tensor(norms)
  clip = tf.cast(l2_norm_clip, norms.dtype)
  finite = tf.math.is_finite(norms)
  safe = tf.where(finite, norms, tf.ones_like(norms))
  return tf.where(finite, tf.minimum(1.0, clip / tf.maximum(safe, 1e-30)),
                  tf.zeros_like(norms))


def _scaled_norms(per_unit_grads):
  """‖g_u‖₂ = scale_u · ratio_u with scale_u = max |entry of g_u|.

  Scaling first gives an exact clip factor even for finite gradients whose
  squares (or norm) overflow float32. ``ok_u`` is False for non-finite units.
  """
  def reduce_rest(fn, t):
    return fn(tf.reshape(t, [tf.shape(t)[0], -1]), axis=1)
  scale = tf.reduce_max(tf.stack(
      [reduce_rest(tf.reduce_max, tf.abs(g)) for g in per_unit_grads]), axis=0)
  ok = tf.math.is_finite(scale)
  safe = tf.where(ok & (scale > 0), scale, tf.ones_like(scale))
  ratio = tf.sqrt(tf.add_n([
      reduce_rest(tf.reduce_sum, tf.square(g / _expand_as(safe, g)))
      for g in per_unit_grads]))
  return safe, ratio, ok & tf.math.is_finite(ratio)


def per_unit_global_norms(per_unit_grads):
  """‖g_u‖₂ over all parameters for every unit u (leading axis); inf/nan if not finite."""
  scale, ratio, ok = _scaled_norms(per_unit_grads)
  return tf.where(ok, scale * ratio, tf.fill(tf.shape(ok), float("nan")))


def clip_per_unit(per_unit_grads, l2_norm_clip):
  """Clips each unit's gradient (leading axis) to L2 norm ≤ C.

  Returns ``(clipped, norms, was_clipped, ok)``; non-finite units (``ok``
  False) come back as exact zeros.
  """
  scale, ratio, ok = _scaled_norms(per_unit_grads)
  clip = tf.cast(l2_norm_clip, scale.dtype)
  # g·min(1, C/(s·r)) = (g/s)·min(s, C/r): no overflowing norm and no
  # denormal factor (flushed to zero on CPU) for huge finite gradients.
  bounded_scale = tf.minimum(scale, clip / tf.maximum(ratio, 1e-30))
  factors = tf.where(ok, bounded_scale, tf.zeros_like(scale))
  # multiply_no_nan: 0 · inf and 0 · nan are 0, so a zeroed unit is exactly 0.
  clipped = [tf.math.multiply_no_nan(g / _expand_as(scale, g),
                                     _expand_as(factors, g))
             for g in per_unit_grads]
  return clipped, scale * ratio, ok & (bounded_scale < scale), ok


def materialized_clipped_sum(per_unit_grads, l2_norm_clip):
  """Σ_u clip_C(g_u) from materialized per-unit gradients."""
  clipped, norms, was_clipped, ok = clip_per_unit(per_unit_grads,
                                                  l2_norm_clip)
  return _summary([tf.reduce_sum(c, axis=0) for c in clipped], norms,
                  was_clipped, ok)


def reweighted_gradient(batch_unit_losses_fn, params, weights):
  """∇_θ Σ_u w_u ℓ_u(θ) with the weights held constant: Σ_u w_u g_u."""
  weights = tf.stop_gradient(weights)
  with tf.GradientTape() as tape:
    tape.watch(params)
    losses = batch_unit_losses_fn(params)
    # A [U, 1] against [U] would broadcast to U x U and sum unclipped terms.
    losses.shape.assert_is_compatible_with(weights.shape)
    total = tf.reduce_sum(weights * losses)
  grads = tape.gradient(
      total, params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
  return grads, losses


def clipped_gradient_sum(unit_loss_fn, batch_unit_losses_fn, params, units,
                         l2_norm_clip, rtol=1e-4):
  """Σ_u clip_C(g_u) for the units of one batch, and the forward outputs.

  Args:
    unit_loss_fn: ``(params, unit) -> (loss, aux)`` for one unit.
    batch_unit_losses_fn: ``(params, indices) -> [U]`` losses of one batched
      forward pass in which unit u is given the data of unit ``indices[u]``
      (the same values ``unit_loss_fn`` gives); or ``None`` where that is not
      exact (stochastic layers, data-dependent extra losses), to materialize
      the per-unit gradients instead.
    params: list of parameter tensors.
    units: nested structure of tensors with leading axis U.
    l2_norm_clip: C > 0.
    rtol: how closely the batched losses must match the per-unit ones.

  Returns:
    ``(ClippedSum, unit_losses [U], aux stacked over units)``.

  The re-weighted sum is used only if the batched pass reproduces every
  unit's loss of the per-unit pass (relative tolerance ``rtol``). If anything
  makes it differ (a layer or loss mixing examples, randomness Keras does not
  track) the sum is set to zero — the step releases noise only, so privacy
  holds — and ``mismatch`` is True for the caller to report. (A ``tf.cond``
  falling back to the materialized path would be exact, but under XLA it
  slowed every step of a CNN 2.5x.)

  In the re-weighted pass a unit whose norm is not finite gets weight 0 and
  the data of a finite unit, so its non-finite values cannot reach the sum
  (0 · nan is nan in a backward pass). Norms that overflow
  float32 (‖g‖ ≳ 1e19) count as non-finite there; the materialized path
  clips them exactly.
  """
  if batch_unit_losses_fn is None:
    return _materialized(unit_loss_fn, params, units, l2_norm_clip)

  norms, losses, aux = per_example.per_unit_norms(unit_loss_fn, params, units)
  ok = tf.math.is_finite(norms)
  factors = clip_factors(norms, l2_norm_clip)
  positions = tf.range(tf.shape(norms)[0])
  stand_in = tf.argmax(tf.cast(ok, tf.int32), output_type=positions.dtype)
  indices = tf.where(ok, positions, stand_in)
  grads, batch_losses = reweighted_gradient(
      lambda p: batch_unit_losses_fn(p, indices), params, factors)
  expected = tf.gather(losses, indices)
  same = tf.reduce_all(tf.abs(batch_losses - expected)
                       <= rtol * tf.abs(expected) + 1e-6)
  # Every unit non-finite: the stand-in is non-finite too; the sum is zero.
  use = same & tf.reduce_any(ok)
  grads = [tf.where(use, g, tf.zeros_like(g)) for g in grads]
  return (_summary(grads, norms, factors < 1.0, ok, mismatch=~same), losses,
          aux)


def _materialized(unit_loss_fn, params, units, l2_norm_clip):
  grads, losses, aux = per_example.per_unit_gradients(
      unit_loss_fn, params, units)
  return materialized_clipped_sum(grads, l2_norm_clip), losses, aux


def _summary(grads, norms, was_clipped, ok, mismatch=False):
  num_clipped = tf.reduce_sum(tf.cast(ok & was_clipped, tf.int32))
  num_nonfinite = tf.reduce_sum(tf.cast(~ok, tf.int32))
  return ClippedSum(list(grads), norms, num_clipped, num_nonfinite,
                    tf.convert_to_tensor(mismatch))


def _expand_as(per_unit, t):
  """[U] -> [U, 1, ..., 1] broadcastable against t of rank r."""
  return tf.reshape(per_unit, [-1] + [1] * (t.shape.rank - 1))
