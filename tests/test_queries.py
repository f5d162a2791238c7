"""DPQuery interop: any DPQuery privatizes the steps of our optimizers.

Tests that need TF-Privacy are skipped without it; the rest use our own
mechanisms, which are DPQueries too.
"""
import math
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc
from tf_dpadambc import mechanisms
from tf_dpadambc import queries
from tf_dpadambc import tf_privacy
from tf_dpadambc.accounting import epsilon as epsilon_lib
from tf_dpadambc.core import clipping
from tf_dpadambc.core import per_example
from tf_dpadambc.accounting import events

needs_tfp = pytest.mark.skipif(not tf_privacy.available(),
                               reason="tensorflow-privacy is not installed")

pytestmark = pytest.mark.filterwarnings(
    "ignore:The DPQuery draws its noise:UserWarning")

X = np.random.RandomState(0).randn(64, 5).astype("float32") * 3
Y = (X[:, 0] > 0).astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(optimizer, jit_compile=None, clipping="auto"):
  """jit_compile: by default XLA for this library's noise, not for a
  TF-Privacy query's (refused there: XLA fixes TensorFlow's random ops)."""
  if jit_compile is None:
    query = getattr(getattr(optimizer, "query", None), "query", None)
    jit_compile = query is None or isinstance(query,
                                              mechanisms.NoiseMechanism)
  keras.utils.set_random_seed(7)
  model = tf_dpadambc.make_private(keras.Sequential([
      keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
      keras.layers.Dense(2)]), clipping=clipping)
  model.compile(optimizer=optimizer, loss=LOSS, jit_compile=jit_compile)
  return model


def _reference_sgd_step(model, x, y, clip, lr):
  """Per-example tape loop, clip to C, mean over the batch, SGD."""
  weights = [w.numpy() for w in model.trainable_variables]
  total = [np.zeros_like(w) for w in weights]
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = LOSS(y[i:i + 1], model(x[i:i + 1]))
    grads = [g.numpy() for g in tape.gradient(loss,
                                              model.trainable_variables)]
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
    total = [t + g * min(1.0, clip / norm) for t, g in zip(total, grads)]
  return [w - lr * t / len(x) for w, t in zip(weights, total)]


def _queries_without_noise(clip):
  made = [("IndependentNoise", mechanisms.IndependentNoise(clip, 0.0))]
  if tf_privacy.available():
    made.append(("GaussianSumQuery", tf_privacy.GaussianSumQuery(clip, 0.0)))
  return made


@pytest.mark.parametrize("index", [0, 1])
def test_query_step_equals_clipped_sgd_reference(index):
  made = _queries_without_noise(0.5)
  if index >= len(made):
    pytest.skip("tensorflow-privacy is not installed")
  _, query = made[index]
  model = _model(tf_dpadambc.DPSGD(query=query, learning_rate=0.3))
  expected = _reference_sgd_step(model, X[:16], Y[:16], 0.5, 0.3)
  model.fit(X[:16], Y[:16], batch_size=16, epochs=1, verbose=0)
  for w, e in zip(model.trainable_variables, expected):
    np.testing.assert_allclose(w.numpy(), e, rtol=1e-5, atol=1e-6)


def _noise_std_of_step(query, num_units=32, dim=20000):
  """The std of one update of DPSGD(lr=1) from zero per-unit gradients."""
  optimizer = tf_dpadambc.DPSGD(query=query, learning_rate=1.0)
  variable = keras.Variable(np.zeros(dim, "float32"))
  optimizer.apply_per_unit(
      per_example.assume_per_unit([tf.zeros([num_units, dim])]), num_units,
      num_units, [variable])
  return float(np.std(variable.numpy())), optimizer


@pytest.mark.parametrize("make", [
    lambda: mechanisms.IndependentNoise(2.0, 1.5),
    pytest.param(lambda: tf_privacy.GaussianSumQuery(2.0, 3.0),
                 marks=needs_tfp)])
