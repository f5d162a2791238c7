"""The tf_keras (Keras 2) adapter: same update, noise and clipping as Keras 3."""
import ast
import re
import os
import pathlib
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

tf_keras = pytest.importorskip(
    "tf_keras", reason="tf_keras is not installed (pip install tf-keras)")

import tf_dpadambc  # noqa: E402
from tf_dpadambc import tf_keras as dptk  # noqa: E402
from tf_dpadambc.core import clipping  # noqa: E402
from tf_dpadambc.tf_keras import _compat  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOSS = tf_keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=tf_keras.losses.Reduction.NONE)


def _quiet(fn, *args, **kwargs):
  """Runs fn without the noise_multiplier=0 / retracing warnings."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return fn(*args, **kwargs)


def _mlp(seed=0):
  tf_keras.utils.set_random_seed(seed)
  return tf_keras.Sequential([
      tf_keras.layers.Dense(5, activation="tanh", input_shape=(4,)),
      tf_keras.layers.Dense(3)])


def _data(n, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, 4)).astype("float32"),
          rng.integers(0, 3, size=n).astype("int32"))


def _unit_gradients(model, x, y, microbatches):
  """Per-unit gradients by a plain GradientTape loop (microbatch means)."""
  units = microbatches or len(x)
  size = len(x) // units
  out = []
  for u in range(units):
    part = slice(u * size, (u + 1) * size)
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(LOSS(y[part], model(x[part], training=True)))
    out.append([tf.convert_to_tensor(g).numpy() for g in
                tape.gradient(loss, model.trainable_variables)])
  return out


def _clipped_sum(unit_grads, clip):
  """Σ_u g_u·min(1, C/‖g_u‖) in NumPy."""
  total = [np.zeros_like(g) for g in unit_grads[0]]
  for grads in unit_grads:
    norm = np.sqrt(sum(float((g ** 2).sum()) for g in grads))
    total = [t + g * min(1.0, clip / norm) for t, g in zip(total, grads)]
  # float32 like the model: the noise is drawn in the clipped sum's dtype.
  return [t.astype("float32") for t in total]


def _global_norm(arrays):
  return np.sqrt(sum(float((a ** 2).sum()) for a in arrays))


# -------------------------------------------------- update = reference
@pytest.mark.parametrize("name, kwargs, microbatches", [
    ("DPAdamBC", {"learning_rate": 0.01, "gamma_prime": 1e-6}, None),
    ("DPAdamBC", {"learning_rate": 0.01, "gamma_prime": 1e-6}, 4),
    ("DPSGD", {"learning_rate": 0.5, "momentum": 0.9}, 4),
])
def test_fit_matches_keras3_optimizer_on_reference_clipped_sums(
    name, kwargs, microbatches):
  """Two fit steps (σ > 0, fixed seed) = the Keras 3 optimizer fed clipped
  sums from a per-unit GradientTape loop with NumPy clipping."""
  x, y = _data(16)
  model = _mlp()
  init = [w.numpy() for w in model.trainable_variables]
  norms = [_global_norm(g) for g in _unit_gradients(model, x[:8], y[:8],
                                                      microbatches)]
  clip = float(np.median(norms))  # some units clipped, some not
  config = dict(l2_norm_clip=clip, noise_multiplier=0.7, seed=3,
                num_microbatches=microbatches, **kwargs)
  optimizer = getattr(dptk, name)(**config)
  model.compile(optimizer=optimizer, loss=LOSS)
  _quiet(model.fit, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

  reference = getattr(tf_dpadambc, name)(**config)
  ref_model = _mlp()
  ref_vars = [keras.Variable(w) for w in init]
  for step in range(2):
    ref_model.set_weights([v.numpy() for v in ref_vars])
    part = slice(8 * step, 8 * step + 8)
    unit_grads = _unit_gradients(ref_model, x[part], y[part], microbatches)
    reference.apply_private(
        clipping.assume_clipped(_clipped_sum(unit_grads, clip)),
        len(unit_grads), 8, ref_vars)
  assert optimizer.steps_taken == 2
  assert optimizer.per_unit_plan == "vectorized"
  assert optimizer.vectorized_steps == 2
  for got, want, start in zip(model.trainable_variables, ref_vars, init):
    assert not np.allclose(got.numpy(), start)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5,
                               atol=2e-6)


def test_sgd_step_is_numpy_formula_without_noise():
  """θ ← θ − η Σ_u clip_C(g_u) / U exactly, with σ = 0 (microbatches of 2)."""
  x, y = _data(8)
  model = _mlp(1)
  init = [w.numpy() for w in model.trainable_variables]
  expected_sum = _clipped_sum(_unit_gradients(model, x, y, 4), 0.2)
  optimizer = _quiet(dptk.DPKerasSGDOptimizer, 0.2, 0.0, 4, 1, 0.3)
  model.compile(optimizer=optimizer, loss=LOSS)
  _quiet(model.fit, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  for got, start, s in zip(model.trainable_variables, init, expected_sum):
    np.testing.assert_allclose(got.numpy(), start - 0.3 * s / 4, rtol=1e-5,
                               atol=1e-7)


# ------------------------------------------------- the vectorized path
def _tutorial_cnn(seed=0):
  """TF-Privacy's tutorial CNN (MNIST shape)."""
  tf_keras.utils.set_random_seed(seed)
  layers = tf_keras.layers
  return tf_keras.Sequential([
      layers.Conv2D(16, 8, strides=2, padding="same", activation="relu",
                    input_shape=(28, 28, 1)),
      layers.MaxPool2D(2, 1),
      layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
      layers.MaxPool2D(2, 1),
      layers.Flatten(),
      layers.Dense(32, activation="relu"),
      layers.Dense(10)])


def _sgd_step(model, x, y, microbatches, clip, lr, vectorize=True,
              sample_weight=None, assume=False, **compile_kwargs):
  """One fit step of DPSGD without noise; returns the optimizer."""
  optimizer = _quiet(dptk.DPSGD, clip, 0.0, learning_rate=lr,
                     num_microbatches=microbatches,
                     assume_examples_independent=assume)
  optimizer.vectorize = vectorize
  model.compile(optimizer=optimizer, loss=LOSS, **compile_kwargs)
  _quiet(model.fit, x, y, sample_weight=sample_weight, batch_size=len(x),
         shuffle=False, verbose=0)
  assert optimizer.steps_taken == 1
  return optimizer


def _assert_sgd_formula(model, init, unit_grads, clip, lr):
  """θ = θ₀ − η Σ_u clip_C(g_u) / U."""
  total = _clipped_sum(unit_grads, clip)
  for got, start, s in zip(model.trainable_variables, init, total):
    np.testing.assert_allclose(got.numpy(), start - lr * s / len(unit_grads),
                               rtol=1e-5, atol=1e-6)


def _weighted_unit_gradients(model, x, y, weights, microbatches):
  """Per-unit gradients of mean(weight · loss) over each unit."""
  size = len(x) // microbatches
  out = []
  for u in range(microbatches):
    part = slice(u * size, (u + 1) * size)
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(weights[part] * LOSS(
          y[part], model(x[part], training=True)))
    out.append([g.numpy() for g in
                tape.gradient(loss, model.trainable_variables)])
  return out


