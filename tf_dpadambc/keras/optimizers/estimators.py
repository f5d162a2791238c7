"""Second-moment estimators: how each variant privatizes or corrects v̂.

Each class here is one estimator of Ganesh, McMahan & Thakurta (2025, §3),
written once and composed with any family of ``adaptive.py`` (Adam, RMSProp,
AdaGrad). Privacy relative to DP-SGD with the same (σ, sampling, steps):

=======================  ===========================  =======================
estimator                released                     privacy
=======================  ===========================  =======================
PostProcessing           ḡ (Alg. 5)                   = DP-SGD
BiasCorrection           ḡ; subtracts Φ_t (Alg. 7)    = DP-SGD
IndependentMoments       ḡ, ḡ² at √2σ each (Alg. 6)   = DP-SGD
JointMoments             (Σclip g, √λ Σclip g²)       = DP-SGD (noise paid) or
                                                      reported σ/√(1+λC²)
ScaleThenPrivatize       Σ clip(s⊙g) (Alg. 8)         = DP-SGD
NoiselessPreconditioner  ḡ and the clean v (baseline) NOT private
=======================  ===========================  =======================
"""
import math
import warnings

import keras
import tensorflow as tf

from tf_dpadambc.core import diagnostics
from tf_dpadambc.core import noise
from tf_dpadambc.core import updates
from tf_dpadambc.keras.optimizers import adaptive
from tf_dpadambc.keras.optimizers import base


class _Epsilon(adaptive.Adaptive):
  """An additive stability ε in the denominator √v̂ + ε."""

  def __init__(self, *args, epsilon=1e-7, **kwargs):
    epsilon = base.check_positive("epsilon", epsilon, allow_zero=True)
    super().__init__(*args, **kwargs)
    self.epsilon = epsilon

  def get_config(self):
    config = super().get_config()
    config["epsilon"] = self.epsilon
    return config


class PostProcessing(_Epsilon):
  """The optimizer run on the private mean ḡ as a black box.

      Δ = first / (√v̂ + ε)           (v accumulates ḡ²)

  E[v̂] = v̂^clean + Φ_t: when Φ dominates, the step is ≈ first/√Φ, DP-SGD
  with momentum (Tang et al. 2024, Eq. 3). Ganesh et al. 2025, Algorithm 5.
  Privacy: exactly DP-SGD's.
  """

  def _direction(self, first, v_hat, phi):
    return updates.adam_direction(first, v_hat, self.epsilon)


class BiasCorrection(adaptive.Adaptive):
  """Subtract the DP noise bias Φ_t from v̂ (Tang, Shpilevskiy & Lécuyer 2024).

      Δ = first / sqrt(max(v̂ − Φ_t, γ'))

  Φ_t is tracked exactly for the family (see ``adaptive.py``); γ' is a floor,
  not an additive ε. Where v̂ − Φ_t < γ' the step is first/√γ' — tuned
  learning rates are smaller than post-processing's (1.4–10x in Tang et al.). Ganesh et al.
  2025, Algorithm 7. Privacy: exactly DP-SGD's (Φ depends only on σ, C, B, β).

  Logs ``dp_clamped_fraction``, the share of coordinates at the floor.

  Args: gamma_prime γ' > 0 (papers: 1e-10 … 5e-8; scale it with Φ).
  """

  TRAITS = adaptive.Adaptive.TRAITS.extend(
      diagnostics=(diagnostics.CLAMPED_FRACTION,), needs_noise_variance=True)

  def __init__(self, *args, gamma_prime=1e-8, **kwargs):
    gamma_prime = base.check_positive("gamma_prime", gamma_prime)
    super().__init__(*args, **kwargs)
    self.gamma_prime = gamma_prime

  def _direction(self, first, v_hat, phi):
    return updates.bias_corrected_direction(first, v_hat, phi,
                                            self.gamma_prime)

  def _statistics(self, index, v_hat, phi):
    return diagnostics.moment_statistics(v_hat, phi, floor=self.gamma_prime,
                                         negative=self._logs_negative)

  def get_config(self):
    config = super().get_config()
    config["gamma_prime"] = self.gamma_prime
    return config


