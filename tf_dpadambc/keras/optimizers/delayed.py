"""DP² — delayed preconditioners (Li, Zaheer, Liu, Reddi, McMahan & Smith, ICLR 2023).

Training alternates two phases, s1 + s2 logical steps long:

* s1 DP-SGD steps on ḡ = (Σ clip_{C1}(g_u) + N(0, σ²C1²))/B, θ ← θ − η ḡ,
  summing the released ḡ into G;
* at the end of that phase the preconditioner is refreshed from the phase's
  average private gradient, A ← γA + (1-γ)(G/s1)² (RMSProp flavour) or
  A ← A + (G/s1)² (AdaGrad flavour);
* s2 adaptive steps that clip and noise the *preconditioned* per-example
  gradients s⊙g_u with s = 1/(√A + ε): ḡ = (Σ clip_{C2}(s⊙g_u) + N(0, σ²C2²))/B,
  θ ← θ − η ḡ.

A is built from released values only, and every step is a Gaussian mechanism
of multiplier σ relative to its own clip norm: privacy exactly DP-SGD's.
Scale-then-privatize is the extreme s1 = 0, s2 = 1 (Ganesh et al. 2025, §3.4).
"""
import keras
import tensorflow as tf

from tf_dpadambc.core import moments
from tf_dpadambc.core import updates
from tf_dpadambc.keras.optimizers import base
from tf_dpadambc.keras.optimizers import traits


class _DelayedPreconditioner(base.DPOptimizer):
  """DP² on any second-moment accumulator (``_decay``: γ, or None for a sum).

  Args:
    l2_norm_clip: C1, the clip norm of the DP-SGD phase (reference 0.1).
    noise_multiplier: σ, used in both phases.
    preconditioned_clip_norm: C2, the clip norm of the preconditioned
      gradients (reference 1.0; default C1).
    sgd_steps, adaptive_steps: s1 ≥ 1, s2 ≥ 1 (reference 100 each).
    epsilon: ε in s = 1/(√A + ε) (reference 1e-8).
    learning_rate: η of both phases.
  """

  TRAITS = traits.EstimatorTraits(releases_plain_sum=False)  # clips at s⊙g
  # The phase schedule and C2 set each step's sensitivity.
  FIXED = base.DPOptimizer.FIXED | {"preconditioned_clip_norm", "sgd_steps",
                                    "adaptive_steps"}
  _decay = None

  def __init__(self, l2_norm_clip, noise_multiplier, learning_rate=0.1,
               preconditioned_clip_norm=None, sgd_steps=100,
               adaptive_steps=100, epsilon=1e-8, **kwargs):
    if isinstance(l2_norm_clip, (list, tuple)):
      raise ValueError("DP² takes one clip norm per phase, not per layer.")
    if preconditioned_clip_norm is not None:
      preconditioned_clip_norm = base.check_positive(
          "preconditioned_clip_norm", preconditioned_clip_norm)
    sgd_steps = base.check_count("sgd_steps", sgd_steps)
    adaptive_steps = base.check_count("adaptive_steps", adaptive_steps)
    epsilon = base.check_positive("epsilon", epsilon)
    super().__init__(l2_norm_clip, noise_multiplier,
                     learning_rate=learning_rate, **kwargs)
    self.preconditioned_clip_norm = preconditioned_clip_norm
    self.sgd_steps, self.adaptive_steps = sgd_steps, adaptive_steps
    self.epsilon = epsilon

  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    self._gradient_sums, self._preconditioners = self.add_optimizer_variables(
        variables, ["dp2_gradient_sum", "dp2_preconditioner"])

  def _in_sgd_phase(self, step=None):
    step = self.iterations if step is None else step
    return step % (self.sgd_steps + self.adaptive_steps) < self.sgd_steps

  def _step_sensitivity(self):
    c2 = self.preconditioned_clip_norm or self.l2_norm_clip
    return tf.where(self._in_sgd_phase(), tf.constant(self.l2_norm_clip),
                    tf.constant(c2))

  def preconditioner(self, trainable_variables):
    """The scale s of the next step: 1 in the SGD phase, 1/(√A + ε) after."""
    sgd = self._in_sgd_phase()
    slots = [self._preconditioners[self._get_variable_index(v)]
             for v in trainable_variables]
    return [tf.where(sgd, tf.ones_like(a),
                     updates.preconditioner_scale(a.value, self.epsilon))
            for a in slots]

  def clip_spec(self, trainable_variables):
    spec = super().clip_spec(trainable_variables)
    return spec._replace(l2_norm_clip=self._step_sensitivity(),
                         scale=self.preconditioner(trainable_variables))

  def update_step(self, gradient, variable, learning_rate):
    index = self._get_variable_index(variable)
    lr = keras.ops.cast(learning_rate, variable.dtype)
    gradient = keras.ops.cast(gradient, variable.dtype)
    total, a = self._gradient_sums[index], self._preconditioners[index]
    step = self.iterations
    sgd = self._in_sgd_phase(step)
    self.assign(total, total + tf.where(sgd, gradient, tf.zeros_like(gradient)))
    cycle = self.sgd_steps + self.adaptive_steps
    phase_end = tf.equal(step % cycle, self.sgd_steps - 1)
    mean = total.value / self.sgd_steps
    self.assign(a, tf.where(phase_end,
                            moments.accumulate(a, tf.square(mean), self._decay),
                            a.value))
    self.assign(total, tf.where(phase_end, tf.zeros_like(mean), total.value))
    self.assign_sub(variable, lr * gradient)

  def get_config(self):
    config = super().get_config()
    config.update({
        "preconditioned_clip_norm": self.preconditioned_clip_norm,
        "sgd_steps": self.sgd_steps, "adaptive_steps": self.adaptive_steps,
        "epsilon": self.epsilon})
    return config


@base.register()
class DP2RMSProp(_DelayedPreconditioner):
  """DP² with an RMSProp preconditioner: A ← ρA + (1-ρ)(G/s1)² (Li et al. 2023).

  See the module docstring; ``rho`` is ρ (default 0.9).
  """

  def __init__(self, *args, rho=0.9, **kwargs):
    rho = base.check_decay("rho", rho)
    super().__init__(*args, **kwargs)
    self.rho = rho

  @property
  def _decay(self):
    return self.rho

  def get_config(self):
    config = super().get_config()
    config["rho"] = self.rho
    return config


@base.register()
class DP2Adagrad(_DelayedPreconditioner):
  """DP² with an AdaGrad preconditioner: A ← A + (G/s1)² (Li et al. 2023)."""
