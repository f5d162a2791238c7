"""Error of a factorization A = (A C⁻¹)·C with noise multiplier 1.

The noise A·C⁻¹·Z·sens(C) lands on the workload A·G, so (Choquette-Choo et
al. 2023, §2; McKenna 2024, arXiv 2405.15913, §2)

    RMSE      = sens(C)·‖A C⁻¹‖_F / √n,
    max error = sens(C)·max_t ‖row_t(A C⁻¹)‖₂.

When A and C are both lower-triangular Toeplitz, so is A C⁻¹, with first
column h = (a * r)[:n] (r the series of 1/C(x)); then ‖row_t‖² = Σ_{k≤t} h_k²
and ‖A C⁻¹‖_F² = Σ_k (n − k) h_k²: O(n log n) with FFT convolutions, so n in
the thousands is instant. Anything else takes a dense triangular solve.
"""
import numpy as np
import scipy.linalg
import scipy.signal

from tf_dpadambc.mf import strategies
from tf_dpadambc.mf import workloads
# By name: the package exports the function ``sensitivity``, which shadows
# the submodule of the same name as an attribute of ``tf_dpadambc.mf``.
from tf_dpadambc.mf.sensitivity import sensitivity as _sensitivity


def toeplitz_workload(workload, n):
  """(a, A): the first column of a lower-triangular Toeplitz workload (or
  None) and its n×n matrix (or None if not built).

  ``workload``: None (prefix sums), a coefficient vector a (≥ n entries), or
  an n×n matrix (a is None unless it is lower-triangular Toeplitz).
  """
  if workload is None:
    return workloads.prefix_sum_coefficients(n), None
  a = np.asarray(workload, dtype=np.float64)
  if a.ndim == 1:
    if a.size < n:
      raise ValueError(f"The workload coefficients need ≥ {n} entries; got "
                       f"{a.size}.")
    return a[:n], None
  if a.shape != (n, n):
    raise ValueError(f"The workload must be {n}×{n}; got {a.shape}.")
  if np.array_equal(a, workloads.matrix(a[:, 0])):
    return a[:, 0].copy(), a
  return None, a


def _inverse_coefficients(strategy, n):
  """r with C⁻¹_{t,j} = r_{t−j} for Toeplitz strategies, else None."""
  if isinstance(strategy, strategies.Identity):
    return strategies._impulse(n)
  if isinstance(strategy, strategies._Toeplitz):
    return strategy.inverse_coefficients(n)
  return None


def toeplitz_product_coefficients(a, r):
  """h = (a * r)[:n]: the first column of A C⁻¹ for Toeplitz A and C⁻¹."""
  return scipy.signal.fftconvolve(a, r)[:len(a)]


def row_norms_squared(strategy, n, workload=None):
  """‖row_t(A C⁻¹)‖², t < n (without the sensitivity factor)."""
  a, matrix = toeplitz_workload(workload, int(n))
  r = _inverse_coefficients(strategy, int(n))
  if a is not None and r is not None:
    return np.cumsum(np.square(toeplitz_product_coefficients(a, r)))
  if matrix is None:
    matrix = workloads.matrix(a)
  c = (strategy.matrix(n) if isinstance(strategy, strategies.Strategy)
       else np.asarray(strategy, dtype=np.float64))
  # (A C⁻¹)ᵀ = C⁻ᵀ Aᵀ: one triangular solve.
  product_t = scipy.linalg.solve_triangular(c, matrix.T, trans="T",
                                            lower=True)
  return np.sum(np.square(product_t), axis=0)


def rmse(strategy, n, workload=None, participations=1, min_separation=1):
  """sens(C)·‖A C⁻¹‖_F/√n: the root-mean-squared noise over the n steps.

  A = ``workload`` (default prefix sums, :func:`workloads.prefix_sums`); the
  sensitivity is :func:`tf_dpadambc.mf.sensitivity` under ``participations`` and
  ``min_separation``. Identity C and prefix sums: √((n + 1)/2)·√k_eff.
  """
  sens = _sensitivity(strategy, n, participations, min_separation)
  return float(sens * np.sqrt(np.sum(row_norms_squared(strategy, n, workload))
                              / n))


def max_error(strategy, n, workload=None, participations=1,
              min_separation=1):
  """sens(C)·max_t ‖row_t(A C⁻¹)‖₂: the noise std of the worst step.

  Identity C and prefix sums: √n·√k_eff.
  """
  sens = _sensitivity(strategy, n, participations, min_separation)
  return float(sens * np.sqrt(np.max(row_norms_squared(strategy, n,
                                                       workload))))
