"""Stage 3, correlated: the DP-MF noise x_t = (C⁻¹z)_t, one step at a time.

DP matrix factorization (Ganesh et al. 2025, Algorithm 1; Choquette-Choo et
al. 2023) adds σ·Δ·sens(C)·(C⁻¹z)_t to the clipped sum of step t instead of
σ·Δ·z_t, with z_t ~ N(0, I) independent. These pure functions compute x_t from
z_t and a small state, so the noise streams inside the compiled train step:

* banded Toeplitz C (c_0..c_{b−1}): C x = z gives
  x_t = (z_t − Σ_{j=1}^{b−1} c_j x_{t−j}) / c_0        state: b−1 past x
  (a ring buffer)
* BLT, C(x) = 1 + Σ_i ω_i x/(1 − θ_i x):
  x_t = z_t − Σ_i ω_i s_i,  then s_i ← θ_i s_i + x_t  state: d buffers s_i
* dense C⁻¹ (small n): x_t = Σ_{j≤t} (C⁻¹)_{t,j} z_j, regenerating each z_j
  from its step's seed                                   state: none

States are tensors shaped [buffers, *shape] per parameter tensor. All of it is
linear in z, so the variance of x_t per coordinate is ‖row_t(C⁻¹)‖².
"""
import tensorflow as tf


def _along_buffers(vector, like):
  """``vector`` [k] reshaped to broadcast against a state [k, *shape]."""
  return tf.reshape(tf.cast(vector, like.dtype),
                    [-1] + [1] * (like.shape.rank - 1))


def banded_step(z, history, coefficients, step):
  """One step of a banded Toeplitz C: returns (x_t, new history).

  Args:
    z: z_t, one tensor.
    history: [b−1, *z.shape], a ring buffer: slot k holds the most recent
      x_j with j ≡ k (mod b−1) (zeros before the first steps).
    coefficients: c_0..c_{b−1} (NumPy or Python floats).
    step: t (0-based).

  x_{t−j} sits in slot (t − j) mod (b−1), so slot k is weighted by c_j with
  j = ((t − k − 1) mod (b−1)) + 1; x_t then overwrites slot t mod (b−1),
  whose x_{t−b+1} is no longer needed. No buffer is shifted: one read of the
  history and one slot written per step.
  """
  c0 = float(coefficients[0])
  buffers = len(coefficients) - 1
  if buffers == 0:
    return z / c0, history
  step = tf.cast(step, tf.int64)
  slots = tf.range(buffers, dtype=tf.int64)
  lags = tf.math.floormod(step - slots - 1, buffers) + 1
  weights = tf.gather(tf.constant(coefficients, z.dtype), lags)
  x = (z - tf.tensordot(weights, history, axes=1)) / c0
  slot = tf.math.floormod(step, buffers)
  return x, tf.tensor_scatter_nd_update(history, [[slot]], x[tf.newaxis])


def blt_step(z, buffers, theta, omega):
  """One step of a BLT C: returns (x_t, new buffers) (McMahan et al. 2024).

  Args:
    z: z_t, one tensor.
    buffers: [d, *z.shape], s_i = Σ_{k≥1} θ_i^{k−1} x_{t−k}.
    theta, omega: the BLT's d decays θ_i and weights ω_i of C.
  """
  x = z - tf.reduce_sum(_along_buffers(omega, buffers) * buffers, axis=0)
  return x, _along_buffers(theta, buffers) * buffers + x[tf.newaxis]


def dense_step(templates, inverse_row, step, draw):
  """x_t = Σ_{j≤t} (C⁻¹)_{t,j} z_j with z_j = ``draw(j)`` (shaped like
  ``templates``).

  ``inverse_row`` is row t of C⁻¹ (a tensor); the loop regenerates z_j from
  the counter-based seed of step j, so no past noise is stored.
  """
  def body(j, total):
    weight = tf.gather(inverse_row, j)
    return j + 1, [acc + tf.cast(weight, z.dtype) * z
                   for acc, z in zip(total, draw(j))]

  zero = [tf.zeros_like(t) for t in templates]
  _, total = tf.while_loop(lambda j, _: j <= tf.cast(step, tf.int64), body,
                           (tf.constant(0, tf.int64), zero))
  return total