def test_vectorized_path_applies_sample_weights_like_tf_keras():
  """Microbatches of 2 with sample weights: the vectorized step is the
  reference formula and the (opted-in) jacobian path's step."""
  x, y = _data(8)
  weights = np.random.default_rng(1).uniform(0, 2, size=8).astype("float32")
  model = _mlp(1)
  init = [w.numpy() for w in model.trainable_variables]
  unit_grads = _weighted_unit_gradients(model, x, y, weights, 4)
  clip = float(np.median([_global_norm(g) for g in unit_grads]))
  optimizer = _sgd_step(model, x, y, 4, clip, 0.3, sample_weight=weights)
  assert optimizer.per_unit_plan == "vectorized"
  assert optimizer.vectorized_steps == 1
  _assert_sgd_formula(model, init, unit_grads, clip, 0.3)

  jacobian = _mlp(1)
  optimizer = _sgd_step(jacobian, x, y, 4, clip, 0.3, vectorize=False,
                        sample_weight=weights, assume=True)
  assert optimizer.per_unit_plan == (
      "jacobian: vectorize=False (assume_examples_independent=True)")
  assert optimizer.vectorized_steps == 0
  for a, b in zip(model.trainable_variables, jacobian.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)


def test_tutorial_cnn_takes_the_vectorized_path():
  """TF-Privacy's tutorial model and loss (one-hot labels,
  CategoricalCrossentropy with reduction NONE), one example per unit."""
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(4, 28, 28, 1)).astype("float32")
  y = tf_keras.utils.to_categorical(rng.integers(0, 10, 4), 10)
  model = _tutorial_cnn()
  optimizer = dptk.DPKerasSGDOptimizer(1.0, 1.1, 4, 1, 0.15)
  loss = tf_keras.losses.CategoricalCrossentropy(
      from_logits=True, reduction=tf_keras.losses.Reduction.NONE)
  model.compile(optimizer=optimizer, loss=loss)
  _quiet(model.fit, x, y, batch_size=4, verbose=0)
  assert optimizer.per_unit_plan == "vectorized"
  assert optimizer.vectorized_steps == optimizer.steps_taken == 1


class _BatchCentering(tf_keras.layers.Layer):
  """Subtracts the batch mean: mixes examples, and is not detected."""

  def call(self, inputs):
    return inputs - tf.reduce_mean(inputs, axis=0, keepdims=True)


def _centring_model():
  tf_keras.utils.set_random_seed(0)
  return tf_keras.Sequential([
      tf_keras.layers.Dense(5, activation="tanh", input_shape=(4,)),
      _BatchCentering(), tf_keras.layers.Dense(3)])


def test_examples_mixed_by_an_undetected_layer_are_reported():
  """Per-unit losses differ from the batch's: the step counts it (no assert
  op: XLA would drop it) and the host raises. The step itself released its
  per-unit clipped sum (not gated on the verdict, which depends on the
  whole batch): σ = 0, so the weights moved by at most lr·C. (The matrix
  below also runs it without XLA.)"""
  model = _centring_model()
  x, y = _data(8)
  init = [w.numpy() for w in model.trainable_variables]
  optimizer = _quiet(dptk.DPSGD, 0.2, 0.0, learning_rate=0.3,
                     num_microbatches=4)
  model.compile(optimizer=optimizer, loss=LOSS, jit_compile=True)
  with pytest.raises(RuntimeError, match="1 training step.s. refused"):
    _quiet(model.fit, x, y, batch_size=8, verbose=0)
  assert optimizer.steps_taken == 1 and optimizer.refused_steps == 1
  moved = np.sqrt(sum(np.sum((w.numpy() - w0) ** 2)
                      for w, w0 in zip(model.trainable_variables, init)))
  assert 0 < moved <= 0.3 * 0.2 * (1 + 1e-4)


def test_a_refused_step_stops_fit_before_the_next_step():
  """The refusal of the first (traced) step is read by the host before the
  second step runs; a later fit raises again for its own refusals."""
  model = _centring_model()
  x, y = _data(24)
  optimizer = _quiet(dptk.DPSGD, 0.2, 0.0, learning_rate=0.3)
  model.compile(optimizer=optimizer, loss=LOSS)
  with pytest.raises(RuntimeError, match="refused"):
    _quiet(model.fit, x, y, batch_size=8, verbose=0)
  assert optimizer.steps_taken == 1
  with pytest.raises(RuntimeError, match="2 training step.s. refused"):
    _quiet(model.fit, x, y, batch_size=8, verbose=0)
  assert optimizer.steps_taken == 2


def test_eager_fit_is_evaluated_per_unit_and_refuses_at_once():
  x, y = _data(8)
  model = _mlp(1)
  init = [w.numpy() for w in model.trainable_variables]
  unit_grads = _unit_gradients(model, x, y, None)
  optimizer = _sgd_step(model, x, y, None, 0.2, 0.3, run_eagerly=True)
  assert optimizer.per_unit_plan == "vectorized"
  _assert_sgd_formula(model, init, unit_grads, 0.2, 0.3)

  mixing = _centring_model()
  init = [w.numpy() for w in mixing.trainable_variables]
  with pytest.raises(RuntimeError, match="refused"):
    _sgd_step(mixing, x, y, None, 0.2, 0.3, run_eagerly=True)
  # (the step released its per-unit clipped mean: σ = 0, at most lr·C)
  assert _global_norm([w.numpy() - w0 for w, w0 in zip(
      mixing.trainable_variables, init)]) <= 0.3 * 0.2 * (1 + 1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_dropout_model_is_evaluated_per_unit_within_the_clip_bound(jit):
  """Random layers draw data-independent values: per-unit evaluation stays
  exact (the check compares the losses in inference mode)."""
  lr, clip = 0.5, 0.1
  rng = np.random.default_rng(2)
  x = 100 * rng.normal(size=(8, 4)).astype("float32")
  y = np.full((8, 3), 1e6, "float32")
  tf_keras.utils.set_random_seed(3)
  model = tf_keras.Sequential([
      tf_keras.layers.Dense(5, activation="tanh", input_shape=(4,)),
      tf_keras.layers.Dropout(0.5), tf_keras.layers.GaussianNoise(0.1),
      tf_keras.layers.Dense(3)])
  init = [w.numpy() for w in model.trainable_variables]
  optimizer = _quiet(dptk.DPSGD, clip, 0.0, learning_rate=lr)
  model.compile(optimizer=optimizer, loss=tf_keras.losses.MeanSquaredError(
      reduction=tf_keras.losses.Reduction.NONE), jit_compile=jit)
  _quiet(model.fit, x, y, batch_size=8, epochs=1, verbose=0)
  assert optimizer.per_unit_plan == "vectorized, checked in inference mode"
  assert optimizer.steps_taken == 1 and optimizer.refused_steps == 0
  step = _global_norm([w.numpy() - s for w, s in
                       zip(model.trainable_variables, init)])
  assert 0.1 * lr * clip < step <= lr * clip * (1 + 1e-5)


class _CustomStep(tf_keras.Sequential):
  """The stock train_step's logic, in user code (not the stock function)."""

  def train_step(self, data):
    x, y = data
    with tf.GradientTape() as tape:
      loss = self.compiled_loss(y, self(x, training=True))
    self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
    return {}


class _CustomPerUnitStep(tf_keras.Sequential):
  """A custom train_step with minimize_per_unit."""

  def train_step(self, data):
    x, y = data
    losses = self.optimizer.minimize_per_unit(
        lambda batch: LOSS(batch[1], self(batch[0], training=True)),
        (x, y), self.trainable_variables)
    return {"loss": tf.reduce_mean(losses)}


def _custom_model(cls):
  tf_keras.utils.set_random_seed(0)
  return cls([tf_keras.layers.Dense(5, activation="tanh", input_shape=(4,)),
              tf_keras.layers.Dense(3)])


def test_custom_train_step_minimize_needs_the_opt_out():
  """A custom train_step's tape gives only the jacobian: refused before any
  update unless assume_examples_independent=True (then TF-Privacy's
  jacobian: the reference formula for this model, which does not mix)."""
  x, y = _data(8)
  model = _custom_model(_CustomStep)
  init = [w.numpy() for w in model.trainable_variables]
  with pytest.raises(ValueError, match="minimize_per_unit[\\s\\S]*"
                     "assume_examples_independent=True"):
    _sgd_step(model, x, y, 4, 0.2, 0.3)
  for w, w0 in zip(model.trainable_variables, init):
    np.testing.assert_array_equal(w.numpy(), w0)

  unit_grads = _unit_gradients(model, x, y, 4)
  optimizer = _sgd_step(model, x, y, 4, 0.2, 0.3, assume=True)
  assert optimizer.per_unit_plan == (
      "jacobian: not called from tf_keras' stock Model.train_step "
      "(assume_examples_independent=True)")
  assert optimizer.vectorized_steps == 0
  _assert_sgd_formula(model, init, unit_grads, 0.2, 0.3)


@pytest.mark.parametrize("microbatches", [None, 4])
def test_custom_train_step_minimize_per_unit_is_the_reference(microbatches):
  x, y = _data(8)
  model = _custom_model(_CustomPerUnitStep)
  init = [w.numpy() for w in model.trainable_variables]
  unit_grads = _unit_gradients(model, x, y, microbatches)
  optimizer = _sgd_step(model, x, y, microbatches, 0.2, 0.3)
  assert optimizer.per_unit_plan == "vectorized (minimize_per_unit)"
  assert optimizer.logical_batch_size == 8
  _assert_sgd_formula(model, init, unit_grads, 0.2, 0.3)


class _RunningMean(tf_keras.layers.Layer):
  """Keeps the batch mean in a variable and uses it: shared state."""

  def build(self, shape):
    self.mean = self.add_weight("mean", shape=shape[-1:], trainable=False,
                                initializer="zeros")

  def call(self, inputs):
    self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(inputs, 0))
    return inputs - self.mean


