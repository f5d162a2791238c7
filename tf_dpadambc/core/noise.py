"""Stage 3 of the pipeline: the Gaussian mechanism.

One draw of N(0, σ²C² I) over all parameters per logical step, added to the
clipped sum Σ_u clip_C(g_u) (L2 sensitivity C), then divided by the number of
units B:

    ḡ = (Σ_u clip_C(g_u) + N(0, σ²C² I)) / B     per-coordinate std σC/B

Randomness is stateless and counter-based (``tf.random.stateless_normal``
keyed by (seed, step, parameter index)): it compiles under XLA, and a run
restored from a checkpoint at step t draws exactly the noise the uninterrupted
run would have. Whoever knows the seed can subtract the noise, so the seed must
stay secret (the optimizers draw one from the OS unless given one).
"""
import secrets

import tensorflow as tf


def random_seed():
  """A fresh secret seed from the operating system's CSPRNG."""
  return [secrets.randbits(62), secrets.randbits(62)]


def step_seed(seed, step):
  """The seed of logical step ``step``: fold the step counter into ``seed``."""
  return tf.random.experimental.stateless_fold_in(
      tf.cast(seed, tf.int64), tf.cast(step, tf.int64))


def gaussian_noise_like(tensors, stddev, seed):
  """Independent N(0, stddev²) noise shaped like each tensor in ``tensors``.

  Tensor j uses ``fold_in(seed, j)``, so the draws are independent across
  parameters and reproducible for a given seed.
  """
  return [
      tf.random.stateless_normal(
          tf.shape(t), seed=tf.random.experimental.stateless_fold_in(seed, j),
          stddev=tf.cast(stddev, t.dtype), dtype=t.dtype,
          # Explicit Philox: the auto-selected algorithm is ~6x slower under
          # XLA on CPU; Philox is also what runs outside XLA (same noise).
          alg="philox")
      for j, t in enumerate(tensors)]


def gaussian_release(clipped_sum, l2_norm_clip, noise_multiplier, num_units,
                     seed):
  """The private mean gradient ḡ = (Σ clip_C(g_u) + N(0, σ²C²I)) / B.

  Args:
    clipped_sum: list of tensors Σ_u clip_C(g_u).
    l2_norm_clip: sensitivity C of the sum (per-unit clip norm).
    noise_multiplier: σ ≥ 0.
    num_units: B, the number of clipped units in the (logical) batch.
    seed: the step's seed, from :func:`step_seed`.

  Returns:
    ``(noisy_mean, noise_variance)``: the list of tensors ḡ and the per-
    coordinate variance of the noise it carries, (σC/B)² — the Φ of
    Tang et al. 2024.
  """
  stddev = tf.cast(noise_multiplier * l2_norm_clip, tf.float32)
  b = tf.cast(num_units, tf.float32)
  noise = gaussian_noise_like(clipped_sum, stddev, seed)
  noisy_mean = [(s + n) / tf.cast(b, s.dtype)
                for s, n in zip(clipped_sum, noise)]
  return noisy_mean, tf.square(stddev / b)
