"""Closed-form results about DP-Adam from Tang, Shpilevskiy & Lécuyer (2024).

Pure NumPy, no TensorFlow graph: these functions describe an optimizer from
its public hyper-parameters (B, C, σ, β) and can be evaluated before training.

Notation: B is the logical batch size (the number of clipped units whose sum
is noised once; the expected size under Poisson sampling), C the clip norm,
σ the noise multiplier, t the 1-based step, and

    Φ = (σC/B)²

the per-coordinate variance of the noise in the private mean gradient ḡ,
which is also the bias of Adam's debiased second moment:
E[v̂_t] = v̂_t^clean + Φ (Tang et al. 2024, Eq. 2).
"""
import math

import numpy as np

from tf_dpadambc._checks import check_decay
from tf_dpadambc._checks import check_positive
from tf_dpadambc.core import moments


def _check_steps(step):
  """Steps as a float array (any shape); each an integer t ≥ 1."""
  steps = np.asarray(step)
  if steps.dtype == bool or not (np.issubdtype(steps.dtype, np.integer)
                                 or np.issubdtype(steps.dtype, np.floating)):
    raise ValueError(f"step must be an integer ≥ 1 or an array of them; got "
                     f"{step!r}.")
  steps = steps.astype(np.float64)
  if (steps.size == 0 or not np.all(np.isfinite(steps))
      or np.any(steps < 1) or np.any(steps != np.floor(steps))):
    raise ValueError(f"step must be an integer ≥ 1 (1-based) or an array of "
                     f"them; got {step!r}.")
  return steps


def _output(value):
  """A Python float for scalar results, else the array."""
  return float(value) if np.ndim(value) == 0 else value


def phi(batch_size, l2_norm_clip, noise_multiplier):
  """Φ = (σC/B)², the DP noise variance per coordinate of the private mean.

  Also the bias of DP-Adam's v̂ (Tang et al. 2024, Eq. 2), which DP-AdamBC
  subtracts. With per-layer clip norms C_k the isotropic noise has std
  σ‖(C_1, …, C_K)‖₂: pass that norm as ``l2_norm_clip``.

  Args:
    batch_size: B > 0, the logical batch size (clipped units per noise draw).
    l2_norm_clip: C > 0.
    noise_multiplier: σ ≥ 0.
  """
  batch_size = check_positive("batch_size", batch_size)
  l2_norm_clip = check_positive("l2_norm_clip", l2_norm_clip)
  noise_multiplier = check_positive("noise_multiplier", noise_multiplier,
                                     allow_zero=True)
  return float(moments.dp_noise_variance(noise_multiplier, l2_norm_clip,
                                         batch_size))


