"""Per-unit evaluation keeps every unit to its own data, for the ops whose
TensorFlow vectorization rule shares one index space between units.

pfor (``tf.vectorized_map``) runs a segment op or a gather's gradient over
all units at once, unit u's ids shifted by u·N: out of [0, N), an id reached
another unit's slots (one example's rows summed into its neighbours').
``core._pfor_compat`` replaces those rules; each must equal the op run on
every unit alone with its out-of-range entries dropped, with and without
XLA, and leave the other units exactly as they are. Roll's rule shifted a
negative axis by one as given (−1 became the unit axis): it must equal a
loop over units for every axis in [−r, r).
"""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import math_ops
from tensorflow.python.ops.parallel_for import pfor

from tf_dpadambc.core import _pfor_compat
from tf_dpadambc.core import per_example  # noqa: F401  (installs the rules)

U, R, F, N = 4, 5, 3, 4  # units, rows per unit, features, segments


def test_every_rule_is_installed():
  registry = pfor._pfor_converter_registry  # pylint: disable=protected-access
  for op in _pfor_compat.UNIT_LOCAL_OPS:
    assert registry[op] is _pfor_compat.RULES[op], op
  assert len(_pfor_compat.UNIT_LOCAL_OPS) == 15
  assert registry["Slice"] is not _pfor_compat.TENSORFLOW_RULES["Slice"]
  assert registry["Roll"] is _pfor_compat.RULES["Roll"]
  assert registry["Roll"] is not _pfor_compat.TENSORFLOW_RULES["Roll"]


def _unsorted(op):
  def run(data, ids, keep):
    return op(data[keep], ids[keep], N)
  def unit(data, ids):
    return op(data, ids, N)
  return unit, run


def _sparse(op, with_num_segments):
  segments = np.array([0, 0, 1, 3, 3], "int32")  # sorted, shared by all
  def unit(data, ids):
    return op(data, ids, segments,
              num_segments=N if with_num_segments else None)
  def run(data, ids, keep):
    # the entries whose row index is in range, the same output size
    return op(data, ids[keep], segments[keep],
              num_segments=N if with_num_segments else segments.max() + 1)
  return unit, run


def _sparse_grad(op):
  segments = np.array([0, 0, 1, 3, 3], "int32")
  def unit(data, ids):  # data [R, F] as the gradient of N' = R segments
    return op(data, ids, segments, R)
  def run(data, ids, keep):
    return op(data, ids[keep], segments[keep], R)
  return unit, run


CASES = {
    "UnsortedSegmentSum": _unsorted(tf.math.unsorted_segment_sum),
    "UnsortedSegmentMax": _unsorted(tf.math.unsorted_segment_max),
    "UnsortedSegmentMin": _unsorted(tf.math.unsorted_segment_min),
    "UnsortedSegmentProd": _unsorted(tf.math.unsorted_segment_prod),
    "SparseSegmentSum": _sparse(tf.sparse.segment_sum, False),
    "SparseSegmentMean": _sparse(tf.sparse.segment_mean, False),
    "SparseSegmentSqrtN": _sparse(tf.sparse.segment_sqrt_n, False),
    "SparseSegmentSumWithNumSegments": _sparse(tf.sparse.segment_sum, True),
    "SparseSegmentMeanWithNumSegments": _sparse(tf.sparse.segment_mean,
                                                True),
    "SparseSegmentSqrtNWithNumSegments": _sparse(tf.sparse.segment_sqrt_n,
                                                 True),
    "SparseSegmentSumGrad": _sparse_grad(math_ops.sparse_segment_sum_grad),
    "SparseSegmentMeanGrad": _sparse_grad(math_ops.sparse_segment_mean_grad),
    "SparseSegmentSqrtNGrad": _sparse_grad(
        math_ops.sparse_segment_sqrt_n_grad),
}


