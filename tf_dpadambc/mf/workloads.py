"""Workloads A: the linear queries of the gradient stream that training uses.

Training with learning rate η releases, in effect, θ_t = θ_0 − η (A G)_t for a
lower-triangular workload A applied to the stream of gradients G. All the
workloads here are lower-triangular Toeplitz, so each is given by its first
column a (A_{t,j} = a_{t−j}); :func:`matrix` builds the n×n matrix.

* SGD: prefix sums, a_k = 1.
* SGD with momentum β: a_k = Σ_{i≤k} β^i = (1 − β^{k+1})/(1 − β)
  (Ganesh et al. 2025, §4.5; Choquette-Choo et al. 2023 find optimizing for
  plain prefix sums about as good in practice).
* Exponentially decayed prefix sums Σ_j β^{t−j} g_j (e.g. Adam's second
  moment accumulator): a_k = β^k.
"""
import numpy as np
import scipy.linalg


def _check_n(n):
  if int(n) != n or n < 1:
    raise ValueError(f"n (the number of steps) must be an integer ≥ 1; got {n!r}.")
  return int(n)


def _check_decay(name, value):
  if not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be in [0, 1); got {value!r}.")
  return float(value)


def prefix_sum_coefficients(n):
  """a_k = 1: the prefix-sum (SGD) workload."""
  return np.ones(_check_n(n))


def momentum_coefficients(n, momentum):
  """a_k = (1 − β^{k+1})/(1 − β): SGD with heavy-ball momentum β."""
  beta = _check_decay("momentum", momentum)
  k = np.arange(_check_n(n))
  return np.cumsum(beta ** k)


def decay_coefficients(n, decay):
  """a_k = β^k: exponentially decayed prefix sums."""
  beta = _check_decay("decay", decay)
  return beta ** np.arange(_check_n(n))


def matrix(coefficients):
  """The n×n lower-triangular Toeplitz matrix with first column ``coefficients``."""
  a = np.asarray(coefficients, dtype=np.float64)
  return scipy.linalg.toeplitz(a, np.zeros_like(a))


def prefix_sums(n):
  """A: the n×n lower-triangular matrix of ones (prefix sums)."""
  return matrix(prefix_sum_coefficients(n))


def momentum_prefix_sums(n, momentum):
  """A_{t,j} = Σ_{k=0}^{t−j} β^k: SGD with momentum (Ganesh et al. §4.5)."""
  return matrix(momentum_coefficients(n, momentum))


def decayed_prefix_sums(n, decay):
  """A_{t,j} = β^{t−j}: exponentially decayed prefix sums."""
  return matrix(decay_coefficients(n, decay))
