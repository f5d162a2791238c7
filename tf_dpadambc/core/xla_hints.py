"""Hints to XLA's compilation that change speed, never values.

:func:`opaque` puts an optimization barrier on a tensor while XLA's CPU
backend (TensorFlow 2.21) optimizes the step: passes before fusion cannot
rewrite the tensor's consumers through it (the barrier is removed before
code generation; nothing is materialized for it). Two rewrites it keeps
off, each measured slower:

- the tree-reduction rewrite, which splits a large reduction into a
  reduce-window over blocks and a second reduction, and runs the pair
  several times slower than one fused loop: Σ of a 784 × 128 comparison
  cast to float32, 0.31 against 0.03 ms;
- reshapes moved through each consumer, after which every consumer of a
  broadcast recomputed it into a buffer of its own: an embedding bag's δ
  [256, 256, 16] was written twice a step, once for the pooled-rows check
  and once as the operand of the fallback's conditional (8.6 → 7.5 ms).
"""
import os

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


def opaque(t):
  """``t``, opaque to XLA's rewrites of its consumers (see the module
  docstring): an identity, also for gradients. A reduction of it may add
  its floats in another order than XLA's tree would."""
  if not _compiling_for_cpu():
    return t
  return _barrier(t)


@tf.custom_gradient
def _barrier(t):
  # XlaOptimizationBarrier has no registered gradient.
  return _xla.optimization_barrier(t)[0], lambda upstream: upstream


def _flag_values(flags):
  """{name: value} of an XLA_FLAGS string ("--name=value" or "--name")."""
  values = {}
  for token in flags.split():
    name, _, value = token.lstrip("-").partition("=")
    values[name] = value.strip().lower() if value else "true"
  return values


def check_ieee_floats(flags=None):
  """Raises where XLA_FLAGS (default: the environment's) let XLA's CPU
  backend assume that no value is NaN or infinite (fast math without
  honoring them): every clip factor is 0 for a non-finite norm, and the
  book-kept sums detect a dropped unit's non-finite input by the NaN it
  leaves (core.ghost.chunked_linear_grad); compiled under that assumption,
  such checks may fold to "finite" and release a sum that is not clipped."""
  values = _flag_values(os.environ.get("XLA_FLAGS", "") if flags is None
                        else flags)
  if values.get("xla_cpu_enable_fast_math") not in ("true", "1"):
    return
  unsafe = [f"--{name}={values[name]}" for name in (
      "xla_cpu_fast_math_honor_nans", "xla_cpu_fast_math_honor_infs")
            if values.get(name) in ("false", "0")]
  if unsafe:
    raise RuntimeError(
        "XLA_FLAGS sets --xla_cpu_enable_fast_math with "
        + " and ".join(unsafe) + ": XLA may then compile away the checks "
        "for NaN and infinity that keep differentially private steps "
        "clipped. Remove these flags to train privately.")