class _UnbiasedSecondMoment(_Epsilon):
  """v accumulates a separately released, unbiased (possibly < 0) x_t.

  Δ = first / max(sqrt(max(v̂, 0)) + ε, floor). Where the noise drives v̂ to
  ≤ 0 the step is first/ε: with Adam's tiny ε it can blow up, which is how
  these estimators fail in high dimension (Ganesh et al. 2025, §4.4).
  ``denominator_floor`` (e.g. 1, as in their Fig. 2, or a multiple of √Φ)
  bounds it; the default 0 is Algorithm 6 as printed.
  """

  TRAITS = adaptive.Adaptive.TRAITS.extend(
      diagnostics=(diagnostics.NEGATIVE_V_FRACTION,),
      releases_plain_sum=False)

  def __init__(self, *args, denominator_floor=0.0, **kwargs):
    floor = base.check_positive("denominator_floor", denominator_floor,
                                allow_zero=True)
    super().__init__(*args, **kwargs)
    self.denominator_floor = floor

  def _second_moment_input(self, index, gradient):
    ctx = self.step_context
    return ctx.release.second[ctx.position(index)]

  def _direction(self, first, v_hat, phi):
    return updates.clamped_direction(first, v_hat, self.epsilon,
                                     self.denominator_floor)

  def get_config(self):
    config = super().get_config()
    config["denominator_floor"] = self.denominator_floor
    return config


class IndependentMoments(_UnbiasedSecondMoment):
  """Independent moment estimation, IME (Ganesh et al. 2025, Algorithm 6).

      x_t = ḡ_c² + (√2 σ (2B+1) C²/B²) z2,   ḡ = ḡ_c + (√2 σ C/B) z1

  with ḡ_c the clean mean of the clipped gradients: two Gaussian releases of
  multiplier √2σ, together exactly one of multiplier σ. Privacy: exactly
  DP-SGD's. v̂ is unbiased but can be negative: Δ = first/(sqrt(max(v̂,0))+ε).
  Good in low dimension (Ganesh et al. Fig. 2), poor in high dimension, where
  the (2B+1)C²/B² noise swamps ḡ². ``dp_v_over_phi`` compares v̂ with the
  variance 2(σC/B)² of the noise in ḡ.
  """

  TRAITS = _UnbiasedSecondMoment.TRAITS.extend(
      noise_streams=(0, 1),
      # ḡ²'s sensitivity (2B+1)C²/B² needs at most B units in the batch.
      poisson_unsupported=("IME: the sensitivity of its ḡ² release, "
                           "(2B+1)C²/B², holds only for batches of at most "
                           "B units, and a Poisson batch can be larger"))

  def _privatize(self, ctx, clipped_sum, clipped_square_sum, num_units):
    del clipped_square_sum
    first, second, variance = noise.independent_moment_release(
        clipped_sum, ctx.sensitivity, self.noise_multiplier, num_units,
        ctx.sample)
    return base.Release(first, second, variance)


ADJACENCIES = ("add_remove", "replace_one")


