"""Private training of a Keras 3 model on several workers (runs offline).

Keras 3's ``fit`` does not run under MultiWorkerMirroredStrategy with several
workers (keras-team/keras#20585), so the loop is written out: each replica
clips its own examples in ``tf_dpadambc.private_step``, the replicas' clipped
sums are summed and the noise is drawn once per global step (std σC, one
seed agreed across the workers), exactly as ``make_private``'s ``fit`` does
on one host.

Run it on each worker with its TF_CONFIG, e.g. two processes on one machine:

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]},
                "task": {"type": "worker", "index": 0}}' python multi_worker.py
    TF_CONFIG='... "index": 1}}' python multi_worker.py

Without TF_CONFIG it runs as one worker (all the machine's devices).
"""
import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

# First of all TensorFlow ops: the strategy sets up the collectives.
strategy = tf.distribute.MultiWorkerMirroredStrategy()

import tf_dpadambc  # noqa: E402  pylint: disable=g-import-not-at-top

x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

# The GLOBAL batch (all workers together) is what the accounting sees.
global_batch, epochs, delta = 150, 15, 1e-5
steps_per_epoch = len(x_train) // global_batch
noise_multiplier = tf_dpadambc.compute_noise_multiplier(
    num_examples=len(x_train), batch_size=global_batch, epochs=epochs,
    target_epsilon=8.0, delta=delta, sampling="shuffle")

with strategy.scope():  # model and optimizer in the scope
  keras.utils.set_random_seed(0)  # the weights' initialisation only
  model = keras.Sequential([keras.Input((64,)),
                            keras.layers.Dense(64, activation="tanh"),
                            keras.layers.Dense(10)])
  model.compile(
      optimizer=tf_dpadambc.DPAdamBC(l2_norm_clip=1.0,
                                     noise_multiplier=noise_multiplier,
                                     learning_rate=2e-3, gamma_prime=1e-6),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  # Built here, not on the first step: a tf.function whose first trace
  # creates variables is traced twice.
  model.optimizer.build(model.trainable_variables)


def dataset(context):
  """This worker's share of each global batch (one shuffled pass per epoch,
  the same permutation on every worker: seeded per epoch, public)."""
  per_replica = context.get_per_replica_batch_size(global_batch)
  return (tf.data.Dataset.from_tensor_slices((x_train, y_train))
          .shuffle(len(x_train), seed=1, reshuffle_each_iteration=True)
          .repeat(epochs)
          .batch(global_batch, drop_remainder=True)
          .unbatch()
          .shard(context.num_input_pipelines, context.input_pipeline_id)
          .batch(per_replica, drop_remainder=True))


@tf.function
def train_step(batch):
  losses = strategy.run(tf_dpadambc.private_step, args=(model, batch))
  return strategy.reduce("MEAN", losses, axis=None)


batches = iter(strategy.distribute_datasets_from_function(dataset))
for epoch in range(epochs):
  loss = np.mean([float(train_step(next(batches)))
                  for _ in range(steps_per_epoch)])
  # One pass over the data: each example in at most one global batch.
  model.optimizer.accounting_ledger.end_epoch()
  print(f"epoch {epoch + 1}: loss {loss:.3f}")

logits = model.predict(x_test, verbose=0)
print(f"Test accuracy: {np.mean(np.argmax(logits, -1) == y_test):.3f}")
print(tf_dpadambc.optimizer_privacy_statement(
    model.optimizer, num_examples=len(x_train), delta=delta))
