import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import tensorflow as tf  # noqa: E402

# Two logical CPU devices, for tests of tf.distribute behaviour.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
  keras.utils.set_random_seed(1234)
  yield


def drive(optimizer, init, mean_gradients, batch_size):
  """Feeds noiseless clipped *means* to ``optimizer.apply_private``.

  Each mean g becomes the clipped sum B·g of a batch of B units; returns the
  parameter trajectory (list of NumPy arrays after each step).
  """
  var = keras.Variable(np.array(init, dtype="float32"))
  out = []
  for g in mean_gradients:
    optimizer.apply_private([np.asarray(g, "float32") * batch_size],
                            batch_size, batch_size, [var])
    out.append(var.numpy().copy())
  return out
