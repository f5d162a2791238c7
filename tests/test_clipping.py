"""Per-unit clipping: the bound, non-finite units, and the two exact paths."""
import numpy as np
import pytest
import tensorflow as tf

from tf_dpadambc.core import clipping
from tf_dpadambc.core import per_example

C = 1.5


def _per_unit(rng, scales):
  """Per-unit gradients over two 'parameters', unit u scaled by scales[u]."""
  a = rng.normal(size=(len(scales), 3, 4)).astype("float32")
  b = rng.normal(size=(len(scales), 5)).astype("float32")
  s = np.asarray(scales, "float32")
  return [a * s[:, None, None], b * s[:, None]]


def _norms(grads):
  return np.sqrt(sum(np.sum(np.reshape(g, (g.shape[0], -1)).astype("float64") ** 2,
                            axis=1) for g in grads))


def test_clipped_norms_bounded_including_huge_and_nonfinite():
  rng = np.random.default_rng(0)
  grads = _per_unit(rng, [1e-3, 0.5, 10.0, 1e30, 1.0, 5e37])
  grads[0][4, 0, 0] = np.nan
  grads[1][1, 2] = np.inf
  clipped, _, _, ok = clipping.clip_per_unit([tf.constant(g) for g in grads], C)
  norms = clipping.per_unit_global_norms([tf.constant(g) for g in grads])
  clipped = [c.numpy() for c in clipped]
  out = _norms(clipped)
  assert np.all(np.isfinite(out))
  assert np.all(out <= C * (1 + 1e-6)), out
  # Units 0 (small) untouched; 2, 3, 5 (huge but finite) clipped to exactly C.
  np.testing.assert_allclose(out[[2, 3, 5]], C, rtol=1e-5)
  np.testing.assert_allclose(clipped[0][0], grads[0][0], rtol=1e-6)
  # Non-finite units 1 and 4 contribute exactly zero.
  assert out[1] == 0 and out[4] == 0
  np.testing.assert_array_equal(ok.numpy(), [1, 0, 1, 1, 0, 1])
  norms = norms.numpy()
  assert not np.isfinite(norms[1]) and not np.isfinite(norms[4])
  np.testing.assert_allclose(norms[3], _norms([g[3:4] / 1e30 for g in grads])[0]
                             * 1e30, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_clipped_units_stay_within_c_in_float64(dtype):
  # The ratio, the factor and the product run in float64. In the gradients'
  # dtype about half of these clipped units came out above C: by up to
  # 8.7e-8 relative in float32, 8.7e-4 in float16 and 5.0e-3 in bfloat16
  # (a sum of n squares can round by ≈n·2⁻ᵖ relative in the worst case).
  rng = np.random.default_rng(3)
  grads = [tf.constant(rng.normal(size=(64, 300, 40)), dtype),
           tf.constant(rng.normal(size=(64, 7)), dtype)]
  clipped, _, was_clipped, ok = clipping.clip_per_unit(grads, C)
  assert np.all(ok.numpy()) and np.all(was_clipped.numpy())
  out = _norms([c.numpy().astype("float64") for c in clipped])
  assert np.all(out <= C * (1 + 1e-13)), np.max(out / C - 1)
  np.testing.assert_allclose(out, C, rtol=1e-13)
  assert all(c.dtype == tf.float64 for c in clipped)
  result = clipping.materialized_clipped_sum(grads, C)
  for got, w in zip(result.grads, [c.numpy().sum(0) for c in clipped]):
    assert got.dtype == tf.float64
    np.testing.assert_allclose(got.numpy(), w, rtol=1e-12, atol=1e-12)


def test_materialized_sum_counts_clipped_and_nonfinite():
  rng = np.random.default_rng(1)
  grads = _per_unit(rng, [0.01, 100.0, 100.0, 0.02])
  grads[0][3, 0, 0] = np.nan
  result = clipping.materialized_clipped_sum([tf.constant(g) for g in grads], C)
  assert int(result.num_clipped) == 2
  assert int(result.num_nonfinite) == 1
  n = _norms(grads)
  factors = np.minimum(1, C / n[:3])
  expected = [np.tensordot(factors, g[:3], 1) for g in grads]
  for got, want in zip(result.grads, expected):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_clip_factors():
  f = clipping.clip_factors(tf.constant([0.5, 3.0, np.inf, np.nan, 0.0]), 1.5)
  np.testing.assert_allclose(f.numpy(), [1.0, 0.5, 0.0, 0.0, 1.0])


def _linear_problem(rng, n=8, d=5):
  x = rng.normal(size=(n, d)).astype("float32")
  x[2] *= 50.0  # a unit whose gradient gets clipped hard
  y = rng.normal(size=(n,)).astype("float32")
  w = tf.constant(rng.normal(size=(d,)).astype("float32"))
  bias = tf.constant(0.3)

  def unit_loss_fn(params, unit):
    ux, uy = unit
    pred = tf.linalg.matvec(ux, params[0]) + params[1]
    return tf.reduce_mean(tf.square(pred - uy)), pred

  return x, y, [w, bias], unit_loss_fn


def test_clipped_sum_equals_numpy():
  rng = np.random.default_rng(2)
  x, y, params, unit_loss_fn = _linear_problem(rng)
  units = per_example.split_microbatches((x, y), None)
  exact, losses, _ = clipping.clipped_gradient_sum(
      unit_loss_fn, params, units, C)
  # NumPy: per-example gradient of (x·w + b − y)² is 2r·(x, 1).
  r = x @ params[0].numpy() + params[1].numpy() - y
  g = np.concatenate([2 * r[:, None] * x, 2 * r[:, None]], axis=1)
  f = np.minimum(1, C / np.linalg.norm(g, axis=1))
  want = (f[:, None] * g).sum(0)
  got = np.concatenate([exact.grads[0].numpy(), [exact.grads[1].numpy()]])
  np.testing.assert_allclose(got, want, rtol=1e-4)
  assert int(exact.num_clipped) == int(np.sum(np.linalg.norm(g, axis=1) > C))
  np.testing.assert_allclose(losses.numpy(), r ** 2, rtol=1e-5)


def test_nonfinite_example_is_zeroed():
  rng = np.random.default_rng(3)
  x, y, params, unit_loss_fn = _linear_problem(rng)
  x[5, 1] = np.nan
  units = per_example.split_microbatches((x, y), None)
  result, _, _ = clipping.clipped_gradient_sum(
      unit_loss_fn, params, units, C)
  assert int(result.num_nonfinite) == 1
  keep = np.arange(8) != 5
  ref, _, _ = clipping.clipped_gradient_sum(
      unit_loss_fn, params,
      per_example.split_microbatches((x[keep], y[keep]), None), C)
  for got, want in zip(result.grads, ref.grads):
    assert np.all(np.isfinite(got.numpy()))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)


