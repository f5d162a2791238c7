"""Stage 2 of the pipeline: bound every unit's contribution by C.

    clip_C(g) = g · min(1, C / ‖g‖₂)

so that the sum over units has L2 sensitivity C when one unit is added,
removed or zeroed out (Abadi et al. 2016). A unit whose gradient is not finite contributes
exactly zero (it stays bounded) and is counted, so one bad example cannot
poison a step.

Σ_u clip_C(g_u) is formed here from materialized per-unit gradients
(U x model size); ``keras.ghost`` forms it from per-unit activations and
output gradients instead. Either way a unit's clip factor is computed from
exactly the values its contribution is built from, so the bound holds by
construction. (An earlier "re-weighted" path — per-unit norms, then one
backward pass of the batched loss Σ_u c_u ℓ_u — was removed: it was exact
only if the batched pass computed the per-unit gradients, which agreeing loss
values cannot prove.)

A :class:`ClipSpec` says how units are clipped: one global bound C (the
default), one bound C_k per parameter tensor ("per-layer"; sensitivity
‖(C_k)‖₂), automatic clipping (factor C/(‖g‖+γ), Bu et al. 2023), and a
per-coordinate scale s under which s⊙g_u is clipped (scale-then-privatize,
delayed and public preconditioners).
"""
import collections
import math

import tensorflow as tf

from tf_dpadambc.core import per_example
from tf_dpadambc.core import xla_hints

ClippedSum = collections.namedtuple(
    "ClippedSum",
    ["grads", "norms", "num_clipped", "num_nonfinite", "mismatch",
     "square_grads", "sensitivity"], defaults=[None, None])
ClippedSum.__doc__ = """Σ_u clip_C(g_u) with what the clipping did.

grads: list of tensors shaped like the parameters, Σ_u clip_C(g_u).
norms: [U] per-unit gradient norms before clipping (inf/nan where not finite).
num_clipped: number of units with ‖g_u‖ > C (scaled down).
num_nonfinite: number of units whose gradient was not finite (zeroed).
mismatch: True if the step could not be verified (the train step's
  batch-consistency check failed): a diagnostic the host raises on; the
  sums are released all the same (each unit was evaluated alone, and a
  release gated on a check of the whole batch would not be private).
square_grads: Σ_u clip(g_u)⊙clip(g_u) when the spec asks for it, else None.
sensitivity: the L2 bound of every unit's contribution to ``grads`` that
  the clipping guarantees — the :attr:`ClipSpec.sensitivity` it was clipped
  with (C, ‖(C_k)‖₂; a float or a scalar tensor, e.g. DP²'s phase-dependent
  bound). ``DPOptimizer.apply_private`` refuses (or, for a bound known only
  at run time, scales down) a sum whose bound exceeds the sensitivity its
  noise is calibrated to. None: not recorded — :func:`assume_clipped`
  without one, where the caller states the units were clipped at the
  optimizer's own bound.

Under a :class:`ClipSpec` with a scale s, ``grads`` is Σ_u clip(s⊙g_u), in
the scaled coordinates, ``norms`` are ‖s⊙g_u‖ and ``sensitivity`` is the
bound in those coordinates (the one the optimizer's noise is added in).
"""


def assume_clipped(grads, square_grads=None, sensitivity=None):
  """A :data:`ClippedSum` of sums the caller vouches for: Σ_u clip_C(g_u)
  (and Σ_u clip(g_u)² where JME needs it) computed elsewhere, e.g. by a
  pipeline that clips each unit itself, or known values in a test.

  ``DPOptimizer.apply_private`` releases only ClippedSums (this, or what
  ``private_gradient_sum``, :func:`materialized_clipped_sum` and
  ``apply_per_unit`` return), so that raw gradients are never released as
  if clipped by mistake: this function is the caller saying so by name.

  ``sensitivity``: the bound the caller clipped every unit to, checked
  against the optimizer's like a computed sum's. None (the default): the
  caller states that it is the bound the optimizer's noise is calibrated
  to, ``optimizer.clip_spec(variables).sensitivity`` of the step it is fed
  to (not checked: the statement is the caller's).
  """
  return ClippedSum(
      grads=list(grads), norms=None, num_clipped=0, num_nonfinite=0,
      mismatch=False,
      square_grads=None if square_grads is None else list(square_grads),
      sensitivity=None if sensitivity is None else recorded(sensitivity))


def recorded(sensitivity):
  """The ``ClippedSum.sensitivity`` of a sum clipped to ``sensitivity`` (a
  :attr:`ClipSpec.sensitivity`): a tensor as it is (the clipping used its
  value), a number as a float64 constant — exact, and kept so through a
  ``tf.function``'s outputs, which would round a Python float to float32
  (0.1 to 0.1000000015, above an optimizer's C = 0.1)."""
  if tf.is_tensor(sensitivity):
    return sensitivity
  return tf.constant(float(sensitivity), tf.float64)