class JointMoments(_UnbiasedSecondMoment):
  """Joint moment estimation, JME (Kalinin, Upadhyay & Lampert 2025).

  One Gaussian release of (Σ_u clip(g_u), √λ Σ_u clip(g_u)²) (squares per
  unit), rescaled to ḡ and x_t = mean of clip(g_u)² (square-then-average).
  Its sensitivity depends on the adjacency notion:

  * ``"add_remove"`` (what dp-accounting's Poisson/RDP/PLD analysis assumes,
    the default): Δ = sqrt(C² + λC⁴). The noise std is σΔ, so the privacy is
    exactly DP-SGD's at σ — the extra sensitivity is paid with noise.
  * ``"replace_one"``: Δ = 2C, DP-SGD's own replace-one sensitivity, iff
    λ ≤ 1/(2C²) (checked): the noise std stays σC and JME is free relative to
    DP-SGD *under replace-one adjacency*. Our accounting is add/remove, so
    the reported DpEvent uses σ·C/sqrt(C² + λC⁴) — never the unpaid σ.

  Args:
    square_weight: λ > 0; default 1/(2C²) (the largest "free" value).
    adjacency: ``"add_remove"`` or ``"replace_one"``.
  Needs materialized per-unit gradients (the sum of squares is not a
  gradient): slower than the other estimators on large models.
  """

  TRAITS = _UnbiasedSecondMoment.TRAITS.extend(uses_square_sum=True,
                                               noise_streams=(0, 2))

  FIXED = adaptive.Adaptive.FIXED | {"square_weight", "adjacency"}

  def __init__(self, *args, square_weight=None, adjacency="add_remove",
               **kwargs):
    if adjacency not in ADJACENCIES:
      raise ValueError(f"adjacency must be one of {ADJACENCIES}; got "
                       f"{adjacency!r}.")
    if square_weight is not None:
      square_weight = base.check_positive("square_weight", square_weight)
    super().__init__(*args, **kwargs)
    if isinstance(self.l2_norm_clip, list):
      raise ValueError("JME does not support per-layer clip norms.")
    free = 1.0 / (2.0 * self.l2_norm_clip ** 2)
    if adjacency == "replace_one" and square_weight is not None and (
        square_weight > free * (1 + 1e-12)):
      raise ValueError(
          f"square_weight λ = {square_weight:g} > 1/(2C²) = {free:g}: under "
          "replace-one adjacency the joint release then has more sensitivity "
          "than DP-SGD's 2C. Use λ ≤ 1/(2C²) or adjacency='add_remove'.")
    self.square_weight = square_weight
    self.adjacency = adjacency

  @property
  def _lambda(self):
    return (self.square_weight if self.square_weight is not None
            else 1.0 / (2.0 * self.l2_norm_clip ** 2))

  @property
  def add_remove_sensitivity(self):
    """sqrt(C² + λC⁴): L2 change of the joint sum when one unit is added."""
    c = self.l2_norm_clip
    return math.sqrt(c ** 2 + self._lambda * c ** 4)

  @property
  def traits(self):
    if self.adjacency == "add_remove":
      return self.TRAITS  # the noise pays for the add/remove sensitivity
    return self.TRAITS.extend(
        accounting_noise_factor=self.l2_norm_clip / self.add_remove_sensitivity)

  @property
  def accounting_reason(self):
    """Why the accounted σ is below σ (for the privacy statement)."""
    if self.adjacency == "add_remove":
      return None
    return (f"JME with adjacency='replace_one' adds DP-SGD's noise σC, but "
            "the joint release (Σ clip g, √λ Σ clip g²) has add/remove "
            f"sensitivity sqrt(C² + λC⁴) = {self.add_remove_sensitivity:.4g}, "
            "which the add/remove accounting charges")

  def _privatize(self, ctx, clipped_sum, clipped_square_sum, num_units):
    sensitivity = (self.add_remove_sensitivity
                   if self.adjacency == "add_remove" else self.l2_norm_clip)
    first, second, variance = noise.joint_moment_release(
        clipped_sum, clipped_square_sum, self.noise_multiplier * sensitivity,
        self._lambda, num_units, ctx.sample)
    return base.Release(first, second, variance)

  def get_config(self):
    config = super().get_config()
    config.update({"square_weight": self.square_weight,
                   "adjacency": self.adjacency})
    return config


