"""Stage 3 of the pipeline: the Gaussian mechanism.

One draw of N(0, σ²C² I) over all parameters per logical step, added to the
clipped sum Σ_u clip_C(g_u) (L2 sensitivity C), then divided by the number of
units B:

    ḡ = (Σ_u clip_C(g_u) + N(0, σ²C² I)) / B     per-coordinate std σC/B

Randomness is stateless and counter-based (Philox words keyed by the seed and
the step, one draw a step cut into the parameters' pieces, turned into
normals by :func:`standard_normal`): it compiles under XLA, and with the same
seed step t draws the same noise (to float32 rounding), with or without
XLA. Whoever knows the seed can subtract the
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

  float32 tensors (and float16, bfloat16: drawn in float32) share one draw:
  :func:`standard_normal` of their total size with ``fold_in(seed, 0)``,
  cut into consecutive pieces in the order given (disjoint Philox counters,
  so the pieces are independent). One draw instead of one per tensor: the
  key derivation, the Philox call and the Box–Muller pass run once per
  step, not once per parameter tensor (under XLA on the CPU each is a
  kernel launch of its own). Other dtypes (float64): tensor j by
  ``tf.random.stateless_normal`` (Philox) with ``fold_in(seed, j + 1)``.
  Reproducible for a given seed and list of shapes.
  """
  out = [None] * len(tensors)
  drawn = [j for j, t in enumerate(tensors)
           if t.dtype in (tf.float32, tf.float16, tf.bfloat16)]
  if drawn:
    sizes = [_size(tensors[j]) for j in drawn]
    # Each piece starts at a multiple of _ALIGN: the consumers' vectorized
    # loops then read aligned slices (unaligned sizes made the draw 2x
    # slower under XLA on the CPU).
    padded = [n if j == len(sizes) - 1 else _aligned(n)
              for j, n in enumerate(sizes)]
    total = (sum(padded) if all(isinstance(n, int) for n in padded)
             else tf.add_n([tf.cast(n, tf.int32) for n in padded]))
    z = _standard_normal_flat(
        total, tf.cast(tf.random.experimental.stateless_fold_in(seed, 0),
                       tf.int64))
    scale = tf.cast(stddev, tf.float32)
    start = 0
    for j, n, step in zip(drawn, sizes, padded):
      t = tensors[j]
      piece = z[start:start + n]
      out[j] = tf.cast(tf.reshape(piece, tf.shape(t)) * scale, t.dtype)
      start = start + step
  for j, t in enumerate(tensors):
    if out[j] is None:
      out[j] = tf.random.stateless_normal(
          tf.shape(t), seed=tf.random.experimental.stateless_fold_in(
              seed, j + 1), stddev=tf.cast(stddev, t.dtype), dtype=t.dtype,
          alg="philox")
  return out


_ALIGN = 16


def _aligned(n):
  """n rounded up to a multiple of _ALIGN."""
  return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _size(t):
  """The number of elements of ``t``: an int where its shape is static."""
  shape = t.shape
  return (shape.num_elements() if shape.is_fully_defined()
          else tf.size(t, out_type=tf.int32))


@tf.function(input_signature=[tf.TensorSpec([], tf.int32),
                              tf.TensorSpec([2], tf.int64)], autograph=False)
def _standard_normal_flat(size, seed):
  """:func:`standard_normal` of shape [size], as a function traced once:
  its ~150 ops are built once per process instead of once per step trace;
  XLA inlines the call, with the call site's constant size."""
  return standard_normal(tf.reshape(size, [1]), seed)