class _TableCarry(tf_keras.layers.Layer):
  """Adds what earlier examples left in a hash table: state that is not a
  variable (a review: 3.6C in the step, 2.9C into the next one)."""

  def build(self, shape):
    self.width = int(shape[-1])
    self.table = tf.lookup.experimental.MutableHashTable(
        tf.int64, tf.float32, tf.zeros([self.width]))

  def call(self, inputs):
    key = tf.constant([0], tf.int64)
    previous = tf.reshape(self.table.lookup(key), [1, self.width])
    insert = self.table.insert(key, previous + tf.reduce_sum(
        inputs, 0, keepdims=True))
    with tf.control_dependencies([insert]):
      return inputs + previous


@pytest.mark.parametrize("layer", [_RunningMean, _TableCarry])
def test_a_layer_that_writes_state_is_refused(layer):
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([
      tf_keras.layers.Dense(5, input_shape=(4,)), layer(),
      tf_keras.layers.Dense(3)])
  init = [w.numpy() for w in model.trainable_variables]
  with pytest.raises(ValueError, match="writes state"):
    _sgd_step(model, *_data(8), None, 0.2, 0.3)
  for w, w0 in zip(model.trainable_variables, init):
    np.testing.assert_array_equal(w.numpy(), w0)


def test_graph_inspection_sees_into_nested_functions():
  """Writes and random draws hidden in a function the model calls."""
  variable = tf.Variable(0.0)

  @tf.function
  def inner(x):
    variable.assign(x[0])
    return x + tf.random.uniform(tf.shape(x))

  found = {}

  @tf.function
  def outer(x):
    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations())
    out = inner(x) + tf.ones_like(x)
    ops = graph.get_operations()[start:]
    found["writes"] = _compat.state_writes(ops, None)
    found["random"] = _compat.draws_random(ops)
    found["pure"] = (_compat.state_writes(ops[-2:], None),
                     _compat.draws_random(ops[-2:]))
    return out

  outer(tf.ones([2]))
  assert found["writes"] and found["random"]
  assert found["pure"] == ([], False)


def test_keras3_dropout_in_a_tf_keras_model_is_random_not_state():
  """A Keras 3 layer advances its SeedGenerator (a variable write) to draw
  data-independent randomness: allowed, and checked in inference mode."""

  class Keras3Dropout(tf_keras.layers.Layer):
    def __init__(self):
      super().__init__()
      self.dropout = keras.layers.Dropout(0.5, seed=1)

    def call(self, inputs, training=None):
      return self.dropout(inputs, training=training)

  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([
      tf_keras.layers.Dense(5, input_shape=(4,)), Keras3Dropout(),
      tf_keras.layers.Dense(3)])
  optimizer = _sgd_step(model, *_data(8), None, 0.2, 0.3)
  assert optimizer.per_unit_plan == "vectorized, checked in inference mode"
  assert optimizer.refused_steps == 0


@pytest.mark.parametrize("vectorizable", [True, False])
def test_ops_tensorflow_cannot_vectorize_are_looped(vectorizable, monkeypatch):
  """An embedding's gradient has no strict vectorization rule: TensorFlow
  loops those ops. Where tf.vectorized_map fails altogether (e.g. LSTM),
  tf.map_fn over units. Each unit is still evaluated alone: the reference
  formula."""
  rng = np.random.default_rng(0)
  x = rng.integers(0, 10, size=(4, 3)).astype("int32")
  y = rng.integers(0, 3, size=4).astype("int32")
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([
      tf_keras.layers.Embedding(10, 2, input_length=3),
      tf_keras.layers.Flatten(), tf_keras.layers.Dense(3)])
  init = [w.numpy() for w in model.trainable_variables]
  unit_grads = _unit_gradients(model, x, y, None)
  if not vectorizable:
    def fail(*args, **kwargs):
      raise ValueError("no vectorization rule (simulated)")
    monkeypatch.setattr(tf, "vectorized_map", fail)
  optimizer = _sgd_step(model, x, y, None, 0.2, 0.3)
  assert optimizer.per_unit_plan == (
      "vectorized, some ops looped" if vectorizable else "loop")
  _assert_sgd_formula(model, init, unit_grads, 0.2, 0.3)


@tf.function
def _masked_sum(x):
  return tf.reduce_sum(tf.boolean_mask(x, x > 0))


class _PositiveSum(tf_keras.layers.Layer):
  """Each example's sum of its positive features, by tf.boolean_mask: an op
  whose result has a different size for each example (in a nested function
  too, whose ops the unit's trace does not hold)."""

  def __init__(self, nested=False):
    super().__init__()
    self.nested = nested

  def call(self, x):
    if x.shape[0] == 1:  # one example
      total = (_masked_sum(x) if self.nested
               else tf.reduce_sum(tf.boolean_mask(x, x > 0)))
      return tf.reshape(total, [1, 1])
    return tf.reduce_sum(tf.where(x > 0, x, 0.), axis=1, keepdims=True)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("jit_compile", [True, False])