def test_noise_std_is_query_stddev_over_batch(make):
  # One release of 20,000 coordinates: the sample std of N(0, s²) is within
  # 3% of s with overwhelming probability (its relative sd is 1/√(2n) ≈ 0.5%).
  std, optimizer = _noise_std_of_step(make())
  expected = 3.0 / 32
  assert abs(std - expected) / expected < 0.03
  # Φ = (std / B)², what bias correction subtracts.
  np.testing.assert_allclose(optimizer.noise_variance.numpy(), expected ** 2,
                             rtol=1e-6)


def test_dp_event_is_composed_from_the_query_event():
  optimizer = tf_dpadambc.DPAdam(query=mechanisms.IndependentNoise(1.0, 1.1),
                                 learning_rate=1e-3)
  model = _model(optimizer)
  model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
  assert optimizer.steps_taken == 8
  assert optimizer.dp_event(64, sampling="poisson") == events.dp_sgd_event(
      1.1, 64, 16, 8)
  assert optimizer.dp_event(64, sampling="shuffle") == events.dp_sgd_event(
      1.1, 64, 16, 8, "shuffle")


def test_microbatches_halve_the_query_noise_multiplier():
  optimizer = tf_dpadambc.DPSGD(query=mechanisms.IndependentNoise(1.0, 2.0),
                                num_microbatches=4)
  model = _model(optimizer)
  model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
  assert optimizer.dp_event(64, sampling="poisson") == events.dp_sgd_event(
      1.0, 64, 16, 4)


def _adaptive(count_stddev, clip=1.0, sigma=1.1, quantile=0.5, rate=0.2):
  return tf_privacy.QuantileAdaptiveClipSumQuery(
      initial_l2_norm_clip=clip, noise_multiplier=sigma,
      target_unclipped_quantile=quantile, learning_rate=rate,
      clipped_count_stddev=count_stddev, expected_num_records=16)


@needs_tfp
def test_adaptive_clip_advances_inside_compiled_fit():
  # No noise on the count and a target quantile of 0: while every norm is
  # below the clip (C₀ = 1e4), each step multiplies C by exp(-η·(1 − 0)).
  query = _adaptive(0.0, clip=1e4, sigma=0.0, quantile=0.0, rate=0.1)
  optimizer = tf_dpadambc.DPAdam(query=query, learning_rate=1e-3)
  model = _model(optimizer)  # a tf.function step (XLA: refused, see below)
  history = model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
  clip = float(optimizer.query_metrics()["clip"])
  np.testing.assert_allclose(clip, 1e4 * math.exp(-0.4), rtol=1e-5)
  np.testing.assert_allclose(history.history["dp_query_clip"][-1], clip,
                             rtol=1e-6)


@needs_tfp
def test_adaptive_clip_event_reaches_accounting():
  query = _adaptive(16 / 20)
  optimizer = tf_dpadambc.DPAdamBC(query=query, learning_rate=1e-3)
  model = _model(optimizer)
  model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
  event = optimizer.dp_event(64, sampling="poisson")
  # The query's own event: the sum (σ = 1.1) and the clipped count (whose
  # records are ±0.5, so its multiplier is stddev / 0.5).
  step = dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(1.1),
      dp_accounting.GaussianDpEvent((16 / 20) / 0.5)])
  eps = epsilon_lib.epsilon_of_event(event, 1e-5)
  # (the query computes its multipliers in float32)
  np.testing.assert_allclose(eps, epsilon_lib.epsilon_of_event(
      events.sampled_event(step, 64, 16, 4), 1e-5), rtol=1e-5)
  assert eps > epsilon_lib.epsilon_of_event(
      events.dp_sgd_event(1.1, 64, 16, 4), 1e-5)
  assert math.isfinite(eps)


@needs_tfp
def test_noiseless_count_refuses_an_epsilon():
  query = _adaptive(0.0)
  optimizer = tf_dpadambc.DPAdam(query=query)
  _model(optimizer).fit(X, Y, batch_size=16, epochs=1, verbose=0)
  with pytest.raises(queries.NotAccountable, match="not private"):
    optimizer.dp_event(64)


