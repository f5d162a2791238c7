"""Stage 1, fast path: per-unit gradient norms and clipped sums of linear layers
from their inputs and output gradients (ghost clipping, book-keeping).

A linear-type layer computes z = a W (+ b) at T positions per example (T = 1
for a Dense on vectors; sequence steps; a convolution's output pixels, with
``a`` its input patches; an embedding's tokens, with ``a`` one-hot rows).
With δ = ∂L/∂z from one batched backward pass of L = Σ_u ℓ_u, unit u's weight
gradient is ∇W_u = A_uᵀ Δ_u (A_u: [T, p], Δ_u: [T, d]). Its squared norm is

    ‖A_uᵀΔ_u‖²_F = ‖a_u‖²·‖δ_u‖²                           (T = 1)
                 = ⟨A_uA_uᵀ, Δ_uΔ_uᵀ⟩   (ghost norm, O(T²(p+d)))
                 = Σ_{pd} (A_uᵀΔ_u)²    (materialized,  O(Tpd))

(Goodfellow 2015; Li et al. 2022 "mixed ghost clipping" picks the cheaper of
the last two per layer: 2T² vs pd). Once every unit's clip factor c_u is
known, the clipped sum needs no second backward pass (Bu et al. 2023,
"book-keeping"): Σ_u c_u ∇W_u = Aᵀ (c ⊙ Δ), one matrix product over the batch.

Everything here is a pure function of tensors. A *unit* is an example or a
microbatch of b examples: a microbatch's gradient is the sum of its examples'
gradients, so its positions are simply its examples' positions concatenated
(:func:`group_units` reshapes [B, T, ·] to [U, bT, ·]).

Scale-then-privatize clips s ⊙ ∇W_u; for T = 1 the norm stays a product:
‖s ⊙ (a_u δ_uᵀ)‖² = (a_u⊙a_u)ᵀ (s⊙s) (δ_u⊙δ_u) (Ganesh et al. 2025); for T > 1
the per-unit gradients are materialized.
"""
import collections
import math
import os

import tensorflow as tf

from tf_dpadambc.core import clipping
from tf_dpadambc.core import unit_chunks
from tf_dpadambc.core import xla_hints


def group_units(t, num_microbatches=None):
  """[B, ...middle, last] -> [U, T, last]: a unit's positions side by side.

  ``num_microbatches=None``: one example per unit, T = the product of the
  middle axes (static). Otherwise U = M microbatches of B/M examples each and
  T = (B/M)·(middle). Rank 1 (e.g. token ids [B]) becomes [U, T].
  """
  t = tf.convert_to_tensor(t)
  last = [] if t.shape.rank == 1 else [tf.shape(t)[-1]]
  if num_microbatches is None:
    middle = t.shape[1:t.shape.rank - len(last)]
    if middle.is_fully_defined():  # keep T static: it picks the method
      return tf.reshape(t, [-1, middle.num_elements()] + last)
    return tf.reshape(t, [tf.shape(t)[0], -1] + last)
  return tf.reshape(t, [num_microbatches, -1] + last)


def per_unit_sum(t, num_microbatches=None):
  """[B, ...] per-example values -> [U, ...] per-unit sums."""
  if num_microbatches is None:
    return t
  return tf.reduce_sum(tf.reshape(
      t, tf.concat([[num_microbatches, -1], tf.shape(t)[1:]], 0)), axis=1)


def sum_squares(t):
  """Σ of squares over every axis but the first, in float64: [U, ...] -> [U].

  float64, because the squares of float32 values neither underflow nor
  overflow there (a norm flushed to 0 would leave a unit unclipped).
  """
  t = tf.cast(t, tf.float64)
  return tf.reduce_sum(tf.square(tf.reshape(t, [tf.shape(t)[0], -1])), axis=1)


def _sum_last(t):
  """Σ over the last axis of a float64 tensor: [..., n] -> [...].

  As a product with a vector of ones where n is static: XLA's CPU float64
  reduction (split into windows of 32) of a Dense layer's [256, 784] inputs
  took 2x as long as the matrix-vector product. Either way a float64 sum of
  n terms (in another order: the rounding bound is the same). Not where the
  reduction fuses with what produces its input (convolution patches): the
  product needs its input in memory, and CNN steps were 10% slower."""
  n = t.shape[-1]
  if n is None:
    return tf.reduce_sum(t, axis=-1)
  flat = tf.reshape(t, [-1, n])
  return tf.reshape(tf.matmul(flat, tf.ones([n, 1], t.dtype)),
                    tf.shape(t)[:-1])


def prefer_ghost(positions, fan_in, fan_out):
  """Li et al.'s rule: ghost norm if 2T² < p·d (smaller work and memory)."""
  return positions == 1 or 2 * positions * positions < fan_in * fan_out


# guarded: a kept float64 squared norm is above GUARD_MARGIN times its
# worst-case rounding error.
GUARD_MARGIN = 2.0 ** 21


def guarded(sq_norms, bound, terms):
  """The squared norms, never below what rounding can explain.

  ``bound`` [U] is an upper bound of the norm (the triangle inequality:
  Σ_t ‖a_t‖‖δ_t‖); ``terms``, how many products each float64 result sums.
  The float64 result's rounding error is at most ≈ terms·2⁻⁵³·bound² (each
  of its products is bounded by the triangle terms), so a result kept above
  GUARD_MARGIN times that is within 1/GUARD_MARGIN = 2⁻²¹ of the true
  squared norm: the unit is clipped at most 2⁻²² above C. Below it —
  cancellation a unit can provoke with rows that nearly cancel — the bound
  is used instead: the unit is clipped as if its norm were the bound, never
  less. (A margin of 1000, as first written, let a kept norm be 5·10⁻⁴ low.)
  The margin costs nothing on ordinary data: a unit's squared norm is about
  bound²/T for T random positions, far above terms·2⁻³³·bound².
  """
  sq_norms = tf.cast(sq_norms, tf.float64)
  bound_sq = tf.square(tf.cast(bound, tf.float64))
  tolerance = GUARD_MARGIN * float(terms) * 2.0 ** -53
  return tf.where(sq_norms >= tolerance * bound_sq, sq_norms, bound_sq)


def _row_norms(t):
  """[U, T, f] -> [U, T] Euclidean norms of the rows, float64."""
  return tf.sqrt(tf.reduce_sum(tf.square(tf.cast(t, tf.float64)), axis=-1))


def linear_sq_norms(a, delta, scale=None):
  """‖A_uᵀΔ_u‖²_F (or ‖s ⊙ A_uᵀΔ_u‖²_F) for every unit: [U, T, p], [U, T, d] -> [U].

  The method is chosen from the static shapes (:func:`prefer_ghost`);
  ``scale`` (shape [p, d]) forces materialization unless T = 1. A unit
  whose rows nearly cancel, or whose values are tiny or huge, is never
  clipped by a norm below its own (the sum, book-kept from the same a and δ,
  would then carry more than C): the ghost norm of float32 inputs is a
  certified upper bound from float32 Gram matrices
  (:func:`gram_sq_norms_upper`), every other result float64 and
  :func:`guarded`.
  """
  a, delta = tf.convert_to_tensor(a), tf.convert_to_tensor(delta)
  positions, fan_in, fan_out = a.shape[1], a.shape[2], delta.shape[2]
  ghost_norm = scale is None and positions is not None and positions > 1 and (
      prefer_ghost(positions, fan_in, fan_out))
  if ghost_norm and float32_gram_applies(a, delta):
    upper = gram_sq_norms_upper(a, delta)
    # Overflow (or a non-finite a or δ, dropped downstream either way): the
    # triangle bound, in float64 (cast in the branch: only there is it run).
    return tf.cond(
        tf.reduce_all(tf.math.is_finite(upper)), lambda: upper,
        lambda: tf.where(tf.math.is_finite(upper), upper, _triangle_sq_upper(
            tf.cast(a, tf.float64), tf.cast(delta, tf.float64))))
  a64, delta64 = tf.cast(a, tf.float64), tf.cast(delta, tf.float64)
  if positions == 1:  # sums of squares: no cancellation
    a64, delta64 = a64[:, 0], delta64[:, 0]
    if scale is None:
      return _sum_last(tf.square(a64)) * _sum_last(tf.square(delta64))
    # (a⊙a)ᵀ (s⊙s) (δ⊙δ), one [U, p] x [p, d] product.
    return tf.reduce_sum(
        tf.matmul(tf.square(a64), tf.square(tf.cast(scale, tf.float64)))
        * tf.square(delta64), axis=1)
  bound = _triangle_bound(a64, delta64)
  if scale is not None:
    bound *= tf.reduce_max(tf.abs(tf.cast(scale, tf.float64)))
  terms = (positions or 1024) ** 2 + (fan_in or 0) + (fan_out or 0)
  if ghost_norm:
    gram_a = tf.matmul(a64, a64, transpose_b=True)
    gram_d = tf.matmul(delta64, delta64, transpose_b=True)
    return guarded(tf.reduce_sum(gram_a * gram_d, axis=[1, 2]), bound, terms)
  grads = unit_linear_grads(a, delta)
  if scale is not None:
    grads *= tf.cast(scale, grads.dtype)
  return guarded(sum_squares(grads), bound, terms)


# The float32 ghost norm (gram_sq_norms_upper): at most this many positions,
# so that each float64 sum of its T² terms rounds by less than 2⁻³⁰ of the
# sum of their magnitudes.
FLOAT32_GRAM_MAX_POSITIONS = 2048
# ... and at most this many features a side: γ_n = nu/(1 − nu) bounds n
# roundings only for nu < 1, and the bounds below take γ_n < 0.07 (1 + γ_n ≤ 2,
# 1/(1 − γ_n) finite); above 2²⁴ a review made γ negative and a norm 0.
FLOAT32_GRAM_MAX_LENGTH = 1 << 20
# Every float32 operation: fl(x ∘ y) = (x ∘ y)(1 + ε) + η, |ε| ≤ 2⁻²⁴ and
# |η| < 2⁻¹²⁶ (a result flushed to zero), and an input below 2⁻¹²⁶ may be
# read as zero (the CPU's FTZ/DAZ under XLA; a GPU's ftz).
_F32_UNDERFLOW = 2.0 ** -126


def float32_products_exact():
  """False where float32 products may run in a lower precision than
  float32's (a GPU with TensorFloat-32 enabled: inputs rounded to 2⁻¹¹;
  :func:`_reduced_float32_precision`), whose rounding no γ_n bounds.
  Read when a step is traced: a setting changed later is not seen."""
  if tf.config.experimental.tensor_float_32_execution_enabled() and (
      tf.config.list_logical_devices("GPU")):
    return False
  return not _reduced_float32_precision()


