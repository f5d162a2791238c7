"""Per-unit evaluation keeps every unit to its own data, for the ops whose
TensorFlow vectorization rule shares one index space between units.

pfor (``tf.vectorized_map``) runs a segment op or a gather's gradient over
all units at once, unit u's ids shifted by u·N: out of [0, N), an id reached
another unit's slots (one example's rows summed into its neighbours').
``core._pfor_compat`` replaces those rules; each must equal the op run on
every unit alone with its out-of-range entries dropped, with and without
XLA, and leave the other units exactly as they are.
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
  assert len(_pfor_compat.UNIT_LOCAL_OPS) == 13
  assert registry["Slice"] is not _pfor_compat.TENSORFLOW_RULES["Slice"]


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