def _ids(op, rng):
  """Per-unit ids, unit 1's pointing past its own range into its
  neighbours' (u·size + j, as the shifted index space would place them)
  and below 0."""
  size = N if op.startswith("Unsorted") else R
  ids = rng.integers(0, size, size=(U, R)).astype("int32")
  ids[1] = [size, size + 1, 2 * size + 2, -1, 0]
  return ids, size


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("op", sorted(CASES))
def test_each_unit_gets_the_op_on_its_own_entries(op, jit):
  unit, run = CASES[op]
  rng = np.random.default_rng(0)
  data = rng.normal(size=(U, R, F)).astype("float32") + 2.0
  data[1] *= 1e3  # the unit whose ids leave its range
  ids, size = _ids(op, rng)

  @tf.function(jit_compile=jit)
  def vectorized(data, ids):
    return tf.vectorized_map(lambda a: unit(*a), (data, ids),
                             fallback_to_while_loop=False)
  out = vectorized(data, ids).numpy()
  for u in range(U):
    keep = (ids[u] >= 0) & (ids[u] < size)
    np.testing.assert_allclose(out[u], run(data[u], ids[u], keep).numpy(),
                               rtol=1e-5, atol=1e-4, err_msg=f"unit {u}")


def test_the_old_rule_leaked_into_the_next_unit():
  # What the replaced rule did (kept here so the test above can fail):
  # TensorFlow's UnsortedSegmentSum rule adds unit 1's id N to unit 2.
  registry = pfor._pfor_converter_registry  # pylint: disable=protected-access
  ours = registry["UnsortedSegmentSum"]
  registry["UnsortedSegmentSum"] = _pfor_compat.TENSORFLOW_RULES[
      "UnsortedSegmentSum"]
  try:
    data = np.ones((3, 1, 1), "float32") * [[[1.0]], [[100.0]], [[2.0]]]
    ids = np.array([[0], [N], [0]], "int32")
    out = tf.vectorized_map(
        lambda a: tf.math.unsorted_segment_sum(a[0], a[1], N), (data, ids))
  finally:
    registry["UnsortedSegmentSum"] = ours
  assert out.numpy()[2, 0, 0] == 102.0  # unit 1's 100 reached unit 2
  mine = tf.vectorized_map(
      lambda a: tf.math.unsorted_segment_sum(a[0], a[1], N), (data, ids))
  assert mine.numpy()[2, 0, 0] == 2.0 and mine.numpy()[1].sum() == 0.0


def _tail_sum(a):  # each unit's sum from its own start to its end
  return tf.reduce_sum(tf.slice(a[0], [a[1]], [-1]))


@pytest.mark.parametrize("jit", [False, True])
def test_a_slice_of_its_own_length_is_refused_and_a_fixed_one_is_exact(jit):
  # TensorFlow's rule gave every unit the batch's longest slice (reading
  # past its end: XLA repeats the last row), so one unit's start changed
  # the others' values.
  x = np.arange(24, dtype="float32").reshape(4, 6)
  starts = np.array([1, 0, 3, 2], "int32")
  for fallback in (False, True):  # no per-op loop either: it fails when run
    with pytest.raises(ValueError, match="fixed size"):
      tf.function(lambda x, s, f=fallback: tf.vectorized_map(  # noqa: B023
          _tail_sum, (x, s), fallback_to_while_loop=f),
                  jit_compile=jit)(x, starts)
  fixed = tf.function(lambda x, s: tf.vectorized_map(
      lambda a: tf.slice(a[0], [a[1]], [3]), (x, s),
      fallback_to_while_loop=False), jit_compile=jit)(x, starts)
  np.testing.assert_array_equal(
      fixed.numpy(), [x[u, s:s + 3] for u, s in enumerate(starts)])