def _sincos_2pi(u):
  """(sin 2πu, cos 2πu) of float32 u ∈ [0, 1), to within 1e-7 absolute.

  Exact reduction to a quadrant (q = 4u and q − round(q) are exact in
  float32), then Cephes' single-precision minimax polynomials on
  [−π/4, π/4] (``sinf``/``cosf``). XLA's ``sine``/``cosine`` on the CPU are
  scalar libm calls: these polynomials vectorize. Checked exhaustively on
  the 2²³ angles drawn here (tests/test_noise.py): error ≤ 1e-7, none 0.
  """
  q = 4.0 * u
  k = tf.round(q)
  x = (q - k) * (math.pi / 2)
  z = x * x
  s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z
       - 1.6666654611e-1) * z * x + x
  c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z
       + 4.166664568298827e-2) * z * z - 0.5 * z + 1.0
  quadrant = tf.cast(k, tf.int32)  # 0..4; sin(kπ/2 + x), cos(kπ/2 + x)
  odd = tf.equal(quadrant % 2, 1)
  sin, cos = tf.where(odd, c, s), tf.where(odd, s, c)
  sin = tf.where(tf.equal(quadrant % 4 // 2, 1), -sin, sin)
  cos = tf.where(tf.equal((quadrant + 1) % 4 // 2, 1), -cos, cos)
  return sin, cos


# The largest float32 below 1: the uniforms' float32 rounding, capped there.
_BELOW_ONE = 1.0 - 2.0 ** -24


def _log_uniform(words):
  """ln u₁ for u₁ = min((w + ½)·2⁻³², 1 − 2⁻²⁴) of uint32 words w: never 0.

  (w + ½)·2⁻³² rounds to 1 in float32 for the top 128 words (ln u₁ = 0: a
  zero radius); capped at the float below 1, they join the next rounding
  bucket (r ≈ 3.5e-4 instead of ≈ 2.4e-4, probability 2⁻²⁵): one min, no
  second logarithm.
  """
  u1 = (tf.cast(words, tf.float32) + 0.5) * 2.0 ** -32
  return tf.math.log(tf.minimum(u1, _BELOW_ONE))


def standard_normal(shape, seed):
  """N(0, 1) float32 noise of ``shape``, stateless (Philox bits), exact up
  to float32 rounding: the Box–Muller transform.

  h = 4⌈n/8⌉ pairs of 32-bit Philox words (``stateless_uniform`` of
  full-range uint32, keyed by ``seed``; whole Philox blocks of four words
  per row: sizes between them made XLA's CPU sampler 2x slower) give a
  radius and an angle:

      u₁ = (w₁ + ½)·2⁻³²  ∈ (0, 1)       r = √(−2 ln u₁)
                    (in float32, at most 1 − 2⁻²⁴)
      u₂ = (⌊w₂ / 2⁹⌋ + ½)·2⁻²³ ∈ (0, 1)  z = (r sin 2πu₂, r cos 2πu₂)

  — r·(sin, cos) of independent uniform u₁, u₂ is exactly a pair of
  independent N(0, 1) (Box & Muller 1958). The first halves of the pairs
  fill the first h coordinates, the second halves the rest (the last
  2h − n ≤ 7 are dropped).

  No draw is exactly 0 (a zero-noise coordinate would release its clipped
  sum exactly: where the neighbour's sum is 0 too, an event of unbounded
  privacy loss, as a review measured: 14 exact zeros in 10⁸ draws of the
  earlier sampler). In float32, u₁ rounds to 1 (r = 0) for the top 128
  words: it is capped at 1 − 2⁻²⁴ (r ≥ 3.4e-4, :func:`_log_uniform`); and
  the angles are the 2²³ midpoints (k + ½)·2⁻²³, none a multiple of π/2,
  so neither sine nor cosine is 0. u₁ is never 0 either: r reaches √(2·33·ln 2) ≈
  6.76, so the sampler's support is cut at a radius of probability
  e^{−r²/2} = 2⁻³³ per pair beyond it (TensorFlow's Philox normal clamps
  u₁ ≥ 1e-7: an atom of probability 2⁻²³ at r = 5.68, and nothing beyond).

  Why not ``tf.random.stateless_normal``: under XLA on the CPU its Box–
  Muller calls scalar ``sin``/``cos``/``log``, 2.3x slower than this
  (:func:`_sincos_2pi`); and eagerly it uses other bits than under XLA (so
  the same seed drew different noise with and without ``jit_compile``).
  This one is the same computation with and without XLA: the same Philox
  words, the transforms' float32 rounding within 2.4e-7 of each other.
  """
  shape = tf.convert_to_tensor(shape, tf.int32)
  n = tf.reduce_prod(shape)
  half = (n + 7) // 8 * 4  # ⌈n/2⌉ rounded up to whole Philox blocks
  words = tf.random.stateless_uniform(
      tf.stack([2, half]), seed=seed, minval=None, maxval=None,
      dtype=tf.uint32, alg="philox")
  radius = tf.sqrt(-2.0 * _log_uniform(words[0]))
  u2 = (tf.cast(tf.bitwise.right_shift(words[1], tf.constant(9, tf.uint32)),
                tf.float32) + 0.5) * 2.0 ** -23
  sin, cos = _sincos_2pi(u2)
  z = tf.reshape(tf.stack([radius * sin, radius * cos]), [-1])
  return tf.reshape(z[:n], shape)


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
  """(2B+1)C²/B²: sensitivity of ḡ² with ḡ = Σ clip_C(g_u)/B, B fixed.

  Zeroing out one unit (or adding one, the divisor B fixed as with Poisson
  batches) changes ((S + g)/B)² − (S/B)² = (2S⊙g + g²)/B², of L2 norm
  ≤ (2BC² + C²)/B² (Ganesh et al. 2025, §3.2 and Algorithm 6).
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