def test_microbatches_clip_the_mean_gradient_of_each_group():
  rng = np.random.default_rng(4)
  x, y, params, unit_loss_fn = _linear_problem(rng)
  units = per_example.split_microbatches((x, y), 4)
  assert units[0].shape == (4, 2, 5)
  result, _, _ = clipping.clipped_gradient_sum(
      unit_loss_fn, params, units, C)
  r = x @ params[0].numpy() + params[1].numpy() - y
  g = np.concatenate([2 * r[:, None] * x, 2 * r[:, None]], axis=1)
  g = g.reshape(4, 2, -1).mean(1)
  f = np.minimum(1, C / np.linalg.norm(g, axis=1))
  want = (f[:, None] * g).sum(0)
  got = np.concatenate([result.grads[0].numpy(), [result.grads[1].numpy()]])
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_microbatches_must_divide_the_batch():
  with pytest.raises(ValueError, match="does not divide"):
    per_example.split_microbatches(tf.zeros([10, 3]), 4)


def test_vectorization_never_falls_back_to_a_while_loop():
  # An op without a pfor rule must fail loudly rather than run as a loop.
  def unit_loss_fn(params, unit):
    return tf.nn.l2_loss(params[0] * unit) + tf.py_function(
        lambda: 0.0, [], tf.float32), ()
  with pytest.raises(Exception):
    per_example.per_unit_norms(unit_loss_fn, [tf.ones([3])], tf.ones([4, 3]))