def test_the_old_slice_rule_read_the_other_units():
  registry = pfor._pfor_converter_registry  # pylint: disable=protected-access
  ours = registry["Slice"]
  registry["Slice"] = _pfor_compat.TENSORFLOW_RULES["Slice"]
  try:
    x = np.arange(24, dtype="float32").reshape(4, 6)
    starts = np.array([1, 0, 3, 2], "int32")
    out = tf.function(lambda x, s: tf.vectorized_map(_tail_sum, (x, s)),
                      jit_compile=True)(x, starts).numpy()
  finally:
    registry["Slice"] = ours
  alone = [x[u, s:].sum() for u, s in enumerate(starts)]
  assert out[1] == alone[1]  # the unit with the smallest start
  assert not np.array_equal(out, alone)  # the others read past their end


# ------------------------------------------------------------------- roll
# (per-unit shape, axis): scalar and vector axes over the whole range
# [-r, r), negative ones, repeated ones (their shifts add up).
ROLLS = [
    ((2, 3, 4), 0), ((2, 3, 4), 2), ((2, 3, 4), -1), ((2, 3, 4), -2),
    ((2, 3, 4), -3), ((2, 3, 4), [-1, 0]), ((2, 3, 4), [-2, 1, -1]),
    ((2, 3, 2, 3), -4), ((2, 3, 2, 3), [3, -1]), ((2, 3, 2, 3), [-3, 2, -4]),
    ((2, 3, 2, 3), [0, 1, 2, 3]),
]


def _roll_inputs(rng):
  xs = [rng.normal(size=(U,) + shape).astype("float32") for shape, _ in ROLLS]
  shifts = [rng.integers(-7, 8, size=(U,) + np.shape(axis)).astype("int32")
            for _, axis in ROLLS]
  return xs, shifts


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("per_unit", [False, True])
def test_roll_equals_a_loop_over_units_for_every_axis(per_unit, jit):
  xs, shifts = _roll_inputs(np.random.default_rng(1))
  if not per_unit:  # one shift for every unit (a tensor, not a constant)
    shifts = [s[0] for s in shifts]

  @tf.function(jit_compile=jit)
  def vectorized(xs, shifts):
    def unit(a):
      x, s = a if per_unit else (a, shifts)
      return [tf.roll(x[i], s[i], axis) for i, (_, axis) in enumerate(ROLLS)]
    return tf.vectorized_map(unit, (xs, shifts) if per_unit else xs,
                             fallback_to_while_loop=False)
  outs = vectorized(xs, shifts)
  for i, (shape, axis) in enumerate(ROLLS):
    loop = [tf.roll(xs[i][u], shifts[i][u] if per_unit else shifts[i],
                    axis).numpy() for u in range(U)]
    np.testing.assert_array_equal(outs[i].numpy(), np.stack(loop),
                                  err_msg=f"rank {len(shape)} axis {axis}")


def test_roll_with_a_dynamic_axis():
  # An axis known only when run: in range it equals a loop; out of range it
  # rolls nothing (a loop would fail) and never moves data between units.
  rng = np.random.default_rng(2)
  x = rng.normal(size=(U, 2, 3, 4)).astype("float32")
  shifts = rng.integers(-5, 6, size=(U, 2)).astype("int32")

  @tf.function(input_signature=[tf.TensorSpec([2], tf.int32)] * 2)
  def vectorized(axis, shared):
    per_unit = tf.vectorized_map(lambda a: tf.roll(a[0], a[1], axis),
                                 (x, shifts), fallback_to_while_loop=False)
    invariant = tf.vectorized_map(lambda a: tf.roll(a, shared, axis), x,
                                  fallback_to_while_loop=False)
    return per_unit, invariant
  for axis in ([-1, -3], [2, -1], [-2, 0]):
    per_unit, invariant = vectorized(tf.constant(axis), shifts[0])
    np.testing.assert_array_equal(per_unit.numpy(), np.stack(
        [tf.roll(x[u], shifts[u], axis) for u in range(U)]), err_msg=axis)
    np.testing.assert_array_equal(invariant.numpy(), np.stack(
        [tf.roll(x[u], shifts[0], axis) for u in range(U)]), err_msg=axis)
  per_unit, invariant = vectorized(tf.constant([-1, 3]), shifts[0])
  np.testing.assert_array_equal(per_unit.numpy(), np.stack(
      [tf.roll(x[u], shifts[u, 0], -1) for u in range(U)]))
  np.testing.assert_array_equal(invariant.numpy(),
                                tf.roll(x, shifts[0, 0], -1).numpy())


