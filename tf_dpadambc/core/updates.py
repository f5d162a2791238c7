"""Stage 5 of the pipeline: update directions from the moments.

Each function maps moment estimates to the direction Δ of
θ ← θ − η·Δ (or, for momentum SGD, the velocity).
"""
import tensorflow as tf


def adam_direction(m_hat, v_hat, epsilon):
  """Adam (Kingma & Ba 2015): Δ = m̂ / (√v̂ + ε).

  On private gradients this is DP-Adam by post-processing (Algorithm 5 of
  Ganesh et al. 2025). Its denominator is dominated by Φ when Φ ≫ v̂^clean,
  which turns it into DP-SGD with momentum (Tang et al. 2024, Eq. 3).
  """
  return m_hat / (tf.sqrt(v_hat) + epsilon)


def bias_corrected_direction(m_hat, v_hat, phi, gamma_prime):
  """DP-AdamBC (Tang, Shpilevskiy & Lécuyer 2024, Algorithm 1):

      Δ = m̂ / sqrt(max(v̂ − Φ, γ'))

  Φ is subtracted after Adam's own 1/(1−β2^t) correction; γ' is a floor
  inside the max (no additive ε). Where v̂ − Φ < γ' the step is m̂/√γ', much
  larger than Adam's: learning rates are smaller (1.4–10x in Tang et al.'s
  tuned runs).
  """
  return m_hat / tf.sqrt(tf.maximum(v_hat - phi, gamma_prime))


def momentum_velocity(velocity, gradient, momentum, learning_rate):
  """Heavy-ball velocity as in Keras SGD: u ← μ·u − η·g.

  The step is θ ← θ + u; Nesterov's variant steps by μ·u_new − η·g, i.e. this
  same function applied once more to the new velocity.
  """
  return momentum * velocity - learning_rate * gradient


def clamped_direction(m_hat, v_hat, epsilon, floor=0.0):
  """Δ = m̂ / max(sqrt(max(v̂, 0)) + ε, floor) for unbiased, possibly negative v̂.

  Independent and joint moment estimation (Ganesh et al. 2025, Algorithm 6;
  Kalinin et al. 2025) release v̂ with zero-mean noise, so it can be negative.
  ``floor`` = 0 is Algorithm 6; Ganesh et al.'s Fig. 2 uses ε = 0, floor = 1
  (a learning rate η/max(1, √v̂)), which bounds the step where v̂ ≤ 0.
  """
  denominator = tf.sqrt(tf.maximum(v_hat, tf.zeros_like(v_hat))) + epsilon
  return m_hat / tf.maximum(denominator, floor)


def preconditioner_scale(v_hat, epsilon):
  """s = 1 / (sqrt(max(v̂, 0)) + ε): the geometry in which gradients are clipped.

  Scale-then-privatize (Ganesh et al. 2025, Algorithm 8) clips and noises
  s_t ⊙ g_u with s_t from the previous step's v̂; delayed (Li et al. 2023)
  and public (Li et al. 2022) preconditioners use their own v̂.
  """
  return 1.0 / (tf.sqrt(tf.maximum(v_hat, tf.zeros_like(v_hat))) + epsilon)