def test_ops_with_per_unit_shapes_are_looped_whole(jit_compile, nested):
  """A review: TensorFlow's per-op loop inside tf.vectorized_map gave every
  unit, under XLA, the last unit's number of positive features (8C between
  neighbours, no error). Such a model is looped whole: the reference."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 5)).astype("float32")
  x[-1] = np.abs(x[-1])  # the last example: every feature positive
  y = rng.normal(size=(4,)).astype("float32")
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([tf_keras.Input((5,)), _PositiveSum(nested),
                               tf_keras.layers.Dense(3)])
  init = [w.numpy() for w in model.trainable_variables]
  unit_grads = _unit_gradients(model, x, y, None)
  optimizer = _sgd_step(model, x, y, None, 0.2, 0.3, jit_compile=jit_compile)
  assert optimizer.per_unit_plan == "loop"
  _assert_sgd_formula(model, init, unit_grads, 0.2, 0.3)


def test_two_outputs_with_two_losses_take_the_per_unit_path():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 4)).astype("float32")
  y1 = rng.integers(0, 3, size=8).astype("int32")
  y2 = rng.normal(size=(8, 1)).astype("float32")
  models = []
  for assume in (False, True):
    tf_keras.utils.set_random_seed(0)
    inp = tf_keras.Input((4,))
    h = tf_keras.layers.Dense(5, activation="tanh")(inp)
    model = tf_keras.Model(inp, [tf_keras.layers.Dense(3)(h),
                                 tf_keras.layers.Dense(1)(h)])
    optimizer = _quiet(dptk.DPSGD, 0.2, 0.0, learning_rate=0.3,
                       assume_examples_independent=assume)
    optimizer.vectorize = not assume
    model.compile(optimizer=optimizer, loss=[
        LOSS, tf_keras.losses.MeanSquaredError(
            reduction=tf_keras.losses.Reduction.NONE)],
                  loss_weights=[1.0, 0.5])
    _quiet(model.fit, x, [y1, y2], batch_size=8, verbose=0)
    assert optimizer.per_unit_plan == ("vectorized" if not assume else
                                       "jacobian: vectorize=False "
                                       "(assume_examples_independent=True)")
    models.append(model)
  for a, b in zip(*(m.trainable_variables for m in models)):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------- the noise
@pytest.mark.parametrize("microbatches, accumulation, units, releases", [
    (None, 1, 20, 2),   # 2 steps of 20 examples
    (5, 1, 5, 2),       # 2 steps of 5 microbatches
    (None, 2, 40, 1),   # 1 logical step over 2 batches: noise drawn once
])
def test_noise_std_is_sigma_c_over_units(microbatches, accumulation, units,
                                         releases):
  """With zero gradients the weights move by the noise alone: each release
  adds N(0, (σC/U)²) per coordinate of the mean (U units per logical step).

  2,000 coordinates: the sample std is within 8% (5 standard errors) of
  √releases·σC/U, and the mean within 5 standard errors of 0.
  """
  sigma, clip = 2.0, 0.5
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([tf_keras.layers.Dense(
      40, use_bias=False, kernel_initializer="zeros", input_shape=(50,))])
  # x = 0: every example's gradient w.r.t. the kernel is exactly 0.
  x = np.zeros((40, 50), "float32")
  y = np.ones((40, 40), "float32")
  optimizer = dptk.DPSGD(clip, sigma, learning_rate=1.0, seed=11,
                         num_microbatches=microbatches,
                         gradient_accumulation_steps=accumulation)
  model.compile(optimizer=optimizer, loss=tf_keras.losses.MeanSquaredError(
      reduction=tf_keras.losses.Reduction.NONE))
  _quiet(model.fit, x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
  assert optimizer.steps_taken == releases
  moved = model.trainable_variables[0].numpy().ravel()
  expected = np.sqrt(releases) * sigma * clip / units
  assert abs(moved.std() / expected - 1) < 0.08
  assert abs(moved.mean()) < 5 * expected / np.sqrt(moved.size)


# ------------------------------------------------------ the clip bound
@pytest.mark.parametrize("identical", [False, True])
def test_huge_loss_examples_move_weights_at_most_lr_times_c(identical):
  """Losses ~1e12: the step is ‖Δθ‖ ≤ ηC (= ηC when all units agree)."""
  lr, clip = 0.5, 0.1
  rng = np.random.default_rng(2)
  x = 100 * rng.normal(size=(8, 4)).astype("float32")
  if identical:
    x[:] = x[0]
  y = np.full((8, 3), 1e6, "float32")
  model = _mlp(3)
  init = [w.numpy() for w in model.trainable_variables]
  model.compile(optimizer=_quiet(dptk.DPSGD, clip, 0.0, learning_rate=lr),
                loss=tf_keras.losses.MeanSquaredError(
                    reduction=tf_keras.losses.Reduction.NONE))
  _quiet(model.fit, x, y, batch_size=8, epochs=1, verbose=0)
  step = _global_norm([w.numpy() - s for w, s in
                       zip(model.trainable_variables, init)])
  assert step <= lr * clip * (1 + 1e-5)
  if identical:
    assert step == pytest.approx(lr * clip, rel=1e-4)
  else:
    assert step > 0.1 * lr * clip


# ------------------------------------------------------------- misuse
def test_scalar_loss_is_refused():
  model = _mlp()
  model.compile(optimizer=dptk.DPAdamBC(1.0, 1.0),
                loss=tf_keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  with pytest.raises(ValueError, match=r"scalar loss[\s\S]*Reduction.NONE"):
    model.fit(*_data(8), batch_size=8, verbose=0)


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_tf_keras_batch_normalization_is_refused(run_eagerly):
  model = tf_keras.Sequential([
      tf_keras.layers.Dense(5, input_shape=(4,)),
      tf_keras.layers.BatchNormalization(),
      tf_keras.layers.Dense(3)])
  model.compile(optimizer=dptk.DPSGD(1.0, 1.0), loss=LOSS,
                run_eagerly=run_eagerly)
  before = [w.numpy() for w in model.trainable_variables]
  with pytest.raises(ValueError, match="BatchNormalization.*whole batch"):
    _quiet(model.fit, *_data(8), batch_size=8, verbose=0)
  for w, b in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(w.numpy(), b)


def test_keras3_batch_normalization_inside_tf_keras_model_is_refused():
  class Net(tf_keras.Model):
    def __init__(self):
      super().__init__()
      self.hidden = tf_keras.layers.Dense(5)
      self.norm = keras.layers.BatchNormalization()
      self.out = tf_keras.layers.Dense(3)

    def call(self, x, training=False):
      return self.out(self.norm(self.hidden(x), training=training))

  model = Net()
  model.compile(optimizer=dptk.DPSGD(1.0, 1.0), loss=LOSS)
  with pytest.raises(ValueError, match="BatchNormalization"):
    model.fit(*_data(8), batch_size=8, verbose=0)


def _conv_bn_forward():
  """A model only reachable through its bound __call__ (not a stack local)."""
  model = tf_keras.Sequential([
      tf_keras.layers.Conv2D(2, 3, input_shape=(6, 6, 1)),
      tf_keras.layers.BatchNormalization(),
      tf_keras.layers.Flatten(), tf_keras.layers.Dense(3)])
  return model.__call__, model.trainable_variables


def test_fused_batch_norm_in_a_traced_custom_step_is_refused():
  forward, variables = _conv_bn_forward()
  optimizer = dptk.DPSGD(1.0, 1.0)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = LOSS(y, forward(x, training=True))
    optimizer.minimize(loss, variables, tape=tape)

  with pytest.raises(ValueError, match="batch normalization op"):
    step(tf.zeros([4, 6, 6, 1]), tf.zeros([4], tf.int32))


def test_layer_normalization_on_sequences_trains_in_a_traced_fit():
  # tf_keras' LayerNormalization of a 3-D input runs the fused batch-norm
  # kernel on [1, rows, features, 1] (per-row statistics): it was refused
  # as batch normalization. It trains as the per-example reference.
  tf_keras.utils.set_random_seed(3)
  model = tf_keras.Sequential([
      tf_keras.layers.Dense(4, input_shape=(3, 4)),
      tf_keras.layers.LayerNormalization(),
      tf_keras.layers.Flatten(), tf_keras.layers.Dense(3)])
  rng = np.random.default_rng(3)
  x = rng.normal(size=(8, 3, 4)).astype("float32")
  y = rng.integers(0, 3, size=8).astype("int32")
  clip, lr = 0.3, 1.0
  want = [w - lr * s / len(x) for w, s in zip(
      [v.numpy() for v in model.trainable_variables],
      _clipped_sum(_unit_gradients(model, x, y, None), clip))]
  optimizer = _quiet(dptk.DPSGD, clip, 0.0, learning_rate=lr)
  model.compile(optimizer=optimizer, loss=LOSS)
  _quiet(model.fit, x, y, batch_size=8, epochs=1, verbose=0)
  for got, expected in zip(model.trainable_variables, want):
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-6)


def test_apply_gradients_is_refused():
  model = _mlp()
  optimizer = dptk.DPKerasAdamOptimizer(1.0, 1.0)
  grads = [tf.zeros_like(v) for v in model.trainable_variables]
  with pytest.raises(RuntimeError, match="aggregated gradients"):
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def test_custom_loop_minimize_needs_a_tape_and_minimize_per_unit_works():
  x, y = _data(8)
  model = _mlp()
  optimizer = dptk.DPSGD(1.0, 1.0, learning_rate=0.1)
  with tf.GradientTape() as tape:
    loss = LOSS(y, model(x, training=True))
  with pytest.raises(ValueError, match="tape"):
    optimizer.minimize(loss, model.trainable_variables)
  with pytest.raises(ValueError, match="cannot evaluate each example alone"):
    optimizer.minimize(loss, model.trainable_variables, tape=tape)
  assert optimizer.steps_taken == 0
  def loss_fn(batch):
    return LOSS(batch[1], model(batch[0], training=True))

  for _ in range(2):
    losses = optimizer.minimize_per_unit(loss_fn, (x, y),
                                         model.trainable_variables)
  assert losses.shape == (8,)
  # Eager: the per-unit evaluation runs in one tf.function, traced once.
  assert optimizer._eager_cache[1].experimental_get_tracing_count() == 1
  assert optimizer.steps_taken == 2
  assert optimizer.logical_batch_size == 8


@pytest.mark.parametrize("make, message", [
    (lambda: dptk.DPAdamBC(-1.0, 1.0), "l2_norm_clip"),
    (lambda: dptk.DPAdamBC(1.0, 1.0, gamma_prime=0.0), "gamma_prime"),
    (lambda: dptk.DPKerasAdamOptimizer(1.0, 1.1, 0), "num_microbatches"),
    (lambda: dptk.DPKerasAdamOptimizer(1.0, 1.1, amsgrad=True), "amsgrad"),
    (lambda: dptk.DPKerasSGDOptimizer(1.0, 1.1, None, 1, 0.1, 0.9, False,
                                      "x"), "positional"),
    (lambda: dptk.TFKerasDPOptimizer(), "abstract"),
    (lambda: dptk.DPSGD.wrap(tf_dpadambc.DPAdam(1.0, 1.0)), "wraps DPSGD"),
    (lambda: dptk.DPSGD(1.0, 1.0, assume_examples_independent="yes"),
     "assume_examples_independent"),
])
def test_invalid_parameters_fail_clearly(make, message):
  with pytest.raises((ValueError, TypeError), match=message):
    make()


def test_microbatches_must_divide_the_batch():
  model = _mlp()
  model.compile(optimizer=dptk.DPSGD(1.0, 1.0, num_microbatches=4),
                loss=LOSS)
  with pytest.raises(Exception, match="does not divide"):
    model.fit(*_data(10), batch_size=10, verbose=0)


# ------------------------------------------- config, state, accounting
def test_every_keras3_class_has_an_adapter_whose_config_round_trips():
  names = [n for n in tf_dpadambc.keras.optimizers.__all__
           if n != "DPOptimizer"]
  for name in names:
    cls = getattr(dptk, name)
    assert cls.keras3_class is getattr(tf_dpadambc, name)
    optimizer = _quiet(cls, 0.7, 1.3, learning_rate=0.02)
    assert isinstance(optimizer, tf_keras.optimizers.Optimizer)
    assert isinstance(optimizer.keras_optimizer, cls.keras3_class)
    config = optimizer.get_config()
    again = _quiet(cls.from_config, config)
    assert type(again) is cls and again.get_config() == config
    restored = _quiet(tf_keras.optimizers.deserialize,
                      tf_keras.optimizers.serialize(optimizer))
    assert type(restored) is cls and restored.get_config() == config
    assert "assume_examples_independent" not in config


def test_the_opt_out_is_explicit_and_round_trips():
  optimizer = dptk.DPKerasAdamOptimizer(1.0, 1.1,
                                        assume_examples_independent=True)
  assert optimizer.assume_examples_independent
  config = optimizer.get_config()
  assert config["assume_examples_independent"] is True
  again = dptk.DPKerasAdamOptimizer.from_config(config)
  assert again.assume_examples_independent and again.get_config() == config
  assert not dptk.DPAdamBC(1.0, 1.0).assume_examples_independent
  assert dptk.DPSGD.wrap(tf_dpadambc.DPSGD(1.0, 1.0),
                         assume_examples_independent=True
                         ).assume_examples_independent


def test_tf_privacy_signature_maps_to_our_arguments():
  optimizer = dptk.DPKerasAdamOptimizer(1.5, 1.1, 250, 1, 0.002, 0.8)
  inner = optimizer.keras_optimizer
  assert type(inner) is tf_dpadambc.DPAdam
  assert (inner.l2_norm_clip, inner.noise_multiplier,
          inner.num_microbatches) == (1.5, 1.1, 250)
  assert inner.beta_1 == 0.8 and inner.epsilon == 1e-7
  assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.002)
  again = dptk.DPKerasAdamOptimizer.from_config(optimizer.get_config())
  assert type(again) is dptk.DPKerasAdamOptimizer
  assert again.get_config() == optimizer.get_config()
  assert type(dptk.DPKerasAdagradOptimizer(1.0, 1.0).keras_optimizer) is (
      tf_dpadambc.DPAdagrad)


def test_accounting_and_privacy_budget_follow_the_run():
  x, y = _data(48)
  model = _mlp()
  optimizer = dptk.DPAdamBC(1.0, 1.2, learning_rate=0.01)
  model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
  budget = dptk.PrivacyBudget(48, 1e-5)
  history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                      callbacks=[budget])
  assert optimizer.steps_taken == 6 and optimizer.iterations.numpy() == 6
  expected = tf_dpadambc.compute_epsilon(48, 16, 2, 1.2, 1e-5,
                                         sampling="shuffle")
  assert history.history["epsilon"][-1] == pytest.approx(expected)
  assert budget.history[-1] == pytest.approx(expected)
  statement = tf_dpadambc.optimizer_privacy_statement(optimizer, 48, 1e-5)
  assert "steps = 6" in statement
  assert set(optimizer.diagnostics()) == {"dp_v_over_phi",
                                          "dp_clamped_fraction"}


def test_checkpoint_keeps_state_but_not_unnoised_accumulated_sums(tmp_path):
  x, y = _data(24)
  model = _mlp()
  optimizer = dptk.DPAdamBC(1.0, 1.0, gradient_accumulation_steps=2,
                            seed=5)
  model.compile(optimizer=optimizer, loss=LOSS)
  model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
  assert optimizer.steps_taken == 1  # 3 batches: one still accumulated
  inner = optimizer.keras_optimizer
  assert any(np.any(s.numpy() != 0) for s in inner._accumulated_sums)
  path = tf.train.Checkpoint(optimizer=optimizer).save(str(tmp_path / "c"))
  first3 = lambda a: tuple(np.ravel(a).astype(np.float32)[:3])
  saved = {first3(tf.train.load_variable(path, name))
           for name, _ in tf.train.list_variables(path)
           if "optimizer" in name}
  for secret in inner._accumulated_sums:  # float64, compared as float32
    assert first3(secret.numpy()) not in saved

  fresh = dptk.DPAdamBC(1.0, 1.0, gradient_accumulation_steps=2, seed=5)
  fresh.build(_mlp().trainable_variables)
  tf.train.Checkpoint(optimizer=fresh).restore(path).assert_consumed()
  assert fresh.steps_taken == 1
  for a, b in zip(fresh.variables, optimizer.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_keras_file_round_trip_keeps_the_optimizer_state(tmp_path):
  x, y = _data(16)
  model = _mlp()
  model.compile(optimizer=dptk.DPKerasSGDOptimizer(1.0, 1.0, None, 1, 0.1,
                                                   0.9), loss=LOSS)
  model.fit(x, y, batch_size=8, verbose=0)
  model.save(tmp_path / "m.keras")
  loaded = tf_keras.models.load_model(tmp_path / "m.keras")
  assert type(loaded.optimizer) is dptk.DPKerasSGDOptimizer
  assert loaded.optimizer.steps_taken == 2
  for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_private_tf_keras_internals_still_exist():
  """The tf_keras internals _compat relies on (fails when tf_keras moves
  them)."""
  assert isinstance(_compat._TFKerasBatchNorm, type)
  for cls in (tf_keras.layers.BatchNormalization,
              tf_keras.layers.experimental.SyncBatchNormalization):
    assert issubclass(cls, _compat._TFKerasBatchNorm)
  # The per-unit fit path (else fit refuses: see the jacobian error).
  assert callable(_compat._compile_utils.match_dtype_and_rank)
  assert callable(_compat._losses_utils.apply_mask)
  assert {"x", "y", "sample_weight", "loss", "tape"} <= set(
      _compat._TRAIN_STEP.__code__.co_varnames)
  assert callable(_compat._compile_utils.LossesContainer._conform_to_outputs)
  assert callable(_compat._losses_utils.cast_losses_to_common_dtype)
  # The host's check after a refused step.
  for name in ("make_train_function", "_validate_and_get_metrics_result"):
    assert callable(getattr(tf_keras.Model, name))


# ------------------------------------------------ the tutorial, Keras 2
def _run(args, env_extra):
  # This checkout's package, not whichever one is installed.
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                         if p)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=path,
             **env_extra)
  return subprocess.run([sys.executable] + args, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def test_import_tf_dpadambc_does_not_import_tf_keras():
  """No module outside tf_dpadambc/tf_keras/ imports tf_keras or this package
  (statically: a subprocess would cost a TensorFlow import)."""
  package = ROOT / "tf_dpadambc"
  for path in package.rglob("*.py"):
    if (package / "tf_keras") in path.parents:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      names = []
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""] + [f"{node.module}.{a.name}"
                                       for a in node.names]
      elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        names = [node.value] if " " not in node.value else []
      for name in names:
        assert not (name == "tf_keras" or name.startswith("tf_keras.")
                    or name.startswith("tf_dpadambc.tf_keras")), (path, name)


def test_tf_privacy_tutorial_runs_on_legacy_keras():
  proc = _run([str(ROOT / "examples" / "tf_privacy_tutorial_keras.py"),
               "--num_train=40", "--num_test=20", "--batch_size=20",
               "--microbatches=20", "--epochs=2"],
              {"TF_USE_LEGACY_KERAS": "1"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "For delta=1e-5, the current epsilon is:" in proc.stdout
  assert "steps = 4 (2 epochs of N examples)" in proc.stdout  # 4 steps
  assert "val_accuracy" in proc.stdout


# --------------------------- examples that mix: issue 13, item 5 (σ = 0)
# One huge example; is its influence on the update bounded by C/B (lr = 1,
# DPSGD: Δw = -Σ_u clip_C(g_u)/B), or does training refuse before any
# weight moves? "Zeroing" the example (features and sample weight 0) must
# move the update by at most C/B: a model that hands example e's features
# to example e+1 moves it by up to 3C/B through the jacobian.
_B, _HUGE, _CLIP = 8, 3, 0.05


def _lag(z):
  """Each example also receives the previous example's features."""
  return z + tf.pad(z, [[1, 0], [0, 0]])[:-1]


