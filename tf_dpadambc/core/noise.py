"""Stage 3 of the pipeline: the Gaussian mechanism.

One draw of N(0, σ²C² I) over all parameters per logical step, added to the
clipped sum Σ_u clip_C(g_u) (L2 sensitivity C), then divided by the number of
units B:

    ḡ = (Σ_u clip_C(g_u) + N(0, σ²C² I)) / B     per-coordinate std σC/B

Randomness is stateless and counter-based (``tf.random.stateless_normal``
keyed by (seed, step, parameter index)): it compiles under XLA, and with the
same seed step t draws the same noise. Whoever knows the seed can subtract the
noise, so the seed must stay secret: the optimizers draw one from the OS unless
given one, never save it, and draw a fresh one when restored (pass ``seed=``
again to reproduce a seeded run).
"""
import math
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


def independent_sampler(seed):
  """``sample(templates, stddev, stream=0)``: independent N(0, stddev²) noise.

  The sampler the releases below take: stream 0 draws with the step's
  ``seed``, a second release (stream k > 0) with :func:`sub_seed`. The
  correlated mechanisms (``tf_dpadambc.mechanisms``) provide samplers with the
  same signature.
  """
  def sample(templates, stddev, stream=0):
    return gaussian_noise_like(templates, stddev, stream_seed(seed, stream))
  return sample


def stream_seed(seed, stream):
  """The seed of release ``stream`` of a step: the step's own for stream 0."""
  return seed if stream == 0 else sub_seed(seed, stream)


def gaussian_release(clipped_sum, l2_norm_clip, noise_multiplier, num_units,
                     sample):
  """The private mean gradient ḡ = (Σ clip_C(g_u) + N(0, σ²C²I)) / B.

  Args:
    clipped_sum: list of tensors Σ_u clip_C(g_u).
    l2_norm_clip: sensitivity C of the sum (per-unit clip norm).
    noise_multiplier: σ ≥ 0.
    num_units: B, the number of clipped units in the (logical) batch.
    sample: the step's noise sampler, e.g. ``independent_sampler(seed)``.

  Returns:
    ``(noisy_mean, noise_variance)``: the list of tensors ḡ and the per-
    coordinate variance of the noise it carries, (σC/B)² — the Φ of
    Tang et al. 2024 (times the sampler's variance factor, for correlated
    noise).
  """
  stddev = tf.cast(noise_multiplier * l2_norm_clip, tf.float32)
  b = tf.cast(num_units, tf.float32)
  noise = sample(clipped_sum, stddev)
  noisy_mean = [(s + n) / tf.cast(b, s.dtype)
                for s, n in zip(clipped_sum, noise)]
  return noisy_mean, tf.square(stddev / b)


def sub_seed(seed, stream):
  """An independent seed for a second release in the same step."""
  return tf.random.experimental.stateless_fold_in(
      seed, tf.constant(0x5EC0 + stream, tf.int64))


def ime_square_sensitivity(l2_norm_clip, batch_size):
  """(2B+1)C²/B²: add/remove sensitivity of ḡ² with ḡ = Σ clip_C(g_u)/B.

  Adding one unit to B changes ((S + g)/B)² − (S/B)² = (2S⊙g + g²)/B², of
  L2 norm ≤ (2BC² + C²)/B² (Ganesh et al. 2025, §3.2 and Algorithm 6).
  """
  b = tf.cast(batch_size, tf.float32)
  return (2.0 * b + 1.0) * tf.square(tf.cast(l2_norm_clip, tf.float32)) / b**2


def independent_moment_release(clipped_sum, l2_norm_clip, noise_multiplier,
                               num_units, sample):
  """Independent moment estimation, IME (Ganesh et al. 2025, Algorithm 6).

  With ḡ = Σ_u clip_C(g_u)/B, two Gaussian releases of multiplier √2·σ each
  (together exactly one Gaussian mechanism of multiplier σ):

      first  = ḡ  + (√2 σ C/B) z1
      second = ḡ² + (√2 σ (2B+1) C²/B²) z2          z1, z2 ~ N(0, I)

  ``second`` is an unbiased estimate of ḡ² and can be negative. ``z1`` is the
  draw :func:`gaussian_release` makes with the same sampler; z2 is stream 1.

  Returns ``(first, second, first_noise_variance)``.
  """
  b = tf.cast(num_units, tf.float32)
  mean = [s / tf.cast(b, s.dtype) for s in clipped_sum]
  sigma = math.sqrt(2.0) * noise_multiplier
  first_std = sigma * tf.cast(l2_norm_clip, tf.float32) / b
  second_std = sigma * ime_square_sensitivity(l2_norm_clip, b)
  z1 = sample(mean, first_std)
  z2 = sample(mean, second_std, 1)
  first = [m + z for m, z in zip(mean, z1)]
  second = [tf.square(m) + z for m, z in zip(mean, z2)]
  return first, second, tf.square(first_std)


def joint_moment_release(clipped_sum, clipped_square_sum, noise_stddev,
                         square_weight, num_units, sample):
  """Joint moment estimation, JME (Kalinin, Upadhyay & Lampert 2025).

  One Gaussian release of the concatenation (Σ clip(g_u), √λ Σ clip(g_u)²)
  with noise std ``noise_stddev`` on every coordinate, rescaled:

      first  = (Σ clip(g_u) + N(0, std²)) / B
      second = (√λ Σ clip(g_u)² + N(0, std²)) / (√λ B)

  ``second`` estimates the mean of the squared clipped per-unit gradients
  (square-then-average) and can be negative. The caller chooses
  ``noise_stddev`` = σ·Δ for the sensitivity Δ of its adjacency notion.

  Returns ``(first, second, first_noise_variance)``.
  """
  b = tf.cast(num_units, tf.float32)
  root = math.sqrt(square_weight)
  z1 = sample(clipped_sum, noise_stddev)
  z2 = sample(clipped_sum, noise_stddev, 2)
  first = [(s + z) / tf.cast(b, s.dtype) for s, z in zip(clipped_sum, z1)]
  second = [(root * q + z) / tf.cast(root * b, q.dtype)
            for q, z in zip(clipped_square_sum, z2)]
  return first, second, tf.square(tf.cast(noise_stddev, tf.float32) / b)
