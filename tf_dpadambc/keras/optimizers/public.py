"""Preconditioner from public data or side information (AdaDPS).

Li, Zaheer, Reddi & Smith, "Private adaptive optimization with side
information" (ICML 2022); Algorithm 9 of Ganesh et al. (2025):

    A      ← β2 A + (1-β2) ḡ_pub²       on public minibatches, every k steps
    s      = 1 / (sqrt(A) + ε)          (A starts at the first refresh's ḡ_pub²)
    ḡ      = (Σ_u clip_C(s ⊙ g_u) + N(0, σ²C² I)) / B
    m      ← β1 m + (1-β1) ḡ;   θ ← θ − η m̂

Public data costs no privacy, so the privacy is exactly DP-SGD's.
"""
import warnings

import keras
import numpy as np
import tensorflow as tf

from tf_dpadambc.core import moments
from tf_dpadambc.core import updates
from tf_dpadambc.keras import _compat
from tf_dpadambc.keras.optimizers import base
from tf_dpadambc.keras.optimizers import traits


@base.register()
class DPAdamPublicPreconditioner(base.DPOptimizer):
  """Momentum step on gradients preconditioned by public information (AdaDPS).

  Args:
    l2_norm_clip, noise_multiplier, ...: see
      :class:`~tf_dpadambc.keras.optimizers.base.DPOptimizer`; C bounds the
      *preconditioned* per-example gradient s⊙g_u.
    public_data: ``(x, y)`` arrays of public, in-distribution examples (no
      privacy cost). The train step of ``make_private`` refreshes A from a
      public minibatch every ``refresh_every`` steps (step 0 included). Not
      saved in the config: pass it again after loading.
    preconditioner: optional side information — one array per trainable
      variable used as A until the first public refresh (or throughout,
      without ``public_data``).
      ``set_preconditioner`` replaces it at any time (e.g. from a callback).
    refresh_every: k ≥ 1 steps between public refreshes.
    public_batch_size: size of each public minibatch.
    beta_1: momentum of the private step; beta_2: decay of A.
    epsilon: ε in s = 1/(√A + ε).
  """

  TRAITS = traits.EstimatorTraits(releases_plain_sum=False)  # clips at s⊙g

  def __init__(self, l2_norm_clip, noise_multiplier, learning_rate=0.001,
               public_data=None, preconditioner=None, refresh_every=100,
               public_batch_size=128, beta_1=0.9, beta_2=0.999, epsilon=1e-8,
               **kwargs):
    beta_1 = base.check_decay("beta_1", beta_1)
    beta_2 = base.check_decay("beta_2", beta_2)
    refresh_every = base.check_count("refresh_every", refresh_every)
    public_batch_size = base.check_count("public_batch_size", public_batch_size)
    epsilon = base.check_positive("epsilon", epsilon)
    if public_data is not None:
      if not (isinstance(public_data, (tuple, list)) and len(public_data) == 2):
        raise ValueError("public_data must be an (x, y) pair of arrays.")
      if len(public_data[0]) != len(public_data[1]) or not len(public_data[0]):
        raise ValueError("public_data: x and y must have the same, non-zero "
                         "number of examples.")
    super().__init__(l2_norm_clip, noise_multiplier,
                     learning_rate=learning_rate, **kwargs)
    self.public_data = public_data
    self._initial_preconditioner = preconditioner
    self.refresh_every, self.public_batch_size = refresh_every, public_batch_size
    self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), epsilon
    if public_data is None and preconditioner is None:
      warnings.warn(
          "DPAdamPublicPreconditioner without public_data or preconditioner: "
          "the preconditioner is 1 (plain DP-SGD with momentum) until "
          "set_preconditioner() is called.", UserWarning, stacklevel=2)

  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    self._momentums = self.add_optimizer_variables(variables, "momentum")
    self._public_moments = self.add_optimizer_variables(
        variables, "public_second_moment", initializer="ones")
    self._refreshes = self.add_variable((), initializer="zeros",
                                        dtype="int64", name="public_refreshes")
    if self._initial_preconditioner is not None:
      self.set_preconditioner(self._initial_preconditioner)

  def set_preconditioner(self, values):
    """Sets A to public side information, one array per trainable variable."""
    values = list(values)
    if len(values) != len(self._public_moments):
      raise ValueError(f"{len(values)} preconditioner arrays for "
                       f"{len(self._public_moments)} trainable variables.")
    for slot, value in zip(self._public_moments, values):
      value = np.asarray(value, dtype=slot.dtype)
      if value.shape != tuple(slot.shape) or np.any(value < 0):
        raise ValueError("Each preconditioner array must be ≥ 0 and shaped "
                         f"like its variable {tuple(slot.shape)}.")
      slot.assign(value)
    self._refreshes.assign(0)

  def refresh_due(self):
    """True at the start of the logical steps where A is refreshed.

    With gradient accumulation only the first physical batch of a logical
    step refreshes, so every physical batch of the step is clipped in the
    same geometry.
    """
    due = tf.equal(self.iterations % self.refresh_every, 0)
    if self.accumulation_steps > 1:
      due &= tf.equal(self._physical_step % self.accumulation_steps, 0)
    return due

  def replica_refusal(self):
    if self.public_data is not None:
      return "a public preconditioner"
    return super().replica_refusal()

  def before_step(self, model):
    """Every k steps (:meth:`refresh_due`), A from one public minibatch of
    ``public_data``. Public data costs no privacy: its gradient is neither
    clipped nor noised, and only A (never a private value) depends on it."""
    if self.public_data is None:
      return
    x_pub, y_pub = self.public_data
    size = min(self.public_batch_size, len(x_pub))
    if not self.built:
      self.build(model.trainable_variables)

    def refresh():
      seed = tf.stack([tf.cast(self.iterations, tf.int64),
                       tf.constant(0x9B1C, tf.int64)])
      index = tf.random.stateless_uniform([size], seed, 0, len(x_pub),
                                          dtype=tf.int64)
      xb = tf.gather(tf.constant(x_pub), index)
      yb = tf.gather(tf.constant(y_pub), index)
      with tf.GradientTape() as tape:
        loss = _compat.compiled_loss(model)(yb, model(xb, training=False),
                                            None)
      grads = tape.gradient(loss, model.trainable_variables,
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      self.observe_public_gradients(grads, model.trainable_variables)
      return tf.constant(True)

    tf.cond(self.refresh_due(), refresh, lambda: tf.constant(False))

  def observe_public_gradients(self, gradients, trainable_variables):
    """A ← β2 A + (1-β2) ḡ_pub² from one public minibatch's mean gradient."""
    slots = [self._public_moments[self._get_variable_index(v)]
             for v in trainable_variables]
    for slot, g in zip(slots, gradients):
      fresh = tf.equal(self._refreshes, 0)
      # The first refresh replaces the initial value instead of averaging
      # with it, so Â needs no 1/(1-β2^n) correction.
      slot.assign(tf.where(fresh, tf.square(g),
                           moments.ema(slot, tf.square(g), self.beta_2)))
    self._refreshes.assign_add(1)

  def preconditioner(self, trainable_variables):
    """s = 1/(sqrt(A) + ε), one tensor per variable in ``trainable_variables``."""
    return [updates.preconditioner_scale(
        self._public_moments[self._get_variable_index(v)].value, self.epsilon)
            for v in trainable_variables]

  def clip_spec(self, trainable_variables):
    spec = super().clip_spec(trainable_variables)
    return spec._replace(scale=self.preconditioner(trainable_variables))

  def update_step(self, gradient, variable, learning_rate):
    index = self._get_variable_index(variable)
    lr = keras.ops.cast(learning_rate, variable.dtype)
    gradient = keras.ops.cast(gradient, variable.dtype)
    step = keras.ops.cast(self.iterations + 1, variable.dtype)
    m = self._momentums[index]
    self.assign(m, moments.ema(m, gradient, self.beta_1))
    self.assign_sub(variable, lr * moments.debias(m.value, self.beta_1, step))

  def get_config(self):
    config = super().get_config()
    config.update({
        "refresh_every": self.refresh_every,
        "public_batch_size": self.public_batch_size,
        "beta_1": self.beta_1, "beta_2": self.beta_2,
        "epsilon": self.epsilon})
    return config