def dpsgdm_equivalent_learning_rate(adam_learning_rate, batch_size,
                                    l2_norm_clip, noise_multiplier, beta_1=0.9,
                                    step=None, epsilon=0.0):
  """The DP-SGD-with-momentum learning rate that DP-Adam amounts to.

  Tang, Shpilevskiy & Lécuyer (AAAI 2024), Eq. 3. When Φ = (σC/B)² dominates
  the clean second moment, DP-Adam's (post-processing, ``DPAdam``) v̂_t ≈ Φ
  and its step θ ← θ − η m̂_t/(√v̂_t + ε) becomes θ ← θ − η m̂_t/(√Φ + ε).
  Adam's debiased first moment is a rescaled heavy-ball buffer:

      m̂_t = (1-β1)/(1-β1^t) · b_t,
      b_t = β1 b_{t-1} + ḡ_t = Σ_{τ≤t} β1^{t-τ} ḡ_τ

  (the paper's DP-SGDM buffer, with no (1-β1) factor on ḡ; the paper prints
  the step as θ ← θ + η b and the relation inverted, b_t = (1-β)/(1-β^t) m̂_t,
  but its Eq. 3 follows from the above), so DP-Adam is θ ← θ − η_t b_t with

      η_t = η_Adam · (1-β1) / ((1-β1^t) · (√Φ + ε)).                  (Eq. 3)

  The paper states Eq. 3 with ε = 0 (the default here); pass ``DPAdam``'s
  ε (added to √v̂, as this library's DPAdam does) to include it. η_t
  decreases from η_Adam/(√Φ+ε) at t = 1 to η_Adam(1-β1)/(√Φ+ε) (``step=None``);
  e.g. 640·η_Adam for B = 256, C = 0.1, σ = 0.4, β1 = 0.9 (the paper's
  "≈ 0.645" at η_Adam = 1e-3). No β2 appears: v̂ is already debiased.

  Mapping to Keras's velocity form (``keras.optimizers.SGD``, ``DPSGD``):
  u ← μu − ηḡ, θ ← θ + u puts η inside the velocity. It reproduces
  θ ← θ − η_t b_t exactly (u_t = −η_t b_t at every step) iff at step t

      η = η_t (this function)   and   μ = μ_t = β1 η_t/η_{t-1}
                                            = β1 (1-β1^{t-1})/(1-β1^t)

  (:func:`dpsgdm_equivalent_momentum`). With a constant μ = β1 and the η_t
  schedule, the early gradients keep their large early rates in the velocity
  (ḡ_1 enters at η_1 = 10·η_∞ for β1 = 0.9) and the trajectory departs from
  DP-Adam's; with a constant μ, the constant rate η_∞ (``step=None``) is the
  closer approximation. Keras schedules see ``optimizer.iterations``, which is
  t − 1.

  Args:
    adam_learning_rate: η_Adam > 0.
    batch_size: B > 0, the logical batch size.
    l2_norm_clip: C > 0.
    noise_multiplier: σ ≥ 0 (σ = 0 needs ε > 0).
    beta_1: β1 in [0, 1), Adam's first-moment decay = the SGD momentum.
    step: ``None`` for the t → ∞ limit, or a 1-based step t, or an array of
      steps (returns the schedule, same shape).
    epsilon: ε ≥ 0 added to √v̂ by DP-Adam; 0 as in the paper.

  Returns:
    η_t: a float, or an array for an array of steps.
  """
  adam_learning_rate = check_positive("adam_learning_rate",
                                       adam_learning_rate)
  beta_1 = check_decay("beta_1", beta_1)
  epsilon = check_positive("epsilon", epsilon, allow_zero=True)
  denominator = math.sqrt(phi(batch_size, l2_norm_clip, noise_multiplier))
  denominator += epsilon
  if denominator == 0:
    raise ValueError("noise_multiplier = 0 and epsilon = 0: without DP noise "
                     "Φ = 0 and Eq. 3 is undefined (DP-Adam is then not "
                     "momentum SGD).")
  rate = adam_learning_rate * (1.0 - beta_1) / denominator
  if step is None:
    return rate
  steps = _check_steps(step)
  return _output(rate / (1.0 - beta_1**steps))


def dpsgdm_equivalent_momentum(beta_1=0.9, step=None):
  """μ_t = β1 (1-β1^{t-1}) / (1-β1^t): Keras-form momentum matching DP-Adam.

  With :func:`dpsgdm_equivalent_learning_rate`'s η_t, the velocity
  u_t = μ_t u_{t-1} − η_t ḡ_t equals −η_t b_t, so θ ← θ + u_t is exactly the
  Eq. 3 equivalent of DP-Adam (Tang et al. 2024) at every step. μ_1 = 0 (the
  velocity starts at zero anyway) and μ_t → β1 as t grows (``step=None``).

  Args:
    beta_1: β1 in [0, 1).
    step: ``None`` (the limit β1), a 1-based step, or an array of steps.
  """
  beta_1 = check_decay("beta_1", beta_1)
  if step is None:
    return beta_1
  steps = _check_steps(step)
  return _output(beta_1 * (1.0 - beta_1**(steps - 1)) / (1.0 - beta_1**steps))