@needs_tfp
def test_tree_aggregation_trains_but_refuses_an_epsilon():
  specs = [tf.TensorSpec(v) for v in [(5, 4), (4,), (4, 2), (2,)]]
  query = tf_privacy.RestartQuery(
      tf_privacy.TreeResidualSumQuery.build_l2_gaussian_query(
          clip_norm=1.0, noise_multiplier=1.1, record_specs=specs),
      tf_privacy.PeriodicRoundRestartIndicator(period=3))
  optimizer = tf_dpadambc.DPAdam(query=query, learning_rate=1e-2)
  model = _model(optimizer, jit_compile=False)
  before = [w.numpy().copy() for w in model.trainable_variables]
  model.fit(X[:48], Y[:48], batch_size=16, epochs=1, verbose=0)
  assert optimizer.steps_taken == 3  # (the tree's buffer grows at step 2)
  assert any(not np.allclose(b, w.numpy())
             for b, w in zip(before, model.trainable_variables))
  with pytest.raises(queries.NotAccountable, match="UnsupportedDpEvent"):
    optimizer.dp_event(64)
  # Bias correction needs Φ, which tree aggregation does not give per step.
  with pytest.raises(ValueError, match="noise std"):
    tf_dpadambc.DPAdamBC(query=query).build(model.trainable_variables)


@needs_tfp
def test_normalized_query_is_not_divided_again():
  query = tf_privacy.NormalizedQuery(tf_privacy.GaussianSumQuery(0.5, 0.0),
                                     denominator=16.0)
  model = _model(tf_dpadambc.DPSGD(query=query, learning_rate=0.3))
  expected = _reference_sgd_step(model, X[:16], Y[:16], 0.5, 0.3)
  model.fit(X[:16], Y[:16], batch_size=16, epochs=1, verbose=0)
  for w, e in zip(model.trainable_variables, expected):
    np.testing.assert_allclose(w.numpy(), e, rtol=1e-5, atol=1e-6)


def test_bad_query_uses_are_refused():
  query = mechanisms.IndependentNoise(1.0, 1.0)
  with pytest.raises(TypeError, match="not a TF-Privacy DPQuery"):
    tf_dpadambc.DPAdam(query=object())
  with pytest.raises(ValueError, match="either query= or l2_norm_clip"):
    tf_dpadambc.DPAdam(1.0, 1.0, query=query)
  with pytest.raises(TypeError, match="needs l2_norm_clip"):
    tf_dpadambc.DPAdam(learning_rate=1e-3)
  with pytest.raises(ValueError, match="own way"):
    tf_dpadambc.DPAdamIME(query=query)
  with pytest.raises(ValueError, match="own way"):
    tf_dpadambc.DPAdamSTP(query=query)
  with pytest.raises(ValueError, match="gradient_accumulation_steps"):
    tf_dpadambc.DPAdam(query=query, gradient_accumulation_steps=2)
  optimizer = tf_dpadambc.DPAdam(query=query)
  with pytest.raises(NotImplementedError, match="cannot be serialized"):
    optimizer.get_config()
  variable = keras.Variable(np.zeros(3, "float32"))
  with pytest.raises(TypeError, match="apply_per_unit"):
    optimizer.apply_private(clipping.assume_clipped([tf.zeros(3)]), 1, 1,
                            [variable])


def _seeded_draws(eager):
  """Two draws of tf.random.normal (seed=None) inside secret_op_seeds, each
  after the same global seed, and two outside it."""
  def draw(secret):
    tf.random.set_seed(3)
    def sample():
      if not secret:
        return tf.random.normal([64])
      with queries.secret_op_seeds():
        return tf.random.normal([64])
    return (sample() if eager else tf.function(sample)()).numpy()
  return (draw(True), draw(True)), (draw(False), draw(False))


