"""The one private TensorFlow API we use: pfor's registry of vectorization
rules, for rules that keep every unit to its own data.

Per-unit evaluation (``tf.vectorized_map``) is what makes per-example clipping
exact by construction, so it must compute, for each unit, what a loop over
the units would: nothing of one unit may reach another's result. Three of
TensorFlow 2.21's rules (or families of rules) broke that; two more
compute wrong values (BatchMatMulV2 with oneDNN, PadV2's constant).

**Segment and gather-gradient ops.** pfor vectorizes ``UnsortedSegment*``,
``SparseSegment*`` and ``SparseSegment*Grad`` as one op over the flattened
units, unit u's ids shifted by u·N (N segments or rows per unit). An id
outside [0, N) — a user's pooling id, or the index of a ``tf.gather`` whose
gradient is such a segment sum (an embedding's table, ``gather(...,
batch_dims=1)``), which XLA clamps in the forward pass — then lands in unit
u ± k's slots: one example's gradient added to its neighbours' (a red-team
review measured 2.7x the clip bound through ``fit``). The rules installed
here drop every entry whose id or index is outside its own unit's range —
what XLA does with an out-of-range scatter in a loop over units — and keep
TensorFlow's arithmetic otherwise (a sum over the same entries; the mean and
√N divide by the unit's count of kept entries). They apply to every
``tf.vectorized_map`` in the process (TensorFlow's rules leak only where
ids are out of range, where eager TensorFlow raises instead).

**Slice with a start that differs between units.** With a size of −1 ("to
the end") a unit's slice has its own length; TensorFlow's rule gives every
unit the longest of the batch and reads past the unit's end (XLA repeats its
last row): one example's start changed every other example's values (10C in
a review, by a layer trimming the padding common to a batch). The rule here
refuses that case (an error when traced; the tf_keras adapter then loops
over units with ``tf.map_fn``) and keeps TensorFlow's rule where the size is
a fixed shape, the same for every unit.

**Roll with a negative axis.** TensorFlow's rule rolls the stacked tensor
along ``axis + 1`` as given: a negative axis then names the next axis, and
−1 the unit axis itself, so an ordinary augmentation
(``keras.ops.roll(x, shift, axis=-1)``) rotated the examples of a batch
into each other's places (3.5–4C against a 2C bound in a review); with a
shift per unit its segment ids u·r + axis put unit u's shifts in unit
u − 1's slots. The rule here first brings every axis to the unit's own
range [0, r) (r its rank), then applies TensorFlow's algorithm (``roll``
along axis + 1 for a shift shared by all units; per-unit offsets and a
``gather_nd`` within each unit otherwise). A static axis out of range is an
error when traced, as in a loop over units; a dynamic one rolls nothing
(its shift masked to 0) rather than fail when run.

**PadV2 drops its constant.** TensorFlow's rule pads every unit with 0
whatever ``constant_values`` says (``tf.pad(x, p, constant_values=c)``,
``keras.ops.pad``): nothing crosses units, but per-unit evaluation then
differs from the batch and ``fit`` refuses the step (a review). The rule
here pads with the constant where it is the same for every unit, and
refuses one that differs between units (the tf_keras adapter then loops).

**BatchMatMulV2.** In TensorFlow 2.21 on CPU with oneDNN, a batched matmul
whose batch axes broadcast (e.g. [U, 1, T, p] times a kernel [p, d]) returns
wrong values, nan, or corrupts the heap. pfor's own rule produces exactly
that op whenever a unit's tensor meets a weight: every Keras ``EinsumDense``
(and so ``MultiHeadAttention``) under ``vectorized_map`` hit it. The rule
here multiplies a unit-stacked [U, ..., m, k] by a loop-invariant matrix
[k, n] as one [U·…·m, k] x [k, n] MatMul (the same numbers, no broadcasting
kernel) and leaves every other case to TensorFlow's rule.

``tests/test_unit_local.py`` checks that every entry is installed, that
each segment rule and roll (every axis, shared and per-unit shifts) equal a
loop over units and leak nothing, and that the slice is refused (and what
TensorFlow's rules did);
``tests/test_ghost.py`` that EinsumDense and MultiHeadAttention vectorize
exactly.
"""
import numpy as np
import tensorflow as tf
from tensorflow.python.ops.parallel_for import pfor as _pfor

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


