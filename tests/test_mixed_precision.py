"""Mixed precision (mixed_float16, mixed_bfloat16): private training with
float32 variables, norms, clipping and noise, and a static loss scale.

References are per-unit GradientTape loops under the same policy (the same
float16/bfloat16 forward and backward passes, with the same static loss scale
divided out in float32). The private paths differ from them by the rounding
of the compute dtype only (vectorized vs one-at-a-time matrix products, and
ghost book-keeping in float64 instead of the float16 MatMul gradient), so
the tolerance is a few units in the last place of the compute dtype:
float16 has 11 significant bits (2**-11 ≈ 5e-4), bfloat16 8 (2**-8 ≈ 4e-3).
"""
import contextlib
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc.core import clipping
from tf_dpadambc.keras import training

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
POLICIES = ["mixed_float16", "mixed_bfloat16"]
# ~8 units in the last place of the compute dtype (see the module docstring).
RTOL = {"mixed_float16": 8 * 2.0 ** -11, "mixed_bfloat16": 8 * 2.0 ** -8}


@contextlib.contextmanager
def policy(name):
  keras.mixed_precision.set_global_policy(name)
  try:
    yield
  finally:
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(autouse=True)
def _float32_afterwards():
  yield
  keras.mixed_precision.set_global_policy("float32")


def _dense():
  return keras.Sequential([keras.Input((7,)),
                           keras.layers.Dense(6, activation="tanh"),
                           keras.layers.Dense(3)])


def _conv():
  return keras.Sequential([keras.Input((6, 6, 2)),
                           keras.layers.Conv2D(3, 3, activation="relu"),
                           keras.layers.Flatten(), keras.layers.Dense(3)])


def _embedding():
  return keras.Sequential([keras.Input((5,), dtype="int32"),
                           keras.layers.Embedding(12, 4),
                           keras.layers.GlobalAveragePooling1D(),
                           keras.layers.Dense(3)])


def _per_layer():  # PReLU has no ghost rule: per-layer per-unit gradients
  return keras.Sequential([keras.Input((7,)), keras.layers.Dense(6),
                           keras.layers.PReLU(), keras.layers.Dense(3)])


def _lstm():  # the recurrent ghost rule (the LSTM cell unrolled)
  return keras.Sequential([keras.Input((5,), dtype="int32"),
                           keras.layers.Embedding(12, 4),
                           keras.layers.LSTM(4), keras.layers.Dense(3)])


def _attention():  # LayerNormalization (float32 inside) and EinsumDense
  inputs = keras.Input((4, 6))
  h = keras.layers.LayerNormalization()(inputs)
  h = keras.layers.MultiHeadAttention(2, 3)(h, h)
  return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))


MODELS = {"attention": _attention, "dense": _dense, "conv": _conv, "embedding": _embedding,
          "per_layer": _per_layer, "lstm": _lstm}


def _data(model, n=8, seed=0):
  rng = np.random.default_rng(seed)
  shape = (n,) + tuple(model.inputs[0].shape[1:])
  if model.inputs[0].dtype.startswith("int"):
    x = rng.integers(0, 12, size=shape).astype("int32")
  else:
    x = rng.normal(size=shape).astype("float32")
  return x, rng.integers(0, 3, size=n).astype("int32")


