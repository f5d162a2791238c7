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
  and a norm up to 5·10⁻⁴ low). Ordinary long-sequence units keep their
  exact ghost norm."""
  terms, bound = 4352, np.array([3.0, 3.0])
  threshold = ghost.GUARD_MARGIN * terms * 2.0**-53 * bound[0] ** 2
  assert ghost.GUARD_MARGIN >= 2.0**21
  sq = np.array([0.99, 1.01]) * threshold
  got = ghost.guarded(tf.constant(sq), tf.constant(bound), terms).numpy()
  assert got[0] == bound[0] ** 2 and got[1] == sq[1]
  rng = np.random.default_rng(2)  # T = 64, p = d = 128: the Gram path
  a = rng.normal(size=(3, 64, 128)).astype("float32")
  d = rng.normal(size=(3, 64, 128)).astype("float32")
  assert ghost.prefer_ghost(64, 128, 128)
  want = np.sum(np.einsum("utp,utd->upd", a.astype(np.float64),
                          d.astype(np.float64)) ** 2, axis=(1, 2))
  np.testing.assert_allclose(ghost.linear_sq_norms(a, d), want, rtol=1e-9)


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