def recorded_sensitivity(result):
  """The bound ``result`` (a :data:`ClippedSum`) records for each unit: a
  Python float where it is known when traced, else a float64 scalar tensor;
  None where none is recorded (:func:`assume_clipped`).

  Replicas' sums released together (``keras.replicas``) record one bound
  per replica: the largest (of this worker's) bounds them all."""
  bound = result.sensitivity
  if bound is None:
    return None
  if isinstance(bound, tf.distribute.DistributedValues):
    local = tf.distribute.get_strategy().experimental_local_results(bound)
  else:
    local = [bound]
  known = [static_scalar(b) for b in local]
  if all(k is not None for k in known):
    return max(known)
  return tf.reduce_max(tf.stack([tf.cast(b, tf.float64) for b in local]))


def static_scalar(value):
  """``value`` (a number or a scalar tensor) as a Python float where it is
  known when traced (eagerly, a constant), else None (a variable: what it
  holds when the step runs)."""
  if hasattr(value, "assign"):
    return None
  if tf.is_tensor(value):
    value = tf.get_static_value(value)
    if value is None:
      return None
  return float(value)


def rescaled_to(result, bound, sensitivity):
  """``result`` whose units are bound by ``bound``, each bound by
  ``sensitivity`` in the data flow (for bounds known only at run time).

  Σ_u x_u with every ‖x_u‖ ≤ b, times f = min(1, Δ/b), is a sum of units
  f·x_u, each ≤ Δ: the release calibrated to Δ is exactly private whatever
  the two bounds are when the step runs (an assert would not do: XLA drops
  it). f = 1 (bit for bit the same sum) where b ≤ Δ; 0 where b is not a
  number. The squares (JME) are the units' squares: scaled by f².
  The returned ClippedSum records ``sensitivity``.
  """
  bound = tf.cast(bound, tf.float64)
  target = tf.cast(sensitivity, tf.float64)
  factor = tf.where(bound <= target, tf.ones_like(target),
                    tf.where(bound > target, target / bound,
                             tf.zeros_like(target)))

  def scaled(tensors, f):
    if tensors is None:
      return None
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    return [t * tf.cast(f, t.dtype) for t in tensors]
  return result._replace(grads=scaled(result.grads, factor),
                         square_grads=scaled(result.square_grads,
                                             factor * factor),
                         sensitivity=sensitivity)


class ClipSpec(collections.namedtuple(
    "ClipSpec", ["l2_norm_clip", "layer_clips", "automatic_gamma", "scale",
                 "square_sum"], defaults=[None, None, None, False])):
  """How each unit's gradient is bounded.

  l2_norm_clip: C, the bound of the whole unit gradient (a float or scalar
    tensor). With ``layer_clips`` it is ignored for clipping.
  layer_clips: None, or one bound C_k per parameter tensor: each tensor of
    each unit is clipped to C_k, so the unit's norm is ≤ ‖(C_k)‖₂.
  automatic_gamma: None for clip_C(g) = g·min(1, C/‖g‖); γ > 0 for automatic
    clipping g·C/(‖g‖+γ) (Bu et al., NeurIPS 2023): every unit is rescaled,
    the norm stays < C.
  scale: None, or tensors s shaped like the parameters: the unit's gradient
    is s⊙g_u before it is clipped (Ganesh et al. 2025, Algorithm 8).
  square_sum: also return Σ_u clip(g_u)² (elementwise), for joint moment
    estimation.
  """

  @property
  def sensitivity(self):
    """The L2 bound of one unit's clipped contribution: C or ‖(C_k)‖₂."""
    if self.layer_clips is not None:
      return math.sqrt(sum(float(c) ** 2 for c in self.layer_clips))
    return self.l2_norm_clip


def as_spec(clip):
  """A :class:`ClipSpec` from a spec, a clip norm C, or per-layer bounds [C_k]."""
  if isinstance(clip, ClipSpec):
    return clip
  if isinstance(clip, (list, tuple)):
    return ClipSpec(None, list(clip))
  return ClipSpec(clip)


def _as(value, dtype):
  """``value`` in ``dtype``, a Python number converted directly (through
  float32, as ``tf.cast`` of a number goes, a γ below 1.2e-38 became 0 and
  a zero gradient's factor C/γ infinite)."""
  if isinstance(value, (int, float)):
    return tf.constant(value, dtype)
  return tf.cast(value, dtype)