@pytest.mark.parametrize("axis", [3, -4, [0, 3], [-1, -5]])
def test_a_static_roll_axis_out_of_range_is_refused(axis):
  x = np.zeros((U, 2, 3, 4), "float32")
  with pytest.raises(ValueError, match="out of range for the per-example"):
    tf.vectorized_map(lambda t: tf.roll(t, np.ones(np.shape(axis), "int32"),
                                        axis), x)


def test_the_old_roll_rule_mixed_the_units():
  # What the replaced rule did (kept here so the test above can fail): it
  # rolled the stacked tensor along axis + 1, so -1 rolled the units
  # themselves, and its per-unit segment ids u·r + axis gave unit u's shift
  # to unit u - 1.
  x = np.arange(U * 3, dtype="float32").reshape(U, 1, 3)
  shifts = np.array([0, 1, 0, 0], "int32")
  registry = pfor._pfor_converter_registry  # pylint: disable=protected-access
  ours = registry["Roll"]
  registry["Roll"] = _pfor_compat.TENSORFLOW_RULES["Roll"]
  try:
    shared = tf.vectorized_map(lambda t: tf.roll(t, 1, -1), x).numpy()
    per_unit = tf.vectorized_map(lambda a: tf.roll(a[0], a[1], -1),
                                 (x, shifts)).numpy()
  finally:
    registry["Roll"] = ours
  np.testing.assert_array_equal(shared, np.roll(x, 1, 0))  # across units
  loop = np.stack([np.roll(x[u], shifts[u], -1) for u in range(U)])
  assert not np.array_equal(per_unit, loop)
  np.testing.assert_array_equal(  # unit 0 rolled by unit 1's shift
      per_unit[0], np.roll(x[0], shifts[1], -1))
  np.testing.assert_array_equal(
      tf.vectorized_map(lambda a: tf.roll(a[0], a[1], -1),
                        (x, shifts)).numpy(), loop)
  np.testing.assert_array_equal(
      tf.vectorized_map(lambda t: tf.roll(t, 1, -1), x).numpy(),
      np.roll(x, 1, -1))


@pytest.mark.parametrize("jit", [False, True])
def test_pad_with_a_constant_equals_a_loop_over_units(jit):
  # TensorFlow's PadV2 rule padded every unit with 0 (a review: a layer's
  # constant_values=5 gave [0, 0, 1, 0] for the loop's [5, 0, 1, 5]).
  xs = np.random.default_rng(2).normal(size=(U, 3, 2)).astype("float32")
  paddings = [[1, 2], [0, 1]]

  @tf.function(jit_compile=jit)
  def vectorized(xs):
    return tf.vectorized_map(
        lambda x: tf.pad(x, paddings, constant_values=5.0), xs,
        fallback_to_while_loop=False)
  loop = [tf.pad(x, paddings, constant_values=5.0).numpy() for x in xs]
  np.testing.assert_array_equal(vectorized(xs).numpy(), np.stack(loop))


def test_a_pad_constant_per_unit_is_refused():
  xs = np.zeros((U, 3), "float32")
  values = np.arange(U, dtype="float32")
  with pytest.raises(ValueError, match="constant_values that differ"):
    tf.function(lambda xs, values: tf.vectorized_map(
        lambda a: tf.pad(a[0], [[1, 1]], constant_values=a[1]), (xs, values),
        fallback_to_while_loop=False))(xs, values)