def bias_correction_error_bound(batch_size, l2_norm_clip, noise_multiplier,
                                beta_2, step, alpha, *, nu_scale=4.0):
  """ξ with P[|v̂_t^corr − v̂_t^clean| ≥ ξ] ≤ α, per coordinate (Tang et al.).

  Tang, Shpilevskiy & Lécuyer (AAAI 2024), Proposition 3 (proof in
  Appendix C): for a fixed-in-advance sequence of parameters and batches,
  with Φ = (σC/B)², c_t = (1-β2)/(1-β2^t) and L = ln(2/α),

      ν = k·Φ·sqrt((1-β2^{2t}) / (1-β2²)),    b = 4Φ,
      δ = ν·sqrt(2L)   if ν·sqrt(2L) ≤ ν²/b   (sub-Gaussian branch)
      δ = 2b·L         otherwise              (sub-exponential branch)
      ξ = c_t·δ.

  It follows from Σ_τ β2^{t-τ}(z_τ² − Φ), z_τ ~ N(0, Φ), being
  sub-exponential with parameters (ν, b) and Wainwright's Proposition 2.9;
  the branch is the one whose range contains δ, so ξ is continuous in α.

  ``nu_scale`` is k: 4 as Proposition 3 is stated and as Table 3 is computed
  (the default); 2 is what the Appendix C proof derives (Lemma 1: a(X²−1) is
  sub-exponential with (2a, 4a)). Both are valid bounds; k = 2 is tighter.

  Scope: the proof bounds the squared-noise term c_t Σ β2^{t-τ}(z_τ² − Φ)
  only — v̂^corr − v̂^clean for a coordinate whose clean gradients are 0. The
  cross term c_t Σ β2^{t-τ} 2ḡ_τ z_τ (zero-mean Gaussian) is not included;
  Tang et al.'s Proposition 4 bounds both, with |ḡ| ≤ C.

  Table 3 (B = 256, C = 0.1, σ = 0.4, β2 = 0.999, α = 0.05) is reproduced:
  8.388e-08, 2.654e-08, 8.725e-09, 5.933e-09 at t = 10, 100, 1000, 10000.
  At α = 0.01, t = 10 the paper prints the sub-Gaussian value 1.005e-07
  although δ > ν²/b there; the proposition's case split gives 1.039e-07.

  Args:
    batch_size: B > 0, the logical batch size.
    l2_norm_clip: C > 0.
    noise_multiplier: σ ≥ 0 (σ = 0 gives 0).
    beta_2: β2 in [0, 1).
    step: a 1-based step t, or an array of steps.
    alpha: α in (0, 1), or an array (broadcast against ``step``).
    nu_scale: k > 0 in ν (keyword-only); see above.

  Returns:
    ξ: a float, or an array.
  """
  noise_variance = phi(batch_size, l2_norm_clip, noise_multiplier)
  beta_2 = check_decay("beta_2", beta_2)
  nu_scale = check_positive("nu_scale", nu_scale)
  steps = _check_steps(step)
  alphas = np.asarray(alpha)
  if (alphas.dtype == bool or not np.issubdtype(alphas.dtype, np.number)
      or alphas.size == 0 or not np.all((alphas > 0) & (alphas < 1))):
    raise ValueError(f"alpha must be in (0, 1); got {alpha!r}.")
  log_term = np.log(2.0 / alphas.astype(np.float64))
  # Σ_{τ≤t} β2^{2(t-τ)}: the sub-Gaussian parameters of the t terms add in
  # quadrature.
  squared_weights = (1.0 - beta_2**(2 * steps)) / (1.0 - beta_2**2)
  nu = nu_scale * noise_variance * np.sqrt(squared_weights)
  b = 4.0 * noise_variance
  sub_gaussian = nu * np.sqrt(2.0 * log_term)
  # ν·sqrt(2L) ≤ ν²/b  ⇔  2L·b² ≤ ν²; written without dividing by b = 0.
  delta = np.where(2.0 * log_term * b**2 <= nu**2, sub_gaussian,
                   2.0 * b * log_term)
  return _output((1.0 - beta_2) / (1.0 - beta_2**steps) * delta)
