"""Recurrent models (LSTM, GRU, SimpleRNN, Bidirectional, stacked) train
privately with exact per-unit gradients.

``tf.vectorized_map`` cannot vectorize a recurrent layer's while loop (its
TensorList fails at run time). LSTM, GRU and SimpleRNN in the common
configuration use the ghost path with the rule ``keras.rules.recurrent``
(the cell unrolled over the static T steps, which vectorizes); the others
(Bidirectional's go_backwards layer, a mask, dropout, ...) evaluate units one
after another (``core.per_example.sequential_units``: ``tf.map_fn``). The
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
from tf_dpadambc.keras.rules import recurrent

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


# (Bidirectional per microbatch: its loop is the fit step's case below.)
@pytest.mark.parametrize("kind, num_microbatches", [
    (kind, m) for kind in KINDS for m in (None, 2)
    if (kind, m) != ("Bidirectional", 2)])
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
  plan = dp.clipping_plan(model)
  if kind == "Bidirectional":  # its backward layer goes backwards: the loop
    assert "recurrent" in plan.fallback
  else:
    assert plan.fallback is None
    assert sum("unrolled cell" in e.method for e in plan.entries) == (
        2 if kind == "stacked" else 1)


# Under XLA one kind: the unrolled cell is one code path for all of them,
# and compiling a recurrent private step takes 10-25 s on 2 cores.
@pytest.mark.parametrize("kind, num_microbatches, jit", [
    (kind, None, kind == "LSTM") for kind in KINDS] + [
        (kind, 4, False) for kind in KINDS])
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


# ------------------------------------------- the rule through the cell

CONFIGS = {
    "LSTM": lambda: keras.layers.LSTM(5),
    "LSTM sequences": lambda: keras.layers.LSTM(5, return_sequences=True),
    "LSTM relu, no bias": lambda: keras.layers.LSTM(
        5, activation="relu", recurrent_activation="hard_sigmoid",
        use_bias=False),
    "GRU": lambda: keras.layers.GRU(5),
    "GRU reset_before": lambda: keras.layers.GRU(5, reset_after=False),
    "GRU sequences, no bias": lambda: keras.layers.GRU(
        5, return_sequences=True, use_bias=False),
    "GRU reset_before sequences": lambda: keras.layers.GRU(
        5, reset_after=False, return_sequences=True, activation="relu"),
    "SimpleRNN sequences": lambda: keras.layers.SimpleRNN(
        5, return_sequences=True),
    "SimpleRNN relu, no bias": lambda: keras.layers.SimpleRNN(
        5, activation="relu", use_bias=False),
}


def _config_model(name, mask=False):
  keras.utils.set_random_seed(3)
  layer = CONFIGS[name]()
  tail = [keras.layers.Flatten()] if layer.return_sequences else []
  return keras.Sequential([keras.Input((LENGTH,), dtype="int32"),
                           keras.layers.Embedding(VOCAB, 4, mask_zero=mask),
                           layer] + tail + [keras.layers.Dense(3)])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_unrolled_forward_equals_the_layers_call(name):
  model = _config_model(name)
  layer = model.layers[1]
  rule = recurrent.Recurrent(layer)
  x = tf.random.stateless_normal([3, LENGTH, 4], [1, 2])
  z, output, record = rule.forward(layer.call, x, {"training": True})
  np.testing.assert_allclose(output, layer(x, training=True), rtol=1e-5,
                             atol=1e-6)
  gates = {"LSTM": 4, "GRU": 3, "SimpleRNN": 1}[type(layer).__name__]
  assert z.shape == (3, LENGTH, gates * 5)
  assert record[0] is x and record[1].shape == (3, LENGTH, 5)


@pytest.mark.parametrize("num_microbatches", [None, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_rule_equals_per_example_gradients(name, num_microbatches):
  model = _config_model(name)
  model.compile(loss=LOSS)
  x, y = _data(2)
  got, _, _ = tf.function(lambda: training.private_gradient_sum(
      model, x, y, None, 0.3, num_microbatches))()
  want = _reference(model, x, y, 0.3, num_microbatches)
  assert dp.clipping_plan(model).fallback is None
  np.testing.assert_allclose(got.norms, want.norms, rtol=1e-5)
  for g, w in zip(got.grads, want.grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["mask", "dropout", "go_backwards",
                                  "frozen"])
def test_configurations_outside_the_rule_keep_the_loop(case):
  if case == "mask":
    model = _config_model("LSTM", mask=True)
  else:
    keras.utils.set_random_seed(3)
    layer = {"dropout": lambda: keras.layers.GRU(5, dropout=0.5),
             "go_backwards": lambda: keras.layers.LSTM(5, go_backwards=True),
             "frozen": lambda: keras.layers.SimpleRNN(5, trainable=False),
             }[case]()
    model = keras.Sequential([keras.Input((LENGTH,), dtype="int32"),
                              keras.layers.Embedding(VOCAB, 4), layer,
                              keras.layers.Dense(3)])
  model.compile(loss=LOSS)
  x, y = _data(3)
  x[:, -2:] = 0  # padding, for the mask
  with pytest.warns(UserWarning, match="tf.map_fn loop"):
    got, _, _ = tf.function(lambda: training.private_gradient_sum(
        model, x, y, None, 0.3))()
  # A mask reaches the LSTM as a second tensor; the others have no rule.
  assert ("several tensors" if case == "mask" else "recurrent") in (
      dp.clipping_plan(model).fallback)
  if case != "dropout":  # dropout draws its own random values
    want = _reference(model, x, y, 0.3, None)
    for g, w in zip(got.grads, want.grads):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "SimpleRNN"])
def test_stateful_layers_are_refused(kind):
  # Evaluated per unit, the state silently never carried over (a review:
  # the state variables never moved); carried over, one batch's examples
  # would reach later steps and the saved state without noise.
  layer = getattr(keras.layers, kind)(5, stateful=True)
  model = keras.Sequential([keras.Input((LENGTH,), batch_size=BATCH,
                                        dtype="int32"),
                            keras.layers.Embedding(VOCAB, 4), layer,
                            keras.layers.Dense(3)])
  with pytest.raises(ValueError, match="stateful=False"):
    dp.make_private(model)
