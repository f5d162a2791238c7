"""TensorFlow's float32 arithmetic on the GPU against float64 NumPy, TF32 off:
a matmul, an XLA-compiled function and a convolution (lent_session.sh runs
this before any timing; a wrong library shim shows here)."""
import numpy as np
import tensorflow as tf

tf.config.experimental.enable_tensor_float_32_execution(False)
gpus = tf.config.list_physical_devices("GPU")
assert gpus, "TensorFlow sees no GPU"
print("TensorFlow", tf.__version__, tf.config.experimental.get_device_details(gpus[0]))
rng = np.random.default_rng(0)
a = rng.normal(size=(257, 300)).astype("float32")
b = rng.normal(size=(300, 129)).astype("float32")
want = a.astype("float64") @ b.astype("float64")
image = rng.normal(size=(8, 28, 28, 3)).astype("float32")
kernel = rng.normal(size=(3, 3, 3, 5)).astype("float32")
with tf.device("GPU:0"):
  product = tf.matmul(a, b).numpy()
  compiled = tf.function(lambda x, y: tf.nn.relu(tf.matmul(x, y)) + tf.reduce_sum(x),
                         jit_compile=True)(a, b).numpy()
  conv = tf.nn.conv2d(image, kernel, 1, "VALID").numpy()
conv_want = sum(np.einsum("nhwc,co->nhwo", image[:, i:i + 26, j:j + 26].astype("float64"),
                          kernel[i, j].astype("float64"))
                for i in range(3) for j in range(3))
scale = np.max(np.abs(want))
errors = (np.max(np.abs(product - want)) / scale,
          np.max(np.abs(compiled - (np.maximum(want, 0) + a.sum()))) / scale,
          np.max(np.abs(conv - conv_want)) / np.max(np.abs(conv_want)))
print("relative errors: matmul %.1e, XLA %.1e, conv2d %.1e" % errors)
assert errors[0] < 1e-5 and errors[1] < 1e-5 and errors[2] < 1e-4, "wrong results"