def _fold(model_input, hidden):
  """[B, T, p] -> [B*T, p] -> Dense -> [B, T, q] (does not mix examples)."""
  t, p = model_input.shape[1:]
  flat = tf_keras.layers.Lambda(lambda v: tf.reshape(v, [-1, p]))(model_input)
  dense = hidden(flat)
  return tf_keras.layers.Lambda(
      lambda v: tf.reshape(v, [-1, t, v.shape[-1]]))(dense)


class _Siamese(tf_keras.layers.Layer):
  """A shared tower on concat([a, b], axis=0) (does not mix examples)."""

  def __init__(self):
    super().__init__()
    self.tower = tf_keras.layers.Dense(3)

  def call(self, inputs):
    a, b = inputs
    both = self.tower(tf.concat([a, b], axis=0))
    n = tf.shape(a)[0]
    return tf.abs(both[:n] - both[n:])


def _mixing_model(kind, custom):
  """(model, x builder): the model's inputs for a batch of features."""
  tf_keras.utils.set_random_seed(7)
  layers = tf_keras.layers
  cls = _Custom if custom == "minimize" else (
      _PerUnit if custom == "minimize_per_unit" else tf_keras.Model)
  if kind == "fold":
    inp = tf_keras.Input((2, 4))
    out = layers.Dense(2)(layers.Flatten()(_fold(inp, layers.Dense(3))))
    return cls(inp, out), lambda f: f.reshape(-1, 2, 4)
  if kind == "siamese":
    a, b = tf_keras.Input((4,)), tf_keras.Input((4,))
    out = layers.Dense(2)(_Siamese()([a, b]))
    return cls([a, b], out), lambda f: [f[:, :4], f[:, 4:]]
  inp = tf_keras.Input((8,))
  h = layers.Dense(3)(inp)
  if kind.startswith("lag"):
    h = layers.Lambda(_lag)(h)
  if kind == "centring":
    h = _BatchCentering()(h)
  if kind == "lag+dropout":
    # Stateless: the same masks in both runs, also under XLA.
    h = layers.Dropout(0.5, seed=3, rng_type="stateless")(h)
  return cls(inp, layers.Dense(2)(h)), lambda f: f


