"""Optimized strategies: banded Toeplitz (BandMF), BLT and the dense optimum.

Each optimizer minimizes sens(C)²·error(A C⁻¹)² for a lower-triangular
Toeplitz workload A (default prefix sums) and returns the strategy:

* :func:`optimize_banded`: b-banded Toeplitz C, L-BFGS-B on c_1..c_{b−1}
  with an analytic gradient (Choquette-Choo et al. 2023, "(Amplified) banded
  matrix factorization"; McKenna 2024, arXiv 2405.15913, "Scaling up the
  banded matrix factorization mechanism").
* :func:`optimize_blt`: d-buffer BLT (McMahan, Xu & Zhang 2024).
* :func:`optimize_dense`: the optimal dense factorization for one
  participation (Denisov et al. 2022; Yuan et al. 2016 fixed point).

The errors are "mean" (RMSE², weights (n − k)/n on h_k²) or "max" (the last
row of the Toeplitz A C⁻¹, whose row norms grow with t). Both are invariant
to scaling C, so c_0 = 1 is fixed. NumPy/SciPy only.
"""
import numpy as np
import scipy.linalg
import scipy.optimize
import scipy.signal
import scipy.special

from tf_dpadambc.mf import error as error_lib
from tf_dpadambc.mf import strategies
from tf_dpadambc.mf import workloads
# By name: ``tf_dpadambc.mf.sensitivity`` is the function once the package
# is imported (it shadows the submodule).
from tf_dpadambc.mf.sensitivity import effective_participations
from tf_dpadambc.mf.sensitivity import packed_column_sum

_OBJECTIVES = ("rmse", "max")
_OVERFLOW = 1e4  # log-objective returned when 1/C(x) overflows
_BOUND = 10.0  # |c_j| for the banded coefficients (c_0 = 1)


def _workload_coefficients(workload, n):
  a, _ = error_lib.toeplitz_workload(workload, n)
  if a is None:
    raise ValueError("The optimizers need a lower-triangular Toeplitz "
                     "workload (a coefficient vector or such a matrix).")
  return a


def _error_weights(n, objective):
  """w_k with error² = Σ_k w_k h_k² for the first column h of A C⁻¹."""
  if objective == "rmse":
    return (n - np.arange(n)) / n
  if objective == "max":
    return np.ones(n)
  raise ValueError(f"objective must be one of {_OBJECTIVES}; got "
                   f"{objective!r}.")