def clip_factors(norms, l2_norm_clip, automatic_gamma=None):
  """c_u = min(1, C/‖g_u‖) (or C/(‖g_u‖+γ), automatic), 0 where not finite
  (an XLA that may assume values finite is refused:
  ``xla_hints.check_ieee_floats``)."""
  xla_hints.check_ieee_floats()
  norms = tf.convert_to_tensor(norms)
  clip = tf.cast(l2_norm_clip, norms.dtype)
  finite = tf.math.is_finite(norms)
  safe = tf.where(finite, norms, tf.ones_like(norms))
  if automatic_gamma is None:
    factors = tf.minimum(tf.ones_like(safe), clip / tf.maximum(safe, 1e-30))
  else:
    factors = clip / (safe + _as(automatic_gamma, norms.dtype))
  return tf.where(finite, factors, tf.zeros_like(norms))


def _scaled_norms(per_unit_grads):
  """‖g_u‖₂ = scale_u · ratio_u with scale_u = max |entry of g_u|, in float64.

  Scaling first gives an exact clip factor even for float64 gradients whose
  squares overflow. The ratio is a float64 sum of squares: in float32 a sum
  of n squares rounds by up to ≈n·2⁻²⁴ relative — the clipped unit could
  exceed C by that much (≈6% at a million parameters, worst case).
  ``ok_u`` is False for non-finite units.
  """
  def reduce_rest(fn, t):
    return fn(tf.reshape(t, [tf.shape(t)[0], -1]), axis=1)
  # The max of |entries| is exact in any dtype; float64 for the rest.
  scale = tf.reduce_max(tf.stack(
      [tf.cast(reduce_rest(tf.reduce_max, tf.abs(g)), tf.float64)
       for g in per_unit_grads]), axis=0)
  ok = tf.math.is_finite(scale)
  safe = tf.where(ok & (scale > 0), scale, tf.ones_like(scale))
  ratio = tf.sqrt(tf.add_n([
      reduce_rest(tf.reduce_sum, tf.square(_scaled(g, safe)))
      for g in per_unit_grads]))
  return safe, ratio, ok & tf.math.is_finite(ratio)


def _scaled(g, scale):
  """g_u / scale_u in float64 (exact up to one rounding of 2⁻⁵³)."""
  return tf.cast(g, tf.float64) / _expand_as(scale, g)


def per_unit_global_norms(per_unit_grads):
  """‖g_u‖₂ over all parameters for every unit u (leading axis), computed in
  float64 and returned in the first tensor's dtype; inf/nan if not finite."""
  scale, ratio, ok = _scaled_norms(per_unit_grads)
  norms = tf.where(ok, scale * ratio, tf.constant(float("nan"), tf.float64))
  return tf.cast(norms, per_unit_grads[0].dtype)


def clip_per_unit(per_unit_grads, l2_norm_clip, automatic_gamma=None):
  """Clips each unit's gradient (leading axis) to L2 norm ≤ C.

  Returns ``(clipped, norms, was_clipped, ok)``: the clipped unit gradients
  in float64 (:func:`sum_dtype`; norm, factor and product all in float64,
  so ‖clipped_u‖ ≤ C to ≈2⁻⁵⁰ relative), the norms in the gradients' dtype;
  non-finite units (``ok`` False) come back as exact zeros.
  ``automatic_gamma``: see :class:`ClipSpec`.
  """
  xla_hints.check_ieee_floats()
  scale, ratio, ok = _scaled_norms(per_unit_grads)
  clip = tf.cast(l2_norm_clip, tf.float64)
  # g·min(1, C/(s·r)) = (g/s)·min(s, C/r): no overflowing norm and no
  # denormal factor for huge finite gradients.
  if automatic_gamma is None:
    bounded_scale = tf.minimum(scale, clip / tf.maximum(ratio, 1e-300))
  else:  # g·C/(s·r + γ) = (g/s)·C/(r + γ/s)
    bounded_scale = clip / (ratio + _as(automatic_gamma, tf.float64)
                            / scale)
  factors = tf.where(ok, bounded_scale, tf.zeros_like(scale))
  # multiply_no_nan: 0 · inf and 0 · nan are 0, so a zeroed unit is exactly 0.
  clipped = [tf.math.multiply_no_nan(_scaled(g, scale), _expand_as(factors, g))
             for g in per_unit_grads]
  norms = tf.cast(scale * ratio, per_unit_grads[0].dtype)
  return clipped, norms, ok & (bounded_scale < scale), ok