_MSE = tf_keras.losses.MeanSquaredError(
    reduction=tf_keras.losses.Reduction.NONE)


class _Custom(tf_keras.Model):
  """A custom train_step that calls minimize with the tape (jacobian)."""

  def train_step(self, data):
    x, y, sw = tf_keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
      loss = _MSE(y, self(x, training=True), sample_weight=sw)
    self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
    return {}


class _PerUnit(tf_keras.Model):
  """A custom train_step that calls minimize_per_unit."""

  def train_step(self, data):
    x, y, sw = tf_keras.utils.unpack_x_y_sample_weight(data)
    losses = self.optimizer.minimize_per_unit(
        lambda b: _MSE(b[1], self(b[0], training=True), sample_weight=b[2]),
        (x, y, sw), self.trainable_variables)
    return {"loss": tf.reduce_mean(losses)}


def _updates(kind, path, jit, inputs_with, inputs_without, y):
  """``(updates, refused)``: Δw of one fit step on each batch (from the
  same weights, one traced step), or None if training refused before any
  release (no weight moved); ``refused`` also where the per-unit check
  failed after its (per-unit, not gated) release."""
  model, inputs = _mixing_model(kind, path)
  init = [w.numpy() for w in model.trainable_variables]
  optimizer = _quiet(dptk.DPSGD, _CLIP, 0.0, learning_rate=1.0)
  model.compile(optimizer=optimizer, loss=_MSE, jit_compile=jit)
  updates, refused = [], False
  for features, weights in (inputs_with, inputs_without):
    model.set_weights(init)
    try:
      _quiet(model.fit, inputs(features), y, sample_weight=weights,
             batch_size=_B, shuffle=False, verbose=0)
    except RuntimeError as error:  # after the step, which was per-unit
      assert re.search(r"training step\(s\) refused", str(error)), error
      refused = True
    except ValueError as error:
      assert re.search("refused|cannot evaluate each example alone",
                       str(error)), error
      for w, w0 in zip(model.trainable_variables, init):
        np.testing.assert_array_equal(w.numpy(), w0)  # not even noise: σ = 0
      return None, True
    updates.append([w.numpy() - w0
                    for w, w0 in zip(model.trainable_variables, init)])
  return updates, refused


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("path, kind, expected", [
    ("fit", "lag", "refused"),
    ("fit", "lag+dropout", "refused"),
    ("fit", "fold", "bounded"),
    ("fit", "siamese", "bounded"),
    ("fit", "centring", "refused"),
    ("minimize", "lag", "refused"),
    ("minimize", "lag+dropout", "refused"),
    ("minimize", "fold", "refused"),
    ("minimize", "siamese", "refused"),
    ("minimize", "centring", "refused"),
    ("minimize_per_unit", "lag", "bounded"),
    ("minimize_per_unit", "lag+dropout", "bounded"),
    ("minimize_per_unit", "fold", "bounded"),
    ("minimize_per_unit", "siamese", "bounded"),
    ("minimize_per_unit", "centring", "bounded"),
])
def test_one_example_moves_the_update_by_at_most_c_or_training_refuses(
    path, kind, expected, jit):
  rng = np.random.default_rng(5)
  features = rng.normal(size=(_B, 8)).astype("float32")
  features[_HUGE] *= 1e3
  y = rng.normal(size=(_B, 2)).astype("float32")
  y[_HUGE] = 1e4
  weights = np.ones(_B, "float32")
  zeroed, no_weight = features.copy(), weights.copy()
  zeroed[_HUGE], no_weight[_HUGE] = 0.0, 0.0
  updates, refused = _updates(kind, path, jit, (features, weights),
                              (zeroed, no_weight), y)
  assert refused == (expected == "refused")
  if updates is None:
    return
  # Refused by the per-unit check after the step: that step was per-unit
  # all the same (not gated on the verdict), so it is bounded too.
  with_it, without = updates
  moved = _global_norm([a - b for a, b in zip(with_it, without)])
  assert 0.5 * _CLIP / _B < moved <= _CLIP / _B * (1 + 1e-5)


