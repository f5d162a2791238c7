"""Floating point cannot be used to escape the clipping bound (ghost path).

A unit's clip factor comes from a norm computed one way (‖a‖·‖δ‖, a Gram
product, token segment sums) and its contribution to the sum another way
(book-keeping Aᵀ(c⊙Δ), a filter gradient, a scatter). A hostile review found
three ways to make the two disagree: squares that underflow to 0 in float32
(norm 0, factor 1, the full gradient added), rows that nearly cancel (the
Gram norm loses the difference), and token ids past the table (counted as
distinct rows by the norm, added to one row by the sum). Each test measures
‖S(X) − S(X without the attacker)‖ ≤ C with σ = 0.
"""
import fractions

import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dpadambc.core import clipping
from tf_dpadambc.core import ghost
from tf_dpadambc.keras import training

C = 1.0
TOL = 1 + 1e-4


def _moved(model, x, y, attacker, method="auto", jit=False, signature=None):
  def release(x, y):
    return training.private_gradient_sum(model, x, y, None,
                                         clipping.ClipSpec(C), None,
                                         method)[0].grads
  fn = tf.function(release, jit_compile=jit, input_signature=signature)
  keep = np.arange(len(x)) != attacker
  full = fn(tf.constant(x), tf.constant(y))
  without = fn(tf.constant(x[keep]), tf.constant(y[keep]))
  return float(np.sqrt(sum(np.sum((a.numpy() - b.numpy()) ** 2)
                           for a, b in zip(full, without))))


@pytest.mark.parametrize("method", ["auto", "vectorized"])
def test_norms_that_underflow_in_float32_do_not_unclip_a_unit(method):
  # Features of 1e-19 square to 0 in float32; a label of 9e18 makes δ huge:
  # the float32 norm ‖a‖·‖δ‖ was 0 and the unit added its gradient (28.8C).
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((256,)),
                            keras.layers.Dense(1, use_bias=False)])
  model.compile(loss="mse")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 256)).astype("float32")
  y = rng.normal(size=(8, 1)).astype("float32")
  x[0], y[0] = 1e-19, 9e18
  assert _moved(model, x, y, 0, method) <= C * TOL


@pytest.mark.parametrize("scale,k", [(1e6, 14), (1e10, 18), (1e12, 20)])
def test_rows_that_nearly_cancel_do_not_shrink_the_norm(scale, k):
  # a₂ = −(1 + 2⁻ᵏ)·a₁ at two positions with equal δ: ⟨AAᵀ, ΔΔᵀ⟩ in float32
  # lost the difference (the sum moved by 1.58C).
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((2, 16)), keras.layers.Dense(16),
                            keras.layers.GlobalAveragePooling1D(),
                            keras.layers.Dense(1)])
  model.compile(loss="mse")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 2, 16)).astype("float32")
  y = rng.normal(size=(8, 1)).astype("float32")
  v = np.sign(rng.normal(size=16)).astype("float32")
  x[0, 0], x[0, 1] = scale * v, -(1 + 2.0 ** -k) * scale * v
  assert _moved(model, x, y, 0) <= C * TOL


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("layer", ["dense", "conv"])
@pytest.mark.parametrize("scale,k", [(1e6, 14), (1e12, 20)])
def test_rows_that_nearly_cancel_in_a_materialized_layer(jit, layer, scale, k):
  # 16 positions of a 4 -> 4 layer (2T² ≥ pd): the per-unit gradients are
  # materialized once in float32 and shared by the norm and the sum, so
  # however they round, the unit adds at most C.
  keras.utils.set_random_seed(0)
  first = (keras.layers.Dense(4) if layer == "dense"
           else keras.layers.Conv1D(4, 1))
  model = keras.Sequential([keras.Input((16, 4)), first,
                            keras.layers.GlobalAveragePooling1D(),
                            keras.layers.Dense(1)])
  model.compile(loss="mse")
  assert ghost.materializes_both(16, 4, 4)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 16, 4)).astype("float32")
  y = rng.normal(size=(8, 1)).astype("float32")
  v = np.sign(rng.normal(size=4)).astype("float32")
  x[0, :8], x[0, 8:] = scale * v, -(1 + 2.0 ** -k) * scale * v
  y[0] = 1e6
  assert _moved(model, x, y, 0, jit=jit) <= C * TOL