def test_a_list_of_clip_norms_means_per_layer_clipping():
  # A bare list (as DPOptimizer.l2_norm_clip holds it) must clip each tensor
  # to its own bound, never be broadcast against the units.
  from tf_dpadambc.core import clipping as clipping_lib
  rng = np.random.default_rng(3)
  grads = [tf.constant(rng.normal(size=(2, 5)) * 10, tf.float32),
           tf.constant(rng.normal(size=(2, 3)) * 10, tf.float32)]
  spec = clipping_lib.as_spec([0.5, 2.0])
  assert spec.layer_clips == [0.5, 2.0]
  assert spec.sensitivity == pytest.approx(np.hypot(0.5, 2.0))
  result = clipping_lib.materialized_clipped_sum(grads, [0.5, 2.0])
  # Two units, each tensor clipped to its bound (all norms ≫ bound).
  for total, bound, g in zip(result.grads, (0.5, 2.0), grads):
    per_unit = g.numpy() * (bound / np.linalg.norm(g.numpy(), axis=1,
                                                   keepdims=True))
    np.testing.assert_allclose(total.numpy(), per_unit.sum(0), rtol=1e-5)


@pytest.mark.parametrize("flags,refused", [
    ("--xla_cpu_enable_fast_math=true --xla_cpu_fast_math_honor_nans=false",
     True),
    ("--xla_cpu_enable_fast_math --xla_cpu_fast_math_honor_infs=0", True),
    ("--xla_cpu_enable_fast_math=true", False),  # NaN and inf still honored
    ("--xla_cpu_fast_math_honor_nans=false", False),  # without fast math
    ("--xla_dump_to=/tmp/x", False),
    ("", False)])
def test_xla_flags_that_may_assume_finite_values_are_refused(flags, refused):
  """An XLA told it may assume no NaN or infinity could fold the checks
  that give a non-finite unit a clip factor of 0 (and the float32 sums'
  NaN test): such XLA_FLAGS are refused, with a message naming them;
  other flags pass."""
  from tf_dpadambc.core import xla_hints  # pylint: disable=import-outside-toplevel
  if refused:
    with pytest.raises(RuntimeError, match="honor"):
      xla_hints.check_ieee_floats(flags)
  else:
    xla_hints.check_ieee_floats(flags)


def test_clipping_checks_the_xla_flags_when_traced(monkeypatch):
  """clip_factors and clip_per_unit (every clipping path takes one) read
  XLA_FLAGS and refuse fast math without NaN; with the flags unset they
  clip, and a non-finite unit gets a factor of 0."""
  norms = tf.constant([1.0, float("nan"), 4.0])
  grads = [tf.constant([[3.0, 4.0], [float("inf"), 0.0]])]
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true "
                     "--xla_cpu_fast_math_honor_nans=false")
  with pytest.raises(RuntimeError, match="honor_nans"):
    clipping.clip_factors(norms, 2.0)
  with pytest.raises(RuntimeError, match="honor_nans"):
    clipping.clip_per_unit(grads, 2.0)
  monkeypatch.delenv("XLA_FLAGS")
  np.testing.assert_allclose(clipping.clip_factors(norms, 2.0).numpy(),
                             [1.0, 0.0, 0.5])
  clipped = clipping.clip_per_unit(grads, 2.0)[0][0].numpy()
  np.testing.assert_allclose(clipped, [[1.2, 1.6], [0.0, 0.0]])


def test_automatic_gamma_is_not_rounded_through_float32():
  """γ given as a Python number reaches the float64 factors directly: a γ
  below float32's range (1e-40) had become 0, and a zero gradient's factor
  C/γ infinite (then 0·inf = NaN in its share of the sum). The optimizers
  refuse γ < 1e-20, where C/γ could leave float32's range."""
  import tf_dpadambc as dp  # pylint: disable=import-outside-toplevel
  norms = tf.constant([0.0, 2.0], tf.float64)
  factors = clipping.clip_factors(norms, 1.0, automatic_gamma=1e-40).numpy()
  np.testing.assert_allclose(factors, [1e40, 0.5])
  clipped = clipping.clip_per_unit(
      [tf.constant([[0.0, 0.0], [0.0, 2.0]])], 1.0, automatic_gamma=1e-40)[0]
  np.testing.assert_array_equal(clipped[0].numpy(), [[0.0, 0.0], [0.0, 1.0]])
  with pytest.raises(ValueError, match="automatic_gamma must be"):
    dp.DPAdamBC(1.0, 1.0, clipping="automatic", automatic_gamma=1e-25)
  dp.DPAdamBC(1.0, 1.0, clipping="automatic", automatic_gamma=1e-20)