class _PythonState(tf_keras.layers.Layer):
  """Runs Python in its forward pass: in a loop over units, Python state
  could carry one unit's data to the next."""

  def call(self, inputs):
    extra = tf.py_function(lambda: np.float32(0.0), [], tf.float32)
    return inputs + tf.ensure_shape(extra, [])


def test_python_in_a_looped_forward_pass_is_refused():
  # The embedding's gradient is looped by TensorFlow (see above).
  rng = np.random.default_rng(0)
  x = rng.integers(0, 10, size=(4, 3)).astype("int32")
  y = rng.integers(0, 3, size=4).astype("int32")
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([
      tf_keras.layers.Embedding(10, 2, input_length=3), _PythonState(),
      tf_keras.layers.Flatten(), tf_keras.layers.Dense(3)])
  init = [w.numpy() for w in model.trainable_variables]
  with pytest.raises(ValueError, match="runs Python|cannot be evaluated"):
    _sgd_step(model, x, y, None, 0.2, 0.3)
  for w, w0 in zip(model.trainable_variables, init):
    np.testing.assert_array_equal(w.numpy(), w0)


def _trim_and_pool(x):
  """The sum after the leading padding common to the batch (per example in
  a batch; each unit alone slices to a length of its own)."""
  nonpad = tf.reduce_any(tf.not_equal(x, 0.0), axis=-1)
  first = tf.argmax(tf.cast(nonpad, tf.int32), axis=1, output_type=tf.int32)
  return tf.reduce_sum(tf.slice(x, [0, tf.reduce_min(first), 0],
                                [-1, -1, -1]), axis=1)


@pytest.mark.parametrize("jit", [False, True])
def test_a_slice_of_each_units_own_length_loops_over_units(jit):
  # TensorFlow's vectorization of that slice read past each unit's end (one
  # example moved the others: 10C in a review); core._pfor_compat refuses
  # it, and the adapter evaluates each unit in a loop: the exact step.
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([
      tf_keras.Input((4, 2)), tf_keras.layers.Lambda(_trim_and_pool),
      tf_keras.layers.Dense(3)])
  x = np.zeros((6, 4, 2), "float32")
  x[:, 2:] = np.random.default_rng(0).normal(size=(6, 2, 2))
  x[2, 0] = [0.5, -0.5]  # no leading padding
  y = np.arange(6, dtype="int32") % 3
  init = [w.numpy() for w in model.trainable_variables]
  unit_grads = _weighted_unit_gradients(model, x, y, np.ones(6, "float32"),
                                        6)
  clip = float(np.median([_global_norm(g) for g in unit_grads]))
  optimizer = _sgd_step(model, x, y, None, clip, 0.5, jit_compile=jit)
  assert optimizer.per_unit_plan == "loop"
  _assert_sgd_formula(model, init, unit_grads, clip, 0.5)


