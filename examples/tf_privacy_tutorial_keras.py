# Adapted from TF-Privacy's tutorials/mnist_dpsgd_tutorial_keras.py
# (Copyright 2019, The TensorFlow Authors; Apache License 2.0).
"""Training a CNN on MNIST with Keras and the DP SGD optimizer.

TF-Privacy's Keras 2 tutorial, run on tf_keras with tf_dpadambc's optimizer.
Run it with the legacy Keras (``tf.keras`` is then tf_keras)::

    pip install "tf-keras>=2.16"
    TF_USE_LEGACY_KERAS=1 python examples/tf_privacy_tutorial_keras.py

What differs from the TF-Privacy original, and nothing else:

* the optimizer import: ``from tf_dpadambc.tf_keras import
  DPKerasSGDOptimizer`` instead of TF-Privacy's ``dp_optimizer_keras`` (the
  optimizer line itself is unchanged; ``--optimizer=DPAdamBC`` etc. picks any
  other class of ``tf_dpadambc.tf_keras``);
* the data: SYNTHETIC MNIST-shaped images (there is no download here) — each
  class is a fixed random 28x28 template plus noise, so the CNN can learn;
  ``--num_train``/``--num_test`` set their sizes (60,000 / 10,000 as MNIST);
* at the end, tf_dpadambc's statement for what ``fit`` did (shuffled
  fixed-size batches), next to the tutorial's Poisson-sampling ε.
"""

from absl import app
from absl import flags
from absl import logging

import dp_accounting
import numpy as np
import tensorflow as tf

import tf_dpadambc
from tf_dpadambc import tf_keras as dp_tf_keras
from tf_dpadambc.tf_keras import DPKerasSGDOptimizer

flags.DEFINE_boolean(
    'dpsgd', True, 'If True, train with DP-SGD. If False, '
    'train with vanilla SGD.')
flags.DEFINE_float('learning_rate', 0.15, 'Learning rate for training')
flags.DEFINE_float('noise_multiplier', 1.1,
                   'Ratio of the standard deviation to the clipping norm')
flags.DEFINE_float('l2_norm_clip', 1.0, 'Clipping norm')
flags.DEFINE_integer('batch_size', 250, 'Batch size')
flags.DEFINE_integer('epochs', 60, 'Number of epochs')
flags.DEFINE_integer(
    'microbatches', 250, 'Number of microbatches '
    '(must evenly divide batch_size)')
flags.DEFINE_string('model_dir', None, 'Model directory')
# tf_dpadambc additions: synthetic data sizes, and the optimizer class.
flags.DEFINE_integer('num_train', 60000, 'Synthetic training examples')
flags.DEFINE_integer('num_test', 10000, 'Synthetic test examples')
flags.DEFINE_string('optimizer', 'DPKerasSGDOptimizer',
                    'A class of tf_dpadambc.tf_keras')

FLAGS = flags.FLAGS


def compute_epsilon(steps):
  """Computes epsilon value for given hyperparameters."""
  if FLAGS.noise_multiplier == 0.0:
    return float('inf')
  orders = [1 + x / 10. for x in range(1, 100)] + list(range(12, 64))
  accountant = dp_accounting.rdp.RdpAccountant(orders)

  sampling_probability = FLAGS.batch_size / FLAGS.num_train
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          sampling_probability,
          dp_accounting.GaussianDpEvent(FLAGS.noise_multiplier)), steps)

  accountant.compose(event)

  # Delta is set to 1e-5 because MNIST has 60000 training points.
  return accountant.get_epsilon(target_delta=1e-5)


def load_mnist():
  """Synthetic MNIST: 28x28x1 images in [0, 1], one-hot labels of 10 classes."""
  rng = np.random.default_rng(0)
  templates = rng.uniform(size=(10, 28, 28, 1))

  def make(n):
    labels = rng.integers(0, 10, size=n)
    data = np.clip(0.6 * templates[labels]
                   + 0.4 * rng.uniform(size=(n, 28, 28, 1)), 0., 1.)
    return data.astype(np.float32), labels.astype(np.int32)

  train_data, train_labels = make(FLAGS.num_train)
  test_data, test_labels = make(FLAGS.num_test)

  train_labels = tf.keras.utils.to_categorical(train_labels, num_classes=10)
  test_labels = tf.keras.utils.to_categorical(test_labels, num_classes=10)

  assert train_data.min() >= 0.
  assert train_data.max() <= 1.
  assert test_data.min() >= 0.
  assert test_data.max() <= 1.

  return train_data, train_labels, test_data, test_labels


def main(unused_argv):
  logging.set_verbosity(logging.ERROR)
  if FLAGS.dpsgd and FLAGS.batch_size % FLAGS.microbatches != 0:
    raise ValueError('Number of microbatches should divide evenly batch_size')

  # Load training and test data.
  train_data, train_labels, test_data, test_labels = load_mnist()

  # Define a sequential Keras model
  model = tf.keras.Sequential([
      tf.keras.layers.Conv2D(16, 8,
                             strides=2,
                             padding='same',
                             activation='relu',
                             input_shape=(28, 28, 1)),
      tf.keras.layers.MaxPool2D(2, 1),
      tf.keras.layers.Conv2D(32, 4,
                             strides=2,
                             padding='valid',
                             activation='relu'),
      tf.keras.layers.MaxPool2D(2, 1),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(32, activation='relu'),
      tf.keras.layers.Dense(10)
  ])

  if FLAGS.dpsgd:
    optimizer_class = (DPKerasSGDOptimizer
                       if FLAGS.optimizer == 'DPKerasSGDOptimizer'
                       else getattr(dp_tf_keras, FLAGS.optimizer))
    optimizer = optimizer_class(
        l2_norm_clip=FLAGS.l2_norm_clip,
        noise_multiplier=FLAGS.noise_multiplier,
        num_microbatches=FLAGS.microbatches,
        learning_rate=FLAGS.learning_rate)
    # Compute vector of per-example loss rather than its mean over a minibatch.
    loss = tf.keras.losses.CategoricalCrossentropy(
        from_logits=True, reduction=tf.losses.Reduction.NONE)
  else:
    optimizer = tf.keras.optimizers.SGD(learning_rate=FLAGS.learning_rate)
    loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True)

  # Compile model with Keras
  model.compile(optimizer=optimizer, loss=loss, metrics=['accuracy'])

  # Train model with Keras
  model.fit(train_data, train_labels,
            epochs=FLAGS.epochs,
            validation_data=(test_data, test_labels),
            batch_size=FLAGS.batch_size)

  # Compute the privacy budget expended.
  if FLAGS.dpsgd:
    eps = compute_epsilon(FLAGS.epochs * FLAGS.num_train // FLAGS.batch_size)
    print('For delta=1e-5, the current epsilon is: %.2f' % eps)
    # tf_dpadambc: ε for what fit did (each example once per epoch).
    print(tf_dpadambc.optimizer_privacy_statement(
        optimizer, num_examples=FLAGS.num_train, delta=1e-5))
  else:
    print('Trained with vanilla non-private SGD optimizer')

if __name__ == '__main__':
  app.run(main)
