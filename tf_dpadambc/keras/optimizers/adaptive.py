"""Adaptive private optimizers: a moment *family* composed with an *estimator*.

Every adaptive variant is one family, which says how the moments accumulate,

    Adam     m ← β1 m + (1-β1) ḡ,  v ← β2 v + (1-β2) x,  both debiased by 1-β^t
    RMSProp  v ← ρ v + (1-ρ) x                            (no m, no debiasing)
    AdaGrad  v ← v + x                                    (no m; v₀ = a₀)

composed with one estimator (``estimators.py``), which says what is released
and how the second moment x is privatized or corrected (post-processing, bias
correction, IME, JME, scale-then-privatize). A public class is one line of
composition, e.g. ``class DPAdamBC(BiasCorrection, AdamFamily)``.

For every composition the DP noise bias of the accumulator is tracked by the
same recursion applied to the per-step noise variance Var_t:

    Φ_t = estimate(accumulate(…, Var_t))      Adam: (1-β2)/(1-β2^t) Σ β2^{t-i} Var_i

which is (σC/B)² for Adam at a constant batch size, (1-ρ^t)(σC/B)² for RMSProp
and t(σC/B)² for AdaGrad (Tang et al. 2024, Eq. 2; Ganesh et al. 2025, §3.3).
"""
import keras
import tensorflow as tf

from tf_dpadambc.core import diagnostics
from tf_dpadambc.core import moments
from tf_dpadambc.keras.optimizers import base
from tf_dpadambc.keras.optimizers import traits


class Adaptive(base.DPOptimizer):
  """The moment-estimation stage shared by every adaptive private optimizer.

  Families set ``_first_decay`` (β1 or None), ``_second_decay`` (β or None
  for a running sum) and ``_debias``; estimators override
  :meth:`_second_moment_input`, :meth:`_direction` and :meth:`_statistics`.
  """

  TRAITS = traits.EstimatorTraits(diagnostics=(diagnostics.V_OVER_PHI,))
  _first_decay = None
  _second_decay = None
  _debias = False
  _initial_accumulator = 0.0

  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    self._momentums = (self.add_optimizer_variables(variables, "momentum")
                       if self._first_decay is not None else [])
    self._velocities = self.add_optimizer_variables(
        variables, "velocity",
        initializer=keras.initializers.Constant(self._initial_accumulator))
    # The DP bias of the accumulator v (before debiasing).
    self._noise_bias = self.add_variable((), initializer="zeros",
                                         dtype="float32", name="dp_noise_bias")

  def _on_private_step(self, ctx):
    super()._on_private_step(ctx)
    self._noise_bias.assign(moments.accumulate(
        self._noise_bias, ctx.release.noise_variance, self._second_decay))

  def _estimate(self, accumulator, step):
    """v̂ from the accumulator v at 1-based ``step`` (step 0: 0).

    v times a scalar, 1/(1 − β^t) (0 at step 0): a product XLA fuses into
    each consumer (the update and the diagnostics), where a full-size
    quotient and select were materialized on every step."""
    if not self._debias or self._second_decay is None:
      return accumulator
    step = tf.cast(step, accumulator.dtype)
    safe = tf.maximum(step, 1.0)
    factor = tf.where(step > 0, moments.debias_factor(
        self._second_decay, safe, accumulator.dtype), 0.0)
    return accumulator * factor

  def phi(self, step=None):
    """Φ_t, the DP noise bias of v̂ at (1-based) step t (default: the last)."""
    step = self.iterations if step is None else step
    return self._estimate(self._noise_bias.value, step)

  def second_moment(self, variable, step=None):
    """v̂ of one variable at (1-based) step t (default: the last step)."""
    step = self.iterations if step is None else step
    index = self._get_variable_index(variable)
    return self._estimate(self._velocities[index].value, step)

  def update_step(self, gradient, variable, learning_rate):
    index = self._get_variable_index(variable)
    dtype = variable.dtype
    lr = keras.ops.cast(learning_rate, dtype)
    gradient = keras.ops.cast(gradient, dtype)
    step = keras.ops.cast(self.iterations + 1, dtype)
    v = self._velocities[index]
    self.assign(v, moments.accumulate(
        v, keras.ops.cast(self._second_moment_input(index, gradient), dtype),
        self._second_decay))
    v_hat = self._estimate(v.value, step)
    first = gradient
    if self._first_decay is not None:
      m = self._momentums[index]
      self.assign(m, moments.ema(m, gradient, self._first_decay))
      first = (moments.debias(m.value, self._first_decay, step)
               if self._debias else m.value)
    phi = keras.ops.cast(self.phi(step), dtype)
    self.step_context.statistics.append(self._statistics(index, v_hat, phi))
    self.assign_sub(variable, lr * self._direction(first, v_hat, phi))

  # ------------------------------------------------------ estimator hooks
  def _second_moment_input(self, index, gradient):
    """x_t accumulated into v: ḡ² by default (post-processing)."""
    del index
    return keras.ops.square(gradient)

  def _direction(self, first, v_hat, phi):
    raise NotImplementedError

  def _statistics(self, index, v_hat, phi):
    del index
    return diagnostics.moment_statistics(v_hat, phi,
                                         negative=self._logs_negative)

  @property
  def _logs_negative(self):
    """Whether the step counts v̂ < 0 (only estimators whose v̂ can be)."""
    return diagnostics.NEGATIVE_V_FRACTION in self.traits.diagnostics


# ------------------------------------------------------------- families
class AdamFamily(Adaptive):
  """Adam's moments: β1-EMA of ḡ and β2-EMA of x, both debiased (Kingma & Ba).

  Args: beta_1, beta_2 in [0, 1).
  """
  _debias = True

  def __init__(self, *args, beta_1=0.9, beta_2=0.999, **kwargs):
    beta_1 = base.check_decay("beta_1", beta_1)
    beta_2 = base.check_decay("beta_2", beta_2)
    super().__init__(*args, **kwargs)
    self.beta_1, self.beta_2 = beta_1, beta_2

  @property
  def _first_decay(self):
    return self.beta_1

  @property
  def _second_decay(self):
    return self.beta_2

  def get_config(self):
    config = super().get_config()
    config.update({"beta_1": self.beta_1, "beta_2": self.beta_2})
    return config


class RMSPropFamily(Adaptive):
  """RMSProp's second moment: v ← ρ v + (1-ρ) x, not debiased (Hinton 2012).

  The step is η ḡ / (√v + ε) (ε outside the root, as in the papers; Keras'
  RMSprop puts it inside).

  Args: rho in [0, 1).
  """

  def __init__(self, *args, rho=0.9, **kwargs):
    rho = base.check_decay("rho", rho)
    super().__init__(*args, **kwargs)
    self.rho = rho

  @property
  def _second_decay(self):
    return self.rho

  def get_config(self):
    config = super().get_config()
    config["rho"] = self.rho
    return config


class AdagradFamily(Adaptive):
  """AdaGrad's second moment: v ← v + x from v₀ = a₀ (Duchi et al. 2011).

  Args: initial_accumulator_value a₀ ≥ 0 (Keras' default 0.1; the papers 0).
  """

  def __init__(self, *args, initial_accumulator_value=0.1, **kwargs):
    value = base.check_positive("initial_accumulator_value",
                                initial_accumulator_value, allow_zero=True)
    super().__init__(*args, **kwargs)
    self.initial_accumulator_value = value

  @property
  def _initial_accumulator(self):
    return self.initial_accumulator_value

  def get_config(self):
    config = super().get_config()
    config["initial_accumulator_value"] = self.initial_accumulator_value
    return config
