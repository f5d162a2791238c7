"""Hints to XLA's compilation that change speed, never values.

XLA's CPU backend (TensorFlow 2.21) rewrites a large reduction into a
reduce-window over blocks and a second reduction (its tree-reduction
rewrite, for accuracy), and runs the pair several times slower than one
fused reduction loop: Σ of a 784 × 128 comparison cast to float32, 0.31
against 0.03 ms; two such sums over 10⁶ values, 1.4 against 0.4 ms. An
optimization barrier on the reduction's input keeps the rewrite off it;
the barrier itself is removed before code generation (nothing is
materialized for it).
"""
import tensorflow as tf

try:
  from tensorflow.compiler.tf2xla.python import xla as _xla
  from tensorflow.python.ops import control_flow_util as _flow
except ImportError:  # pragma: no cover - a TensorFlow without them
  _xla = _flow = None


def _compiling_for_cpu():
  """True while a function is traced for XLA (``jit_compile=True``, also
  in functions it calls) on a machine without a GPU. Outside XLA the
  barrier would run as an op compiled on its own (0.14 ms a call)."""
  if _xla is None or tf.executing_eagerly():
    return False
  if not _flow.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
    return False
  return not tf.config.list_logical_devices("GPU")


def whole_reduction(t):
  """``t``, as the input of a reduction XLA should run as one loop (see
  the module docstring): an identity. The float additions may run in
  another order than the tree's."""
  if not _compiling_for_cpu():
    return t
  return _xla.optimization_barrier(t)[0]