def _fixed_size_slice(pfor_input, fallback):
  _, begin_stacked, _ = pfor_input.input(1)
  if begin_stacked:
    size = tf.get_static_value(pfor_input.unstacked_input(2))
    if size is None or (size < 0).any():
      # Not ConversionNotImplementedError: pfor would loop over units for
      # this op alone, and stacking their slices of different lengths fails
      # only when run, depending on the data. Refused here, a caller that
      # can loop over whole units (the tf_keras adapter's map_fn) does.
      raise ValueError(
          "tf.slice with a start that differs between examples and a size "
          "of -1 (to the end): each example's slice has its own length, "
          "which tf.vectorized_map cannot evaluate per example (TensorFlow's "
          "rule would give every example the batch's longest slice, reading "
          "past its own end). Give the slice a fixed size, or mask the "
          "positions instead of slicing them off.")
  return fallback(pfor_input)


# ------------------------------------------------------------ segment ops
def _per_unit(pfor_input, i):
  """Input i with a leading unit axis (tiled if loop-invariant)."""
  t, stacked, _ = pfor_input.input(i)
  if stacked:
    return t
  n = pfor_input.pfor.loop_len_vector
  return tf.broadcast_to(t[tf.newaxis], tf.concat([n, tf.shape(t)], 0))


def _flat_ids(ids, size, keep=None):
  """[U, ...] per-unit ids in [0, size) -> ids into U·size flattened slots;
  −1 (dropped by every unsorted segment op) where out of range or not
  ``keep``."""
  ids = tf.cast(ids, tf.int64)
  size = tf.cast(size, tf.int64)
  units = tf.shape(ids, out_type=tf.int64)[0]
  offsets = tf.reshape(tf.range(units) * size,
                       tf.concat([[units], tf.ones_like(tf.shape(ids)[1:],
                                                        tf.int64)], 0))
  inside = (ids >= 0) & (ids < size)
  if keep is not None:
    inside &= keep
  return tf.where(inside, ids + offsets, -1), inside


def _unflatten(output, units):
  """[U·size, ...] -> [U, size, ...]."""
  return tf.reshape(output, tf.concat([units, [-1], tf.shape(output)[1:]], 0))


def _trailing(weights, rank):
  """``weights`` with trailing axes of size 1, to broadcast against a
  tensor of ``rank`` whose leading axes are its own."""
  return tf.reshape(weights, tf.concat(
      [tf.shape(weights), tf.ones([rank - weights.shape.rank], tf.int32)], 0))


def _unsorted_segment(op):
  def convert(pfor_input):
    data, ids = _per_unit(pfor_input, 0), _per_unit(pfor_input, 1)
    num_segments = pfor_input.unstacked_input(2)
    flat, _ = _flat_ids(ids, num_segments)
    units = pfor_input.pfor.loop_len_vector
    out = op(data, flat, tf.cast(num_segments, tf.int64)
             * tf.cast(units[0], tf.int64))
    return _pfor.wrap(_unflatten(out, units), True)
  return convert


def _segment_counts(flat, size, dtype):
  return tf.math.unsorted_segment_sum(tf.ones(tf.shape(flat), dtype), flat,
                                      size)


def _normalizer(kind, counts):
  """Divide a segment's sum by this (mean, √N) given its entry count."""
  counts = tf.maximum(counts, 1)
  return {"sum": tf.ones_like(counts), "mean": counts,
          "sqrt_n": tf.sqrt(counts)}[kind]


def _sparse_segment(kind):
  """SparseSegment{Sum,Mean,SqrtN}[WithNumSegments]: output[s] = Σ over the
  entries i with segment_ids[i] = s of data[indices[i]] (divided by the
  entry count for the mean, by its root for √N)."""
  def convert(pfor_input):
    data, data_stacked, _ = pfor_input.input(0)
    if len(pfor_input.inputs) == 3:
      # TensorFlow's rule: one output size for every unit.
      segments = pfor_input.unstacked_input(2)
      num_segments = tf.nn.relu(tf.reduce_max(segments) + 1)
    else:
      num_segments = pfor_input.unstacked_input(3)
    indices, segments = _per_unit(pfor_input, 1), _per_unit(pfor_input, 2)
    rows = tf.shape(data)[1 if data_stacked else 0]
    indices = tf.cast(indices, tf.int64)
    valid = (indices >= 0) & (indices < tf.cast(rows, tf.int64))
    picked = tf.clip_by_value(indices, 0, tf.cast(rows, tf.int64) - 1)
    rows_of = (tf.gather(data, picked, batch_dims=1) if data_stacked
               else tf.gather(data, picked))
    flat, _ = _flat_ids(segments, num_segments, keep=valid)
    units = pfor_input.pfor.loop_len_vector
    size = tf.cast(num_segments, tf.int64) * tf.cast(units[0], tf.int64)
    sums = tf.math.unsorted_segment_sum(rows_of, flat, size)
    if kind != "sum":
      counts = _segment_counts(flat, size, sums.dtype)
      sums /= _trailing(_normalizer(kind, counts), sums.shape.rank)
    return _pfor.wrap(_unflatten(sums, units), True)
  return convert