@pytest.mark.parametrize("eager", [True, False])
def test_a_global_seed_does_not_fix_query_noise(eager):
  # A review: with a global seed set, a DPQuery's noise (TensorFlow's random
  # ops, seed=None) was the same in every trace; two runs' releases differed
  # by their un-noised sums exactly (to 3.6e-7 at σC = 5).
  secret, plain = _seeded_draws(eager)
  np.testing.assert_array_equal(plain[0], plain[1])  # what TF does
  assert np.abs(secret[0] - secret[1]).min() > 0
  if eager:  # the user's own random ops after the block go on as without it
    tf.random.set_seed(5)
    first = tf.random.normal([4]).numpy()
    tf.random.set_seed(5)
    with queries.secret_op_seeds():
      tf.random.normal([4])
    np.testing.assert_array_equal(tf.random.normal([4]).numpy(), first)


@needs_tfp
def test_query_noise_differs_between_runs_under_a_global_seed():
  releases = []
  for _ in range(2):
    query = tf_privacy.GaussianSumQuery(l2_norm_clip=1.0, stddev=5.0)
    optimizer = tf_dpadambc.DPSGD(query=query, learning_rate=1.0)
    keras.utils.set_random_seed(7)
    model = tf_dpadambc.make_private(keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(1, kernel_initializer="zeros", use_bias=False)]))
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(X[:8, :4], Y[:8, None].astype("float32"), batch_size=8,
              epochs=1, shuffle=False, verbose=0)
    releases.append(model.get_weights()[0])
  # Same data, same weights, same global seed: only the noise (std 5/8 per
  # coordinate) can tell the two runs apart.
  assert np.abs(releases[0] - releases[1]).max() > 0.05


def test_statement_of_a_query_run():
  optimizer = tf_dpadambc.DPAdam(query=mechanisms.IndependentNoise(1.0, 1.1))
  _model(optimizer).fit(X, Y, batch_size=16, epochs=2, verbose=0)
  text = tf_dpadambc.optimizer_privacy_statement(optimizer, 64,
                                                            1e-5)
  shuffle = epsilon_lib.epsilon_of_event(
      events.dp_sgd_event(1.1, 64, 16, 8, "shuffle"), 1e-5)
  assert "DPQuery IndependentNoise" in text
  assert f"ε = {shuffle:.3f} if each example is used exactly once" in text
  assert "does NOT apply" in text


@needs_tfp
def test_statement_refuses_an_unaccountable_epsilon():
  specs = [tf.TensorSpec(v) for v in [(5, 4), (4,), (4, 2), (2,)]]
  query = tf_privacy.TreeResidualSumQuery.build_l2_gaussian_query(
      clip_norm=1.0, noise_multiplier=1.1, record_specs=specs)
  optimizer = tf_dpadambc.DPSGD(query=query)
  _model(optimizer, jit_compile=False).fit(X, Y, batch_size=16, epochs=1,
                                           verbose=0)
  text = tf_dpadambc.optimizer_privacy_statement(optimizer, 64,
                                                            1e-5)
  assert "NO ε" in text and "UnsupportedDpEvent" in text
  assert "ε = " not in text


@pytest.mark.parametrize("make", [
    lambda: mechanisms.IndependentNoise(0.5, 0.0),
    pytest.param(lambda: _adaptive(0.0, clip=0.5, sigma=0.0, rate=0.3),
                 marks=needs_tfp)], ids=["IndependentNoise", "adaptive"])