def test_token_ids_past_the_table_count_as_the_rows_they_read():
  # Under XLA a lookup clamps ids; with an unknown sequence length the norm
  # used int64 keys (ids 7 + k·2³² were distinct rows) but the sum int32
  # (all row 7): the sum moved by 6.5C. Both now clamp to [0, vocab).
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((None,), dtype="int64"),
                            keras.layers.Embedding(50, 4),
                            keras.layers.GlobalAveragePooling1D(),
                            keras.layers.Dense(1, use_bias=False)])
  model.compile(loss="mse")
  rng = np.random.default_rng(0)
  x = rng.integers(0, 50, (8, 64)).astype("int64")
  y = rng.normal(size=(8, 1)).astype("float32")
  x[0] = 7 + np.arange(1, 65, dtype=np.int64) * 2 ** 32
  y[0] = 1e6
  signature = [tf.TensorSpec([None, None], tf.int64),
               tf.TensorSpec([None, 1], tf.float32)]
  assert _moved(model, x, y, 0, jit=True, signature=signature) <= C * TOL


def test_guarded_norms_fall_back_to_the_triangle_bound():
  # Exactly cancelling rows: the computed norm is 0 at rounding level, so
  # the unit is clipped by Σ_t ‖a_t‖‖δ_t‖ instead.
  a = np.array([[[1e8, 1.0], [-1e8, -1.0]]], "float32")
  d = np.array([[[1.0], [1.0]]], "float32")
  got = float(ghost.linear_sq_norms(a, d)[0])
  bound = 2 * np.linalg.norm(a[0, 0]) * 1.0
  assert got == pytest.approx(bound ** 2, rel=1e-6)
  # and an ordinary unit keeps its exact norm
  rng = np.random.default_rng(1)
  a = rng.normal(size=(2, 5, 4)).astype("float32")
  d = rng.normal(size=(2, 5, 3)).astype("float32")
  want = np.sum(np.einsum("utp,utd->upd", a, d) ** 2, axis=(1, 2))
  np.testing.assert_allclose(ghost.linear_sq_norms(a, d), want, rtol=1e-5)


def test_guard_keeps_only_norms_within_2_to_the_minus_21():
  """A kept squared norm is at least GUARD_MARGIN = 2²¹ times its worst-case
  float64 rounding error terms·2⁻⁵³·bound², so it is within 2⁻²¹ of the true
  one; just below that the unit takes the bound (a margin of 1000 kept it,
  and a norm up to 5·10⁻⁴ low). Ordinary long-sequence units of float64
  inputs keep their exact ghost norm (float32 inputs take the float32 Gram
  bound: test_float32_ghost_norms_are_certified_upper_bounds)."""
  terms, bound = 4352, np.array([3.0, 3.0])
  threshold = ghost.GUARD_MARGIN * terms * 2.0**-53 * bound[0] ** 2
  assert ghost.GUARD_MARGIN >= 2.0**21
  sq = np.array([0.99, 1.01]) * threshold
  got = ghost.guarded(tf.constant(sq), tf.constant(bound), terms).numpy()
  assert got[0] == bound[0] ** 2 and got[1] == sq[1]
  rng = np.random.default_rng(2)  # T = 64, p = d = 128: the Gram path
  a = rng.normal(size=(3, 64, 128))
  d = rng.normal(size=(3, 64, 128))
  assert ghost.prefer_ghost(64, 128, 128)
  want = np.sum(np.einsum("utp,utd->upd", a, d) ** 2, axis=(1, 2))
  np.testing.assert_allclose(ghost.linear_sq_norms(a, d), want, rtol=1e-9)


def _exact_sq_norms(a, d):
  """‖A_uᵀΔ_u‖²_F of the given float values, in exact rational arithmetic."""
  out = []
  for a_u, d_u in zip(a, d):
    rows_a = [[fractions.Fraction(float(v)) for v in row] for row in a_u]
    rows_d = [[fractions.Fraction(float(v)) for v in row] for row in d_u]
    out.append(sum(
        sum(x[i] * y[j] for x, y in zip(rows_a, rows_d)) ** 2
        for i in range(len(rows_a[0])) for j in range(len(rows_d[0]))))
  return out