def _sparse_segment_grad(kind):
  """SparseSegment{Sum,Mean,SqrtN}Grad(grad, indices, segment_ids, dim0):
  output[indices[i]] += grad[segment_ids[i]] (divided by its segment's
  entry count, or its root)."""
  def convert(pfor_input):
    grad = pfor_input.stacked_input(0)
    indices, segments = _per_unit(pfor_input, 1), _per_unit(pfor_input, 2)
    dim0 = pfor_input.unstacked_input(3)
    num_segments = tf.shape(grad, out_type=tf.int64)[1]
    segments = tf.cast(segments, tf.int64)
    indices = tf.cast(indices, tf.int64)
    # An entry counts only if both its ids are in range (as in the forward
    # rule, whose mean it differentiates).
    kept = (indices >= 0) & (indices < tf.cast(dim0, tf.int64))
    seg_flat, kept = _flat_ids(segments, num_segments, keep=kept)
    units = pfor_input.pfor.loop_len_vector
    picked = tf.gather(grad, tf.clip_by_value(segments, 0, num_segments - 1),
                       batch_dims=1)
    if kind != "sum":
      size = num_segments * tf.cast(units[0], tf.int64)
      counts = _segment_counts(seg_flat, size, grad.dtype)
      per_entry = tf.gather(_normalizer(kind, counts),
                            tf.maximum(seg_flat, 0))
      picked /= _trailing(per_entry, grad.shape.rank)
    flat, _ = _flat_ids(indices, dim0, keep=kept)
    out = tf.math.unsorted_segment_sum(
        picked, flat, tf.cast(dim0, tf.int64) * tf.cast(units[0], tf.int64))
    return _pfor.wrap(_unflatten(out, units), True)
  return convert


# ------------------------------------------------------------------- roll
def _pad_v2(pfor_input):
  t = pfor_input.stacked_input(0)
  paddings = pfor_input.unstacked_input(1)
  value, value_stacked, _ = pfor_input.input(2)
  if value_stacked:
    raise ValueError(
        "tf.pad with constant_values that differ between examples cannot be "
        "evaluated per example by tf.vectorized_map; pad with a constant.")
  paddings = tf.concat([[[0, 0]], paddings], 0)
  return _pfor.wrap(tf.pad(t, paddings, constant_values=value), True)


def _roll_axes(t, axis):
  """Roll's axes (scalar or vector) as a vector in the per-unit range
  [0, r) of the unit-stacked ``t`` (r = its rank − 1), and where each one
  was in [−r, r) at all (None: all, known when traced). A static axis out
  of range is an error here (a loop over units fails too); a dynamic one is
  reported as not ``valid``, its shift masked to 0 by the caller: it rolls
  nothing, where a loop would fail when run, and never moves data between
  units."""
  rank = t.shape.rank
  static = tf.get_static_value(axis)
  if static is not None and rank is not None:
    r = rank - 1
    flat = np.reshape(np.asarray(static, np.int64), [-1])
    bad = flat[(flat < -r) | (flat >= r)]
    if bad.size:
      raise ValueError(
          f"tf.roll with axis {static.tolist()} out of range for the "
          f"per-example rank {r} (the axes must lie in [{-r}, {r})): "
          f"tf.vectorized_map evaluates the op on each example alone, where "
          f"this axis does not exist.")
    return np.where(flat < 0, flat + r, flat), None
  r = tf.cast(tf.rank(t) - 1, tf.int64)
  flat = tf.reshape(tf.cast(axis, tf.int64), [-1])
  valid = (flat >= -r) & (flat < r)
  flat = tf.where(flat < 0, flat + r, flat)
  return tf.where(valid, flat, tf.zeros_like(flat)), valid


