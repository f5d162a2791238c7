"""The one private TensorFlow API we use: a vectorization rule for BatchMatMulV2.

Per-unit evaluation (``tf.vectorized_map``) is what makes per-example clipping
exact by construction, so its results must be right. In TensorFlow 2.21 on CPU
with oneDNN, a batched matmul whose batch axes broadcast (e.g. [U, 1, T, p]
times a kernel [p, d]) returns wrong values, nan, or corrupts the heap. pfor's
own rule for BatchMatMulV2 produces exactly that op whenever a unit's tensor
meets a weight: every Keras ``EinsumDense`` (and so ``MultiHeadAttention``)
under ``vectorized_map`` hit it.

The rule installed here multiplies a unit-stacked [U, ..., m, k] by a
loop-invariant matrix [k, n] as one [U·…·m, k] x [k, n] MatMul (the same
numbers, no broadcasting kernel) and leaves every other case to TensorFlow's
rule. ``tests/test_per_example.py`` checks that the registry still has the
entry and that EinsumDense and MultiHeadAttention vectorize exactly.
"""
import tensorflow as tf
from tensorflow.python.ops.parallel_for import pfor as _pfor

_OP = "BatchMatMulV2"
_installed = False


def _stacked_times_matrix(pfor_input, fallback):
  x, x_stacked, _ = pfor_input.input(0)
  y, y_stacked, _ = pfor_input.input(1)
  if not x_stacked or y_stacked or y.shape.rank != 2:
    return fallback(pfor_input)
  if pfor_input.get_attr("adj_x"):
    x = tf.linalg.adjoint(x)
  shape = tf.shape(x)
  product = tf.matmul(tf.reshape(x, [-1, shape[-1]]), y,
                      adjoint_b=pfor_input.get_attr("adj_y"))
  out = tf.reshape(product, tf.concat([shape[:-1], tf.shape(product)[-1:]], 0))
  return _pfor.wrap(out, True)


def install():
  """Installs the rule once (idempotent)."""
  global _installed
  if _installed:
    return
  registry = _pfor._pfor_converter_registry  # pylint: disable=protected-access
  fallback = registry[_OP]
  registry[_OP] = lambda pfor_input: _stacked_times_matrix(pfor_input,
                                                           fallback)
  _installed = True