def test_l2_clipping_queries_take_ghost_clipping_exactly(make):
  # Queries that clip by L2 norm get the clipped sum and the norms from
  # ghost clipping; the query's own preprocess_record on vectorized per-unit
  # gradients must give the same steps (weights, adaptive clip, metrics).
  runs = {}
  for clipping in ("auto", "vectorized"):
    optimizer = tf_dpadambc.DPAdam(query=make(), learning_rate=1e-2)
    model = _model(optimizer, clipping=clipping)
    history = model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    runs[clipping] = (model, optimizer, history.history)
  assert tf_dpadambc.clipping_plan(runs["auto"][0]).fallback is None
  for a, b in zip(runs["auto"][0].trainable_variables,
                  runs["vectorized"][0].trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
  clips = [r[1].query_metrics().get("clip") for r in runs.values()]
  if clips[0] is not None:
    assert float(clips[0]) != 0.5  # it adapted
    np.testing.assert_allclose(float(clips[0]), float(clips[1]), rtol=1e-6)
  assert 0 < runs["auto"][2]["dp_clipped_fraction"][0] < 1


class _HalvingNoise(mechanisms.IndependentNoise):
  """A user's subclass that clips each record to C/2 (its own
  preprocess_record): the release must use it, not our L2 shortcut at C."""

  def preprocess_record(self, params, record):
    return super().preprocess_record(params / 2, record)


def test_a_query_subclass_is_served_by_its_own_preprocess_record():
  # Ghost clipping takes a query's clip norm only for the exact classes it
  # knows; a subclass may clip or sum differently, so it gets per-unit
  # records through its own preprocess_record.
  assert queries._kind(_HalvingNoise(0.5, 0.0)) is None
  assert not queries.QueryRelease(_HalvingNoise(0.5, 0.0)).sums
  optimizer = tf_dpadambc.DPSGD(query=_HalvingNoise(0.5, 0.0),
                                learning_rate=1.0)
  model = _model(optimizer)
  expected = _reference_sgd_step(model, X[:16], Y[:16], 0.25, 1.0)
  model.fit(X[:16], Y[:16], batch_size=16, epochs=1, verbose=0)
  for w, e in zip(model.trainable_variables, expected):
    np.testing.assert_allclose(w.numpy(), e, rtol=1e-4, atol=1e-5)


@needs_tfp
def test_a_dpquery_refuses_low_precision_variables():
  """A DPQuery sums and noises its records in the variables' dtype: with
  float16/bfloat16 variables that would round the clipped sum before its
  noise, so the optimizer refuses them (its own noise takes them)."""
  keras.mixed_precision.set_global_policy("bfloat16")
  try:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  finally:
    keras.mixed_precision.set_global_policy("float32")
  model = tf_dpadambc.make_private(model)
  query = tf_privacy.GaussianSumQuery(1.0, 1.0)
  model.compile(optimizer=tf_dpadambc.DPAdam(query=query, learning_rate=1e-3),
                loss="mse")
  with pytest.raises(ValueError, match="float16/bfloat16"):
    model.fit(np.zeros((8, 4), "float32"), np.zeros((8, 2), "float32"),
              batch_size=8, epochs=1, verbose=0)


def test_queries_drawing_tensorflow_random_ops_are_refused_under_xla():
  # A review: XLA compiles TensorFlow's stateful random ops to the same
  # numbers in every process, seeded or not: a DPQuery's noise (TF-Privacy's
  # draw with them) was the same in every run under jit_compile=True.
  class OwnRandom:  # any DPQuery but this library's mechanisms
    pass
  for jit_compile in (True, np.bool_(True), 1, "auto"):  # (np.bool_: a review)
    with pytest.raises(ValueError, match="same numbers in every process"):
      queries.check_not_under_xla(OwnRandom(), jit_compile)
  queries.check_not_under_xla(OwnRandom(), False)
  queries.check_not_under_xla(mechanisms.IndependentNoise(1.0, 1.0), True)


@needs_tfp
def test_a_tf_privacy_query_under_xla_is_refused_before_a_step():
  optimizer = tf_dpadambc.DPSGD(
      query=tf_privacy.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.0),
      learning_rate=1.0)
  model = _model(optimizer, jit_compile=True)
  before = [w.copy() for w in model.get_weights()]
  with pytest.raises(ValueError, match="same numbers in every process"):
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
  for w, b in zip(model.get_weights(), before):
    np.testing.assert_array_equal(w, b)
  # A review: jit_compile turned off after the train function was made
  # left that XLA function in use.
  model = _model(tf_dpadambc.DPSGD(
      query=tf_privacy.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.0),
      learning_rate=1.0), jit_compile=True)
  model.make_train_function()
  model.jit_compile = False
  with pytest.raises(ValueError, match="same numbers in every process"):
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
