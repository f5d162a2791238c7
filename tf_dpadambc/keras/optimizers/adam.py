"""DP-Adam (post-processing) and DP-AdamBC (bias-corrected second moment)."""
import keras

from tf_dpadambc.core import moments
from tf_dpadambc.core import updates
from tf_dpadambc.keras.optimizers import base


class _AdamMoments(base.DPOptimizer):
  """Adam's two EMAs of the private gradient; subclasses give the direction."""

  def __init__(self, l2_norm_clip, noise_multiplier, learning_rate=0.001,
               beta_1=0.9, beta_2=0.999, **kwargs):
    for name, beta in (("beta_1", beta_1), ("beta_2", beta_2)):
      if not 0.0 <= beta < 1.0:
        raise ValueError(f"{name} must be in [0, 1); got {beta!r}.")
    super().__init__(l2_norm_clip, noise_multiplier,
                     learning_rate=learning_rate, **kwargs)
    self.beta_1 = float(beta_1)
    self.beta_2 = float(beta_2)

  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    self._momentums, self._velocities = self.add_optimizer_variables(
        variables, ["momentum", "velocity"])

  def update_step(self, gradient, variable, learning_rate):
    lr = keras.ops.cast(learning_rate, variable.dtype)
    gradient = keras.ops.cast(gradient, variable.dtype)
    step = keras.ops.cast(self.iterations + 1, variable.dtype)
    index = self._get_variable_index(variable)
    m, v = self._momentums[index], self._velocities[index]
    self.assign(m, moments.ema(m, gradient, self.beta_1))
    self.assign(v, moments.ema(v, keras.ops.square(gradient), self.beta_2))
    direction = self._direction(moments.debias(m.value, self.beta_1, step),
                                moments.debias(v.value, self.beta_2, step),
                                step)
    self.assign_sub(variable, lr * direction)

  def _direction(self, m_hat, v_hat, step):
    raise NotImplementedError

  def get_config(self):
    config = super().get_config()
    config.update({"beta_1": self.beta_1, "beta_2": self.beta_2})
    return config


@keras.saving.register_keras_serializable(package=base.PACKAGE)
class DPAdam(_AdamMoments):
  """DP-Adam by post-processing: Adam on the private mean gradient ḡ.

      m ← β1 m + (1-β1) ḡ;  v ← β2 v + (1-β2) ḡ²
      θ ← θ − η · m̂ / (√v̂ + ε)

  Privacy: exactly DP-SGD's (same σ, sampling rate and steps).
  E[v̂] = v̂^clean + Φ with Φ = (σC/B)²: when Φ dominates, this is DP-SGD with
  momentum under a decaying learning rate (Tang et al. 2024, Eq. 3). Algorithm
  5 of Ganesh, McMahan & Thakurta (2025).

  Args:
    l2_norm_clip, noise_multiplier, num_microbatches,
    gradient_accumulation_steps, seed: see :class:`DPOptimizer`.
    learning_rate: η.
    beta_1, beta_2: EMA decays of the first and second moments.
    epsilon: ε added to √v̂ (on the bias-corrected v̂, as in the paper).
  """

  def __init__(self, l2_norm_clip, noise_multiplier, learning_rate=0.001,
               beta_1=0.9, beta_2=0.999, epsilon=1e-7, name="DPAdam",
               **kwargs):
    epsilon = base.check_positive("epsilon", epsilon, allow_zero=True)
    super().__init__(l2_norm_clip, noise_multiplier,
                     learning_rate=learning_rate, beta_1=beta_1,
                     beta_2=beta_2, name=name, **kwargs)
    self.epsilon = epsilon

  def _direction(self, m_hat, v_hat, step):
    return updates.adam_direction(m_hat, v_hat, self.epsilon)

  def get_config(self):
    config = super().get_config()
    config["epsilon"] = self.epsilon
    return config


@keras.saving.register_keras_serializable(package=base.PACKAGE)
class DPAdamBC(_AdamMoments):
  """DP-AdamBC: Adam with the DP noise bias Φ removed from the second moment.

      θ ← θ − η · m̂ / sqrt(max(v̂ − Φ_t, γ'))

  with Φ_t = (1-β2)/(1-β2^t) Σ_{i≤t} β2^{t-i} (σC/B_i)², which is exactly
  Φ = (σC/B)² when every logical batch has B units (Tang, Shpilevskiy &
  Lécuyer, AAAI 2024, Algorithm 1; Algorithm 7 of Ganesh et al. 2025). Φ is
  subtracted after Adam's 1/(1−β2^t) correction; γ' is a floor, not an
  additive ε.

  Privacy: exactly DP-SGD's — Φ depends only on public σ, C, B, β2, t.
  Learning rates are typically 10–100x smaller than DP-Adam's, because the
  step is m̂/√γ' wherever v̂ − Φ < γ'. The papers tune γ' in 1e-10 … 5e-8
  (scale it with Φ).

  Args:
    l2_norm_clip, noise_multiplier, num_microbatches,
    gradient_accumulation_steps, seed: see :class:`DPOptimizer`.
    learning_rate: η.
    beta_1, beta_2: EMA decays of the first and second moments.
    gamma_prime: γ' > 0, the floor of the corrected second moment.
  """

  def __init__(self, l2_norm_clip, noise_multiplier, learning_rate=0.001,
               beta_1=0.9, beta_2=0.999, gamma_prime=1e-8, name="DPAdamBC",
               **kwargs):
    gamma_prime = base.check_positive("gamma_prime", gamma_prime)
    super().__init__(l2_norm_clip, noise_multiplier,
                     learning_rate=learning_rate, beta_1=beta_1,
                     beta_2=beta_2, name=name, **kwargs)
    self.gamma_prime = gamma_prime

  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    # EMA of the per-step noise variance; debiased like v it is Φ_t.
    self._noise_variance_ema = self.add_variable(
        (), initializer="zeros", dtype="float32", name="dp_phi_ema")

  def _on_private_step(self, noise_variance):
    self._noise_variance_ema.assign(
        moments.ema(self._noise_variance_ema, noise_variance, self.beta_2))

  def phi(self, step):
    """Φ_t, the DP bias of v̂_t subtracted at (1-based) step t."""
    return moments.debias(self._noise_variance_ema.value, self.beta_2, step)

  def _direction(self, m_hat, v_hat, step):
    phi = keras.ops.cast(self.phi(step), v_hat.dtype)
    return updates.bias_corrected_direction(m_hat, v_hat, phi,
                                            self.gamma_prime)

  def get_config(self):
    config = super().get_config()
    config["gamma_prime"] = self.gamma_prime
    return config