def _roll(pfor_input):
  """Roll(input, shift, axis), every axis normalized to the unit's own
  range before it is shifted past the unit axis. TensorFlow's rule added 1
  to the axis as given: a negative one then named the next axis, −1 the
  unit axis itself (one example's data rolled into another's place); with a
  shift per unit its segment ids u·r + axis put unit u's shift in unit
  u − 1's slots."""
  t = pfor_input.stacked_input(0)
  shift, shift_stacked, _ = pfor_input.input(1)
  axis, valid = _roll_axes(t, pfor_input.unstacked_input(2))
  if not shift_stacked:
    shift = tf.reshape(shift, [-1])
    if valid is not None:
      shift = tf.where(valid, shift, tf.zeros_like(shift))
    return _pfor.wrap(tf.roll(t, shift, axis + 1), True)
  # TensorFlow's algorithm with the normalized axes: each unit's shifts
  # summed per axis into its own r slots (an invalid axis's entry dropped,
  # id −1), then every result element gathered from its source coordinate
  # within the same unit.
  units = tf.cast(pfor_input.pfor.loop_len_vector[0], tf.int64)
  r = tf.cast(tf.rank(t) - 1, tf.int64)
  shift = tf.cast(tf.reshape(shift, [units, -1]), tf.int64)
  ids = tf.range(units)[:, tf.newaxis] * r + axis[tf.newaxis, :]
  if valid is not None:
    ids = tf.where(valid[tf.newaxis, :], ids, -tf.ones_like(ids))
  offsets = tf.reshape(
      tf.math.unsorted_segment_sum(shift, ids, units * r), [units, r])
  shape = tf.shape(t, out_type=tf.int64)[1:]
  cumsize = tf.math.cumprod(shape, exclusive=True, reverse=True)
  elements = tf.range(tf.reduce_prod(shape))
  coordinates = ((elements[tf.newaxis, :, tf.newaxis]
                  // cumsize[tf.newaxis, tf.newaxis, :]
                  - offsets[:, tf.newaxis, :]) % shape[tf.newaxis, tf.newaxis])
  out = tf.gather_nd(t, coordinates, batch_dims=1)
  return _pfor.wrap(tf.reshape(out, tf.shape(t)), True)


RULES = {
    "UnsortedSegmentSum": _unsorted_segment(tf.math.unsorted_segment_sum),
    "UnsortedSegmentMax": _unsorted_segment(tf.math.unsorted_segment_max),
    "UnsortedSegmentMin": _unsorted_segment(tf.math.unsorted_segment_min),
    "UnsortedSegmentProd": _unsorted_segment(tf.math.unsorted_segment_prod),
    "SparseSegmentSum": _sparse_segment("sum"),
    "SparseSegmentMean": _sparse_segment("mean"),
    "SparseSegmentSqrtN": _sparse_segment("sqrt_n"),
    "SparseSegmentSumWithNumSegments": _sparse_segment("sum"),
    "SparseSegmentMeanWithNumSegments": _sparse_segment("mean"),
    "SparseSegmentSqrtNWithNumSegments": _sparse_segment("sqrt_n"),
    "SparseSegmentSumGrad": _sparse_segment_grad("sum"),
    "SparseSegmentMeanGrad": _sparse_segment_grad("mean"),
    "SparseSegmentSqrtNGrad": _sparse_segment_grad("sqrt_n"),
    "Roll": _roll,
    "PadV2": _pad_v2,
}
UNIT_LOCAL_OPS = tuple(RULES)
TENSORFLOW_RULES = {}  # what install() replaced (tests show they leaked)


def install():
  """Installs the rules once (idempotent)."""
  global _installed
  if _installed:
    return
  registry = _pfor._pfor_converter_registry  # pylint: disable=protected-access
  TENSORFLOW_RULES.update({op: registry[op] for op in UNIT_LOCAL_OPS + (
      "BatchMatMulV2", "Slice")})
  matmul, slice_ = registry["BatchMatMulV2"], registry["Slice"]
  registry["BatchMatMulV2"] = lambda pfor_input: _stacked_times_matrix(
      pfor_input, matmul)
  registry["Slice"] = lambda pfor_input: _fixed_size_slice(pfor_input,
                                                           slice_)
  registry.update(RULES)
  _installed = True