def float32_gram_applies(a, delta):
  """Whether :func:`linear_sq_norms` takes :func:`gram_sq_norms_upper`:
  neither side float64, T static and at most FLOAT32_GRAM_MAX_POSITIONS,
  p and d static and at most FLOAT32_GRAM_MAX_LENGTH, and float32 products
  exact (:func:`float32_products_exact`)."""
  positions, fan_in, fan_out = a.shape[1], a.shape[2], delta.shape[2]
  return (a.dtype != tf.float64 and delta.dtype != tf.float64
          and positions is not None
          and positions <= FLOAT32_GRAM_MAX_POSITIONS
          and fan_in is not None and fan_in <= FLOAT32_GRAM_MAX_LENGTH
          and fan_out is not None and fan_out <= FLOAT32_GRAM_MAX_LENGTH
          and float32_products_exact())


def _gamma32(n):
  """Higham's γ_n = nu/(1 − nu) for float32 (u = 2⁻²⁴), n ≤ 2²⁰."""
  if not 0 <= n <= 1 << 20:
    raise ValueError(f"γ_n of float32 for n = {n}: at most 2²⁰ roundings")
  return n * 2.0 ** -24 / (1.0 - n * 2.0 ** -24)


def _gram_error(r, n):
  """[U, T, T] bounds of |Ĝ_ts − G_ts|, Ĝ = fl(X Xᵀ) the float32 Gram
  matrix of rows x_t of length n, r_t ≥ ‖x_t‖: the products and additions
  γ_n·Σ_i|x_ti x_si| ≤ γ_n r_t r_s (Cauchy–Schwarz; any summation order or
  blocking, with or without FMA); the results flushed to zero (n products, n
  additions, < 2⁻¹²⁶ each) and the inputs read as zero (|x_ti| < 2⁻¹²⁶
  drops at most 2⁻¹²⁶|x_si|: Σ_i ≤ 2⁻¹²⁶√n·r_s), doubled for the roundings
  they then pass through (1 + γ_n ≤ 2: n ≤ FLOAT32_GRAM_MAX_LENGTH)."""
  outer = r[:, :, None] * r[:, None, :]
  return (_gamma32(n) * outer + 2.0 * _F32_UNDERFLOW * (
      2.0 * n + math.sqrt(n) * (r[:, :, None] + r[:, None, :])))


def _gram_row_norms(g, n):
  """r_t ≥ ‖x_t‖ from the Gram matrix's diagonal Ĝ_tt = fl(‖x_t‖²), in
  float64: ‖x_t‖² ≤ (Ĝ_tt + 2n·2⁻¹²⁶)/(1 − γ_n) (a sum of squares:
  relative rounding, plus what underflow drops), raised by 2⁻⁴⁰ for the
  float64 arithmetic here."""
  diag = tf.cast(tf.linalg.diag_part(g), tf.float64)
  return tf.sqrt((diag + 2.0 * n * _F32_UNDERFLOW)
                 / (1.0 - _gamma32(n))) * (1.0 + 2.0 ** -40)


def gram_sq_norms_upper(a, delta):
  """An upper bound of ‖A_uᵀΔ_u‖²_F from float32 Gram matrices: [U, T, p],
  [U, T, d] -> [U] float64 (inf or NaN where they overflow, or a or δ is
  not finite).

  The ghost norm N = Σ_ts G^a_ts G^δ_ts, with Ĝ^a = fl(A Aᵀ) and
  Ĝ^δ = fl(Δ Δᵀ) float32 products (of float32 inputs: casts from 16-bit
  floats are exact) and everything after in float64, where the product of
  two float32 values is exact. With E^a ≥ |Ĝ^a − G^a| and
  E^δ ≥ |Ĝ^δ − G^δ| elementwise (:func:`_gram_error`, from row-norm bounds
  r^a, r^δ read off the diagonals, :func:`_gram_row_norms`),

      |Σ_ts Ĝ^a Ĝ^δ − N| ≤ Σ_ts |Ĝ^a| E^δ + |Ĝ^δ| E^a + E^a E^δ

  (ĜaĜδ − GaGδ = Ĝa(Ĝδ − Gδ) + Gδ(Ĝa − Ga), |Gδ| ≤ |Ĝδ| + Eδ), and the
  float64 sum of the T² products rounds by < 2⁻³⁰ Σ_ts|Ĝ^a Ĝ^δ|. The result
  N̂ + (those)·(1 + 2⁻²⁰) is ≥ N whatever the data: the unit is never
  clipped by a norm below its own (the sum, book-kept in float64 from the
  same a and δ, carries A_uᵀΔ_u), with no guard (:func:`guarded`) to fall
  back on. The price is the bound's excess over N, about (γ_p + γ_d)·N for
  rows of a that are far from parallel (|Ĝ^a_ts| ≪ r_t r_s off the
  diagonal), at most about 2(γ_p + γ_d)·(Σ_t r^a_t r^δ_t)² (the rounded
  sum may itself be above N by its error): 2–5·10⁻⁴ of the squared norm
  on CIFAR CNN5's third convolution (p = 576, d = 128), where the float64
  Gram matrices took about 50 of a 470 ms step on the CPU.
  """
  a = tf.cast(a, tf.float32)
  delta = tf.cast(delta, tf.float32)
  fan_in, fan_out = a.shape[2], delta.shape[2]
  gram_a = tf.matmul(a, a, transpose_b=True)
  gram_d = tf.matmul(delta, delta, transpose_b=True)
  err_a = _gram_error(_gram_row_norms(gram_a, fan_in), fan_in)
  err_d = _gram_error(_gram_row_norms(gram_d, fan_out), fan_out)
  gram_a, gram_d = tf.cast(gram_a, tf.float64), tf.cast(gram_d, tf.float64)
  products = gram_a * gram_d
  error = tf.reduce_sum(tf.abs(gram_a) * err_d + tf.abs(gram_d) * err_a
                        + err_a * err_d + 2.0 ** -30 * tf.abs(products),
                        axis=[1, 2])
  return tf.maximum(tf.reduce_sum(products, axis=[1, 2])
                    + error * (1.0 + 2.0 ** -20), 0.0)


def _triangle_bound(a64, delta64):
  """Σ_t ‖a_t‖‖δ_t‖ ≥ ‖A_uᵀΔ_u‖_F (the triangle inequality), float64."""
  return tf.reduce_sum(_row_norms(a64) * _row_norms(delta64), axis=1)


def _triangle_sq_upper(a64, delta64):
  """(Σ_t ‖a_t‖‖δ_t‖)², never below ‖A_uᵀΔ_u‖²_F of the float32 values:
  each row norm raised by √n·2⁻¹²⁶ (a cast from float32 may read a value
  below 2⁻¹²⁶ as zero) and the result by its float64 rounding (the row
  sums of n squares, T products: ≈ (n + T)·2⁻⁵³ relative)."""
  positions, fan_in, fan_out = (a64.shape[1] or 1 << 20, a64.shape[2] or 0,
                                delta64.shape[2] or 0)
  rows = lambda t, n: _row_norms(t) + math.sqrt(n) * _F32_UNDERFLOW
  bound = tf.reduce_sum(rows(a64, fan_in) * rows(delta64, fan_out), axis=1)
  slack = 1.0 + (fan_in + fan_out + positions + 8) * 2.0 ** -50
  return tf.square(bound * slack)


def unit_linear_grads(a, delta):
  """The per-unit gradients A_uᵀΔ_u in float64: [U, T, p], [U, T, d] ->
  [U, p, d]. One expression for the norms and the sums, so that XLA (or
  Grappler) computes it once where both need it."""
  return tf.einsum("utp,utd->upd", tf.cast(a, tf.float64),
                   tf.cast(delta, tf.float64))


def materializes_both(positions, fan_in, fan_out):
  """True where a rule should compute the per-unit gradients once, in
  float32 (:func:`shared_unit_grads`), for both the norms and the sum: T > 1
  static, and :func:`linear_sq_norms` would materialize them (2T² ≥ pd) or
  they take at most twice the memory of a and δ (pd ≤ 2T(p + d)).

  The ghost norm's float64 Gram matrices (U·T²·(p + d)) and the float64
  book-kept sum (U·T·p·d) cost more than one float32 U·T·p·d product: the
  MNIST CNN's second convolution (T = 25, pd = 8192) this way took the step
  from 1.81x to 1.45x of non-private; CIFAR CNN5's third (pd ≤ 4T(p + d))
  gained 5% for 75 MB at batch 256, so the memory bound stays at 2."""
  return positions is not None and positions > 1 and (
      not prefer_ghost(positions, fan_in, fan_out)
      or fan_in * fan_out <= 2 * positions * (fan_in + fan_out))


def shared_unit_grads(a, delta):
  """ĝ_u = fl(A_uᵀΔ_u) in float32 (float64 inputs stay float64), [U, p, d],
  for a caller that takes BOTH the unit's norm (:func:`shared_sq_norms`) and
  its share of the sum (:func:`shared_grad`, :func:`shared_square_sum`)
  from this one tensor.

  Why float32 is safe here, where the book-kept sums need float64: unit u
  adds c_u·ĝ_u, and c_u is computed from ‖ĝ_u‖ itself (its squares summed in
  float64), so ‖c_u ĝ_u‖ ≤ C
  whatever the rounding of ĝ_u: rows that nearly cancel make ĝ_u inexact
  (by at most ≈T·2⁻²⁴·Σ_t‖a_t‖‖δ_t‖), never larger than its own clip. Each
  block ĝ_u is a function of unit u's a and δ only (a batched product).
  The caller must use the one tensor for both (one graph node: computed
  once, with or without XLA); recomputing it could round differently.
  """
  dtype = tf.float64 if a.dtype == tf.float64 else tf.float32
  return tf.einsum("utp,utd->upd", tf.cast(a, dtype), tf.cast(delta, dtype))


def shared_sq_norms(grads, scale=None):
  """‖ĝ_u‖² (or ‖s ⊙ ĝ_u‖²) of :func:`shared_unit_grads`, never below it:
  float32 ĝ (no scale) by :func:`float32_sq_norms_upper`, otherwise in
  float64.

  Unguarded: a sum of squares has no cancellation to guard against
  (float32 squares are exact in float64), and the unit's share of the sum
  is c_u·ĝ_u from this same ĝ_u, so ‖c_u ĝ_u‖ ≤ C however ĝ_u rounded.
  (The triangle bound Σ_t ‖a_t‖‖δ_t‖ it was guarded by took two float64
  passes over the inputs: 12% of an MNIST CNN step.)"""
  if scale is None and grads.dtype != tf.float64 and (
      _float32_sum_length(grads.shape[1:])) and float32_products_exact():
    upper = float32_sq_norms_upper(grads)
    # A square past float32's range (or a non-finite ĝ, dropped either
    # way): that unit's sum in float64, raised as float32_sq_norms_upper's.
    n = grads.shape[1:].num_elements()
    return tf.cond(
        tf.reduce_all(tf.math.is_finite(upper)), lambda: upper,
        lambda: tf.where(tf.math.is_finite(upper), upper,
                         _raised_sum_of_squares(sum_squares(grads), n, 0)))
  grads = tf.cast(grads, tf.float64)
  if scale is not None:
    grads *= tf.cast(scale, tf.float64)
  return sum_squares(grads)


