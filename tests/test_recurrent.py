"""Recurrent models (LSTM, GRU, SimpleRNN, Bidirectional, stacked) train
privately with exact per-unit gradients.

``tf.vectorized_map`` cannot vectorize a recurrent layer's while loop (its
TensorList fails at run time), so such models evaluate units one after
another (``core.per_example.sequential_units``: ``tf.map_fn``). The
reference is a per-unit GradientTape loop; one noiseless DPSGD step of
``fit`` (with and without XLA, per example and per microbatch) must move the
weights by exactly −lr · Σ_u clip(g_u) / U.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc.core import clipping
from tf_dpadambc.keras import training

pytestmark = pytest.mark.filterwarnings("ignore:Per-example computation")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
VOCAB, LENGTH, BATCH = 20, 6, 8


def _model(kind):
  keras.utils.set_random_seed(7)
  layers = {
      "LSTM": [keras.layers.LSTM(5)],
      "GRU": [keras.layers.GRU(5)],
      "SimpleRNN": [keras.layers.SimpleRNN(5)],
      "Bidirectional": [keras.layers.Bidirectional(keras.layers.LSTM(3))],
      "stacked": [keras.layers.LSTM(4, return_sequences=True),
                  keras.layers.LSTM(4)],
  }[kind]
  return keras.Sequential([keras.Input((LENGTH,), dtype="int32"),
                           keras.layers.Embedding(VOCAB, 4)] + layers
                          + [keras.layers.Dense(3)])


def _data(seed=0):
  rng = np.random.default_rng(seed)
  return (rng.integers(0, VOCAB, size=(BATCH, LENGTH)).astype("int32"),
          rng.integers(0, 3, size=BATCH).astype("int32"))


def _reference(model, x, y, clip, num_microbatches):
  size = 1 if num_microbatches is None else BATCH // num_microbatches
  per_unit = []
  for start in range(0, BATCH, size):
    part = slice(start, start + size)
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(LOSS.call(y[part], model(x[part], training=True)))
    per_unit.append(tape.gradient(
        loss, model.trainable_variables,
        unconnected_gradients=tf.UnconnectedGradients.ZERO))
  return clipping.materialized_clipped_sum(
      [tf.stack([tf.convert_to_tensor(g) for g in grads])
       for grads in zip(*per_unit)], clip)


KINDS = ["LSTM", "GRU", "SimpleRNN", "Bidirectional", "stacked"]


@pytest.mark.parametrize("num_microbatches", [None, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_clipped_sum_equals_per_unit_reference(kind, num_microbatches):
  model = _model(kind)
  model.compile(loss=LOSS)
  x, y = _data()
  got, _, y_pred = tf.function(lambda: training.private_gradient_sum(
      model, x, y, None, 0.2, num_microbatches))()
  want = _reference(model, x, y, 0.2, num_microbatches)
  np.testing.assert_allclose(got.norms, want.norms, rtol=1e-5)
  assert int(got.num_clipped) == int(want.num_clipped) > 0
  for g, w in zip(got.grads, want.grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(y_pred, model(x), rtol=1e-5, atol=1e-6)
  assert "recurrent" in dp.clipping_plan(model).fallback


@pytest.mark.parametrize("num_microbatches, jit", [(None, True), (4, False)])
@pytest.mark.parametrize("kind", KINDS)
def test_one_fit_step_is_the_clipped_sgd_step(kind, num_microbatches, jit):
  model = dp.make_private(_model(kind))
  x, y = _data(1)
  lr, clip = 0.5, 0.2
  model.compile(optimizer=dp.DPSGD(clip, 0.0, learning_rate=lr,
                                   num_microbatches=num_microbatches),
                loss=LOSS, jit_compile=jit)
  before = [v.numpy() for v in model.trainable_variables]
  want = _reference(model, x, y, clip, num_microbatches)
  units = num_microbatches or BATCH
  with pytest.warns(UserWarning, match="tf.map_fn loop"):
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                        shuffle=False).history
  assert np.isfinite(history["loss"][0])
  for b, v, g in zip(before, model.trainable_variables, want.grads):
    np.testing.assert_allclose(v.numpy(), b - lr * g.numpy() / units,
                               rtol=1e-4, atol=1e-6)
