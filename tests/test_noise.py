"""The Gaussian sampler (core.noise.standard_normal): its distribution, its
trigonometry, and the same draws with and without XLA."""
import math

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tf_dpadambc.core import noise

SEED = tf.constant([20240511, 7], tf.int64)


def _xla(fn, *args):
  return tf.function(fn, jit_compile=True)(*args)


def test_sincos_within_1e7_and_never_zero_on_every_angle_drawn():
  """Exhaustive over the 2²³ angles u₂ = (k + ½)·2⁻²³ the sampler uses:
  within 1e-7 of sin and cos, and never exactly 0 (a zero would release a
  clipped sum's coordinate without noise)."""
  u = (tf.range(2**23, dtype=tf.float32) + 0.5) * 2.0**-23
  sin, cos = _xla(noise._sincos_2pi, u)  # pylint: disable=protected-access
  theta = 2 * np.pi * u.numpy().astype(np.float64)
  assert np.abs(sin.numpy() - np.sin(theta)).max() < 1e-7
  assert np.abs(cos.numpy() - np.cos(theta)).max() < 1e-7
  assert np.abs(sin.numpy()).max() <= 1.0 and np.abs(cos.numpy()).max() <= 1.0
  assert np.abs(sin.numpy()).min() > 0 and np.abs(cos.numpy()).min() > 0


def test_standard_normal_moments_tails_and_ks():
  n = 4_000_001  # odd: the last pair's second half is dropped
  z = _xla(lambda s: noise.standard_normal([n], s), SEED).numpy()
  assert z.shape == (n,) and z.dtype == np.float32 and np.isfinite(z).all()
  z = z.astype(np.float64)
  se = 1 / math.sqrt(n)
  assert abs(z.mean()) < 5 * se
  assert abs(z.std() - 1) < 5 * se / math.sqrt(2)
  assert abs(stats.skew(z)) < 5 * math.sqrt(6 / n)
  assert abs(stats.kurtosis(z)) < 5 * math.sqrt(24 / n)
  assert stats.kstest(z, "norm").pvalue > 1e-3
  for t in (1.0, 2.0, 3.0, 4.0):  # two-sided tail masses, binomial 5σ
    p = 2 * stats.norm.sf(t)
    assert abs((np.abs(z) > t).mean() - p) < 5 * math.sqrt(p * (1 - p) / n)
  # The two halves of a pair (r sin θ, r cos θ) are uncorrelated, and so
  # are r² and θ-parts: z₁² + z₂² = r² is χ²₂ (exponential, mean 2).
  half = (n + 7) // 8 * 4  # pairs in whole Philox blocks
  first, second = z[:n - half], z[half:]
  assert abs(np.corrcoef(first, second)[0, 1]) < 5 / math.sqrt(half)
  r2 = first**2 + second**2
  assert stats.kstest(r2, "expon", args=(0, 2)).pvalue > 1e-3


def test_standard_normal_is_box_muller_of_its_philox_words():
  """Each pair is (r sin 2πu₂, r cos 2πu₂) of the same two Philox words,
  the sines filling the first h = 4⌈n/8⌉ coordinates (pairs in whole
  Philox blocks: the last ≤ 7 draws are dropped): against a float64 NumPy
  transform of the words (float32 rounding and the 1e-7 polynomials)."""
  n = 10_001
  z = _xla(lambda s: noise.standard_normal([n], s), SEED).numpy()
  words = tf.random.stateless_uniform(
      [2, (n + 7) // 8 * 4], seed=SEED, minval=None, maxval=None,
      dtype=tf.uint32, alg="philox").numpy().astype(np.float64)
  u1 = (words[0] + 0.5) * 2.0**-32
  u2 = (np.floor(words[1] / 2**9) + 0.5) * 2.0**-23
  r = np.sqrt(-2 * np.log(u1))
  want = np.concatenate([r * np.sin(2 * np.pi * u2),
                         r * np.cos(2 * np.pi * u2)])[:n]
  np.testing.assert_allclose(z, want, rtol=0, atol=1e-5)


def test_radius_is_neither_clamped_nor_zero():
  """u₁ = (w + ½)·2⁻³² ∈ (0, 1): no atom at a clamped radius (the largest
  is √(2·33·ln 2) ≈ 6.76, at u₁ = 2⁻³³), and no zero radius where u₁
  rounds to 1 in float32 (the top 128 words: capped below 1). Against
  float64 logarithms of the exact uniforms, eagerly and under XLA."""
  words = np.array([0, 1, 2**20, 2**31 - 1, 2**31, 2**32 - 385,
                    2**32 - 129, 2**32 - 128, 2**32 - 1], np.uint64)
  exact = np.sqrt(-2 * np.log1p((words.astype(np.float64) + 0.5) * 2.0**-32
                                - 1))
  for log_u in (noise._log_uniform(tf.constant(words, tf.uint32)),  # pylint: disable=protected-access
                _xla(noise._log_uniform, tf.constant(words, tf.uint32))):  # pylint: disable=protected-access
    radius = np.sqrt(-2.0 * log_u.numpy().astype(np.float64))
    assert np.isfinite(radius).all() and radius.min() >= 3.4e-4
    np.testing.assert_allclose(radius[:5], exact[:5], rtol=1e-6)
    # Near 1 the float32 uniform is within 2⁻²⁴ of u₁: r² = −2 ln u₁ within
    # about 2·2⁻²⁴ of the exact (the capped top words included).
    assert np.abs(radius[5:]**2 - exact[5:]**2).max() <= 2 * 2.0**-23
  np.testing.assert_allclose(exact[0], math.sqrt(2 * 33 * math.log(2)),
                             rtol=1e-6)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5, 7), (784, 128)])
