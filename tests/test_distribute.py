"""tf.distribute: per-replica clipping, one global noise draw (std σC).

conftest.py splits the CPU into two logical devices, so MirroredStrategy runs
two replicas here.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc
from tf_dpadambc import mechanisms

DEVICES = ["/cpu:0", "/cpu:1"]
X = np.random.RandomState(0).randn(64, 5).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _fit(make_optimizer, strategy=None, epochs=2, **fit_kwargs):
  scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
  with scope:
    keras.utils.set_random_seed(1)
    model = tf_dpadambc.make_private(keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
        keras.layers.Dense(2)]))
    optimizer = make_optimizer()
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
  model.fit(X, Y, batch_size=16, epochs=epochs, verbose=0, **fit_kwargs)
  return model, optimizer


def _microbatched(m):
  return lambda: tf_dpadambc.DPSGD(0.5, 0.7, seed=4, num_microbatches=m,
                                   learning_rate=0.1)


@pytest.mark.parametrize("make, make_mirrored", [
    (lambda: tf_dpadambc.DPAdamBC(1.0, 1.0, seed=3, learning_rate=1e-2),
     None),
    # num_microbatches splits each replica's share: 2 replicas × 4 of the
    # 8 examples each are the same units as 8 microbatches of the batch.
    (_microbatched(8), _microbatched(4)),
    (lambda: tf_dpadambc.DPAdamJME(1.0, 1.0, seed=5,
                                   gradient_accumulation_steps=2), None),
], ids=["DPAdamBC", "DPSGD-microbatches", "DPAdamJME-accumulation"])
def test_two_replicas_equal_one_device(make, make_mirrored):
  # Same seed, same batches: the replicas' clipped sums add up to the
  # single-device sum, and the one noise draw is the single-device draw.
  single, single_opt = _fit(make)
  mirrored, mirrored_opt = _fit(make_mirrored or make,
                                tf.distribute.MirroredStrategy(DEVICES))
  assert mirrored.distribute_strategy.num_replicas_in_sync == 2
  for a, b in zip(single.trainable_variables, mirrored.trainable_variables):
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-5)
  assert mirrored_opt.steps_taken == single_opt.steps_taken
  assert mirrored_opt.logical_batch_size == single_opt.logical_batch_size
  assert mirrored_opt.dp_event(64) == single_opt.dp_event(64)


def test_noise_is_added_once_with_global_std():
  # Zero inputs and no bias: every gradient is 0, so one DPSGD step (lr 1)
  # moves the kernel by exactly -noise/B. With B = 32 split over 2 replicas
  # the std must be σC/32 = 0.0625 — not √2 times that (noise per replica)
  # nor σC/16 (normalised per replica). 20,000 coordinates: the sample std
  # is within 3% of the truth with overwhelming probability (sd ≈ 0.5%).
  strategy = tf.distribute.MirroredStrategy(DEVICES)
  with strategy.scope():
    model = tf_dpadambc.make_private(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(5000, use_bias=False,
                                              kernel_initializer="zeros")]))
    model.compile(optimizer=tf_dpadambc.DPSGD(1.0, 2.0, learning_rate=1.0),
                  loss="mse", jit_compile=False)
  model.fit(np.zeros((32, 4), "float32"), np.zeros((32, 5000), "float32"),
            batch_size=32, epochs=1, verbose=0)
  std = float(np.std(model.trainable_variables[0].numpy()))
  assert abs(std - 2.0 / 32) / (2.0 / 32) < 0.03
  assert model.optimizer.logical_batch_size == 32


def test_unsupported_strategies_and_combinations_are_refused():
  strategy = tf.distribute.experimental.CentralStorageStrategy(DEVICES)
  with pytest.raises(NotImplementedError, match="CentralStorageStrategy"):
    _fit(lambda: tf_dpadambc.DPAdam(1.0, 1.0), strategy, epochs=1)
  with pytest.raises(NotImplementedError, match="DPQuery"):
    _fit(lambda: tf_dpadambc.DPAdam(
        query=mechanisms.IndependentNoise(1.0, 1.0)),
         tf.distribute.MirroredStrategy(DEVICES), epochs=1)


def _custom_loop(strategy=None, steps=2, make=None):
  """DPAdamBC (or ``make()``) through tf_dpadambc.private_step in a
  custom loop (under ``strategy.run`` when given), global batches of 16."""
  scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
  with scope:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(2)])
    optimizer = (make() if make else
                 tf_dpadambc.DPAdamBC(1.0, 1.0, seed=3, learning_rate=1e-2))
    model.compile(optimizer=optimizer, loss=LOSS)
  if strategy is None:
    step = tf.function(lambda batch: tf_dpadambc.private_step(model, batch))
    batches = [(X[s:s + 16], Y[s:s + 16]) for s in range(0, 16 * steps, 16)]
  else:
    step = tf.function(lambda batch: strategy.reduce(
        "MEAN", strategy.run(tf_dpadambc.private_step, args=(model, batch)),
        axis=None))
    batches = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((X[:16 * steps], Y[:16 * steps]))
        .batch(16))
  losses = [float(step(batch)) for batch in batches]
  return model, optimizer, losses


def test_custom_loop_private_step_equals_fit():
  # private_step is fit's step: same weights, steps and DpEvent as
  # make_private + fit on one device, and on two replicas (each clips its 8
  # examples; one release of the summed clipped sums).
  fitted, fit_opt = _fit(
      lambda: tf_dpadambc.DPAdamBC(1.0, 1.0, seed=3, learning_rate=1e-2),
      epochs=1, shuffle=False)
  for strategy in (None, tf.distribute.MirroredStrategy(DEVICES)):
    model, optimizer, losses = _custom_loop(strategy, steps=4)
    assert all(np.isfinite(losses))
    for a, b in zip(fitted.trainable_variables, model.trainable_variables):
      np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-5)
    assert optimizer.steps_taken == fit_opt.steps_taken == 4
    assert optimizer.logical_batch_size == 16
    assert (optimizer.dp_event(64, sampling="poisson")
            == fit_opt.dp_event(64, sampling="poisson"))


@pytest.mark.parametrize("make", [
    # The query's own clipping and release (fit's _query_step), noiseless so
    # that the two runs must agree exactly.
    lambda: tf_dpadambc.DPSGD(query=mechanisms.IndependentNoise(0.5, 0.0),
                              learning_rate=0.5),
    # The public preconditioner refreshes in before_step, as in fit.
    lambda: tf_dpadambc.DPAdamPublicPreconditioner(
        0.5, 0.0, seed=3, learning_rate=0.05, refresh_every=2,
        public_data=(X[:8], Y[:8]))], ids=["dpquery", "public"])
def test_custom_loop_private_step_takes_every_optimizer_on_one_device(make):
  # (Both are refused under several replicas, above.)
  with pytest.warns(UserWarning, match="NOT differentially private"):
    fitted, fit_opt = _fit(make, epochs=1, shuffle=False)
    model, optimizer, _ = _custom_loop(steps=4, make=make)
  for a, b in zip(fitted.trainable_variables, model.trainable_variables):
    np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
  assert not np.allclose(model.trainable_variables[0].numpy(),
                         _custom_loop(steps=0, make=make)[0]
                         .trainable_variables[0].numpy())
  assert optimizer.steps_taken == fit_opt.steps_taken == 4


def test_private_step_refuses_cross_replica_context_and_other_optimizers():
  strategy = tf.distribute.MirroredStrategy(DEVICES)
  with strategy.scope():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(optimizer=tf_dpadambc.DPSGD(1.0, 1.0), loss=LOSS)
    with pytest.raises(RuntimeError, match="strategy.run"):
      tf_dpadambc.private_step(model, (X[:8], Y[:8]))
  model.compile(optimizer="sgd", loss=LOSS)
  with pytest.raises(TypeError, match="tf_dpadambc Keras 3 optimizer"):
    tf_dpadambc.private_step(model, (X[:8], Y[:8]))


def test_tf_keras_fit_on_two_replicas_equals_one_device():
  # The tf_keras adapter under MirroredStrategy: per-replica clipping, one
  # release (same weights as one device with the same seed), and noise std
  # σC/B_global (zero gradients, as test_noise_is_added_once_with_global_std).
  import tf_keras  # pylint: disable=g-import-not-at-top

  def fit(strategy, zeros=False):
    scope = strategy.scope() if strategy else tf.distribute.get_strategy(
    ).scope()
    none = tf_keras.losses.Reduction.NONE
    with scope:
      tf_keras.utils.set_random_seed(1)
      if zeros:
        model = tf_keras.Sequential([
            tf_keras.Input((4,)), tf_keras.layers.Dense(
                5000, use_bias=False, kernel_initializer="zeros")])
        optimizer = tf_dpadambc.tf_keras.DPSGD(1.0, 2.0, learning_rate=1.0)
        model.compile(optimizer=optimizer,
                      loss=tf_keras.losses.MeanSquaredError(reduction=none))
        model.fit(np.zeros((32, 4), "float32"),
                  np.zeros((32, 5000), "float32"), batch_size=32, verbose=0)
        return model, optimizer
      model = tf_keras.Sequential([
          tf_keras.Input((5,)), tf_keras.layers.Dense(4, activation="tanh"),
          tf_keras.layers.Dense(2)])
      optimizer = tf_dpadambc.tf_keras.DPAdamBC(1.0, 1.0, seed=3,
                                                learning_rate=1e-2)
      model.compile(optimizer=optimizer,
                    loss=tf_keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True, reduction=none))
    model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model, optimizer

  single, single_opt = fit(None)
  mirrored, mirrored_opt = fit(tf.distribute.MirroredStrategy(DEVICES))
  for a, b in zip(single.get_weights(), mirrored.get_weights()):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
  assert mirrored_opt.steps_taken == single_opt.steps_taken == 4
  assert mirrored_opt.logical_batch_size == 16
  assert mirrored_opt.dp_event(64) == single_opt.dp_event(64)
  noise, noise_opt = fit(tf.distribute.MirroredStrategy(DEVICES), zeros=True)
  std = float(np.std(noise.get_weights()[0]))
  assert abs(std - 2.0 / 32) / (2.0 / 32) < 0.03, std
  assert noise_opt.logical_batch_size == 32