def _float32_gram_norms(a, d, jit):
  return tf.function(ghost.linear_sq_norms, jit_compile=jit)(
      tf.constant(a), tf.constant(d)).numpy()


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**32 - 1),
                  exponents=st.lists(st.integers(-150, 60), min_size=5,
                                     max_size=5),
                  cancel=st.integers(0, 30), jit=st.booleans())
def test_float32_ghost_norms_are_certified_upper_bounds(seed, exponents,
                                                        cancel, jit):
  """The float32 Gram path's result is ≥ the exact squared norm, whatever
  the data: rows scaled by 2^k from denormal (read as zero under
  flush-to-zero) to overflowing float32's Gram matrices (the triangle
  bound), and two rows of a that cancel to 2⁻ᵏ with equal δ rows (the
  float32 Gram matrices lose the difference). Checked in exact rational
  arithmetic, with and without XLA."""
  rng = np.random.default_rng(seed)
  units, positions, p, dim = 4, 5, 24, 12
  assert ghost.prefer_ghost(positions, p, dim)
  scales = np.array([2.0 ** k for k in exponents])
  a = (rng.normal(size=(units, positions, p)) * scales[:, None]).astype(
      "float32")
  d = (rng.normal(size=(units, positions, dim))
       * scales[::-1, None]).astype("float32")
  if cancel:
    a[0, 1] = -(1 + 2.0 ** -cancel) * a[0, 0]
    d[0, 1] = d[0, 0]
  assert ghost.float32_gram_applies(tf.constant(a), tf.constant(d))
  got = _float32_gram_norms(a, d, jit)
  for g, want in zip(got, _exact_sq_norms(a, d)):
    assert np.isfinite(g) and fractions.Fraction(float(g)) >= want


@pytest.mark.parametrize("jit", [False, True])
def test_float32_ghost_norms_cover_the_worst_rounding_and_underflow(jit):
  """Two cases the bound must pay for in full. A row (1, s, …, s) of
  p = 4,096 with s² just under half of 1's ulp: added one by one, as XLA's
  CPU product does, every s² rounds away (the squared norm comes out 1, low
  by ≈ (p − 1)·u: all of γ_p). Rows of 2⁻⁶⁶, whose products 2⁻¹³² are
  flushed to zero: the Gram matrix is 0, and only the underflow terms
  (n·2⁻¹²⁶ per entry) cover the norm. Rows of 3·10³⁷ (the Gram matrix
  overflows: the triangle bound) against δ of 1.1·10⁻³⁸, which a cast to
  float64 reads as zero: a review's case, once 0 against 70.6."""
  rows = np.full((2, 4096), np.float32(2.0 ** -12 * 0.99), np.float32)
  rows[:, 0] = 1.0
  cases = [(rows[None], np.eye(2, 8, dtype=np.float32)[[0, 0]][None]),
           (np.full((1, 2, 24), 2.0 ** -66, np.float32),
            np.ones((1, 2, 12), np.float32)),
           (np.array([[[3e37] * 24, [-1.5e37] * 24]], np.float32),
            np.array([[[1.1e-38] * 12, [-1.1e-38] * 12]], np.float32))]
  for a, d in cases:
    assert ghost.float32_gram_applies(tf.constant(a), tf.constant(d))
    got = _float32_gram_norms(a, d, jit)
    assert fractions.Fraction(float(got[0])) >= _exact_sq_norms(a, d)[0]


@pytest.mark.parametrize("jit", [False, True])
def test_float32_ghost_norms_stay_within_their_rounding_of_the_exact(jit):
  """On ordinary data (CIFAR CNN5's third convolution: T = 49, p = 576,
  d = 128, rows of a all positive as after a ReLU) the bound's excess is
  about (γ_p + γ_d) times the Gram matrices' off-diagonal mass: under
  10⁻³ of the squared norm. A unit whose float32 Gram matrix overflows
  takes the triangle bound (Σ_t ‖a_t‖‖δ_t‖)², the others keep theirs; a
  unit with a NaN stays non-finite (dropped by its clip factor)."""
  rng = np.random.default_rng(3)
  a = np.abs(rng.normal(size=(4, 49, 576))).astype("float32")
  d = rng.normal(size=(4, 49, 128)).astype("float32")
  a[1] *= 1e18  # ‖a_t‖² ≈ 5.8·10³⁸ > float32's largest
  a[2, 3, 4] = np.nan
  got = _float32_gram_norms(a, d, jit)
  a64, d64 = a.astype(np.float64), d.astype(np.float64)
  want = np.sum(np.einsum("utp,utd->upd", a64, d64) ** 2, axis=(1, 2))
  ratio = got / want
  assert 1.0 < ratio[0] < 1.0 + 1e-3 and 1.0 < ratio[3] < 1.0 + 1e-3
  triangle = np.sum(np.linalg.norm(a64[1], axis=1)
                    * np.linalg.norm(d64[1], axis=1)) ** 2
  np.testing.assert_allclose(got[1], triangle, rtol=1e-9)
  assert got[1] >= want[1] and not np.isfinite(got[2])


