"""A per-unit computation over chunks of units, one chunk at a time.

Ghost clipping's exact fallbacks (sorted embedding norms, float64 sums of
δ rows) hold float64 copies of every unit's rows: at 1,024 units of 256
ids × 16 features, 34 MB a copy, several copies. XLA reserves a
conditional's untaken branch with the rest of the step, so a fallback that
never runs still set the peak: an embedding bag's step reserved 102 MB for
them against 34 MB for the whole non-private step. Run over chunks of K
units in a while loop, they hold one chunk's copies (K rows of each) at a
time; the results are the same values (:func:`map_chunks`: each unit's
outputs are computed from its own rows alone; :func:`sum_chunks`: the same
terms, added chunk by chunk).

The loop runs only where the copies pass CHUNK_BYTES (:func:`chunk_size`),
with U static; below it, or with U unknown when traced, the computation
runs once on all units, as before.
"""
import tensorflow as tf

# The bytes one loop iteration's per-unit buffers may take (an estimate the
# callers give per unit). Larger chunks run fewer, longer iterations.
CHUNK_BYTES = 1 << 22


def chunk_size(units, bytes_per_unit, shared_bytes=0, budget=None):
  """K, the units per chunk, or None where one pass over all units stays
  within the budget (or U is unknown when traced, or U ≤ 1). K·bytes is
  within the budget, or K = 1: a chunk's own call takes one pass.

  ``bytes_per_unit``: what one unit's buffers take (None: unknown, no
  loop); ``shared_bytes``: what every iteration takes whatever K (a [vocab, d] table added per chunk),
  raising the budget to it so that the loop's own overhead stays below its
  work. The chunks are balanced: ⌈U/K⌉ of them, K = ⌈U/count⌉."""
  budget = max(CHUNK_BYTES if budget is None else budget, shared_bytes)
  # One unit is never split (a chunk's own call must not loop again, even
  # where one unit alone passes the budget).
  if units is None or bytes_per_unit is None or units <= 1 or (
      units * bytes_per_unit <= budget):
    return None
  largest = max(1, int(budget // max(bytes_per_unit, 1)))
  count = -(-units // largest)
  return -(-units // count)


def _rows(num_units, chunk, c):
  """Chunk c's row indices (clamped to the last unit) and which are real."""
  rows = tf.range(chunk) + c * chunk
  return tf.minimum(rows, num_units - 1), rows < num_units


def _chunk(tensors, num_units, chunk, c):
  """(chunk c's rows of each of ``tensors``, which rows are real): a slice
  where the chunks tile U exactly and the rows' shape is static (XLA reads
  it in place), else a gather of the rows, clamped to the last unit. U is
  the first tensor's (static); the others' leading axes may be unknown."""
  rows, real = _rows(num_units, chunk, c)
  take = lambda t: (tf.reshape(t, [-1, chunk] + t.shape[1:].as_list())[c]
                    if num_units % chunk == 0
                    and t.shape[1:].is_fully_defined()
                    else tf.gather(t, rows))
  return tf.nest.map_structure(take, tensors), real


def map_chunks(fn, tensors, chunk, specs):
  """``fn(tensors)`` of per-unit values, computed K = ``chunk`` units at a
  time: ``fn`` takes tensors with leading axis K (the chunk's rows of each
  of ``tensors``, leading axis U, static) and returns a tuple of tensors
  with leading axis K, the chunk's units' values, one per ``specs`` (a
  ``tf.TensorSpec`` of one unit's value: its shape without the K); the
  result is a tuple of tensors with leading axis U. ``fn`` must compute
  each unit's values from that unit's rows alone (the last chunk repeats
  the last unit to fill it; its copies' values are dropped)."""
  tensors = tf.nest.map_structure(tf.convert_to_tensor, tensors)
  num_units = tf.nest.flatten(tensors)[0].shape[0]
  count = -(-num_units // chunk)

  def body(c, arrays):
    out = fn(_chunk(tensors, num_units, chunk, c)[0])
    return c + 1, tuple(a.write(c, o) for a, o in zip(arrays, out))

  arrays = tuple(tf.TensorArray(spec.dtype, size=count,
                                element_shape=[chunk] + spec.shape.as_list())
                 for spec in specs)
  _, arrays = tf.while_loop(lambda c, _: c < count, body,
                            (tf.constant(0), arrays))
  return tuple(tf.reshape(a.stack(), [count * chunk] + spec.shape.as_list())[
      :num_units] for a, spec in zip(arrays, specs))


def sum_chunks(fn, tensors, chunk, initial):
  """Σ over chunks of ``fn(chunk_tensors, real)``, K = ``chunk`` units at a
  time: ``fn`` takes the chunk's rows of each of ``tensors`` (leading axis
  U, static) and ``real`` [K], False for the copies of the last unit that
  fill the last chunk, which it must leave out of its sum (a zero weight);
  ``initial``: zeros of the sum's shape and dtype."""
  tensors = tf.nest.map_structure(tf.convert_to_tensor, tensors)
  num_units = tf.nest.flatten(tensors)[0].shape[0]
  count = -(-num_units // chunk)

  def body(c, total):
    part = fn(*_chunk(tensors, num_units, chunk, c))
    return c + 1, total + part

  return tf.while_loop(lambda c, _: c < count, body,
                       (tf.constant(0), initial))[1]
