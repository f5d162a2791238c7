"""Stage 1 of the pipeline: per-unit gradients and their norms.

A *unit* is what gets clipped: one example, or one microbatch of examples
(TF-Privacy's ``num_microbatches``). Everything here is vectorized over units
with ``tf.vectorized_map(..., fallback_to_while_loop=False)``: an op without a
vectorization rule is an error at trace time, never a silent per-example
``while_loop`` (which costs 10-100x).

Functions take ``unit_loss_fn(params, unit) -> (loss, aux)``: a pure function of
a list of parameter tensors and one unit's data (a nested structure whose
leading dimension is the unit's examples) returning the unit's scalar loss and
any auxiliary outputs (predictions, per-example losses) to stack.
"""
import contextlib
import logging
import re
import warnings

import tensorflow as tf

from tf_dpadambc.core import _pfor_compat
from tf_dpadambc.core import graph

_pfor_compat.install()


class _LoopedOps(logging.Filter):
  """Collects TensorFlow's per-op 'uses a while_loop' vectorization warnings."""

  def __init__(self):
    super().__init__()
    self.ops = set()

  def filter(self, record):
    match = re.match(r"(\w+) uses a while_loop", record.getMessage())
    if match:
      self.ops.add(match.group(1))
      return False
    return True


@contextlib.contextmanager
def _report_looped_ops():
  """One clear warning instead of TensorFlow's one line per converted op.

  Some pfor converters (e.g. Conv2DBackpropFilter, the per-example gradient of
  a convolution kernel) loop internally even with
  ``fallback_to_while_loop=False``. That is correct but slower: say so once.
  """
  looped = _LoopedOps()
  logger = tf.get_logger()
  logger.addFilter(looped)
  try:
    yield
  finally:
    logger.removeFilter(looped)
    if looped.ops:
      warnings.warn(
          "tf.vectorized_map computes the per-example gradients of "
          f"{', '.join(sorted(looped.ops))} with an internal while_loop "
          "(TensorFlow's vectorization rule for that op): correct, but "
          "those layers cost more per step than the rest.", stacklevel=3)


class _FailedConversion(logging.Filter):
  """Drops pfor's error log of a conversion it gives up on: the op and every
  op it was created from, with stack traces. pfor then re-raises the error
  (e.g. a refused per-unit slice), which says what to do."""

  def filter(self, record):
    return not (record.msg == "%s\ncreated at:\n  %s" or str(
        record.msg).startswith("Got error while pfor was converting op"))


@contextlib.contextmanager
def quiet_failed_conversions():
  """Within it, a failed vectorization is reported by its exception only."""
  logger, quiet = tf.get_logger(), _FailedConversion()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


class PerUnitGradients(list):
  """Per-unit gradients g_u (a list of [U, ...] tensors, one per variable),
  each computed from its own unit's examples alone.

  ``DPOptimizer.apply_per_unit`` clips and releases only these: what
  ``tf_dpadambc.keras.training.per_unit_gradients`` and the tf_keras
  adapter's per-unit evaluation return, or :func:`assume_per_unit` where
  the caller vouches for them. Rows of a batched jacobian are per-example
  only if the model never mixes examples (a lag feature, a batch
  statistic): a review fed them to apply_per_unit and moved the weights by
  3C/B for a bound of 2C/B. A list, so it reads as one.
  """


def assume_per_unit(grads):
  """:class:`PerUnitGradients` of gradients the caller vouches for: row u
  of each tensor depends on unit u's examples only (e.g. evaluated one unit
  at a time, or the jacobian of a model that provably never mixes
  examples). The caller saying so by name, as ``clipping.assume_clipped``."""
  return PerUnitGradients(grads)


def split_microbatches(batch, num_microbatches):
  """Reshapes every tensor of ``batch`` from ``[B, ...]`` to ``[M, B/M, ...]``.

  ``num_microbatches=None`` means one example per unit: ``[B, 1, ...]``.
  Raises ``ValueError`` when ``M`` does not divide a statically known ``B``;
  a dynamic ``B`` that ``M`` does not divide fails the reshape at run time.
  """
  def split(t):
    t = tf.convert_to_tensor(t)
    if num_microbatches is None:
      return t[:, tf.newaxis]
    static_b = t.shape[0]
    if static_b is not None and static_b % num_microbatches:
      raise ValueError(
          f"num_microbatches={num_microbatches} does not divide the batch "
          f"size {static_b}. Choose a batch size that is a multiple of "
          "num_microbatches (and drop the last partial batch), or use "
          "num_microbatches=None to clip every example.")
    shape = tf.shape(t)
    return tf.reshape(
        t, tf.concat([[num_microbatches, shape[0] // num_microbatches],
                      shape[1:]], 0))
  return tf.nest.map_structure(split, batch)


def merge_microbatches(stacked):
  """Inverse of :func:`split_microbatches` for stacked outputs: ``[M, b, ...] -> [M*b, ...]``."""
  def merge(t):
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([[shape[0] * shape[1]], shape[2:]], 0))
  return tf.nest.map_structure(merge, stacked)


