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