@pytest.mark.parametrize("setting", [
    "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE",
    "TF_SET_ONEDNN_FPMATH_MODE", "TF_ENABLE_AUTO_MIXED_PRECISION",
    "auto_mixed_precision_onednn_bfloat16", "auto_mixed_precision_mkl",
    "auto_mixed_precision"])
def test_float32_ghost_norms_need_exact_float32_products(monkeypatch,
                                                         setting):
  """Where float32 products may run in bfloat16 or TF32 — oneDNN's fpmath
  mode (either name; a review found DNNL_… unread: a norm 0.27 of the
  exact one, 1.94C end to end), or a Grappler mixed precision rewrite — or
  the inputs are float64, the Gram matrices are float64 and guarded, as
  exact as before; no float32 sum runs either."""
  rng = np.random.default_rng(4)
  a = rng.normal(size=(2, 8, 64)).astype("float32")
  d = rng.normal(size=(2, 8, 32)).astype("float32")
  want = np.sum(np.einsum("utp,utd->upd", a.astype(np.float64),
                          d.astype(np.float64)) ** 2, axis=(1, 2))
  assert ghost.float32_gram_applies(tf.constant(a), tf.constant(d))
  assert ghost.float32_max_units(1024, 64, tf.float32) > 0
  assert not ghost.float32_gram_applies(tf.constant(a, tf.float64),
                                        tf.constant(d, tf.float64))
  if setting.isupper():
    monkeypatch.setenv(setting, "1" if "PRECISION" in setting else "BF16")
  else:
    tf.config.optimizer.set_experimental_options({setting: True})
  try:
    assert not ghost.float32_gram_applies(tf.constant(a), tf.constant(d))
    assert ghost.float32_max_units(1024, 64, tf.float32) == 0
    assert ghost.embedding_float32_max_units(10000, 16, tf.float32) == 0
    np.testing.assert_allclose(_float32_gram_norms(a, d, False), want,
                               rtol=1e-12)
  finally:
    if not setting.isupper():
      tf.config.optimizer.set_experimental_options({setting: False})


def test_float32_ghost_norms_need_fewer_than_2_to_the_20_features():
  """γ_n = nu/(1 − nu) bounds n roundings only for nu < 1: past 2²⁴
  features it went negative and a review's attacker got norm 0 (2.9·10⁷C
  end to end). Above 2²⁰ features a side the Gram matrices are float64."""
  wide, narrow = tf.zeros([1, 2, (1 << 20) + 1]), tf.zeros([1, 2, 1])
  assert not ghost.float32_gram_applies(wide, narrow)
  assert not ghost.float32_gram_applies(narrow, wide)
  assert ghost.float32_gram_applies(tf.zeros([1, 2, 1 << 20]), narrow)
  with pytest.raises(ValueError):
    ghost._gamma32((1 << 20) + 1)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scale,k,tiny", [(1e6, 14, False), (1e12, 20, False),
                                          (1.0, 0, True)])