_SEQUENTIAL = []  # trace-time flag: map_units loops instead of vectorizing


@contextlib.contextmanager
def sequential_units(enabled=True):
  """Within it, :func:`map_units` evaluates units one after another.

  For computations TensorFlow's vectorizer gets wrong at run time rather
  than refusing at trace time: recurrent layers (their while loop's
  TensorList fails inside ``vectorized_map``, "TensorListPushBack").
  """
  _SEQUENTIAL.append(bool(enabled))
  try:
    yield
  finally:
    _SEQUENTIAL.pop()


_LOSS_SCALE = []  # trace-time static loss scale (mixed_float16)


@contextlib.contextmanager
def loss_scale(scale):
  """Within it, every unit's backward pass runs on ``scale · loss_u``.

  For float16 compute (mixed precision): small gradients of the float16
  activations would underflow to 0 in the backward pass. ``scale`` is a
  static power of two fixed when the step is traced, never a function of the
  data: a step skipped or rescaled because some unit overflowed would reveal
  that unit (a data-dependent decision outside the clipping). The gradients
  are divided by ``scale`` in float32 (exact: a power of two) before any norm
  or clipping, so the clip bound C and the noise σC are untouched; a unit
  whose scaled gradient overflows is non-finite and zeroed alone
  (``num_nonfinite``), like any other non-finite unit.
  """
  _LOSS_SCALE.append(float(scale))
  try:
    yield
  finally:
    _LOSS_SCALE.pop()


def current_loss_scale():
  """The static loss scale of the innermost :func:`loss_scale` (1.0 outside)."""
  return _LOSS_SCALE[-1] if _LOSS_SCALE else 1.0


def unscale(t, dtype=tf.float32):
  """``t / scale`` in (at least) float32: float16/bfloat16 values are cast
  first, so dividing by the power-of-two scale is exact."""
  if t is None:
    return t
  if isinstance(t, tf.IndexedSlices):
    return tf.IndexedSlices(unscale(t.values, dtype), t.indices, t.dense_shape)
  if t.dtype in (tf.float16, tf.bfloat16):
    t = tf.cast(t, dtype)
  scale = current_loss_scale()
  return t if scale == 1.0 else t / tf.cast(scale, t.dtype)


OUTSIDE_DATA_ERROR = (
    "Per-example evaluation read data other than the example's own: "
    "{reads}. Each example's (or microbatch's) loss must be computed from "
    "that unit and the model alone: code that reaches the batch (a tensor "
    "of the train step found through the graph or kept from another call, "
    "the step's inputs, an iterator, a tensor captured from outside) gives "
    "every unit the other examples, and clipping then bounds no example's "
    "influence. Compute the model's output from its inputs, its weights and "
    "constants it holds; pass per-batch context as input features of each "
    "example.")


def unit_local(fn, units):
  """``(wrapped, check)``: ``fn`` wrapped to record, when traced, what it
  reads from outside itself (``graph.outside_data``), and ``check()``,
  which raises ``ValueError`` if it read anything but its own unit,
  constants and resources (variables, tables).

  Per-unit evaluation is exact only if a unit's function reads its unit and
  nothing else that depends on the data: under ``tf.vectorized_map`` it is
  traced in the step's own graph, where a layer can reach the batch (walk
  the graph to the step's input, keep a tensor of another forward pass on
  the batch) and add it to every unit (a review: 7.5C and 12.7C for a bound
  of 2C). Checked while the trace is open (its captures say what came from
  outside), when traced: before anything runs or is released. A tensor
  captured from eager counts as a constant, like a NumPy array (Keras and
  KerasHub layers keep such constants; a traced step's batch is never
  eager): a statistic computed eagerly from the training data before the
  step is the user's (as ``Normalization.adapt``, refused by class).
  """
  found = []
  data = [t for t in tf.nest.flatten(units) if tf.is_symbolic_tensor(t)]

  def wrapped(unit):
    trace = tf.compat.v1.get_default_graph()
    start = len(trace.get_operations())
    out = fn(unit)
    ops = trace.get_operations()[start:]
    own = [t for t in tf.nest.flatten(unit) if tf.is_symbolic_tensor(t)]
    found.extend(graph.outside_data(ops, own, data, held=None))
    return out

  def check():
    if found:
      raise ValueError(OUTSIDE_DATA_ERROR.format(
          reads="; ".join(sorted(set(found))[:3])))
  return wrapped, check