# ----------------------------------- a loss that reads beyond its unit
class _OuterBatchStep(tf_keras.Sequential):
  """A custom train_step whose loss_fn reads the outer batch's x or y
  (``closure``), or x through a tf.function it calls, instead of its
  argument's: every unit then gets the batch's gradient (a review: 8 C/B
  at B = 8)."""
  closure = None

  def unit_loss(self, x, y):
    outer_x = tf.function(lambda: x)

    def loss_fn(batch):
      bx, by = batch
      if self.closure == "x":
        bx = x
      elif self.closure == "y":
        by = y
      elif self.closure == "x through a call":
        bx = bx + 0.0 * tf.reduce_sum(outer_x())
      return _MSE(by, self(bx, training=True))
    return loss_fn

  def train_step(self, data):
    x, y = data
    losses = self.optimizer.minimize_per_unit(
        self.unit_loss(x, y), (x, y), self.trainable_variables)
    return {"loss": tf.reduce_mean(losses)}



def _outer_batch_model(closure):
  tf_keras.utils.set_random_seed(0)
  # Normalization holds its statistics as eager tensors: the model's own
  # constants, read from outside the unit function, accepted.
  model = _OuterBatchStep([
      tf_keras.layers.Normalization(mean=[0.5] * 4, variance=[2.0] * 4,
                                    input_shape=(4,)),
      tf_keras.layers.Dense(5, activation="tanh"), tf_keras.layers.Dense(3)])
  model.closure = closure
  return model


def _outer_batch_step(model, path, x, y, clip, lr):
  """One step of minimize_per_unit by ``path``; returns the optimizer."""
  optimizer = _quiet(dptk.DPSGD, clip, 0.0, learning_rate=lr)
  if path == "eager loop":
    batch = (tf.constant(x), tf.constant(y))
    _quiet(optimizer.minimize_per_unit, model.unit_loss(*batch), batch,
           model.trainable_variables)
  else:
    model.compile(optimizer=optimizer)
    _quiet(model.fit, x, y, batch_size=len(x), shuffle=False, verbose=0)
  return optimizer


@pytest.mark.parametrize("path", ["fit", "fit, looped", "eager loop"])
@pytest.mark.parametrize("closure", ["x", "y", "x through a call"])
def test_a_loss_fn_that_reads_the_outer_batch_is_refused(closure, path,
                                                         monkeypatch):
  """Refused when traced, before any weight moves: in fit's traced step (the
  batch comes from the iterator), with tf.map_fn over units (a loop body
  that captures it), and called eagerly (captured from eager). The same
  step reading its argument is the reference formula."""
  if path == "fit, looped":
    def fail(*args, **kwargs):
      raise ValueError("no vectorization rule (simulated)")
    monkeypatch.setattr(tf, "vectorized_map", fail)
  x, _ = _data(8)
  y = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
  model = _outer_batch_model(closure)
  init = [w.numpy() for w in model.trainable_variables]
  with pytest.raises(ValueError, match="reads data other than that unit's"
                     "[\\s\\S]*bounds no example's influence"):
    _outer_batch_step(model, path, x, y, 0.2, 0.3)
  for w, w0 in zip(model.trainable_variables, init):
    np.testing.assert_array_equal(w.numpy(), w0)

  model = _outer_batch_model(None)
  init = [w.numpy() for w in model.trainable_variables]
  unit_grads = []
  for xu, yu in zip(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_MSE(yu[None], model(xu[None], training=True)))
    unit_grads.append([g.numpy() for g in
                       tape.gradient(loss, model.trainable_variables)])
  optimizer = _outer_batch_step(model, path, x, y, 0.2, 0.3)
  assert optimizer.per_unit_plan == (
      "loop" if path == "fit, looped" else "vectorized") + (
          " (minimize_per_unit)")
  _assert_sgd_formula(model, init, unit_grads, 0.2, 0.3)


class _BankStep(tf_keras.Sequential):
  """A custom train_step that writes the batch into a variable (a memory
  bank, a batch context) which every unit's loss then reads: one example
  reaches all units (a review: 11 C/B for a bound of 2 C/B)."""

  def train_step(self, data):
    x, y = data
    self.bank.assign(tf.reduce_mean(x, axis=0))

    def loss_fn(batch):
      return _MSE(batch[1], self(batch[0] + self.bank, training=True))
    losses = self.optimizer.minimize_per_unit(loss_fn, (x, y),
                                              self.trainable_variables)
    return {"loss": tf.reduce_mean(losses)}


@pytest.mark.parametrize("looped", [False, True])
def test_a_variable_the_step_writes_from_the_batch_is_refused(looped,
                                                              monkeypatch):
  if looped:
    def fail(*args, **kwargs):
      raise ValueError("no vectorization rule (simulated)")
    monkeypatch.setattr(tf, "vectorized_map", fail)
  x, _ = _data(8)
  y = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
  tf_keras.utils.set_random_seed(0)
  model = _BankStep([tf_keras.layers.Dense(3, input_shape=(4,))])
  model.bank = tf.Variable(tf.zeros([4]), trainable=False)
  init = [w.numpy() for w in model.trainable_variables]
  model.compile(optimizer=_quiet(dptk.DPSGD, 0.2, 0.0, learning_rate=0.3))
  with pytest.raises(ValueError, match="writes the batch into a variable"):
    _quiet(model.fit, x, y, batch_size=8, verbose=0)
  for w, w0 in zip(model.trainable_variables, init):
    np.testing.assert_array_equal(w.numpy(), w0)


def test_a_tensor_captured_from_eager_is_refused_one_made_in_loss_fn_is_not():
  """Class weights made eagerly outside loss_fn are captured like an eager
  batch would be (they cannot be told apart): refused, with the fix in the
  message. Made inside loss_fn they are a constant of the step: trained."""
  x, y = _data(8)
  class_weights = np.array([1.0, 2.0, 0.5], "float32")
  outside = tf.constant(class_weights)
  model = _mlp()
  init = [w.numpy() for w in model.trainable_variables]
  optimizer = _quiet(dptk.DPSGD, 0.2, 0.0, learning_rate=0.3)

  def captured(batch):
    return tf.gather(outside, batch[1]) * LOSS(
        batch[1], model(batch[0], training=True))

  def made_inside(batch):
    return tf.gather(tf.constant(class_weights), batch[1]) * LOSS(
        batch[1], model(batch[0], training=True))

  with pytest.raises(ValueError, match="float32\\[3\\] tensor captured from "
                     "eager[\\s\\S]*create it inside loss_fn"):
    optimizer.minimize_per_unit(captured, (x, y), model.trainable_variables)
  assert optimizer.steps_taken == 0
  for w, w0 in zip(model.trainable_variables, init):
    np.testing.assert_array_equal(w.numpy(), w0)

  unit_grads = _weighted_unit_gradients(model, x, y, class_weights[y], 8)
  optimizer.minimize_per_unit(made_inside, (x, y), model.trainable_variables)
  assert optimizer.steps_taken == 1
  _assert_sgd_formula(model, init, unit_grads, 0.2, 0.3)