def _pattern(n, participations, min_separation):
  """(k_eff, s); s defaults to ⌊n/k⌋ (cyclic participation, k epochs)."""
  k = int(participations)
  if min_separation is None:
    min_separation = max(1, n // k)
  s = int(min_separation)
  return effective_participations(n, k, s), s


def _banded_sensitivity_weights(n, bands, k_eff, s):
  """m_t with sens² = Σ_{t<b} m_t c_t² for a b-banded Toeplitz C, b ≤ s.

  The columns of a pattern are then orthogonal and the column norms of a
  Toeplitz C shrink with the column index, so the packed pattern 0, s, …
  is the worst: m_t = #{j < k_eff : t < n − js} (= k_eff unless the last
  participation's column is cut off at step n).
  """
  t = np.arange(bands)
  return np.sum(t[None, :] < n - s * np.arange(k_eff)[:, None], axis=0)


def _error_and_gradient(a, r, error_weights, m):
  """(E, ∂E/∂c_j for j < m): E = Σ_k w_k h_k², h = (a * r)[:n], r = 1/C(x).

  ∂r/∂c_j = −x^j r², so ∂h_k/∂c_j = −q_{k−j} with q = (h * r)[:n] and
  ∂E/∂c_j = −2 Σ_k (w h)_{k+j} q_k: one correlation, by FFT (O(n log n)).
  """
  n = a.size
  h = scipy.signal.fftconvolve(a, r)[:n]
  q = scipy.signal.fftconvolve(h, r)[:n]
  corr = scipy.signal.fftconvolve((error_weights * h)[::-1], q)
  return float(np.sum(error_weights * h * h)), -2.0 * corr[n - m:n][::-1]


def _banded_loss(c, a, sens_weights, error_weights):
  """(L, ∂L/∂c) with L = (Σ_t m_t c_t²)·(Σ_k w_k h_k²), r = 1/C(x) by
  lfilter (O(n·b))."""
  with np.errstate(over="ignore", invalid="ignore"):
    r = scipy.signal.lfilter([1.0], c, strategies._impulse(a.size))
    err2, grad_err = _error_and_gradient(a, r, error_weights, c.size)
    sens2 = float(np.sum(sens_weights * c * c))
    grad = err2 * 2.0 * sens_weights * c + sens2 * grad_err
  loss = sens2 * err2
  if not (np.isfinite(loss) and np.all(np.isfinite(grad))):
    return np.inf, np.full(c.size, np.nan)
  return loss, grad


def _banded_setup(n, bands, participations, min_separation, workload,
                  objective):
  n, bands = int(n), int(bands)
  if bands < 1:
    raise ValueError(f"bands must be ≥ 1; got {bands}.")
  bands = min(bands, n)
  k_eff, s = _pattern(n, participations, min_separation)
  if k_eff > 1 and bands > s:
    raise ValueError(
        f"optimize_banded needs bands ≤ min_separation with several "
        f"participations (got bands={bands}, min_separation={s}): only then "
        f"are the columns of one example's participations orthogonal and "
        f"sens² = k_eff·‖c‖² exact.")
  a = _workload_coefficients(workload, n)
  return (bands, a, _banded_sensitivity_weights(n, bands, k_eff, s),
          _error_weights(n, objective))


def banded_objective(coefficients, n, participations=1, min_separation=None,
                     workload=None, objective="rmse"):
  """(sens²·error², gradient w.r.t. every coefficient) of a banded Toeplitz C.

  error² is RMSE²/sens² or max error²/sens² (``objective``), so the value is
  the squared RMSE (max error) of ``Toeplitz(coefficients)``. The objective
  :func:`optimize_banded` minimizes; exposed for gradient checks.
  """
  c = np.asarray(coefficients, dtype=np.float64)
  bands, a, m, w = _banded_setup(n, c.size, participations, min_separation,
                                 workload, objective)
  return _banded_loss(c[:bands], a, m, w)


def _lbfgs(fun, x0, bounds, jac=True, args=(), **options):
  options = {"maxiter": 20000, "maxfun": 50000, "ftol": 1e-13,
             "gtol": 1e-10, "maxcor": 30, **options}
  return scipy.optimize.minimize(fun, x0, args=args, jac=jac,
                                 method="L-BFGS-B", bounds=bounds,
                                 options=options)


def optimize_banded(n, bands, participations=1, min_separation=None,
                    workload=None, objective="rmse"):
  """The b-banded Toeplitz C (c_0 = 1) minimizing sens²·error² over n steps.

  L-BFGS-B on the log of the objective over c_1..c_{b−1} with the analytic
  gradient of :func:`banded_objective`, started from the truncated
  square-root factorization. Float64 throughout; the coefficients are
  bounded to [−10, 10] and a trial point where 1/C(x) overflows (C(x) with
  a root inside the unit disk) gets a large finite value, so the line
  search backs off instead of failing. ``workload``: the
  first column a of a lower-triangular Toeplitz A or the matrix (default
  prefix sums). With k > 1 participations (``min_separation`` s, default
  ⌊n/k⌋) bands ≤ s is required: then the columns of one example's
  participations are orthogonal and sens² = k_eff·‖c‖² is exact
  (Choquette-Choo et al. 2023).

  >>> c = optimize_banded(1024, 64)  # ~0.1 s
  >>> round(mf.rmse(c, 1024), 3), round(mf.max_error(c, 1024), 3)
  (4.066, 5.219)
  """
  bands, a, m, w = _banded_setup(n, bands, participations, min_separation,
                                 workload, objective)
  if bands == 1:
    return strategies.Toeplitz([1.0])

  def fun(x):  # the log: well scaled; overflow -> a large finite value
    loss, grad = _banded_loss(np.concatenate([[1.0], x]), a, m, w)
    if not np.isfinite(loss):
      return _OVERFLOW, np.zeros(x.size)
    return np.log(loss), grad[1:] / loss

  x0 = strategies.sqrt_toeplitz_coefficients(bands)[1:]
  result = _lbfgs(fun, x0, [(-_BOUND, _BOUND)] * (bands - 1))
  return strategies.Toeplitz(np.concatenate([[1.0], result.x]))


def _blt_parameters(x):
  """θ = sigmoid(u) ∈ (0, 1), ω = softmax(v, 0)[:d] > 0 with Σω < 1."""
  d = x.size // 2
  theta = scipy.special.expit(x[:d])
  omega = scipy.special.softmax(np.concatenate([x[d:], [0.0]]))[:d]
  return theta, omega


def _blt_rational(theta, omega):
  """(numerator, denominator) of C(x) = 1 + Σ_i ω_i x/(1 − θ_i x), in
  increasing powers: den = Π_i (1 − θ_i x) = np.poly(θ) read upwards."""
  den = np.poly(theta)
  num = np.concatenate([den, [0.0]])
  for i, w in enumerate(omega):
    num[1:] += w * np.concatenate([np.poly(np.delete(theta, i)),
                                   np.zeros(1)])[:num.size - 1]
  return num, den


def _packed_sensitivity_and_gradient(c, k_eff, s):
  """(sens², ∂sens²/∂c) of the packed pattern: y = Σ_{j<k} c shifted by js,
  sens² = ‖y‖², ∂/∂c_m = 2 Σ_j y_{m+js}."""
  n = c.size
  y = packed_column_sum(c, k_eff, s)
  back = np.zeros(n)
  for j in range(k_eff):
    back[:n - j * s] += y[j * s:]
  return float(y @ y), 2.0 * back


def _blt_loss(x, a, k_eff, s, error_weights):
  """(log L, ∂ log L/∂x) for x = (u, v), L = sens²·E of the BLT C.

  Both factors are functions of c_1..c_{n−1} (c_k = Σ_i ω_i θ_i^{k−1}):
  ∂L/∂c from the packed sensitivity and :func:`_error_and_gradient`, then
  ∂c_k/∂ω_i = θ_i^{k−1}, ∂c_k/∂θ_i = ω_i (k−1) θ_i^{k−2}, and the chain
  through the sigmoid and the softmax.
  """
  n = a.size
  theta, omega = _blt_parameters(x)
  powers = np.power.outer(theta, np.arange(n - 1))  # θ_i^{k−1}, k = 1..n−1
  c = np.concatenate([[1.0], omega @ powers])
  if k_eff == 1:
    sens2 = float(c @ c)
    grad_sens = 2.0 * c
  else:
    sens2, grad_sens = _packed_sensitivity_and_gradient(c, k_eff, s)
  with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
    num, den = _blt_rational(theta, omega)
    r = scipy.signal.lfilter(den, num, strategies._impulse(n))
    err2, grad_err = _error_and_gradient(a, r, error_weights, n)
    loss = sens2 * err2
    grad_c = (err2 * grad_sens + sens2 * grad_err)[1:] / loss
  if not (np.isfinite(loss) and loss > 0 and np.all(np.isfinite(grad_c))):
    return _OVERFLOW, np.zeros(x.size)
  grad_omega = powers @ grad_c
  k = np.arange(1, n - 1)
  grad_theta = omega * (powers[:, :n - 2] @ (grad_c[1:] * k))
  grad_u = grad_theta * theta * (1.0 - theta)
  grad_v = omega * (grad_omega - omega @ grad_omega)
  return np.log(loss), np.concatenate([grad_u, grad_v])


def _blt_starts(d, n, rng, restarts):
  """Starting points (u, v): decays spread over time scales 2..n, weights
  splitting ~1/2, then random ones."""
  starts = []
  for scale in (0.5, 0.9):
    timescales = np.geomspace(2.0, n, d) if d > 1 else np.array([n ** 0.5])
    theta = 1.0 - 1.0 / timescales
    omega = np.full(d, scale / d)
    starts.append((theta, omega))
  for _ in range(restarts):
    theta = 1.0 - 1.0 / np.exp(rng.uniform(0.0, np.log(n), d))
    omega = rng.dirichlet(np.ones(d + 1))[:d]
    starts.append((theta, omega))
  for theta, omega in starts:
    theta = np.clip(theta, 1e-3, 1.0 - 1e-9)
    v = np.log(omega) - np.log1p(-np.sum(omega))
    yield np.concatenate([scipy.special.logit(theta), v])


def optimize_blt(n, buffers, participations=1, min_separation=None,
                 workload=None, objective="rmse", restarts=4, seed=0):
  """The d-buffer BLT C minimizing sens²·error² over n steps.

  θ = sigmoid(u) and ω = exp(v)/(1 + Σ exp(v)) keep θ ∈ (0, 1), ω > 0 and
  Σω < 1, so c is positive and non-increasing and the packed-pattern
  sensitivity (``sensitivity.packed_toeplitz_sensitivity_squared``; the
  closed form for one participation) is exact. L-BFGS-B on the log of the
  objective with its analytic gradient (:func:`_blt_loss`), from two
  deterministic and ``restarts`` random starts; the best is returned
  (McMahan, Xu & Zhang 2024; Dvijotham et al. 2024).

  >>> c = optimize_blt(1024, 2)  # ~0.5 s
  >>> round(mf.rmse(c, 1024), 3), round(mf.max_error(c, 1024), 3)
  (3.084, 3.408)
  """
  n, d = int(n), int(buffers)
  if d < 1:
    raise ValueError(f"buffers must be ≥ 1; got {buffers}.")
  k_eff, s = _pattern(n, participations, min_separation)
  a = _workload_coefficients(workload, n)
  w = _error_weights(n, objective)
  rng = np.random.default_rng(seed)
  bounds = [(-8.0, 25.0)] * d + [(-20.0, 10.0)] * d
  best = None
  for x0 in _blt_starts(d, n, rng, restarts):
    x0 = np.clip(x0, [lo for lo, _ in bounds], [hi for _, hi in bounds])
    result = _lbfgs(_blt_loss, x0, bounds, args=(a, k_eff, s, w),
                    ftol=1e-13, gtol=1e-9, maxiter=5000)
    if best is None or result.fun < best.fun:
      best = result
  return strategies.BLT(*_blt_parameters(best.x))


def _dual_matrix_sqrt(v, w):
  """M^{1/2} for M = V^{1/2} W V^{1/2}, V = diag(v), by eigh."""
  sv = np.sqrt(v)
  eigval, eigvec = np.linalg.eigh(sv[:, None] * w * sv[None, :])
  return (eigvec * np.sqrt(np.maximum(eigval, 0.0))) @ eigvec.T


def reverse_cholesky(x):
  """Lower-triangular C with CᵀC = X: J X J = L Lᵀ, C = J Lᵀ J (J the
  exchange matrix)."""
  low = np.linalg.cholesky(x[::-1, ::-1])
  return low.T[::-1, ::-1]


def optimize_dense(n, workload=None, tol=1e-10, max_iterations=5000):
  """The optimal dense lower-triangular C for one participation.

  Minimizes tr(AᵀA X⁻¹) subject to diag(X) = 1 (X = CᵀC, sensitivity 1).
  The Lagrange dual is max_v g(v) = 2 tr((V^{1/2} W V^{1/2})^{1/2}) − Σv,
  W = AᵀA, with ∂g/∂v_i = [M^{1/2}]_ii/v_i − 1 and the primal solution
  X = V^{−1/2} M^{1/2} V^{−1/2}. It is solved by L-BFGS-B on log v with
  this gradient, one eigendecomposition per step: about half the
  eigendecompositions of the fixed point v_i ← [M^{1/2}]_ii (Yuan et al.
  2016, used by Denisov et al. 2022), which has the same optimum. C is the
  reverse Cholesky factor of X after rescaling diag(X) to exactly 1 (so
  sens(C) = 1 whatever the tolerance).

  >>> c = optimize_dense(256)  # ~1 s
  >>> round(mf.rmse(c, 256), 3), round(mf.max_error(c, 256), 3)
  (2.524, 2.749)
  """
  n = int(n)
  if workload is None:
    a_matrix = workloads.prefix_sums(n)
  else:
    a_matrix = np.asarray(workload, dtype=np.float64)
    if a_matrix.ndim == 1:
      a_matrix = workloads.matrix(a_matrix[:n])
    if a_matrix.shape != (n, n):
      raise ValueError(f"The workload must be {n}×{n} (or its first "
                       f"column); got {a_matrix.shape}.")
  w = a_matrix.T @ a_matrix
  w = w / np.mean(np.diag(w))  # scale-free: the optimal X does not change

  def negative_dual(log_v):
    v = np.exp(log_v)
    root = _dual_matrix_sqrt(v, w)
    diag = np.diag(root)
    value = 2.0 * np.sum(diag) - np.sum(v)
    grad_v = diag / v - 1.0
    return -value, -grad_v * v

  v0 = np.diag(w).copy()
  result = _lbfgs(negative_dual, np.log(v0), None, ftol=1e-15,
                  gtol=tol, maxiter=max_iterations)
  v = np.exp(result.x)
  root = _dual_matrix_sqrt(v, w)
  x = root / np.sqrt(np.outer(v, v))
  d = np.sqrt(np.diag(x))
  x = x / np.outer(d, d)
  return strategies.Dense(reverse_cholesky(x))
