"""The private step's building blocks, timed beside their alternatives.

    python benchmarks/kernels.py                        # batch 256 and 1,024
    python benchmarks/kernels.py --batch-sizes 1024 --rounds 9

Where ``profile_step.py`` says which thunks a private step spends its time
in, this times the candidates for one of them side by side, each an
XLA-compiled function of the same inputs, in one process, in interleaved
rounds (a figure is the best round's mean over ``--reps`` calls; the ratio is
to the group's first row, measured in the same rounds):

- ``kernel sum``: Σ_u w_u a_u δ_uᵀ of the MLP's 784 x 128 kernel — one
  float32 product (the non-private gradient), the library's chunked float32
  sum (``core.ghost.chunked_linear_grad``, chunks of K units for the
  kernel's own unit limit L) and its float64 sum (``core.ghost.linear_grad``);
- ``head sum``: the same for the MLP's 128 x 10 head, which takes the
  float64 sum (below ``FLOAT32_MIN_WEIGHTS``), chunked as if it took the
  784 x 128 kernel's L;
- ``row norms``: ‖a_u‖²‖δ_u‖² of a T = 1 layer, the library's float64
  products with ones (``core.ghost.linear_sq_norms``) against float32 sums
  of squares raised to upper bounds (``core.ghost.float32_sq_norms_upper``);
- ``sampler``: N(0, 1) for the MLP's 101,770 parameters
  (``core.noise.standard_normal``) against the Philox words it is made of
  alone, drawn as uint32 (as it does) or as uint64 split in two (the same
  words).

Each group checks first that its rows compute the same values (to their
rounding), so that a ratio compares ways of doing one job. Figures in
README ("Issue 16's twenty-fifth part").
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_dpadambc.core import ghost, noise  # noqa: E402

MLP_PARAMETERS = 784 * 128 + 128 + 128 * 10 + 10


def _sum_rows(units, fan_in, fan_out, limit, seed):
  """The three ways to the kernel sum of ``units`` T = 1 units."""
  rng = np.random.default_rng(seed)
  a = tf.constant(rng.random((units, 1, fan_in), np.float32))
  d = tf.constant(rng.standard_normal((units, 1, fan_out)).astype(np.float32))
  w = tf.constant(rng.random(units).astype(np.float32))
  inputs = (a, d, w)
  rows = [
      ("float32, one product", lambda a, d, w: tf.cast(tf.matmul(
          a[:, 0], d[:, 0] * w[:, None], transpose_a=True), tf.float64)),
      (f"chunked float32, K = {ghost.float32_chunk(units, limit)}",
       lambda a, d, w: tf.cast(ghost.chunked_linear_grad(a, d, w, limit),
                               tf.float64)),
      ("float64", ghost.linear_grad),
  ]
  return rows, inputs, 1e-4


def _norm_rows(units, seed):
  rng = np.random.default_rng(seed)
  a = tf.constant(rng.random((units, 1, 784), np.float32))
  d = tf.constant(rng.standard_normal((units, 1, 128)).astype(np.float32))
  upper = ghost.float32_sq_norms_upper
  rows = [
      ("float64 products with ones", ghost.linear_sq_norms),
      ("float32 sums of squares, raised",
       lambda a, d: upper(a[:, 0]) * upper(d[:, 0])),
  ]
  return rows, (a, d), 1e-4


def _sampler_rows(size, seed):
  half = (size + 7) // 8 * 4  # standard_normal's pairs: whole Philox blocks

  def words32(s):
    return tf.random.stateless_uniform([2 * half], seed=s, minval=None,
                                       maxval=None, dtype=tf.uint32,
                                       alg="philox")

  def words64(s):
    return tf.reshape(tf.bitcast(tf.random.stateless_uniform(
        [half], seed=s, minval=None, maxval=None, dtype=tf.uint64,
        alg="philox"), tf.uint32), [-1])

  rows = [
      ("standard_normal", lambda s: noise.standard_normal([size], s)),
      ("its words: uint32", words32),
      ("its words: uint64, split", words64),
  ]
  return rows, (tf.constant([seed, 7], tf.int64),), None


def groups(batch_sizes, size=MLP_PARAMETERS, seed=0):
  """(name, rows, inputs, rtol) of every group; ``size``: the sampler's."""
  kernel = ghost.float32_max_units(784, 128, tf.float32)
  out = []
  for units in batch_sizes:
    out.append((f"kernel sum 784 x 128, U = {units}",
                *_sum_rows(units, 784, 128, kernel, seed)))
    out.append((f"head sum 128 x 10, U = {units}",
                *_sum_rows(units, 128, 10, kernel, seed)))
    out.append((f"row norms, U = {units}", *_norm_rows(units, seed)))
  out.append((f"sampler, n = {size:,}", *_sampler_rows(size, seed)))
  return out


def check(rows, inputs, rtol):
  """The rows' results agree (to ``rtol``; the sampler's words: exactly)."""
  results = [np.asarray(tf.function(f, jit_compile=True)(*inputs))
             for _, f in rows]
  if rtol is None:  # the two word layouts are the same words
    np.testing.assert_array_equal(results[1], results[2])
    return
  for got in results[1:]:
    np.testing.assert_allclose(got, results[0], rtol=rtol,
                               atol=rtol * np.abs(results[0]).max())


def measure(rows, inputs, rounds, reps):
  """Best-round mean ms of each row, interleaved rounds."""
  compiled = [tf.function(f, jit_compile=True) for _, f in rows]
  for g in compiled:
    np.asarray(g(*inputs))
  best = [float("inf")] * len(rows)
  for _ in range(rounds):
    for j, g in enumerate(compiled):
      start = time.perf_counter()
      for _ in range(reps):
        out = g(*inputs)
      np.asarray(out)
      best[j] = min(best[j], (time.perf_counter() - start) / reps * 1e3)
  return best


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch-sizes", type=int, nargs="+",
                      default=[256, 1024])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--reps", type=int, default=100)
  parser.add_argument("--sampler-size", type=int, default=MLP_PARAMETERS)
  args = parser.parse_args(argv)
  print(f"TensorFlow {tf.__version__}, {os.cpu_count()} CPUs; ms per call "
        f"(best of {args.rounds} rounds of {args.reps}), ratio to the "
        "group's first row")
  for name, rows, inputs, rtol in groups(args.batch_sizes,
                                         args.sampler_size):
    check(rows, inputs, rtol)
    times = measure(rows, inputs, args.rounds, args.reps)
    print(f"\n{name}")
    for (label, _), ms in zip(rows, times):
      print(f"  {label:34s} {ms:8.3f} ms  {ms / times[0]:5.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