def _reference(model, x, y, spec, num_microbatches, scale):
  """Σ_u clip(g_u) from per-unit tapes under the model's policy: loss in
  float32, backward on scale·loss, gradients (float32) divided by scale."""
  size = 1 if num_microbatches is None else len(y) // num_microbatches
  per_unit = []
  for start in range(0, len(y), size):
    part = slice(start, start + size)
    with tf.GradientTape() as tape:
      y_pred = tf.cast(model(x[part], training=True), tf.float32)
      loss = tf.reduce_mean(LOSS.call(y[part], y_pred))
      scaled = loss * scale
    grads = tape.gradient(scaled, model.trainable_variables,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    per_unit.append([tf.convert_to_tensor(g) / scale for g in grads])
  return clipping.materialized_clipped_sum(
      [tf.stack(g) for g in zip(*per_unit)], spec)


def _private_sum(model, x, y, spec, num_microbatches, method, sample_weight=None):
  model.compile(loss=LOSS)
  return tf.function(lambda: training.private_gradient_sum(
      model, x, y, sample_weight, spec, num_microbatches, method))()[0]


def _build(name, kind):
  keras.utils.set_random_seed(3)
  with policy(name):
    return MODELS[kind]()


@pytest.mark.filterwarnings("ignore:Per-example computation")
@pytest.mark.parametrize("kind, method, num_microbatches", [
    ("dense", "ghost", None), ("dense", "vectorized", 4),
    ("conv", "ghost", None), ("conv", "vectorized", None),
    ("embedding", "ghost", 2), ("per_layer", "ghost", None),
    ("attention", "ghost", None),
    ("lstm", "auto", None)])
@pytest.mark.parametrize("name", POLICIES)
def test_clipped_sums_equal_the_per_unit_reference(name, kind, method,
                                                   num_microbatches):
  model = _build(name, kind)
  assert model.layers[-1].compute_dtype != "float32"
  x, y = _data(model)
  spec = clipping.ClipSpec(0.3)
  got = _private_sum(model, x, y, spec, num_microbatches, method)
  scale = training.loss_scale(model)
  assert scale == (2.0 ** 10 if name == "mixed_float16" else 1.0)
  want = _reference(model, x, y, spec, num_microbatches, scale)
  for g, v in zip(got.grads, model.trainable_variables):
    assert g.dtype == tf.float64 and v.dtype == "float32"
  rtol = RTOL[name]
  np.testing.assert_allclose(got.norms, want.norms, rtol=rtol)
  assert int(got.num_nonfinite) == 0
  top = max(float(np.max(np.abs(w))) for w in want.grads)
  for g, w in zip(got.grads, want.grads):
    np.testing.assert_allclose(np.asarray(g) / top, np.asarray(w) / top,
                               atol=rtol)


@pytest.mark.filterwarnings("ignore:Per-example computation")
@pytest.mark.parametrize("method", ["ghost", "vectorized"])
@pytest.mark.parametrize("name", POLICIES)
def test_every_unit_adds_at_most_c(name, method):
  # Each unit alone (a batch of one): its clipped contribution is the sum.
  # Large inputs make every unit clipped; in float16 the last ones overflow
  # (inf activations): zeroed, counted, never an unbounded contribution.
  model = _build(name, "dense")
  model.compile(loss=LOSS)
  c = 0.05
  step = tf.function(lambda x, y: training.private_gradient_sum(
      model, x, y, None, c, None, method)[0])
  rng = np.random.default_rng(1)
  nonfinite = 0
  for magnitude in (1.0, 30.0, 1e3, 1e5, 1e7):
    x = (magnitude * rng.normal(size=(1, 7))).astype("float32")
    result = step(x, np.array([1], "int32"))
    norm = np.sqrt(sum(float(np.sum(np.square(g.numpy().astype("float64"))))
                       for g in result.grads))
    assert norm <= c * (1 + 1e-5)
    nonfinite += int(result.num_nonfinite)
    if not int(result.num_nonfinite):
      assert norm == pytest.approx(c, rel=1e-4)  # clipped to C exactly
  if name == "mixed_float16":
    assert nonfinite >= 1  # 1e7 overflows float16 (max 65504)


def test_the_loss_scale_keeps_float16_gradients_from_underflowing():
  # ŷ = 2⁻¹⁴ (x = 0.5, 0.5; w1 = 1; w2 = 2⁻¹⁴), y = 0: δ2 = 2(ŷ − y) = 2⁻¹³
  # and the float16 gradient at the first layer's output is δ2·w2 = 2⁻²⁷,
  # below half of float16's smallest subnormal (2⁻²⁴): 0 unscaled, exact
  # (2⁻¹⁷) once scaled by 2**10. Kernel gradient: 4 units · 0.5 · 2⁻²⁷.
  def build():
    with policy("mixed_float16"):
      return keras.Sequential([
          keras.Input((2,)),
          keras.layers.Dense(1, use_bias=False,
                             kernel_initializer=keras.initializers.Constant(
                                 1.0)),
          keras.layers.Dense(1, use_bias=False,
                             kernel_initializer=keras.initializers.Constant(
                                 2.0 ** -14))])
  x = np.full((4, 2), 0.5, "float32")
  y = np.zeros((4, 1), "float32")
  firsts = {}
  for scale in (1, None):
    model = dp.make_private(build(), loss_scale=scale)
    model.compile(loss="mse")
    for method in ("ghost", "vectorized"):
      result = tf.function(lambda m=model, k=method: (
          training.private_gradient_sum(m, x, y, None, 10.0, None, k)))()[0]
      firsts[scale, method] = result.grads[0].numpy()
  for method in ("ghost", "vectorized"):
    assert np.all(firsts[1, method] == 0)  # underflowed in float16
    np.testing.assert_allclose(firsts[None, method], 2.0 ** -26, rtol=1e-6)


@pytest.mark.parametrize("loss_scale", [None, 2.0 ** 4])
@pytest.mark.parametrize("name", POLICIES)
def test_noise_std_is_sigma_c_in_float32(name, loss_scale):
  # Zero inputs, no bias: every gradient is 0, so one DPSGD step (lr 1)
  # moves the kernel by exactly -noise/B, std σC/B = 2/32 whatever the loss
  # scale. 20,000 coordinates: the sample std is within 3% with
  # overwhelming probability (sd ≈ 0.5%).
  with policy(name):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        5000, use_bias=False, kernel_initializer="zeros")])
  model = dp.make_private(model, loss_scale=loss_scale)
  model.compile(optimizer=dp.DPSGD(1.0, 2.0, learning_rate=1.0), loss="mse")
  assert type(model.optimizer) is dp.DPSGD  # no LossScaleOptimizer
  model.fit(np.zeros((32, 4), "float32"), np.zeros((32, 5000), "float32"),
            batch_size=32, epochs=1, verbose=0)
  kernel = model.trainable_variables[0]
  assert kernel.dtype == "float32"
  noise = kernel.numpy()
  assert abs(np.std(noise) / (2.0 / 32) - 1) < 0.03
  assert len(np.unique(noise)) > 19000  # float32 draws, not float16 ones