def _float32_sum_length(shape):
  """k, how many squares :func:`float32_sq_norms_upper` adds in float32:
  the last axis of the per-unit shape where it is 8 to 1,024 (a reduction
  over the minor axis, fused with the squares), else the divisor of the n
  values per unit nearest 128 (64 ≤ k ≤ 512). None — the float64 sum —
  where the shape is not static, n = 0, no such k, or n/k > 2²² partial
  sums (the float64 sum's 2⁻³⁰ allowance)."""
  if not shape.is_fully_defined() or shape.rank == 0:
    return None
  n = shape.num_elements()
  if not n:
    return None
  if 8 <= shape[-1] <= 1024:
    k = shape[-1]
  else:
    near = [k for k in range(64, min(n, 512) + 1) if n % k == 0]
    if not near:
      return None
    k = min(near, key=lambda k: abs(k - 128))
  return k if n // k <= 2 ** 22 else None


def float32_sq_norms_upper(t):
  """An upper bound of Σ t² over every axis but the first: float32 (or
  16-bit) [U, ...] -> [U] float64, inf where a square overflows float32.

  The squares are added in float32, k at a time (:func:`_float32_sum_length`),
  and the U·n/k partial sums in float64. A float32 sum of k squares
  (non-negative: nothing cancels) is within γ_k of the exact one,
  relatively, in any order of addition, plus what underflow drops (squares
  and partial sums below 2⁻¹²⁶ flushed to zero, inputs below it read as
  zero: < 2·2⁻¹²⁶ a value), so Σ t² ≤ (Σ_c ŝ_c + 2n·2⁻¹²⁶)/(1 − γ_k),
  raised by 2⁻³⁰ for the float64 sum (of up to 2²² partial sums) and
  arithmetic. Its excess over the exact sum is at most γ_k ≈ k·2⁻²⁴ (2·10⁻⁶
  at k = 32). On XLA's CPU the float64 squares and their reduction took
  5.6 ms for an MNIST CNN's [256, 256, 32] per-unit gradients, this 2.7
  (9.6 → 2.8 ms for CIFAR CNN5's [256, 2304, 10])."""
  t = tf.cast(t, tf.float32)
  k = _float32_sum_length(t.shape[1:])
  if k is None:
    raise ValueError(f"float32_sq_norms_upper: per-unit shape {t.shape[1:]} "
                     "has no float32 sum length (_float32_sum_length)")
  n = t.shape[1:].num_elements()
  partial = tf.reduce_sum(tf.square(tf.reshape(t, [-1, n // k, k])), axis=2)
  return _raised_sum_of_squares(
      tf.reduce_sum(tf.cast(partial, tf.float64), axis=1), n, k)


def _raised_sum_of_squares(sums, n, k):
  """(Σ + 2n·2⁻¹²⁶)/(1 − γ_k)·(1 + 2⁻³⁰): ≥ the exact sum of n squares
  whose float64 ``sums`` added them k at a time in float32 (k = 0: squares
  and sums in float64, where only a cast's denormals-as-zero and the
  float64 rounding are paid for)."""
  return ((sums + 2.0 * n * _F32_UNDERFLOW) / (1.0 - _gamma32(k))
          * (1.0 + 2.0 ** -30))


def shared_grad(grads, weights):
  """Σ_u w_u ĝ_u of :func:`shared_unit_grads`, in float64 (0 where
  w_u = 0)."""
  return weighted_sum(tf.cast(grads, tf.float64),
                      tf.cast(weights, tf.float64))


def shared_square_sum(grads, weights):
  """Σ_u w_u² ĝ_u⊙ĝ_u of :func:`shared_unit_grads` (joint moment
  estimation), in float64."""
  grads = tf.cast(grads, tf.float64)
  return weighted_sum(tf.square(grads),
                      tf.square(tf.cast(weights, tf.float64)))


def linear_grad(a, delta, weights):
  """Σ_u w_u A_uᵀΔ_u = Aᵀ(w ⊙ Δ): [U, T, p], [U, T, d], [U] -> [p, d], in
  float64 (rounded only after the noise: ``clipping.sum_dtype``).

  Units with weight 0 add exactly 0, even if their a or δ are not finite.
  Where :func:`linear_sq_norms` materializes the per-unit gradients
  (T > 1 and 2T² ≥ pd), their weighted sum reuses them: U·p·d more
  operations instead of U·T·p·d.
  """
  a, weights = tf.convert_to_tensor(a), tf.convert_to_tensor(weights)
  positions, fan_in, fan_out = a.shape[1], a.shape[2], delta.shape[2]
  if positions is not None and positions > 1 and not prefer_ghost(
      positions, fan_in, fan_out):
    return weighted_sum(unit_linear_grads(a, delta),
                        tf.cast(weights, tf.float64))
  # float64: the sum must carry each unit's A_uᵀΔ_u as exactly as its norm
  # was computed; in float32 the rounding of rows that nearly cancel could
  # add to a unit's contribution beyond C.
  a64, delta64 = tf.cast(a, tf.float64), tf.cast(delta, tf.float64)
  keep = weights != 0
  # [U·T, p]ᵀ [U·T, d] as one product with a transposed operand: XLA copies
  # both into a transposed float64 layout for the einsum "utp,utd->pd"
  # (CIFAR CNN5's layers: 13–50% slower); the same sum, bitwise here.
  rows = lambda t: tf.reshape(t, [-1, tf.shape(t)[2]])
  grad = tf.matmul(rows(masked(a64, keep)),
                   rows(masked(delta64, keep)
                        * tf.cast(weights, tf.float64)[:, None, None]),
                   transpose_a=True)
  return grad


# Chunked float32 sums of T = 1 layers (chunked_linear_grad): the chunk K₀
# whose rounding the clip shrink is computed for (and the chunk where U is
# unknown when traced); the most the clip may shrink for their rounding
# (2γ_{K₀+5}·L: 0.9%, L = 2,040 units, which leaves room for one chunk of up
# to 272 units — a batch of 256 in one float32 product, where 2⁻⁷ took two);
# the smallest kernel (p·d) where they pay; the most memory their partial
# sums may take.
FLOAT32_CHUNK = 32
FLOAT32_MAX_SHRINK = 0.009
FLOAT32_MIN_WEIGHTS = 1 << 15
FLOAT32_MAX_PARTIAL_BYTES = 1 << 26


def float32_rounding(chunk=None):
  """γ: a bound, relative to Σ_u ‖x_u‖ (x_u = c_u a_u δ_uᵀ, c_u the float64
  clip factor), of everything rounding can add to a book-kept sum of the
  T = 1 path of :func:`chunked_linear_grad` with K = ``chunk`` units per
  chunk (elementwise |error| ≤ γ·Σ_u |x_u|, so ‖error‖ ≤ γ·Σ_u ‖x_u‖).

  Each term passes K − 1 float32 additions (in any order: a product's
  summation tree is at most K − 1 deep), the cast of c_u to float32, the
  products c_u·δ_u and a_u·(c_uδ_u), and the final cast of the sum to
  float32: K + 3 roundings of u = 2⁻²⁴ (Higham's γ_n = nu/(1 − nu)); two
  more for the float64 norms and the float64 sum of the chunks (each
  ≪ 2⁻²⁴ relative). The float64 path of :func:`linear_grad` is covered by
  the same γ. K defaults to FLOAT32_CHUNK.

  Relative rounding leaves out underflow: TensorFlow's CPU kernels and
  XLA flush float32 results below 2⁻¹²⁶ to zero, which only shrinks a term
  (a clip factor of 7.6e-46 cast to float32 becomes 0, and its unit adds
  nothing); gradual underflow would round such a factor up to 1.4e-45, and
  the unit would add 1.84·C'. Overflow of w_u·δ_u is saturated
  (:func:`saturated`), which also only shrinks a term."""
  n = (FLOAT32_CHUNK if chunk is None else chunk) + 5
  return n * 2.0 ** -24 / (1.0 - n * 2.0 ** -24)


def float32_clip_shrink(max_units):
  """1 + 2γL for a model whose float32 sums take at most L units (γ of
  FLOAT32_CHUNK): with every unit clipped at C' = C/(1 + 2γL) and each
  batch's rounding at most γ_K·Σ_u‖x_u‖ ≤ γ_K·U·C' ≤ γ·L·C' (U ≤ L units in
  chunks of :func:`float32_chunk`), adding or removing a unit moves the
  computed sum by at most C'(1 + 2γL) = C: the sensitivity the noise is
  calibrated to, with the rounding included. L must not depend on the batch
  (``keras.ghost._float32_sums``)."""
  return tf.constant(1.0 + 2.0 * float32_rounding() * float(max_units),
                     tf.float64)


def float32_chunk(units, max_units):
  """K, the units per float32 chunk for a batch of U = ``units`` in a model
  whose float32 sums take at most L = ``max_units``: the largest K with
  γ_K·U ≤ γ_{FLOAT32_CHUNK}·L (:func:`float32_rounding`), the rounding
  :func:`float32_clip_shrink` pays for, spread evenly over ⌈U/K⌉ chunks —
  never more chunks than ⌈U/FLOAT32_CHUNK⌉ (the memory bound of
  :func:`float32_max_units`); FLOAT32_CHUNK where U is unknown when traced
  (U ≤ L is then checked when run), and where U = 0 or U > L (the float64
  sum runs: the float32 branch is only traced).

  Batches below L take the slack the constant shrink leaves them: fewer,
  longer chunks, so fewer float32 partial sums to write and add in float64
  (the MLP, L = 2,040: one chunk of 256 at batch 256 instead of 8 of 32; at
  1024, 16 of 64 instead of 32 of 32)."""
  if units is None or units == 0 or units > max_units:
    return FLOAT32_CHUNK
  budget = float32_rounding() * float(max_units)
  chunk = max(1, min(units, int(budget / (units * 2.0 ** -24)) - 5))
  while chunk > 1 and float32_rounding(chunk) * units > budget:
    chunk -= 1
  count = -(-units // chunk)
  return -(-units // count)


# oneDNN's fpmath mode (and its older name), and TensorFlow's own setting of it.
_FPMATH_VARIABLES = ("ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE",
                     "TF_SET_ONEDNN_FPMATH_MODE")
# Grappler's rewrites of float32 ops to float16/bfloat16, by environment.
_MIXED_PRECISION_VARIABLES = ("TF_ENABLE_AUTO_MIXED_PRECISION",
                              "TF_ENABLE_AUTO_MIXED_PRECISION_GRAPH_REWRITE")


def _reduced_float32_precision():
  """True where float32 products may run in a lower precision: oneDNN's
  fpmath mode set to anything but STRICT (bf16, tf32 …), or one of
  Grappler's automatic mixed precision rewrites on (``auto_mixed_precision``
  and its oneDNN/MKL/CPU variants: float32 ops rewritten to 16 bits), by
  ``tf.config.optimizer`` or the environment. Read when a step is traced."""
  if any(os.environ.get(name, "STRICT").strip().upper() not in (
      "", "STRICT") for name in _FPMATH_VARIABLES):
    return True
  if any(os.environ.get(name, "").strip().lower() not in ("", "0", "false")
         for name in _MIXED_PRECISION_VARIABLES):
    return True
  options = tf.config.optimizer.get_experimental_options()
  return any(value for name, value in options.items()
             if name.startswith("auto_mixed_precision"))


def float32_max_units(fan_in, fan_out, dtype):
  """The most units for which a Dense-like kernel's book-kept sum may take
  :func:`chunked_linear_grad` (0: never), of the kernel alone ([fan_in,
  fan_out] of ``dtype``): not float64, at least FLOAT32_MIN_WEIGHTS
  entries (below that the float64 product is cheap), a clip shrink
  2γU ≤ FLOAT32_MAX_SHRINK and partial sums within
  FLOAT32_MAX_PARTIAL_BYTES (at most ⌈U/FLOAT32_CHUNK⌉ of them); never
  where float32 products may run in TF32 (a GPU with TensorFloat-32
  enabled: inputs rounded to 2⁻¹¹, outside γ). Never of the batch (its U,
  or T: a call with T = 1 is what lets the sum run in float32, not what
  sets the limit), since the clip shrink it sets must be the same for
  every batch (``keras.ghost._float32_sums``)."""
  if dtype == tf.float64 or fan_in is None or fan_out is None or (
      fan_in * fan_out < FLOAT32_MIN_WEIGHTS):
    return 0
  if not float32_products_exact():
    return 0
  return _float32_limit(fan_in * fan_out)


def _float32_limit(entries):
  """L for float32 partial sums of ``entries`` values each: a clip shrink
  2γL ≤ FLOAT32_MAX_SHRINK, and at most ⌈L/FLOAT32_CHUNK⌉ partial sums
  within FLOAT32_MAX_PARTIAL_BYTES."""
  by_rounding = int(FLOAT32_MAX_SHRINK / (2.0 * float32_rounding()))
  by_memory = FLOAT32_CHUNK * (FLOAT32_MAX_PARTIAL_BYTES // (4 * entries))
  return min(by_rounding, by_memory)


def chunked_linear_grad(a, delta, weights, max_units):
  """Σ_u w_u a_u δ_uᵀ of a T = 1 layer ([U, 1, p], [U, 1, d], [U] -> [p, d]):
  float32 products over chunks of K units (:func:`float32_chunk` of U and
  the model's float32 unit limit L = ``max_units``; zero units pad the
  last), the chunks summed in float64.

  Private only with every unit clipped at C/:func:`float32_clip_shrink` of
  the same L, and U ≤ L (``keras.ghost.clipped_sum`` does): the rounding of
  a float32 sum is not any one unit's and moves with the others', bounded
  by γ_K·Σ_u‖x_u‖ (:func:`float32_rounding`). Units with weight 0 add
  exactly 0.

  Only w⊙δ is masked, not a (a copy of the layer's whole input: 3.2 MB and
  a pass at 1,024 units of 784): a zero-weight unit's row of w⊙δ is exactly
  0, so its a_u·0 adds exactly ±0 where a_u is finite, and NaN to a whole
  row of the sum where it is not (0·inf and 0·NaN are NaN, and NaN absorbs
  every addition, in any order). A sum with every entry finite is the
  masked one (up to the sign of zeros); one with a non-finite entry is
  recomputed with a masked, chunk by chunk in a loop (it holds one small
  chunk's copy, not U rows, and runs only for such batches). w⊙δ is formed
  in float64 and saturated to float32's range (:func:`saturated`): an
  overflow there would leave inf, and NaN in every entry."""
  keep = weights != 0
  chunk = float32_chunk(a.shape[0], max_units)
  a = a[:, 0]
  y = saturated(masked(tf.cast(delta[:, 0], tf.float64), keep)
                 * tf.cast(weights, tf.float64)[:, None], delta.dtype)
  total = _chunk_sums(a, y, chunk)
  finite = tf.reduce_all(tf.math.is_finite(total))
  # The recomputation's chunks are at most FLOAT32_CHUNK: fewer roundings
  # (γ_K grows with K), and one small chunk's copy in memory at a time.
  # (XLA reserves the untaken branch's buffers: recomputing as _chunk_sums
  # of a masked copy took the MLP's peak at 1,024 units to 11.2 MiB, this
  # loop leaves it at 8.2.)
  return tf.cast(tf.cond(finite, lambda: total,
                         lambda: _masked_chunk_sums(
                             a, y, keep, min(chunk, FLOAT32_CHUNK))),
                 a.dtype)


def saturated(t, dtype):
  """float64 ``t`` in ``dtype``, held to its finite range: w_u·δ_u past
  float32's (a factor C/γ of automatic clipping for a zero gradient, or an
  example of zero inputs and a huge output gradient) would be inf, and
  0·inf NaN in the whole sum. A kept unit's w_u·δ_u past the range has
  ‖a_u‖ < C'/‖w_u δ_u‖, so the saturated row only shrinks its share."""
  top = tf.constant(t.dtype.max if dtype == t.dtype else dtype.max, t.dtype)
  return tf.cast(tf.clip_by_value(t, -top, top), dtype)


def _chunk_sums(a, y, chunk):
  """Σ over chunks of K = ``chunk`` rows of the float32 aᵀy, in float64:
  [U, p], [U, d] -> [p, d]. Zero rows pad both to whole chunks (a's rows
  are not copied where U is a multiple of K)."""
  pad = (-tf.shape(a)[0]) % chunk
  if a.shape[0] is None or a.shape[0] % chunk:
    a = tf.pad(a, [[0, pad], [0, 0]])
    y = tf.pad(y, [[0, pad], [0, 0]])
  a = tf.reshape(a, [-1, chunk, a.shape[-1]])
  y = tf.reshape(y, [-1, chunk, y.shape[-1]])
  partial = tf.einsum("ckp,ckd->cpd", a, y)
  return tf.reduce_sum(tf.cast(partial, tf.float64), 0)


def _masked_chunk_sums(a, y, keep, chunk):
  """:func:`_chunk_sums` with the rows of a where ``keep`` is False zeroed,
  one chunk at a time (a while loop: each chunk's rows gathered, masked,
  multiplied and added in float64)."""
  num_units = tf.shape(a)[0]
  count = (num_units + chunk - 1) // chunk
  rows = lambda c: tf.range(chunk) + c * chunk
  inside = lambda c: rows(c) < num_units
  pick = lambda t, c: tf.gather(t, tf.minimum(rows(c), num_units - 1))

  def body(c, total):
    use = inside(c) & pick(keep, c)
    part = tf.matmul(masked(pick(a, c), use), masked(pick(y, c), use),
                     transpose_a=True)
    return c + 1, total + tf.cast(part, tf.float64)

  zeros = tf.zeros([a.shape[-1], y.shape[-1]], tf.float64)
  return tf.while_loop(lambda c, _: c < count, body,
                       (tf.constant(0), zeros))[1]


def linear_square_sum(a, delta, weights):
  """Σ_u w_u² (A_uᵀΔ_u)⊙(A_uᵀΔ_u) (joint moment estimation): -> [p, d].

  For T = 1 a product, (a⊙a)ᵀ (w² ⊙ δ⊙δ) (Bu et al.'s book-keeping of
  squares); otherwise the per-unit gradients are materialized.
  """
  a, delta = tf.convert_to_tensor(a), tf.convert_to_tensor(delta)
  keep = weights != 0
  # float64, as the norms (see linear_grad).
  a = masked(tf.cast(a, tf.float64), keep)
  delta = masked(tf.cast(delta, tf.float64), keep)
  weights = tf.cast(weights, tf.float64)
  if a.shape[1] == 1:
    return tf.matmul(tf.square(a[:, 0]),
                     tf.square(delta[:, 0] * weights[:, None]),
                     transpose_a=True)
  return weighted_sum(tf.square(tf.einsum("utp,utd->upd", a, delta)),
                      tf.square(weights))


def broadcast_grads(delta, param_shape):
  """Per-unit gradients of a parameter added with broadcasting (a bias).

  ``delta``: [U, ...], the output gradient of z = x + b (b aligned to the
  trailing axes, as in NumPy broadcasting). Returns [U, *param_shape]: δ
  summed over the axes along which b is broadcast.
  """
  rank = delta.shape.rank - 1
  full = [1] * (rank - len(param_shape)) + list(param_shape)
  axes = [i + 1 for i, n in enumerate(full) if n == 1]
  summed = tf.reduce_sum(delta, axis=axes) if axes else delta
  return tf.reshape(summed, [-1] + list(param_shape))


def weighted_sum(per_unit, weights):
  """Σ_u w_u g_u of materialized per-unit values [U, ...] (0 where w_u = 0),
  in float64 (``clipping.sum_dtype``: rounded only after the noise).

  float64: the sum of U float32 terms rounds by up to ≈U·2⁻²⁴·Σ_u‖w_u g_u‖,
  which no unit's clip pays for; in float64 that is ≈U·2⁻⁵³, like every
  other book-kept sum (as fast under XLA on the benchmark models).
  """
  per_unit, keep = tf.convert_to_tensor(per_unit), weights != 0
  products = (tf.cast(masked(per_unit, keep), tf.float64)
              * tf.reshape(tf.cast(weights, tf.float64),
                           [-1] + [1] * (per_unit.shape.rank - 1)))
  return tf.cast(tf.reduce_sum(products, axis=0),
                 clipping.sum_dtype(per_unit.dtype))


def _rows_of(ids, vocab_size):
  """The table rows ids address, as the lookup does under XLA: clamped to
  [0, vocab). The norm and the sum must agree on them (an id past the table
  counted as its own row in the norm but added to another row in the sum
  would leave a unit under-clipped); eagerly such ids raise in the lookup."""
  return tf.clip_by_value(tf.cast(ids, tf.int64), 0, vocab_size - 1)


def _segments(ids, delta, vocab_size):
  """Σ of δ over each unit's equal ids: ``(sums [U·T, d], unit [U·T],
  id [U·T])``, one slot per position, of which the unused ones are zero.

  Where U·vocab counters fit (:data:`_MAX_COUNTERS`), by each id's first
  position in its unit (:func:`_segments_by_first`); otherwise by sorting
  every unit's ids (:func:`_segments_by_sort`)."""
  ids = tf.convert_to_tensor(ids)
  if ids.shape[0] is not None:
    if ids.shape[0] * vocab_size <= _MAX_COUNTERS:
      return _segments_by_first(ids, delta, vocab_size)
    return _segments_by_sort(ids, delta, vocab_size)
  return tf.cond(tf.shape(ids)[0] * vocab_size <= _MAX_COUNTERS,
                 lambda: _segments_by_first(ids, delta, vocab_size),
                 lambda: _segments_by_sort(ids, delta, vocab_size))


def _segments_by_first(ids, delta, vocab_size):
  """:func:`_segments` without a sort: a scatter-min of the positions into
  U·vocab counters (:func:`_counter_dtype`) gives each position the first
  position of its id in its unit, and δ is summed into that position's
  slot (the slots of later repeats stay zero). XLA's comparator sort took
  15 ms for 256 units of 256 ids on one CPU core; this, well under a
  millisecond."""
  delta = tf.convert_to_tensor(delta)
  num_units, length = tf.shape(ids)[0], tf.shape(ids)[1]
  token = tf.cast(_rows_of(ids, vocab_size), tf.int32)
  keys = token + tf.range(num_units)[:, None] * vocab_size
  # Positions 0..T−1 in the narrowest counters that hold them (uint8 up to
  # T = 256): U·vocab of them, two copies (XLA's CPU scatter is not in
  # place), 82 MB in int32 at 1,024 units of a 10k vocabulary.
  positions = tf.broadcast_to(
      tf.cast(tf.range(length), _counter_dtype(ids.shape[1], -1))[None],
      tf.shape(keys))
  first = tf.math.unsorted_segment_min(
      tf.reshape(positions, [-1]), tf.reshape(keys, [-1]),
      num_units * vocab_size)
  slot = (tf.cast(tf.gather(first, keys), tf.int32)
          + tf.range(num_units)[:, None] * length)
  sums = tf.math.unsorted_segment_sum(
      tf.reshape(delta, [-1, tf.shape(delta)[-1]]), tf.reshape(slot, [-1]),
      num_units * length)
  unit = tf.repeat(tf.range(num_units), length)
  return sums, unit, tf.reshape(token, [-1])


def _segments_by_sort(ids, delta, vocab_size):
  """:func:`_segments` by sorting every unit's ids.

  Each row of ids is sorted on its own (keys id·T + t, int32 where they fit),
  δ is gathered in that order, and runs of equal ids are summed. Returns
  ``(sums [U·T, d], unit [U·T], id [U·T])``: one slot per position, of which
  the unused ones are zero.
  """
  ids, delta = _rows_of(ids, vocab_size), tf.convert_to_tensor(delta)
  num_units, length = tf.shape(ids)[0], tf.shape(ids)[1]
  static_length = ids.shape[1]
  wide = static_length is None or vocab_size * static_length >= 2**31
  key_dtype = tf.int64 if wide else tf.int32
  length_k = tf.cast(length, key_dtype)
  keys = tf.sort(tf.cast(ids, key_dtype) * length_k
                 + tf.range(length_k, dtype=key_dtype)[None], axis=1)
  order, sorted_ids = keys % length_k, keys // length_k
  rows = tf.gather(delta, tf.cast(order, tf.int32), batch_dims=1)
  starts = tf.concat([tf.ones_like(sorted_ids[:, :1], tf.bool),
                      sorted_ids[:, 1:] != sorted_ids[:, :-1]], 1)
  run = tf.cumsum(tf.cast(starts, tf.int32), axis=1) - 1
  slots = num_units * length
  segment = tf.reshape(run + tf.range(num_units)[:, None] * length, [-1])
  sums = tf.math.unsorted_segment_sum(
      tf.reshape(rows, [-1, tf.shape(delta)[-1]]), segment, slots)
  token = tf.cast(tf.maximum(tf.math.unsorted_segment_max(
      tf.reshape(sorted_ids, [-1]), segment, slots), 0), tf.int32)
  unit = tf.repeat(tf.range(num_units), length)
  return sums, unit, token


# Most per-unit token counters (uint8 to int32) the paths below allocate.
_MAX_COUNTERS = 1 << 24
# The pooled shortcut runs unconditionally (embedding_sq_norms) where a
# unit's counters (vocab) are at most this many times its δ (T·d values).
_COUNTERS_PER_ROW = 4


def _counter_dtype(length, offset=0):
  """The narrowest integer dtype that holds 0..T + ``offset`` (T =
  ``length``, static): uint8, int16 or int32 — the U·vocab counters'
  memset and scatter scale with their bytes (an embedding bag's counts at
  256 units of a 10k vocabulary: int32 1.4, int16 1.1, uint8 0.9 ms on the
  CPU). int32 where T is unknown, and on a GPU without XLA TensorFlow may
  lack the narrow segment kernels (the op would move to the CPU)."""
  if length is None or tf.config.list_logical_devices("GPU"):
    return tf.int32
  if length + offset <= 255:
    return tf.uint8
  return tf.int16 if length + offset < 2 ** 15 else tf.int32


def _one_row_per_unit(delta):
  """(all, g [U, d], nonzero [U, T]): ``all`` is True when every unit's
  non-zero δ rows are one and the same row g_u (exactly: the gradient of a
  mean or sum pooling right after the lookup, padding positions zero).

  Column by column: the non-zero rows are equal iff in every feature their
  largest value equals their smallest. Only finite δ qualifies: a NaN or
  ±inf anywhere makes some column sum over T non-finite (IEEE arithmetic
  propagates them), and such δ goes to the sorted path. Compared in δ's
  own dtype: casting to float64 is exact and injective. Reductions over T
  and elementwise maxima of the d feature slices: XLA vectorizes them on
  the CPU, where a reduction over the short feature axis, argmax and
  gathers were 3x slower."""
  finite = tf.reduce_all(tf.math.is_finite(tf.reduce_sum(delta, axis=1)))
  if delta.shape[2] is not None and delta.shape[2] <= 64:
    largest = tf.abs(delta[:, :, 0])
    for j in range(1, delta.shape[2]):
      largest = tf.maximum(largest, tf.abs(delta[:, :, j]))
  else:
    largest = tf.reduce_max(tf.abs(delta), axis=2)
  nonzero = largest > 0  # exact for finite δ
  rows = nonzero[:, :, None]
  big = tf.reduce_max(tf.where(rows, delta, -math.inf), axis=1)
  small = tf.reduce_min(tf.where(rows, delta, math.inf), axis=1)
  # A unit without non-zero rows: big = −inf < small = inf, g_u = 0.
  same = tf.reduce_max(tf.where(big > small, 1, 0)) == 0
  g = tf.where(big > -math.inf, big, tf.zeros_like(big))
  return finite & same, g, nonzero


def _equal_rows(delta):
  """(all, g [U, d]): ``all`` is True when all of every unit's δ rows are
  one finite row g_u (a mean or sum pooling right after the lookup, no
  padding mask): :func:`_one_row_per_unit` with every row counted.

  Exact: with every δ finite, a unit's rows are equal in feature j iff
  their largest value equals their smallest (== is IEEE equality: −0 = +0,
  as before). Finite is checked on the sums over T: a NaN or ±inf anywhere
  makes its column's sum non-finite in any order of addition (an overflow
  of finite values fails too, and goes to the general path), so the
  maximum and minimum need no NaN semantics. Three reductions over T (on
  the CPU XLA runs them as three library calls) and no [U, T, d] mask:
  under XLA 1.4 → 0.9 ms at 256 units of 256 × 16, 4.1 → 2.0 ms at 1,024,
  against comparing every row with the first and reducing that mask.
  T = 0 fails here (−inf ≠ inf) and goes to the masked-rows check.
  (g: the first row as a sum over a slice, so that T = 0 gives g = 0.)"""
  finite = tf.reduce_all(tf.math.is_finite(tf.reduce_sum(delta, axis=1)))
  same = tf.reduce_all(tf.equal(tf.reduce_max(delta, axis=1),
                                tf.reduce_min(delta, axis=1)))
  return finite & same, tf.reduce_sum(delta[:, :1], axis=1)


def _may_be_one_row_per_unit(delta):
  """False where :func:`_one_row_per_unit` would be: some unit has two
  different non-zero values in its first feature column (a pooled unit's
  rows are 0 or g_u). Reads one column: the full check is skipped for
  models whose δ rows differ (a transformer's embedding)."""
  column = delta[:, :, 0]
  nonzero = column != 0
  big = tf.reduce_max(tf.where(nonzero, column, -math.inf), axis=1)
  small = tf.reduce_min(tf.where(nonzero, column, math.inf), axis=1)
  # Necessary, not sufficient: a pooled unit's non-zero values in the
  # column are all g_u[0] (none where g_u[0] = 0: −inf vs inf passes).
  # Whatever passes (NaN included) goes through the full check.
  return tf.reduce_all(tf.logical_not(big > small))


def _first_counts(ids, nonzero, vocab_size):
  """n [U, T] int32: at the first non-zero position of each id in its unit,
  n_uv, the unit's non-zero positions with that id; 0 at every other
  position (``nonzero`` None: every position counts).

  A scatter-min of the positions into U·vocab counters
  (:func:`_counter_dtype`: positions 0..T − 1, uint8 up to T = 256) gives
  each position its id's first position, and a scatter-add of ones into
  the U·T first positions counts them: integers, exact. The positions that
  do not count are dropped from both scatters (segment id −1). One term
  per (unit, id) is what the float32 sum needs
  (:func:`pooled_embedding_grad`), and Σ_t n_ut² = Σ_v n_uv² the norm.
  Over chunks of units where the counters would pass
  ``unit_chunks.CHUNK_BYTES`` (10 MB at 1,024 units of a 10k vocabulary)."""
  length = ids.shape[1]
  chunk = None if length is None else unit_chunks.chunk_size(
      ids.shape[0], 2 * vocab_size * tf.as_dtype(
          _counter_dtype(length, -1)).size + 16 * length)
  if chunk is not None:  # each unit's counts are its own
    parts = (ids,) if nonzero is None else (ids, nonzero)
    return unit_chunks.map_chunks(
        lambda t: (_first_counts(t[0], None if nonzero is None else t[1],
                                 vocab_size),),
        parts, chunk, (tf.TensorSpec([length], tf.int32),))[0]
  num_units, length = tf.shape(ids)[0], tf.shape(ids)[1]
  keys = (tf.cast(_rows_of(ids, vocab_size), tf.int32)
          + tf.range(num_units)[:, None] * vocab_size)
  if nonzero is not None:
    keys = tf.where(nonzero, keys, -1)
  positions = tf.broadcast_to(
      tf.cast(tf.range(length), _counter_dtype(ids.shape[1], -1))[None],
      tf.shape(keys))
  first = tf.math.unsorted_segment_min(
      tf.reshape(positions, [-1]), tf.reshape(keys, [-1]),
      num_units * vocab_size)
  slots = (tf.cast(tf.gather(first, tf.maximum(keys, 0)), tf.int32)
           + tf.range(num_units)[:, None] * length)
  if nonzero is not None:
    slots = tf.where(nonzero, slots, -1)
  counts = tf.math.unsorted_segment_sum(
      tf.ones([num_units * length], tf.int32), tf.reshape(slots, [-1]),
      num_units * length)
  return tf.reshape(counts, [num_units, length])


def _norms_of_counts(g, counts, present):
  """(‖∇E_u‖², bound) of units whose rows are n_uv·g_u
  (:func:`_first_counts`): ‖g_u‖²·Σ_v n_uv², and Σ_t ‖δ_t‖ =
  ‖g_u‖·``present`` (the unit's non-zero positions, [U])."""
  # Σ_v n_uv² ≤ T² < 2³¹ (int32: exact, one float64 pass fewer).
  length = counts.shape[1]
  small = length is not None and length < 2 ** 15
  pairs = (tf.cast(tf.reduce_sum(counts * counts, 1), tf.float64) if small
           else tf.reduce_sum(tf.square(tf.cast(counts, tf.float64)), 1))
  g_sq = sum_squares(g)
  return g_sq * pairs, tf.sqrt(g_sq) * present


def _pooled_sq_norms(ids, g, nonzero, vocab_size):
  """(‖∇E_u‖², bound) when unit u's non-zero rows all equal g_u: its
  gradient has rows n_uv·g_u (n_uv: its non-zero positions with id v), so
  ‖∇E_u‖² = ‖g_u‖² Σ_v n_uv², by counting (:func:`_first_counts`): no
  sort. The bound Σ_t ‖δ_t‖ of :func:`guarded` is ‖g_u‖·(number of
  non-zero positions)."""
  return _norms_of_counts(
      g, _first_counts(ids, nonzero, vocab_size),
      tf.reduce_sum(tf.cast(nonzero, tf.float64), 1))


_PER_UNIT_NORM = (tf.TensorSpec([], tf.float64),) * 2  # (‖·‖², bound)


def _segment_bytes(length, dim, vocab_size):
  """What one unit's buffers take in :func:`_sorted_with_bound` (None where
  T or d is unknown): four float64 copies of its T × d rows (δ, the
  gathered rows, the sums and their squares), its keys, and two copies of
  its vocab counters (``_segments_by_first``; the sort's are smaller)."""
  if length is None or dim is None:
    return None
  return length * (4 * 8 * dim + 16) + 2 * vocab_size * tf.as_dtype(
      _counter_dtype(length, -1)).size


def _sorted_sq_norms(ids, delta64, vocab_size, scale):
  """‖∇E_u‖² from each unit's row sums, formed by sorting its ids."""
  sums, _, token = _segments(ids, delta64, vocab_size)
  if scale is not None:
    sums *= tf.gather(tf.cast(scale, sums.dtype), token)
  # Slots are laid out unit by unit, T per unit.
  return tf.reduce_sum(tf.reshape(tf.reduce_sum(tf.square(sums), 1),
                                  tf.shape(ids)[:2]), 1)


def _norms_over_chunks(fn, ids, delta, vocab_size):
  """``fn(ids, δ)`` -> (‖∇E_u‖², bound) per unit, over chunks of units
  (``unit_chunks.map_chunks``) where the units' copies of their rows and
  counters (:func:`_segment_bytes`) would pass ``unit_chunks.CHUNK_BYTES``;
  None where one pass stays within it. ``fn`` must compute each unit's
  values from its own rows alone."""
  chunk = unit_chunks.chunk_size(ids.shape[0], _segment_bytes(
      ids.shape[1], delta.shape[2], vocab_size))
  if chunk is None:
    return None
  return unit_chunks.map_chunks(lambda t: fn(t[0], t[1]), (ids, delta),
                                chunk, _PER_UNIT_NORM)


def _sorted_with_bound(ids, delta, vocab_size, scale):
  """(‖∇E_u‖² of :func:`_sorted_sq_norms`, Σ_t ‖δ_t‖), over chunks of units
  where their float64 copies of δ and counters would pass
  ``unit_chunks.CHUNK_BYTES`` (each unit's values from its own rows)."""
  chunked = _norms_over_chunks(
      lambda i, d: _sorted_with_bound(i, d, vocab_size, scale), ids, delta,
      vocab_size)
  if chunked is not None:
    return chunked
  delta64 = tf.cast(delta, tf.float64)
  bound = tf.reduce_sum(_row_norms(delta64), axis=1)  # Σ_t ‖δ_t‖
  if scale is not None:
    bound *= tf.reduce_max(tf.abs(tf.cast(scale, tf.float64)))
  return _sorted_sq_norms(ids, delta64, vocab_size, scale), bound


def _masked_rows_with_bound(ids, delta, vocab_size):
  """(‖∇E_u‖², bound) where padding positions (zero rows) may sit between a
  unit's equal rows: by counting where every unit's non-zero rows are one
  row (:func:`_one_row_per_unit`), else sorted. Over chunks of units where
  their copies would pass ``unit_chunks.CHUNK_BYTES`` (the check's
  [K, T, d] selects, the counters, the sorted path's rows), each chunk
  choosing for its own units: either way a unit's norm is its own."""
  chunked = _norms_over_chunks(
      lambda i, d: _masked_rows_with_bound(i, d, vocab_size), ids, delta,
      vocab_size)
  if chunked is not None:
    return chunked
  pooled, g, nonzero = _one_row_per_unit(delta)
  return tf.cond(pooled,
                 lambda: _pooled_sq_norms(ids, g, nonzero, vocab_size),
                 lambda: _sorted_with_bound(ids, delta, vocab_size, None))


PooledLookup = collections.namedtuple(
    "PooledLookup", ["delta", "pooled", "rows", "counts"])
PooledLookup.__doc__ = """An embedding lookup's δ, checked for pooling
(:func:`pooled_lookup`).

delta: δ [U, T, d], one buffer (read by the check, the fallbacks and the
float64 sum). pooled: bool, True when every row of every unit is one finite
row g_u. rows: g [U, d]. counts: n [U, T] of :func:`_first_counts` (every
position counted), meaningful where ``pooled``.
"""


def pooled_lookup(ids, delta, vocab_size):
  """:class:`PooledLookup` of ids [U, T], δ [U, T, d], or None where the
  check does not run unconditionally: U, T and d static, U·vocab counters
  within _MAX_COUNTERS and vocab ≤ _COUNTERS_PER_ROW·T·d.

  Unconditionally, its results used outside any cond: computed inside a
  conditional's branch, or used only there (XLA then moves it into the
  branch), the same work took 0.8 ms more of an embedding bag's step on
  the CPU (batch 256: 6.3 → 5.5 ms). Only where the counters are at most a
  few times δ's size: a model whose rows differ (a transformer's
  embedding) pays the check and the counts for nothing. One δ for the
  check and the fallbacks' operands (xla_hints.opaque): XLA wrote it
  twice, 1.1 ms of an embedding bag's 8.6 ms step."""
  delta = tf.convert_to_tensor(delta)
  units, length, dim = ids.shape[0], delta.shape[1], delta.shape[2]
  if units is None or units * vocab_size > _MAX_COUNTERS or (
      length is None or dim is None) or (
          vocab_size > _COUNTERS_PER_ROW * length * dim):
    return None
  delta = xla_hints.opaque(delta)
  equal, g = _equal_rows(delta)
  return PooledLookup(delta, equal, g, _first_counts(ids, None, vocab_size))


def embedding_sq_norms(ids, delta, vocab_size, scale=None, lookup=None):
  """‖∇E_u‖²_F of an embedding lookup: ids [U, T], δ [U, T, d] -> [U].

  Unit u's gradient has row Σ_{t: id_t = v} δ_t for every token v it uses;
  the rows are formed by sorting each unit's ids, O(UT log T + UTd), never
  [U, vocab, d]. ``scale`` ([vocab, d]) weights row v by s_v.

  When every unit's non-zero δ rows are one row g_u — checked exactly on
  the values, as after a mean or sum pooling of the embeddings — the rows
  are n_uv·g_u and ‖∇E_u‖² = ‖g_u‖²·Σ_v n_uv²: token counts replace the
  sort (XLA's comparator sort dominates an embedding bag's step on the CPU).
  Either way in float64 and :func:`guarded` by Σ_t ‖δ_t‖. ``lookup``:
  :func:`pooled_lookup` of the same ids and δ, if the caller has it.
  """
  delta = tf.convert_to_tensor(delta)
  if scale is None and lookup is None:
    lookup = pooled_lookup(ids, delta, vocab_size)
  if scale is None and lookup is not None:
    delta = lookup.delta
  sorted_sq = lambda: _sorted_with_bound(ids, delta, vocab_size, scale)
  masked_rows = lambda: _masked_rows_with_bound(ids, delta, vocab_size)
  units = ids.shape[0]
  fits = units is not None and units * vocab_size <= _MAX_COUNTERS
  if scale is None and lookup is not None:
    # The pooled case outside any cond (pooled_lookup); only the fallback
    # runs under one (which returns zeros when not needed).
    pooled_sq, pooled_bound = _norms_of_counts(
        lookup.rows, lookup.counts,
        tf.cast(tf.fill(tf.shape(ids)[:1], tf.shape(ids)[1]), tf.float64))
    zero = tf.zeros_like(pooled_sq)
    other_sq, other_bound = tf.cond(
        lookup.pooled, lambda: (zero, zero), lambda: tf.cond(
            _may_be_one_row_per_unit(delta), masked_rows, sorted_sq))
    sq = tf.where(lookup.pooled, pooled_sq, other_sq)
    bound = tf.where(lookup.pooled, pooled_bound, other_bound)
  elif scale is None and (units is None or fits):
    def counted():
      equal, g = _equal_rows(delta)
      every = tf.ones(tf.shape(ids), tf.bool)
      return tf.cond(equal,
                     lambda: _pooled_sq_norms(ids, g, every, vocab_size),
                     masked_rows)
    sq, bound = tf.cond(
        (tf.shape(ids)[0] * vocab_size <= _MAX_COUNTERS)
        & _may_be_one_row_per_unit(delta), counted, sorted_sq)
  else:
    sq, bound = sorted_sq()
  return guarded(sq, bound, (ids.shape[1] or 1024) + (delta.shape[2] or 0))


def embedding_square_sum(ids, delta, weights, vocab_size):
  """Σ_u w_u² ∇E_u⊙∇E_u: ids [U, T], δ [U, T, d], w [U] -> [vocab, d].
  Over chunks of units where their row sums would pass
  ``unit_chunks.CHUNK_BYTES`` and a [vocab, d] table."""
  delta = tf.convert_to_tensor(delta)
  chunked = _table_over_chunks(
      embedding_square_sum, ids, delta, weights, vocab_size,
      _segment_bytes(ids.shape[1], delta.shape[2], vocab_size))
  if chunked is not None:
    return chunked
  weights = tf.cast(weights, tf.float64)
  sums, unit, token = _segments(
      ids, masked(tf.cast(delta, tf.float64), weights != 0), vocab_size)
  w = tf.gather(weights, unit)
  return tf.math.unsorted_segment_sum(
      tf.square(sums * w[:, None]), tf.cast(token, tf.int32), vocab_size)


def _table_over_chunks(fn, ids, delta, weights, vocab_size, bytes_per_unit):
  """``fn(ids, δ, w, vocab)`` -> float64 [vocab, d], summed over chunks of
  units (the filler copies weighted 0) where ``bytes_per_unit`` (None:
  unknown) of all units would pass ``unit_chunks.CHUNK_BYTES`` and a
  [vocab, d] table; None where one pass stays within them."""
  dim = delta.shape[2]
  chunk = None if dim is None else unit_chunks.chunk_size(
      ids.shape[0], bytes_per_unit, shared_bytes=8 * vocab_size * dim)
  if chunk is None:
    return None
  return unit_chunks.sum_chunks(
      lambda t, real: fn(t[0], t[1], tf.where(real, t[2], tf.zeros_like(t[2])),
                         vocab_size),
      (ids, delta, weights), chunk, tf.zeros([vocab_size, dim], tf.float64))


def embedding_grad(ids, delta, weights, vocab_size):
  """Σ_u w_u ∇E_u: ids [U, T], δ [U, T, d], w [U] -> [vocab, d], in
  float64 (as the norms: see linear_grad). Summed over chunks of units
  (``unit_chunks.sum_chunks``) where the float64 rows of all units would
  pass ``unit_chunks.CHUNK_BYTES`` and a [vocab, d] table."""
  delta, weights = tf.convert_to_tensor(delta), tf.convert_to_tensor(weights)
  length, dim = delta.shape[1], delta.shape[2]
  chunked = _table_over_chunks(
      embedding_grad, ids, delta, weights, vocab_size,
      None if length is None or dim is None else 8 * length * (2 * dim + 1))
  if chunked is not None:
    return chunked
  weighted = masked(tf.cast(delta, tf.float64), weights != 0) * tf.cast(
      weights, tf.float64)[:, None, None]
  return tf.math.unsorted_segment_sum(
      tf.reshape(weighted, [-1, tf.shape(delta)[-1]]),
      tf.reshape(tf.cast(_rows_of(ids, vocab_size), tf.int32), [-1]),
      vocab_size)


def embedding_float32_max_units(vocab_size, dim, dtype):
  """The most units for which an embedding's book-kept sum may take
  :func:`pooled_embedding_grad` (0: never): a table ([vocab, d] of
  ``dtype``) not float64, of at least FLOAT32_MIN_WEIGHTS entries, a clip
  shrink 2γU ≤ FLOAT32_MAX_SHRINK, and partial tables within
  FLOAT32_MAX_PARTIAL_BYTES (at most ⌈U/FLOAT32_CHUNK⌉ of them). Of the
  table alone, never of the batch (its U or T): the clip shrink it sets
  must be the same for every batch (``keras.ghost._float32_sums``)."""
  if dim is None or dtype == tf.float64 or (
      vocab_size * dim < FLOAT32_MIN_WEIGHTS):
    return 0
  # No products (TF32 is moot), but a Grappler rewrite to 16 bits is not.
  if _reduced_float32_precision():
    return 0
  return _float32_limit(vocab_size * dim)


def pooled_embedding_grad(ids, rows, counts, weights, vocab_size, max_units):
  """Σ_u w_u ∇E_u of units whose rows are n_uv·g_u (rows g [U, d], counts n
  [U, T] of :func:`_first_counts`) -> float32 [vocab, d]: one float32 term
  n_uv·w_u·g_u per (unit, id), scattered at the id's first position into
  ⌈U/K⌉ partial tables of K units (:func:`float32_chunk` of U and the
  model's float32 unit limit L = ``max_units``), the tables summed in
  float64. The float64 sum of δ (:func:`embedding_grad`) scatters U·T rows
  of float64: 8.4 of an embedding bag's 22 ms a step at 1,024 units on the
  CPU.

  Private only with every unit clipped at C/:func:`float32_clip_shrink` of
  the same L, and U ≤ L (``keras.ghost.clipped_sum`` does). The rounding,
  elementwise: each term is formed in float64 (n exact) and rounded once
  to float32 (:func:`saturated`: an overflow only shrinks it); a table's
  entry adds at most K non-zero terms, one per unit of its chunk, in any
  order (the zero positions are dropped from the scatter); the tables'
  float32 → float64 casts are exact, and their float64 sum is rounded to
  float32 once. That is K + 1 roundings of 2⁻²⁴, of the K + 5 γ_K allows
  (:func:`float32_rounding`), relative to Σ_u |x_u|:
  ‖error‖ ≤ γ_K·Σ_u‖x_u‖, as the Dense sums. One term per unit matters: a
  unit's n_uv copies of w_u·g_u would round n_uv times. Units with weight 0
  add exactly 0 (their g is finite: pooled rows are checked finite)."""
  units = ids.shape[0]
  chunk = float32_chunk(units, max_units)
  dim = rows.shape[-1]
  # Groups of at most G chunks (G tables within 2·CHUNK_BYTES), one group
  # at a time, its tables added into a float64 total: tables of at most K
  # units as below, never more than G in memory. All ⌈U/K⌉ at once (and
  # their terms) took 11 MB more of an embedding bag's peak at 1,024 units
  # (47.2 against 36.1 MiB; the loop cost about 1 ms of its 20 ms step).
  # Balanced groups: the last one's copies of the last unit (weight 0)
  # fill only a few rows.
  tables = None if dim is None else max(
      1, 2 * unit_chunks.CHUNK_BYTES // (4 * vocab_size * dim))
  if units is not None and dim is not None and units > tables * chunk:
    groups = -(-units // (tables * chunk))
    return tf.cast(unit_chunks.sum_chunks(
        lambda t, real: _summed_tables(_pooled_tables(
            t[0], t[1], t[2], tf.where(real, t[3], tf.zeros_like(t[3])),
            vocab_size, chunk), vocab_size),
        (ids, rows, counts, weights), -(-units // groups),
        tf.zeros([vocab_size, dim], tf.float64)), tf.float32)
  partial = _pooled_tables(ids, rows, counts, weights, vocab_size, chunk)
  if units is not None and units <= chunk:
    return partial  # one table: nothing to add in float64
  return tf.cast(_summed_tables(partial, vocab_size), tf.float32)


def _pooled_tables(ids, rows, counts, weights, vocab_size, chunk):
  """The float32 partial tables of :func:`pooled_embedding_grad`, units
  0..K−1 in the first, K..2K−1 in the second, ...: [⌈U/K⌉·vocab, d]."""
  num_units = tf.shape(ids)[0]
  count = (num_units + chunk - 1) // chunk
  weights = tf.cast(weights, tf.float64)
  y = masked(tf.cast(rows, tf.float64), weights != 0) * weights[:, None]
  terms = saturated(tf.cast(counts, tf.float64)[:, :, None] * y[:, None],
                     tf.float32)
  table = (tf.cast(_rows_of(ids, vocab_size), tf.int32)
           + (tf.range(num_units) // chunk)[:, None] * vocab_size)
  table = tf.where(counts > 0, table, -1)
  return tf.math.unsorted_segment_sum(
      tf.reshape(terms, [-1, tf.shape(terms)[-1]]), tf.reshape(table, [-1]),
      count * vocab_size)


def _summed_tables(partial, vocab_size):
  """[n·vocab, d] float32 tables -> their float64 sum [vocab, d]."""
  return tf.reduce_sum(tf.cast(tf.reshape(
      partial, [-1, vocab_size, tf.shape(partial)[-1]]), tf.float64), 0)


def conv_patches(x, kernel_size, strides, padding, dilation_rate):
  """A convolution's input patches, the ``a`` of its linear form.

  x: [B, *spatial, c] (channels last, 1 or 2 spatial axes). Returns
  [B, T, prod(kernel_size)·c] with T the output positions, ordered like the
  kernel reshaped to [prod(kernel_size)·c, filters]. ``padding``: "valid",
  "same" or (1-D) "causal".
  """
  if len(kernel_size) == 1:  # a 1-D convolution is a 2-D one of height 1
    x, padding = _causal(x, kernel_size, padding, dilation_rate)
    x = x[:, tf.newaxis]
    kernel_size, strides, dilation_rate = ((1,) + tuple(kernel_size),
                                           (1,) + tuple(strides),
                                           (1,) + tuple(dilation_rate))
  if x.shape[1:].is_fully_defined():
    patches = _patches_by_slices(x, kernel_size, strides, padding,
                                 dilation_rate)
  else:
    patches = tf.image.extract_patches(
        x, sizes=[1, *kernel_size, 1], strides=[1, *strides, 1],
        rates=[1, *dilation_rate, 1], padding=padding.upper())
  positions = (patches.shape[1] * patches.shape[2]
               if patches.shape[1:3].is_fully_defined() else -1)
  return tf.reshape(patches, [tf.shape(x)[0], positions, patches.shape[-1]])


def _patches_by_slices(x, kernel_size, strides, padding, dilation_rate):
  """``tf.image.extract_patches`` of a 2-D input of static shape, by one
  strided slice per kernel offset, concatenated: the same values (zero
  padding included) in the same order (offset-major, then channel); checked
  bitwise against the op (tests/test_ghost.py).

  Under XLA the op itself is lowered to a convolution with a one-hot filter
  of (k_h·k_w·c)² entries — 8x8 patches of a 28x28 image took longer than
  the layer's own forward and backward passes; slices only move the data.
  """
  (kh, kw), (sh, sw), (dh, dw) = kernel_size, strides, dilation_rate
  height, width = x.shape[1], x.shape[2]
  def extent(size, k, stride, dilation):
    span = (k - 1) * dilation + 1
    if padding.lower() == "valid":
      return max((size - span) // stride + 1, 0), 0, 0
    out = -(-size // stride)  # SAME: ⌈size / stride⌉
    total = max((out - 1) * stride + span - size, 0)
    return out, total // 2, total - total // 2
  out_h, top, bottom = extent(height, kh, sh, dh)
  out_w, left, right = extent(width, kw, sw, dw)
  if top or bottom or left or right:
    x = tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]])
  if out_h == 0 or out_w == 0:
    return tf.zeros([tf.shape(x)[0], out_h, out_w, kh * kw * x.shape[3]],
                    x.dtype)
  rows = lambda t, i: t[:, i * dh:i * dh + (out_h - 1) * sh + 1:sh]
  cols = lambda t, j: t[:, :, j * dw:j * dw + (out_w - 1) * sw + 1:sw]
  channels = x.shape[3]
  if channels >= 16:  # one concatenation of k_h·k_w slices
    pieces = [cols(rows(x, i), j) for i in range(kh) for j in range(kw)]
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=3)
  # Few channels: a concatenation of k_h·k_w thin slices is slow under XLA
  # (4x on 8x8 patches of one channel); rows, then columns, k_h and k_w
  # operands each: [B, out_h, W, k_h, c] -> [B, out_h, out_w, k_h, k_w, c].
  by_rows = tf.stack([rows(x, i) for i in range(kh)], axis=3)
  both = tf.stack([cols(by_rows, j) for j in range(kw)], axis=4)
  return tf.reshape(both, [-1, out_h, out_w, kh * kw * channels])


def _causal(x, kernel_size, padding, dilation_rate):
  """(x, padding) with a 1-D causal padding made explicit."""
  if padding == "causal":
    x = tf.pad(x, [[0, 0], [dilation_rate[0] * (kernel_size[0] - 1), 0],
                   [0, 0]])
    padding = "valid"
  return x, padding


def single_channel_conv_applies(x_shape, kernel_shape, dilation_rate):
  """Whether :func:`single_channel_conv_unit_grads` takes a convolution:
  one input channel, no dilation, 1 or 2 spatial axes of static size. The
  input's channels are checked as well as the kernel's: a grouped
  convolution has one kernel channel per group."""
  return (len(kernel_shape) in (3, 4) and kernel_shape[-2] == 1
          and all(r == 1 for r in dilation_rate)
          and x_shape.rank == len(kernel_shape)
          and x_shape[1:].is_fully_defined() and x_shape[-1] == 1)


def single_channel_conv_unit_grads(x, delta, kernel_size, strides, padding):
  """ĝ_n = fl(∇K_n) for every row n of a convolution with ONE input channel
  (channels last, no dilation), [N, k_h·k_w, d] ordered like the kernel
  reshaped to [k_h·k_w, d]: the :func:`shared_unit_grads` of the patches,
  without the patches (k_h·k_w/(s_h·s_w) times the input: 51 MB of 8x8
  patches of 1024 MNIST images, at the step's peak memory).

  Rochette et al. (2019), "Efficient per-example gradient computations in
  convolutional neural networks": ∇K_n[i, j, f] = Σ_{p,q} x_n[s_h p + i,
  s_w q + j] δ_n[p, q, f] is a depthwise convolution of the rows, made
  channels ([1, H, W, N] -> [H, W, 1, N]), with each row's δ_n as its own
  filters, dilated by the strides. (Slower than the patches beyond one
  input channel on the CPU: CIFAR CNN5's first layer, 3 channels, 13.5 →
  33.0 ms at 256 units.)

  Each ĝ_n is a function of row n's x and δ only — a grouped convolution,
  which an implementation may run as a dense one with zero filter blocks:
  exact zeros for the other rows, but 0·inf = NaN, so non-finite values
  are zeroed before it and the row's ĝ_n made NaN after it (a row with any
  non-finite input or output gradient adds nothing; see :func:`masked`),
  and a huge row is scaled down by a power of two before it (undone
  after it), so that no transform of it overflows. On the CPU XLA keeps
  one grouped convolution.
  float32 (float64 inputs stay float64), as :func:`shared_unit_grads`,
  whose privacy argument is this one's: norms and sums from this tensor.
  """
  dtype = tf.float64 if x.dtype == tf.float64 else tf.float32
  x, delta = tf.cast(x, dtype), tf.cast(delta, dtype)
  if len(kernel_size) == 1:  # 1-D: a 2-D convolution of height 1
    x, padding = _causal(x, kernel_size, padding, (1,))
    x, delta = x[:, tf.newaxis], delta[:, tf.newaxis]
    kernel_size, strides = (1,) + tuple(kernel_size), (1,) + tuple(strides)
  (kh, kw), (sh, sw) = kernel_size, strides
  out_h, out_w, filters = delta.shape[1], delta.shape[2], delta.shape[3]
  if padding.lower() == "same":
    pad_h = max((out_h - 1) * sh + kh - x.shape[1], 0)
    pad_w = max((out_w - 1) * sw + kw - x.shape[2], 0)
    x = tf.pad(x, [[0, 0], [pad_h // 2, pad_h - pad_h // 2],
                   [pad_w // 2, pad_w - pad_w // 2], [0, 0]])
  rows = tf.shape(x)[0]
  # One zero row more: XLA's CPU convolution dies (SIGFPE) on 0 channels.
  x = tf.concat([x, tf.zeros([1, *x.shape[1:]], dtype)], 0)
  delta = tf.concat([delta, tf.zeros([1, *delta.shape[1:]], dtype)], 0)
  flat = lambda t: tf.reshape(t, [rows + 1, -1])
  # Huge rows scaled down by a power of two (exact), so that no transform
  # of them (Winograd, FFT) overflows into the other rows' results.
  x, x_exp, x_bad = _finite_scaled_down(x, flat)
  delta, delta_exp, delta_bad = _finite_scaled_down(delta, flat)
  bad = x_bad | delta_bad
  out = tf.nn.depthwise_conv2d(
      tf.transpose(x, [3, 1, 2, 0]),             # [1, H, W, N + 1]
      tf.transpose(delta, [1, 2, 0, 3]),         # [out_h, out_w, N + 1, d]
      strides=[1, 1, 1, 1], padding="VALID", dilations=[sh, sw])
  grads = tf.reshape(out[0, :kh, :kw], [kh * kw, rows + 1, filters])
  grads = tf.transpose(grads, [1, 0, 2])         # [N + 1, k_h·k_w, d]
  # Scaled back in float64, where 2^(2h) is a normal number (a float32
  # result beyond float32's range becomes ±inf, as the product would).
  scale = _power_of_two(x_exp + delta_exp, tf.float64)[:, None, None]
  grads = tf.cast(tf.cast(grads, tf.float64) * scale, dtype)
  return tf.where(bad[:, None, None], tf.constant(math.nan, dtype),
                  grads)[:rows]


def _power_of_two(exponent, dtype):
  """2^k, exactly, for integer k within the dtype's normal range."""
  if dtype == tf.float64:
    bits = tf.bitwise.left_shift(tf.cast(exponent, tf.int64) + 1023,
                                 tf.constant(52, tf.int64))
    return tf.bitcast(bits, tf.float64)
  bits = tf.bitwise.left_shift(tf.cast(exponent, tf.int32) + 127,
                               tf.constant(23, tf.int32))
  return tf.bitcast(bits, tf.float32)


def _finite_scaled_down(t, flat):
  """(t', k [N], bad [N]): bad where row n has a value that is not finite;
  t' = t with those values zeroed, times 2^−k per row: k = h where the
  row's largest magnitude is above 2^h, else 0 (h = 64 in float32, 256 in
  float64): every value then at most 2^h, far from overflowing in a sum of
  a few thousand of them. One factor, so that no optimizer can fold two
  into a subnormal; exact but for values below 2^(h−126) in such a row
  (flushed to 0).

  One reduction for both: the row's largest |value| with non-finite values
  counted as +inf (never NaN, so the maximum's NaN semantics — XLA's on the
  CPU ignores NaN — do not matter); ∞ means bad. (A finiteness reduction
  and a magnitude reduction were two passes: 3% of an MNIST CNN step.)"""
  h = 256 if t.dtype == tf.float64 else 64
  finite = tf.math.is_finite(t)
  largest = tf.reduce_max(
      flat(tf.where(finite, tf.abs(t), tf.constant(math.inf, t.dtype))),
      axis=1)
  bad = tf.equal(largest, math.inf)  # (−inf: a row of no values)
  exponent = tf.where(largest > 2.0 ** h, h, 0)
  shape = [-1] + [1] * (t.shape.rank - 1)
  scale = tf.reshape(_power_of_two(-exponent, t.dtype), shape)
  return tf.where(finite, t, tf.zeros([], t.dtype)) * scale, exponent, bad


def conv_grad(x, delta, weights, kernel_shape, strides, padding,
              dilation_rate):
  """Σ_u w_u ∇K_u of a convolution (channels last): [p, d] products of its
  input patches and output gradients, reshaped to ``kernel_shape``.

  The book-kept sum Σ_u w_u A_uᵀΔ_u, with A the patches the norms use (so
  where the norms materialized per-unit gradients they are reused; see
  :func:`linear_grad`). ``delta``: [U, ...output], one row per unit (per
  example: microbatches are weighted by repeating their weight). Not the
  convolution's own filter-gradient op: in float64 under XLA on the CPU it
  took 20x longer (413 vs 22 ms, 64 units of a 7x7x64 -> 128 layer).
  """
  a = conv_patches(x, kernel_shape[:-2], strides, padding, dilation_rate)
  delta = tf.reshape(delta, [tf.shape(delta)[0], -1, kernel_shape[-1]])
  if a.shape[1] is not None:
    delta = tf.ensure_shape(delta, [None, a.shape[1], kernel_shape[-1]])
  return tf.reshape(linear_grad(a, delta, weights), kernel_shape)


def _conv_grad_by_backprop(x, delta, weights, kernel_shape, strides, padding,
                           dilation_rate):
  """conv_grad by TensorFlow's Conv*DBackpropFilter (no patches; slow in
  float64 under XLA). Kept as the reference the tests compare with."""
  keep = weights != 0
  dtype = x.dtype
  # float64, as the norms (see linear_grad).
  x = masked(tf.cast(x, tf.float64), keep)
  delta = masked(tf.cast(delta, tf.float64), keep) * tf.reshape(
      tf.cast(weights, tf.float64), [-1] + [1] * (delta.shape.rank - 1))
  x, padding = _causal(x, kernel_shape[:-2], padding, dilation_rate)
  kernel = tf.zeros(kernel_shape, tf.float64)
  with tf.GradientTape() as tape:
    tape.watch(kernel)
    z = tf.nn.convolution(x, kernel, strides=list(strides),
                          padding=padding.upper(),
                          dilations=list(dilation_rate))
  return tf.cast(tape.gradient(z, kernel, output_gradients=delta), dtype)


def masked(t, keep):
  """Zeroes the units where ``keep`` [U] is False, even where t is inf/nan.

  A unit whose norm is not finite must add exactly zero; 0·nan is nan, so
  multiplying by a zero clip factor alone would not do.
  """
  t = tf.convert_to_tensor(t)
  return tf.math.multiply_no_nan(
      t, tf.reshape(tf.cast(keep, t.dtype), [-1] + [1] * (t.shape.rank - 1)))
