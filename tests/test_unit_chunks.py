"""core.unit_chunks: per-unit computations over chunks of units."""
import numpy as np
import pytest
import tensorflow as tf

from tf_dpadambc.core import unit_chunks


def test_chunk_size_balances_chunks_within_the_budget():
  """None where one pass fits (or U or the bytes are unknown); otherwise
  the fewest chunks of at most budget/bytes units, balanced; a per-chunk
  shared cost raises the budget to itself."""
  assert unit_chunks.chunk_size(None, 10, budget=100) is None
  assert unit_chunks.chunk_size(10, None, budget=100) is None
  assert unit_chunks.chunk_size(10, 10, budget=100) is None
  assert unit_chunks.chunk_size(11, 10, budget=100) == 6  # 2 chunks: 6 + 5
  assert unit_chunks.chunk_size(1000, 10, budget=100) == 10
  assert unit_chunks.chunk_size(5, 1000, budget=100) == 1
  # A chunk's own call takes one pass (a unit past the budget alone once
  # chunked its one-unit chunk again, without end).
  assert unit_chunks.chunk_size(1, 1000, budget=100) is None
  for units in range(2, 40):
    for size in (1, 7, 30, 101):
      chunk = unit_chunks.chunk_size(units, size, budget=100)
      if chunk is not None:
        assert unit_chunks.chunk_size(chunk, size, budget=100) is None
  assert unit_chunks.chunk_size(30, 10, shared_bytes=150, budget=100) == 15


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("units,chunk", [(7, 3), (6, 3), (4, 4), (5, 1)])
def test_map_and_sum_over_chunks_equal_one_pass(jit, units, chunk):
  """Per-unit values (several, of several shapes) and a weighted sum over
  chunks equal one pass: the last chunk's copies of the last unit are
  dropped from the values and weighted 0 in the sum (NaN rows included:
  ``fn`` zeroes them)."""
  rng = np.random.default_rng(3)
  x = tf.constant(rng.normal(size=(units, 4, 2)), tf.float64)
  w = tf.constant(rng.uniform(size=units), tf.float64)

  def per_unit(t):
    return (tf.reduce_sum(tf.square(t[0]), [1, 2]), t[0][:, 1] * 2.0,
            tf.cast(tf.argmax(t[0][:, :, 0], 1), tf.int32))

  def weighted(t, real):
    keep = tf.where(real, t[1], tf.zeros_like(t[1]))
    return tf.reduce_sum(
        tf.math.multiply_no_nan(t[0], keep[:, None, None]), 0)

  specs = (tf.TensorSpec([], tf.float64), tf.TensorSpec([2], tf.float64),
           tf.TensorSpec([], tf.int32))
  got = tf.function(lambda: unit_chunks.map_chunks(per_unit, (x, w), chunk,
                                                   specs),
                    jit_compile=jit)()
  once = tf.function(lambda: per_unit((x, w)), jit_compile=jit)()
  for a, b in zip(got, once):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  total = tf.function(lambda: unit_chunks.sum_chunks(
      weighted, (x, w), chunk, tf.zeros([4, 2], tf.float64)),
                      jit_compile=jit)()
  np.testing.assert_allclose(
      total.numpy(), np.einsum("utd,u->td", x.numpy(), w.numpy()),
      rtol=1e-14)
  # The last unit's copies carry its NaN rows with weight 0: dropped.
  nan_x = tf.tensor_scatter_nd_update(x, [[0, 0, 0]], [np.nan])
  nan_w = tf.tensor_scatter_nd_update(w, [[0]], [0.0])
  nan_total = unit_chunks.sum_chunks(weighted, (nan_x, nan_w), chunk,
                                     tf.zeros([4, 2], tf.float64))
  assert np.all(np.isfinite(nan_total.numpy()))


@pytest.mark.parametrize("units,chunk", [(6, 3), (7, 3)])
def test_a_tensor_of_unknown_shape_beside_static_units(units, chunk):
  """U is the first tensor's static size; another tensor whose own leading
  axis (weights traced as [None]) or row shape is unknown is gathered, not
  sliced, and the sum is still the one-pass sum (a slice read its unknown
  axis as U and failed to trace)."""
  rng = np.random.default_rng(5)
  x = tf.constant(rng.normal(size=(units, 3)), tf.float64)
  w = rng.uniform(size=units)

  def weighted(t, real):
    keep = tf.where(real, t[1], tf.zeros_like(t[1]))
    return tf.reduce_sum(t[0] * keep[:, None], 0)

  total = tf.function(
      lambda w: unit_chunks.sum_chunks(weighted, (x, w), chunk,
                                       tf.zeros([3], tf.float64)),
      input_signature=[tf.TensorSpec([None], tf.float64)])(w)
  np.testing.assert_allclose(total.numpy(), w @ x.numpy(), rtol=1e-14)