def materialized_clipped_sum(per_unit_grads, clip):
  """Σ_u clip(g_u) from materialized per-unit gradients.

  ``clip`` is a clip norm C or a :class:`ClipSpec` (scale, per-layer bounds,
  automatic clipping, sum of squares).
  """
  spec = as_spec(clip)
  if spec.scale is not None:
    per_unit_grads = [g * tf.cast(s, g.dtype)[None]
                      for g, s in zip(per_unit_grads, spec.scale)]
  if spec.layer_clips is None:
    clipped, norms, was_clipped, ok = clip_per_unit(
        per_unit_grads, spec.l2_norm_clip, spec.automatic_gamma)
  else:
    if len(spec.layer_clips) != len(per_unit_grads):
      raise ValueError(
          f"{len(spec.layer_clips)} per-layer clip norms for "
          f"{len(per_unit_grads)} trainable variables: give one per variable.")
    parts = [clip_per_unit([g], c, spec.automatic_gamma)
             for g, c in zip(per_unit_grads, spec.layer_clips)]
    clipped = [p[0][0] for p in parts]
    # A unit is dropped whole if any of its tensors is not finite.
    ok = tf.reduce_all(tf.stack([p[3] for p in parts]), axis=0)
    clipped = [tf.where(_expand_as(ok, c), c, tf.zeros_like(c))
               for c in clipped]
    norms = per_unit_global_norms(per_unit_grads)
    was_clipped = tf.reduce_any(tf.stack([p[2] for p in parts]), axis=0)
  squares = ([_sum_over_units(tf.square(c)) for c in clipped]
             if spec.square_sum else None)
  # Every clipped unit is ≤ C (‖(C_k)‖₂ per layer) to ≈2⁻⁵⁰ relative, in
  # float64 (clip_per_unit), and summed in float64: the spec's bound.
  return _summary([_sum_over_units(c) for c in clipped], norms,
                  was_clipped, ok, square_grads=squares,
                  sensitivity=recorded(spec.sensitivity))


def _sum_over_units(t):
  """Σ_u t_u accumulated in float64, in :func:`sum_dtype` of t's: a float32
  sum of U terms rounds by up to ≈U·2⁻²⁴·Σ_u‖t_u‖, which no unit's clip
  pays for (as ``core.ghost.weighted_sum``)."""
  return tf.cast(tf.reduce_sum(tf.cast(t, tf.float64), axis=0),
                 sum_dtype(t.dtype))


def sum_dtype(dtype):
  """The dtype a clipped sum is held in until the noise is added: float64
  for floating-point variables.

  Rounding a sum before the noise is not post-processing: it moves the sum
  by up to 2⁻ᵖ·Σ_u‖x_u‖ (p: the dtype's significand bits), data-dependently,
  which the sensitivity C does not cover — ≈U·2⁻²⁴·C in float32 (adding one
  of 250 identical units moved a float32 sum by 1.00001C), and for float16
  or bfloat16 variables (a pure low-precision policy) up to 1.03C and 1.24C
  in the same test. In float64 it is ≈U·2⁻⁵³·C, the precision every norm is
  computed in. The noise is drawn in the variable's dtype, added in float64,
  and the noisy mean is rounded to the variable's dtype after
  (post-processing)."""
  dtype = tf.as_dtype(dtype)
  return tf.float64 if dtype.is_floating else dtype


def clipped_gradient_sum(unit_loss_fn, params, units, clip):
  """Σ_u clip_C(g_u) for the units of one batch, and the forward outputs.

  Args:
    unit_loss_fn: ``(params, unit) -> (loss, aux)`` for one unit.
    params: list of parameter tensors.
    units: nested structure of tensors with leading axis U.
    clip: C > 0, or a :class:`ClipSpec`.

  Returns:
    ``(ClippedSum, unit_losses [U], aux stacked over units)``. Each unit's
    gradient is computed from that unit alone (``tf.vectorized_map``),
    clipped, and summed.
  """
  return _materialized(unit_loss_fn, params, units, as_spec(clip))


def losses_agree(batch_losses, unit_losses, rtol=1e-4):
  """True if a batched pass gave every unit the loss it gets alone.

  Relative tolerance ``rtol`` (plus 1e-6); a loss that is not finite in both
  passes agrees (its unit is zeroed anyway).
  """
  close = tf.abs(batch_losses - unit_losses) <= rtol * tf.abs(unit_losses) + 1e-6
  both_nonfinite = ~tf.math.is_finite(batch_losses) & ~tf.math.is_finite(
      unit_losses)
  return tf.reduce_all(close | both_nonfinite)


def _materialized(unit_loss_fn, params, units, spec):
  grads, losses, aux = per_example.per_unit_gradients(
      unit_loss_fn, params, units)
  return materialized_clipped_sum(grads, spec), losses, aux


def _summary(grads, norms, was_clipped, ok, mismatch=False, square_grads=None,
             sensitivity=None):
  num_clipped = tf.reduce_sum(tf.cast(ok & was_clipped, tf.int32))
  num_nonfinite = tf.reduce_sum(tf.cast(~ok, tf.int32))
  return ClippedSum(list(grads), norms, num_clipped, num_nonfinite,
                    tf.convert_to_tensor(mismatch), square_grads, sensitivity)


def _expand_as(per_unit, t):
  """[U] -> [U, 1, ..., 1] broadcastable against t of rank r."""
  return tf.reshape(per_unit, [-1] + [1] * (t.shape.rank - 1))