def test_same_draws_with_and_without_xla_and_by_seed(shape):
  eager = noise.standard_normal(shape, SEED).numpy()
  xla = _xla(lambda s: noise.standard_normal(shape, s), SEED).numpy()
  assert eager.shape == shape
  np.testing.assert_allclose(eager, xla, rtol=1e-5, atol=2e-6)
  np.testing.assert_array_equal(eager, noise.standard_normal(shape,
                                                             SEED).numpy())
  other = noise.standard_normal(shape, SEED + 1).numpy()
  assert not np.allclose(eager, other)


def test_gaussian_noise_like_scales_and_keeps_dtypes():
  templates = [tf.zeros((300, 200)), tf.zeros((9,), tf.bfloat16),
               tf.zeros((4, 4), tf.float64)]
  out = noise.gaussian_noise_like(templates, 2.5, SEED)
  assert [o.dtype for o in out] == [tf.float32, tf.bfloat16, tf.float64]
  assert [o.shape for o in out] == [t.shape for t in templates]
  big = out[0].numpy().astype(np.float64)
  assert abs(big.std() - 2.5) < 5 * 2.5 / math.sqrt(2 * big.size)
  # The float32-drawn tensors are consecutive pieces of one draw with
  # fold_in(seed, 0); the float64 one draws with fold_in(seed, j + 1).
  one = noise.standard_normal(
      [300 * 200 + 9], tf.random.experimental.stateless_fold_in(SEED, 0))
  np.testing.assert_allclose(out[0].numpy(),
                             2.5 * tf.reshape(one[:60000], (300, 200)),
                             rtol=1e-6)
  np.testing.assert_array_equal(
      out[1].numpy(), tf.cast(2.5 * one[60000:], tf.bfloat16).numpy())
  np.testing.assert_allclose(out[2].numpy(), tf.random.stateless_normal(
      (4, 4), tf.random.experimental.stateless_fold_in(SEED, 3), stddev=2.5,
      dtype=tf.float64, alg="philox").numpy())


def test_gaussian_noise_like_pieces_are_independent_and_reproducible():
  """The pieces of one draw: each N(0, 1), uncorrelated with the others,
  the same under XLA and eagerly and for the same seed, different for
  another seed."""
  templates = [tf.zeros((200, 150)), tf.zeros((30000,)), tf.zeros((1,))]
  out = [o.numpy().ravel() for o in noise.gaussian_noise_like(templates, 1.0,
                                                               SEED)]
  xla = tf.function(lambda s: noise.gaussian_noise_like(templates, 1.0, s),
                    jit_compile=True)(SEED)
  for a, b in zip(out, xla):
    np.testing.assert_allclose(a, b.numpy().ravel(), rtol=1e-5, atol=2e-6)
  for z in out[:2]:
    assert abs(z.mean()) < 5 / math.sqrt(z.size)
    assert abs(z.std() - 1) < 5 / math.sqrt(2 * z.size)
  assert abs(np.corrcoef(out[0][:30000], out[1])[0, 1]) < 5 / math.sqrt(30000)
  again = noise.gaussian_noise_like(templates, 1.0, SEED)
  other = noise.gaussian_noise_like(templates, 1.0, SEED + 1)
  np.testing.assert_array_equal(out[0], again[0].numpy().ravel())
  assert not np.allclose(out[1], other[1].numpy().ravel())