@pytest.mark.filterwarnings("ignore:Per-example computation")
@pytest.mark.parametrize("kind", ["dense", "conv", "embedding", "lstm"])
@pytest.mark.parametrize("name", POLICIES)
def test_fit_learns_an_easy_task(name, kind):
  model = _build(name, kind)
  rng = np.random.default_rng(5)
  x, _ = _data(model, n=128, seed=5)
  feature = x.reshape(len(x), -1)[:, 0]
  y = (feature > (5 if x.dtype == np.int32 else 0)).astype("int32")
  model = dp.make_private(model)
  model.compile(optimizer=dp.DPAdam(1.0, 0.3, learning_rate=2e-2, seed=1),
                loss=LOSS, jit_compile=kind != "lstm")
  history = model.fit(x, y, batch_size=32, epochs=6, verbose=0,
                      shuffle=False).history
  del rng
  assert history["loss"][-1] < history["loss"][0]
  # (logged only when non-zero)
  assert history.get("dp_nonfinite_examples", [0])[-1] == 0


def test_compile_does_not_wrap_the_dp_optimizer_in_a_loss_scale_optimizer(
    caplog):
  with policy("mixed_float16"):
    model = _dense()
  # Compiled before make_private: Keras wrapped it; make_private unwraps.
  optimizer = dp.DPSGD(1.0, 1.0)
  model.compile(optimizer=optimizer, loss=LOSS)
  assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
  with caplog.at_level(logging.WARNING):
    dp.make_private(model)
  assert model.optimizer is optimizer
  assert "static loss scale" in caplog.text
  # Compiled after make_private: never wrapped, even when asked explicitly.
  model.compile(optimizer=dp.DPSGD(1.0, 1.0), loss=LOSS)
  assert isinstance(model.optimizer, dp.DPSGD)
  model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
      dp.DPSGD(1.0, 1.0)), loss=LOSS)
  assert isinstance(model.optimizer, dp.DPSGD)


def test_loss_scale_factor_and_bad_loss_scales_are_refused():
  with pytest.raises(ValueError, match="make_private"):
    dp.DPAdam(1.0, 1.0, loss_scale_factor=128.0)
  for bad in (3.0, 0.5, 0, float("inf"), True, tf.constant(2.0)):
    with pytest.raises(ValueError, match="power of two"):
      dp.make_private(_dense(), loss_scale=bad)


def test_per_layer_float32_policies_in_a_mixed_model():
  # A float16 body with a float32 head (the usual recipe): same checks.
  keras.utils.set_random_seed(4)
  with policy("mixed_float16"):
    model = keras.Sequential([keras.Input((7,)),
                              keras.layers.Dense(6, activation="tanh"),
                              keras.layers.Dense(3, dtype="float32")])
  x, y = _data(model)
  spec = clipping.ClipSpec(0.3)
  got = _private_sum(model, x, y, spec, None, "ghost")
  want = _reference(model, x, y, spec, None, training.loss_scale(model))
  np.testing.assert_allclose(got.norms, want.norms,
                             rtol=RTOL["mixed_float16"])


@pytest.mark.parametrize("name", POLICIES)
def test_the_tf_keras_adapter_refuses_mixed_precision_clearly(name):
  tf_keras = pytest.importorskip("tf_keras")
  from tf_dpadambc import tf_keras as dptk  # pylint: disable=import-outside-toplevel
  tf_keras.mixed_precision.set_global_policy(name)
  try:
    model = tf_keras.Sequential([
        tf_keras.layers.Dense(4, activation="tanh", input_shape=(3,)),
        tf_keras.layers.Dense(2)])
  finally:
    tf_keras.mixed_precision.set_global_policy("float32")
  model.compile(optimizer=dptk.DPAdam(1.0, 0.1),
                loss=tf_keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction="none"))
  x = np.zeros((8, 3), "float32")
  with pytest.raises(ValueError, match="does not support mixed precision"):
    model.fit(x, np.zeros(8, "int32"), batch_size=4, verbose=0)