def map_units(fn, units):
  """``fn`` on every unit alone, results stacked.

  ``tf.vectorized_map`` (an op without a vectorization rule is an error, never
  a silent loop), or inside :func:`sequential_units` a ``tf.map_fn`` loop.
  Both have the semantics of a loop over units, provided ``fn`` reads
  nothing from outside but its unit, constants and variables (checked when
  traced: :func:`unit_local`). A sequential loop could pass
  data from one unit to the next through state, so its body is traced first
  and refused if it writes a variable or runs Python (``tf.py_function``).
  """
  fn, check = unit_local(fn, units)
  result = _map_units(fn, units)
  check()
  return result


def _map_units(fn, units):
  if not (_SEQUENTIAL and _SEQUENTIAL[-1]):
    return tf.vectorized_map(fn, units, fallback_to_while_loop=False)
  spec = tf.nest.map_structure(
      lambda t: tf.TensorSpec(t.shape[1:], t.dtype), units)
  body = tf.function(fn, autograph=False).get_concrete_function(spec)
  operations = body.graph.get_operations()
  stateful = graph.state_effects(operations) + graph.python_calls(
      operations)
  if stateful:
    raise ValueError(
        "Per-example computation in a loop over units (recurrent layers) "
        "must not write state (variables, hash tables, random generators, "
        f"queues) or run Python functions ({', '.join(stateful[:3])}): "
        "one unit could pass its data to the next. Remove them from the "
        "model's forward pass.")
  signature = tf.nest.map_structure(
      lambda t: tf.TensorSpec(t.shape, t.dtype), body.structured_outputs)
  warnings.warn("Per-example computation in a tf.map_fn loop (recurrent "
                "layers cannot be vectorized): exact, slower than the other "
                "layers.", stacklevel=3)
  return tf.map_fn(fn, units, fn_output_signature=signature)


def _unit_gradient(unit_loss_fn, params, unit):
  scale = current_loss_scale()
  with tf.GradientTape() as tape:
    tape.watch(params)
    loss, aux = unit_loss_fn(params, unit)
    scaled = loss if scale == 1.0 else loss * tf.cast(scale, loss.dtype)
  grads = tape.gradient(
      scaled, params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
  # (params are float32 variables' values: the gradients are float32 here)
  return [unscale(g) for g in grads], loss, aux


def per_unit_gradients(unit_loss_fn, params, units):
  """Materialized per-unit gradients.

  Returns ``(grads, losses, aux)`` with ``grads[j]`` of shape
  ``[U, *params[j].shape]`` and ``losses`` of shape ``[U]``.
  Memory is U x (model size): use it where it is needed (non-finite
  gradients, stochastic layers); :func:`per_unit_norms` avoids storing it.
  """
  with _report_looped_ops():
    return map_units(lambda unit: _unit_gradient(unit_loss_fn, params, unit),
                     units)


def per_unit_norms(unit_loss_fn, params, units, scale=None):
  """Per-unit gradient L2 norms ``‖∇ℓ_u‖₂`` without returning the gradients.

  Returns ``(norms [U], losses [U], aux)``. The squared norm is reduced inside
  the vectorized function so the per-unit gradients never leave it. With
  ``scale`` (tensors shaped like ``params``) the norms are ``‖s⊙∇ℓ_u‖₂``.
  """
  def unit_norm(unit):
    grads, loss, aux = _unit_gradient(unit_loss_fn, params, unit)
    if scale is not None:
      grads = [g * tf.cast(s, g.dtype) for g, s in zip(grads, scale)]
    return tf.sqrt(_sum_of_squares(grads)), loss, aux
  with _report_looped_ops():
    return map_units(unit_norm, units)


def _sum_of_squares(tensors):
  # reduce_sum(square) rather than tf.nn.l2_loss / tf.norm: L2Loss has no
  # vectorization rule and would force a while_loop.
  return tf.add_n([tf.reduce_sum(tf.square(t)) for t in tensors])
