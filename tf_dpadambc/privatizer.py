"""The privatization stage: one interface for every way a step is noised.

A DP optimizer holds exactly one :class:`Privatizer`, chosen once in its
constructor:

=============================================  ================================
privatizer                                     release of the clipped sum S_t
=============================================  ================================
``mechanisms.IndependentNoise`` (default)      (S_t + σΔ·z_t) / B   (DP-SGD)
``mechanisms.CorrelatedNoise(strategy, ...)``  (S_t + σΔ·sens(C)(C⁻¹z)_t) / B
``queries.QueryRelease(dpquery)``              get_noised_result(S_t) / B
=============================================  ================================

with S_t = Σ_u clip(g_u) over the logical step's units, Δ the clipping's
sensitivity and z_t ~ N(0, I) drawn from the secret seed for step t. The
optimizer hands each step a :class:`StepContext` and calls
:meth:`Privatizer.release`; it never asks which privatizer it holds, only
what the privatizer declares (:attr:`Privatizer.secret_stream`,
:attr:`Privatizer.replica_refusal`, :meth:`Privatizer.poisson_refusal`,
:attr:`Privatizer.clips_records`). :func:`release_once` is the guard around
every release: noise is never drawn twice for one step index with one seed,
and a secret stream never resumes mid-way. The DpEvent of the releases is
the accounting's (``accounting.run``).
"""
import collections
import dataclasses
from typing import Any, Callable

import tensorflow as tf

from tf_dpadambc.core import noise as core_noise

Release = collections.namedtuple("Release",
                                 ["first", "second", "noise_variance"])
Release.__doc__ = """What one logical step's privatization hands to the update.

first: the private mean gradient ḡ, one tensor per variable (what Keras'
  ``update_step`` receives).
second: None, or a separately released second-moment input per variable
  (independent / joint moment estimation).
noise_variance: per-coordinate variance of the noise in ``first``.
"""


@dataclasses.dataclass
class StepContext:
  """One logical step's release, as the hooks and ``update_step`` see it.

  Created by the optimizer's release (one per step, alive only while the
  step is traced) and handed to ``_privatize(ctx, ...)`` and
  ``_on_private_step(ctx)``; ``update_step`` reads it as
  ``self.step_context``.

  Attributes:
    variables: the variables updated this step, in the release's order.
    positions: optimizer variable index → position in the release.
    sample: ``sample(templates, stddev, stream=0)``, the step's noise
      (``core.noise``: counter-based seeds from the secret seed).
    sensitivity: Δ of the step's clipped sum (C, ‖(C_k)‖₂, DP²'s C1 or C2).
    noise_multiplier: σ (None with a DPQuery).
    state: the optimizer's :class:`~tf_dpadambc.keras.optimizers.state.PrivateState`.
    release: the :class:`Release`, once privatized.
    statistics: ``core.diagnostics.MomentStatistics`` reported by
      ``update_step`` (summarized after the step).
    scale: the preconditioner s_t the units were clipped under (STP), or None.
  """

  variables: list
  positions: dict
  sample: Callable
  sensitivity: Any
  noise_multiplier: Any
  state: Any
  release: Release = None
  statistics: list = dataclasses.field(default_factory=list)
  scale: list = None

  def position(self, index):
    """Position in this step's release of the variable of optimizer index i."""
    return self.positions[index]


class Privatizer:
  """The interface of a privatization stage (see the module docstring)."""

  # Each step continues a secret state (DP-MF's past noise, a DPQuery's state
  # not known to be public) that no file holds: a run cannot resume mid-way.
  secret_stream = False
  # Why the clipped sums of synchronous replicas cannot be added and released
  # once (state or noise per process), or None.
  replica_refusal = None
  # Clips every record itself (a DPQuery's preprocess_record): takes per-unit
  # records, or a sum clipped at its own clip norm, never another clipped sum.
  clips_records = False

  def adds_noise(self, noise_multiplier):
    """False where the release adds no noise (σ = 0: NOT private)."""
    return noise_multiplier > 0

  def poisson_refusal(self):
    """Why Poisson batches (normalised by the expected B) are unsound with
    this privatizer, or None."""
    return None

  def state_shape(self, shape):
    """Shape of the streaming state kept for a parameter of ``shape``, or None."""
    del shape
    return None

  def check_step_variables(self, indices, num_built):
    """Refuses a step over the optimizer variables ``indices`` (of
    ``num_built``) this privatizer cannot serve; any subset by default."""
    del indices, num_built

  def variance_factor(self, step):
    """Var of the step-t noise per coordinate, divided by (σΔ)²."""
    del step
    return tf.constant(1.0, tf.float32)

  def release(self, ctx, clipped_sum, num_units):
    """The private mean of one logical step: a :class:`Release`.

    Args:
      ctx: the :class:`StepContext`.
      clipped_sum: Σ_u clip(g_u), one tensor per variable (a DPQuery: its
        sample state).
      num_units: B, the units of the logical step (or the expected B).
    """
    del ctx, clipped_sum, num_units
    raise NotImplementedError


def release_once(state, step, secret_stream, release):
  """Runs ``release()`` for step index ``step`` at most once per seed.

  Never draws the noise of a step index twice with one seed, and refuses a
  secret noise stream (DP-MF) that does not continue where it stopped.
  ``state`` is the optimizer's ``PrivateState`` (seed, stream position).
  """
  state.traced = True  # see PrivateState.restart
  position = state.next_noise_step
  if not secret_stream:
    # A step index the current seed has drawn before: a restore rolled the
    # step counter back in this process (unseen by load_own_variables, e.g.
    # tf.train.Checkpoint.restore). Two releases with the same noise would
    # let their difference cancel it, so go on with a fresh secret seed
    # derived from the current one (in the compiled step: no OS).
    seed = state.seed_variable
    seed.assign(tf.where(
        step < position.value,
        tf.random.experimental.stateless_split(seed.value, 2)[1],
        seed.value))
    position.assign(step + 1)
    release()
    return
  state.check_stream_continues()  # eagerly, when the step is traced
  # The same check inside the step, for a restore into an optimizer whose
  # step is compiled already. It raises where the step is not compiled by
  # XLA; XLA drops asserts, and there the step is skipped: no noise, no
  # update, the step counter does not move (nothing is released).
  continues = tf.equal(step, position.value)
  checks = tf.debugging.Assert(continues, [
      "A noise stream cannot resume mid-stream: step", step,
      "but the stream is at", position.value])

  def release_and_advance():
    position.assign(step + 1)
    release()
    return tf.constant(True)

  with tf.control_dependencies([checks] if checks is not None else []):
    tf.cond(continues, release_and_advance, lambda: tf.constant(False))


def gaussian_release(ctx, clipped_sum, num_units):
  """DP-SGD's release through the step's noise: ḡ = (S + σΔ·noise) / B,
  Φ = (σΔ/B)² (``core.noise.gaussian_release``)."""
  noisy_mean, noise_variance = core_noise.gaussian_release(
      clipped_sum, ctx.sensitivity, ctx.noise_multiplier, num_units,
      ctx.sample)
  return Release(noisy_mean, None, noise_variance)
