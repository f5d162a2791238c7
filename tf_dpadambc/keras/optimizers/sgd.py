"""DP-SGD (Abadi et al. 2016), with optional (Nesterov) momentum."""
import keras

from tf_dpadambc.core import updates
from tf_dpadambc.keras.optimizers import base


@base.register()
class DPSGD(base.DPOptimizer):
  """DP-SGD: θ ← θ − η ḡ, or with momentum u ← μu − ηḡ, θ ← θ + u.

  ḡ = (Σ_u clip_C(g_u) + N(0, σ²C² I)) / B. The baseline every private Adam
  variant is compared with; the same privacy cost as all of them.

  Args:
    l2_norm_clip, noise_multiplier, num_microbatches,
    gradient_accumulation_steps, seed: see :class:`DPOptimizer`.
    learning_rate: η.
    momentum: μ in [0, 1).
    nesterov: Nesterov momentum, as ``keras.optimizers.SGD``.
  """

  def __init__(self, l2_norm_clip=None, noise_multiplier=None,
               learning_rate=0.01,
               momentum=0.0, nesterov=False, name="DPSGD", **kwargs):
    momentum = base.check_decay("momentum", momentum)
    super().__init__(l2_norm_clip, noise_multiplier,
                     learning_rate=learning_rate, name=name, **kwargs)
    self.momentum = float(momentum)
    self.nesterov = bool(nesterov)

  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    self._momentums = (self.add_optimizer_variables(variables, "momentum")
                       if self.momentum else [])

  def update_step(self, gradient, variable, learning_rate):
    lr = keras.ops.cast(learning_rate, variable.dtype)
    gradient = keras.ops.cast(gradient, variable.dtype)
    if not self.momentum:
      self.assign_sub(variable, lr * gradient)
      return
    u = self._momentums[self._get_variable_index(variable)]
    self.assign(u, updates.momentum_velocity(u, gradient, self.momentum, lr))
    step = (updates.momentum_velocity(u.value, gradient, self.momentum, lr)
            if self.nesterov else u.value)
    self.assign_add(variable, step)

  def get_config(self):
    config = super().get_config()
    config.update({"momentum": self.momentum, "nesterov": self.nesterov})
    return config