def test_a_convolution_on_the_float32_gram_path_adds_at_most_c(jit, scale, k,
                                                               tiny):
  """A 3 × 3 convolution of 64 → 64 channels on 3 × 3 inputs (T = 9:
  the float32 ghost norm) with an attacker whose positions nearly cancel,
  or whose inputs are denormal (read as zero by float32 products under
  flush-to-zero) against a huge label: its unit moves the sum by at most C."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3, 3, 64)),
                            keras.layers.Conv2D(64, 3, padding="same"),
                            keras.layers.GlobalAveragePooling2D(),
                            keras.layers.Dense(1)])
  model.compile(loss="mse")
  assert ghost.prefer_ghost(9, 576, 64) and not ghost.materializes_both(
      9, 576, 64)
  rng = np.random.default_rng(5)
  x = rng.normal(size=(8, 3, 3, 64)).astype("float32")
  y = rng.normal(size=(8, 1)).astype("float32")
  if tiny:
    x[0] = np.float32(1e-40) * np.sign(rng.normal(size=(3, 3, 64)))
    y[0] = 3e38
  else:
    v = np.sign(rng.normal(size=64)).astype("float32")
    x[0, :, :2], x[0, :, 2:] = scale * v, -(1 + 2.0 ** -k) * scale * v
    y[0] = 1e6
  assert _moved(model, x, y, 0, jit=jit) <= C * TOL


@pytest.mark.parametrize("jit", [False, True])
def test_float32_sums_of_squares_are_certified_upper_bounds(jit):
  """The shared per-unit gradients' squared norms (float32 squares added
  k at a time, the partial sums in float64) are ≥ the exact sums, in
  exact rational arithmetic: against the worst rounding (a 1 then squares
  just under half its ulp, each lost when added one by one: γ_k in full),
  denormal and flushed values, and 30 binades; a square past float32's
  range takes the float64 sum (within 2⁻³⁰ there), a NaN stays NaN."""
  rng = np.random.default_rng(6)
  worst = np.full((1, 4, 64), np.float32(2.0 ** -12 * 0.99), np.float32)
  worst[0, :, 0] = 1.0
  wide = (rng.normal(size=(3, 16, 8))
          * 2.0 ** rng.integers(-75, 60, size=(3, 16, 1))).astype("float32")
  wide[0, :2] = np.float32(1e-40)  # denormal: read as zero
  wide[1, :, :] = np.float32(2.0 ** -66)  # squares flushed to zero
  huge = rng.normal(size=(2, 16, 8)).astype("float32")
  huge[0, 3, 1] = 3e20
  huge[1, 0, 0] = np.nan
  assert ghost._float32_sum_length(tf.TensorShape([16, 8])) == 8
  assert ghost._float32_sum_length(tf.TensorShape([2, 2048])) == 128
  # No good k, no values, or past 2²² partial sums: the float64 sum (a
  # review found the last two raising where the float64 sum had run).
  for shape in ([1, 1031], [4, 0], [2 ** 16, 2 ** 15], [None, 8]):
    assert ghost._float32_sum_length(tf.TensorShape(shape)) is None
  np.testing.assert_array_equal(
      ghost.shared_sq_norms(tf.ones([2, 4, 0])).numpy(), [0.0, 0.0])
  fn = tf.function(ghost.shared_sq_norms, jit_compile=jit)
  for grads in (worst, wide, huge):
    got = fn(tf.constant(grads)).numpy()
    for u, g in enumerate(grads):
      if np.isnan(g).any():
        assert np.isnan(got[u])
        continue
      want = sum(fractions.Fraction(float(v)) ** 2 for v in g.ravel())
      assert fractions.Fraction(float(got[u])) >= want
      assert got[u] <= float(want) * (1 + 1e-5) + 1e-30
  exact = np.sum(huge[0].astype(np.float64) ** 2)
  np.testing.assert_allclose(fn(tf.constant(huge)).numpy()[0], exact,
                             rtol=1e-9)


def test_weighted_sums_of_materialized_gradients_accumulate_in_float64():
  """Σ_u w_u g_u of float32 per-unit gradients is summed in float64: units
  that cancel leave the small one exactly (a float32 sum loses it), and a
  zero-weight unit with NaN adds exactly 0."""
  g = np.array([[2.0**25, 1.0], [1.0, 1.0], [-(2.0**25), 1.0], [np.nan, 1.0]],
               np.float32)
  w = np.array([1.0, 1.0, 1.0, 0.0], np.float32)
  for jit in (False, True):
    got = tf.function(ghost.weighted_sum, jit_compile=jit)(
        tf.constant(g), tf.constant(w)).numpy()
    assert got.dtype == np.float64  # rounded only after the noise
    np.testing.assert_array_equal(got, [1.0, 3.0])
