"""Stage 4 of the pipeline: moment estimation.

Adam's moments are exponential moving averages of the private gradient ḡ:

    m_t = β1 m_{t-1} + (1-β1) ḡ_t          m̂_t = m_t / (1-β1^t)
    v_t = β2 v_{t-1} + (1-β2) ḡ_t²         v̂_t = v_t / (1-β2^t)

With independent noise of per-coordinate variance Var_t in ḡ_t,
E[v̂_t] = v̂_t^clean + Φ_t with

    Φ_t = (1-β2)/(1-β2^t) · Σ_{i≤t} β2^{t-i} Var_i

(Tang, Shpilevskiy & Lécuyer 2024, Eq. 2). For a constant Var = (σC/B)² this
is exactly Φ = (σC/B)². Tracking Φ_t as one more EMA (of Var_t, debiased like
v) keeps it exact when the batch size varies between steps.
"""
import tensorflow as tf


def ema(average, value, decay):
  """β·average + (1-β)·value."""
  return decay * average + (1.0 - decay) * value


def debias(average, decay, step):
  """Adam's initialization-bias correction: average / (1 - β^t), t ≥ 1."""
  return average / _unbiased_share(decay, step, average.dtype)


def debias_factor(decay, step, dtype=tf.float32):
  """1 / (1 - β^t), the scalar :func:`debias` divides by (t ≥ 1)."""
  return 1.0 / _unbiased_share(decay, step, dtype)


def _unbiased_share(decay, step, dtype):
  """1 - β^t: the weight an EMA from zero has put on its inputs by step t."""
  return 1.0 - tf.pow(tf.cast(decay, dtype), tf.cast(step, dtype))


def dp_noise_variance(noise_multiplier, l2_norm_clip, batch_size):
  """Φ = (σC/B)²: per-coordinate variance of the noise in the private mean."""
  return (noise_multiplier * l2_norm_clip / batch_size) ** 2


def accumulate(total, value, decay):
  """The second-moment accumulator of each optimizer family.

  ``decay`` β: exponential moving average β·total + (1-β)·value (Adam,
  RMSProp); ``None``: running sum total + value (AdaGrad). The DP bias of the
  accumulator obeys the same recursion with the per-step noise variance in
  place of ḡ², which is how Φ_t is tracked for every family.
  """
  if decay is None:
    return total + value
  return ema(total, value, decay)


def clamp_negative(v_hat):
  """max(v̂, 0): unbiased second-moment estimates (IME, JME, v̂ − Φ) can be < 0."""
  return tf.maximum(v_hat, tf.zeros_like(v_hat))