PURE = ["float16", "bfloat16"]


@pytest.mark.filterwarnings("ignore:Per-example computation")
@pytest.mark.parametrize("method", ["ghost", "vectorized"])
@pytest.mark.parametrize("name", ["float32"] + PURE)
def test_sums_stay_float64_until_the_noise(name, method):
  """The clipped sum is held in float64 until the noise is added, whatever
  the variables' dtype (float32, or float16/bfloat16 under a pure policy).
  Rounded to the variables' dtype first (as it was), a sum of U units moved
  by up to U·2⁻²⁴·C (float32), U·2⁻¹¹·C or U·2⁻⁸·C: with these identical
  units, adding one moved the ghost sum by up to 1.00001C (float32 sums),
  1.03C (float16) and 1.24C (bfloat16) over U = 64–72 and 250–259. Now each
  added unit moves it by C, to float64's rounding."""
  with policy(name):
    model = keras.Sequential([keras.Input((7,)),
                              keras.layers.Dense(6, activation="tanh"),
                              keras.layers.LayerNormalization(),
                              keras.layers.Dense(3)])
  assert model.trainable_variables[0].dtype == name
  model.compile(loss=LOSS)
  c = 0.05
  step = tf.function(lambda x, y: training.private_gradient_sum(
      model, x, y, None, c, None, method)[0])
  x = np.repeat(30 * np.random.default_rng(3).normal(size=(1, 7)), 260,
                0).astype("float32")
  y = np.ones(260, "int32")
  sums = {}
  for units in range(250, 257):
    result = step(x[:units], y[:units])
    assert all(g.dtype == tf.float64 for g in result.grads)
    sums[units] = np.concatenate([np.ravel(g.numpy()) for g in result.grads])
  c32 = float(np.float32(c))  # C as the clip and the noise hold it
  for units in range(251, 257):
    moved = np.linalg.norm(sums[units] - sums[units - 1])
    assert moved <= c32 * (1 + 1e-9), (units, moved / c32)


@pytest.mark.parametrize("name", PURE)
def test_pure_low_precision_fit_applies_a_float32_noisy_mean(name):
  """One DPSGD step on zero gradients moves a float16/bfloat16 kernel by
  −noise/B rounded once to its dtype: std σC/B."""
  with policy(name):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        5000, use_bias=False, kernel_initializer="zeros")])
  model = dp.make_private(model)
  model.compile(optimizer=dp.DPSGD(1.0, 2.0, learning_rate=1.0), loss="mse")
  model.fit(np.zeros((32, 4), "float32"), np.zeros((32, 5000), "float32"),
            batch_size=32, epochs=1, verbose=0)
  kernel = model.trainable_variables[0]
  assert kernel.dtype == name
  noise = np.asarray(kernel.numpy(), np.float64)
  assert abs(np.std(noise) / (2.0 / 32) - 1) < 0.03


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_noise_of_low_precision_variables_has_no_exact_zeros(dtype):
  # A review: the noise of float16 variables was drawn in float32, rounded
  # to float16, then added to the float64 clipped sum: draws below 2⁻²⁵
  # became exact zeros, and each such coordinate released its sum exactly
  # (37 in 10⁶ at σC = 10⁻³). At σC = 10⁻⁴, 2²⁰ float16-rounded draws hold
  # ≈ 250 zeros (P ≈ 2·2⁻²⁵/(σC·√(2π)) each); float32 draws hold none.
  from tf_dpadambc.core import noise as noise_lib  # pylint: disable=g-import-not-at-top
  from tf_dpadambc.keras.optimizers import base  # pylint: disable=g-import-not-at-top
  variable = keras.Variable(np.zeros(1 << 20), dtype=dtype)
  sample = base._in_variable_dtypes(  # pylint: disable=protected-access
      noise_lib.independent_sampler(tf.constant([3, 4], tf.int64)),
      [variable])
  drawn = sample([tf.zeros([1 << 20], tf.float64)], 1e-4)[0]
  assert drawn.dtype == tf.float64
  drawn = drawn.numpy()
  assert np.count_nonzero(drawn == 0) == 0
  assert abs(np.std(drawn) / 1e-4 - 1) < 0.01
  # Not rounded to the variable's dtype before the sum (only after it).
  rounded = drawn.astype(np.float32).astype(
      np.float16 if dtype == "float16" else np.float32)
  if dtype == "float16":
    assert np.count_nonzero(rounded == 0) > 100