class ScaleThenPrivatize(_Epsilon):
  """Scale-then-privatize, STP (Ganesh et al. 2025, Algorithm 8; Li et al.).

      s_t = 1 / (sqrt(v̂_{t-1}) + ε_s1)
      g̃' = (Σ_u clip_C(s_t ⊙ g_u) + N(0, σ²C² I)) / B,    g̃ = g̃' / s_t

  then the family's ordinary step on g̃ (with ε = ε_s2). s_t depends only on
  released values, so the privacy is exactly DP-SGD's. In original
  coordinates the noise std is σC/(B s_t): small where v̂ is small. C bounds
  the *scaled* gradient and must be re-tuned (‖s⊙g‖ ≈ √(#params) when v̂
  tracks g²).

  First step: v̂_0 = 0 (AdaGrad: a₀) makes s_1 = 1/ε_s1 (1/(√a₀+ε_s1)) the
  same for every coordinate — step 1 is a DP-SGD step clipped at C·ε_s1 in
  original coordinates, after which s adapts. Choose ``scale_epsilon`` ε_s1
  much larger than Adam's ε (default 1e-3) so that rarely-updated coordinates
  are not scaled up without bound.

  Stability needs σC/B < 1: the noise in original coordinates grows with
  √v̂, so v̂ ≈ (σC/B)²(√v̂ + ε_s1)² has no fixed point when σC/B ≥ 1 and v̂
  grows without bound (observed: divergence at σC/B ≈ 4.7).

  ``dp_v_over_phi`` is computed in the scaled geometry (v̂ s_t² / Φ), where
  the noise is isotropic.

  Args: scale_epsilon ε_s1 > 0; epsilon ε_s2 ≥ 0.
  """

  TRAITS = _Epsilon.TRAITS.extend(releases_plain_sum=False)

  def __init__(self, *args, scale_epsilon=1e-3, **kwargs):
    scale_epsilon = base.check_positive("scale_epsilon", scale_epsilon)
    super().__init__(*args, **kwargs)
    self.scale_epsilon = scale_epsilon

  def preconditioner(self, trainable_variables):
    """s_t for the next step, one tensor per variable in ``trainable_variables``."""
    return [updates.preconditioner_scale(
        self._estimate(self._velocities[self._get_variable_index(v)].value,
                       self.iterations), self.scale_epsilon)
            for v in trainable_variables]

  def clip_spec(self, trainable_variables):
    spec = super().clip_spec(trainable_variables)
    return spec._replace(scale=self.preconditioner(trainable_variables))

  def _privatize(self, ctx, clipped_sum, clipped_square_sum, num_units):
    release = super()._privatize(ctx, clipped_sum, clipped_square_sum,
                                 num_units)
    ctx.scale = self.preconditioner(ctx.variables)
    return release._replace(first=[g / tf.cast(s, g.dtype) for g, s
                                   in zip(release.first, ctx.scale)])

  def _direction(self, first, v_hat, phi):
    return updates.adam_direction(first, v_hat, self.epsilon)

  def _statistics(self, index, v_hat, phi):
    ctx = self.step_context
    scale = keras.ops.cast(ctx.scale[ctx.position(index)], v_hat.dtype)
    return diagnostics.moment_statistics(v_hat * scale * scale, phi,
                                         negative=self._logs_negative)

  def get_config(self):
    config = super().get_config()
    config["scale_epsilon"] = self.scale_epsilon
    return config


class NoiselessPreconditioner(_Epsilon):
  """Research baseline, NOT private: noisy first moment, clean second moment.

  m accumulates the private ḡ but v accumulates the square of the clean mean
  of the clipped gradients, which is released without noise. It isolates
  the cost of privatizing v (Ganesh et al. 2025, §3 baselines); it has no
  ε: its privacy report says so and the accounting refuses it.
  """

  TRAITS = _Epsilon.TRAITS.extend(
      releases_plain_sum=False,
      not_private_reason=(
          "it is a research baseline whose second moment is computed from "
          "un-noised clipped gradients; it is not differentially private."))

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    warnings.warn(
        f"{self.__class__.__name__} is NOT differentially private: its "
        "second moment uses un-noised gradients. Use it only to study "
        "private optimizers, never to train on sensitive data.",
        UserWarning, stacklevel=2)

  def _privatize(self, ctx, clipped_sum, clipped_square_sum, num_units):
    release = super()._privatize(ctx, clipped_sum, clipped_square_sum,
                                 num_units)
    b = tf.cast(num_units, tf.float32)
    clean = [tf.square(s / tf.cast(b, s.dtype)) for s in clipped_sum]
    return release._replace(second=clean)

  _second_moment_input = _UnbiasedSecondMoment._second_moment_input

  def _direction(self, first, v_hat, phi):
    return updates.adam_direction(first, v_hat, self.epsilon)
