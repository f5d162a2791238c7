"""tf_dpadambc.mf: sensitivity, error and optimized strategies.

Reference figures: /work/shared/notes/matrix-factorization.md (NumPy/SciPy,
cross-checked there with jax_privacy 2.0). Prefix-sum workload, noise
multiplier 1; (RMSE, max error).
"""
import numpy as np
import pytest

from tf_dpadambc import mf
from tf_dpadambc.mf import optimize
from tf_dpadambc.mf import strategies
from tf_dpadambc.mf import workloads
from tf_dpadambc.mf.sensitivity import blt_coefficients
from tf_dpadambc.mf.sensitivity import effective_participations
from tf_dpadambc.mf.sensitivity import max_weight_pattern
from tf_dpadambc.mf.sensitivity import packed_toeplitz_sensitivity_squared

SQRT_TOEPLITZ = {256: (2.669, 2.831), 1024: (3.110, 3.273),
                 2048: (3.331, 3.493)}
BANDED = {(256, 16): (3.638, 4.777), (256, 64): (2.783, 3.341),
          (1024, 16): (6.343, 8.659), (1024, 64): (4.066, 5.219),
          (1024, 128): (3.523, 4.333), (2048, 64): (5.170, 6.811)}


def _central_differences(fun, x, step=1e-6):
  eye = np.eye(x.size) * step
  return np.array([(fun(x + e) - fun(x - e)) / (2 * step) for e in eye])


def _errors(strategy, n, **kwargs):
  return mf.rmse(strategy, n, **kwargs), mf.max_error(strategy, n, **kwargs)


# Closed forms.

@pytest.mark.parametrize("n", [1, 7, 256, 1000])
def test_identity_prefix_sums(n):
  assert mf.rmse(strategies.Identity(), n) == pytest.approx(
      np.sqrt((n + 1) / 2), rel=1e-12)
  assert mf.max_error(strategies.Identity(), n) == pytest.approx(
      np.sqrt(n), rel=1e-12)


def test_identity_multiple_participations():
  # k_eff = min(k, ⌈n/s⌉) = min(5, ⌈100/30⌉) = 4.
  assert mf.sensitivity(strategies.Identity(), 100, 5, 30) == 2.0
  assert mf.rmse(strategies.Identity(), 1024, participations=4,
                 min_separation=256) == pytest.approx(45.28, abs=5e-3)
  assert mf.rmse(strategies.Identity(), 1024, participations=16,
                 min_separation=64) == pytest.approx(90.55, abs=5e-3)


def test_sqrt_toeplitz_coefficients_and_square():
  c = strategies.sqrt_toeplitz_coefficients(5)
  np.testing.assert_allclose(c, [1, 1 / 2, 3 / 8, 5 / 16, 35 / 128])
  n = 64
  root = strategies.sqrt_toeplitz(n).matrix(n)
  np.testing.assert_allclose(root @ root, workloads.prefix_sums(n),
                             atol=1e-12)


@pytest.mark.parametrize("n", sorted(SQRT_TOEPLITZ))
def test_sqrt_toeplitz_reference_figures(n):
  got = _errors(strategies.sqrt_toeplitz(n), n)
  np.testing.assert_allclose(got, SQRT_TOEPLITZ[n], atol=5e-4)


def test_toeplitz_error_matches_dense_computation():
  n = 40
  rng = np.random.default_rng(0)
  toeplitz = strategies.Toeplitz(np.r_[1.0, rng.uniform(-0.3, 0.5, 9)])
  dense = strategies.Dense(toeplitz.matrix(n))
  momentum = workloads.momentum_prefix_sums(n, 0.9)
  not_toeplitz = np.tril(rng.uniform(0.5, 1.5, (n, n)))
  for workload in (None, momentum, workloads.momentum_coefficients(n, 0.9),
                   not_toeplitz):
    for kwargs in ({}, {"participations": 2, "min_separation": 20}):
      np.testing.assert_allclose(
          _errors(toeplitz, n, workload=workload, **kwargs),
          _errors(dense, n, workload=workload, **kwargs), rtol=1e-10)


# Sensitivity.

def _random_cases(rng, count):
  for trial in range(count):
    n = int(rng.integers(2, 12))
    k = int(rng.integers(1, 5))
    s = int(rng.integers(1, n + 1))
    yield trial % 5, n, k, s


def _strategy(kind, n, s, rng):
  """0: truncated sqrt-Toeplitz, 1: BLT (Σω < 1), 2: banded with signs,
  b ≤ s, 3: non-negative non-increasing Toeplitz, any bands, 4: dense
  banded with bandwidth ≤ s."""
  if kind == 0:
    return strategies.sqrt_toeplitz(int(rng.integers(1, n + 1)))
  if kind == 1:
    d = int(rng.integers(1, 4))
    return strategies.BLT(rng.uniform(0.01, 0.99, d),
                          rng.dirichlet(np.ones(d + 1))[:d])
  if kind == 2:
    c = rng.normal(size=int(rng.integers(1, s + 1)))
    return strategies.Toeplitz(np.r_[abs(c[0]) + 0.1, c[1:]])
  if kind == 3:
    c = np.sort(rng.uniform(0, 1, int(rng.integers(1, n + 1))))[::-1]
    return strategies.Toeplitz(np.r_[1.0, c])
  lag = np.subtract.outer(np.arange(n), np.arange(n))
  c = rng.normal(size=(n, n)) * ((lag >= 0) & (lag < s))
  np.fill_diagonal(c, np.abs(np.diag(c)) + 0.1)
  return strategies.Dense(c)


def test_exact_sensitivities_match_brute_force():
  rng = np.random.default_rng(0)
  for kind, n, k, s in _random_cases(rng, 400):
    strategy = _strategy(kind, n, s, rng)
    exact = mf.brute_force_sensitivity(strategy.matrix(n), k, s)
    assert mf.sensitivity(strategy, n, k, s) == pytest.approx(
        exact, rel=1e-10), (strategy, n, k, s)


def test_packed_pattern_is_worst_for_nonincreasing_toeplitz():
  # The notes' claim, checked on its own: participations at 0, s, 2s, ...
  rng = np.random.default_rng(1)
  for _ in range(200):
    n = int(rng.integers(2, 13))
    k, s = int(rng.integers(2, 5)), int(rng.integers(1, n))
    c = np.r_[1.0, np.sort(rng.uniform(0, 1, n - 1))[::-1]]
    c[rng.integers(1, n):] = 0.0  # sometimes banded, bands > s
    exact = mf.brute_force_sensitivity(workloads.matrix(c), k, s)
    assert np.sqrt(packed_toeplitz_sensitivity_squared(c, k, s)) == (
        pytest.approx(exact, rel=1e-12))


def test_general_bound_is_an_upper_bound():
  rng = np.random.default_rng(2)
  tight = 0
  for _, n, k, s in _random_cases(rng, 300):
    matrix = np.tril(rng.normal(size=(n, n)))
    np.fill_diagonal(matrix, np.abs(np.diag(matrix)) + 0.1)
    exact = mf.brute_force_sensitivity(matrix, k, s)
    bound = mf.sensitivity_upper_bound(matrix, k, s)
    assert bound >= exact * (1 - 1e-12)
    assert mf.sensitivity(strategies.Dense(matrix), n, k, s) == bound
    tight += bound < exact * 1.01
  assert tight > 100  # informative, not just valid
  # Toeplitz with negative coefficients and bands > s takes this path too.
  c = np.array([1.0, -0.5, 0.4, -0.3, 0.2, 0.6])
  for k, s in ((2, 2), (3, 1), (4, 3)):
    exact = mf.brute_force_sensitivity(workloads.matrix(np.r_[c, 0, 0]), k, s)
    assert mf.sensitivity(strategies.Toeplitz(c), 8, k, s) >= exact


def test_max_weight_pattern():
  w = np.array([5.0, 1.0, 4.0, 3.0, 2.0, 6.0])
  assert max_weight_pattern(w, 1, 1) == 6.0
  assert max_weight_pattern(w, 2, 3) == 11.0  # 5 + 6 (0 and 5)
  assert max_weight_pattern(w, 3, 2) == 15.0  # 5 + 4 + 6 (0, 2, 5)
  assert effective_participations(10, 5, 4) == 3


@pytest.mark.parametrize("n", [1, 2, 10, 1000])
def test_blt_single_participation_closed_form(n):
  theta, omega = np.array([0.99, 0.7, 0.2]), np.array([0.1, 0.3, 0.2])
  blt = strategies.BLT(theta, omega)
  column_norms = np.linalg.norm(blt.matrix(n), axis=0)
  closed = mf.blt_single_participation_sensitivity_squared(theta, omega, n)
  assert closed == pytest.approx(np.max(column_norms) ** 2, rel=1e-10)
  assert mf.sensitivity(blt, n) ** 2 == pytest.approx(closed, rel=1e-10)
  np.testing.assert_allclose(blt_coefficients(theta, omega, n),
                             blt.coefficients(n), rtol=1e-9, atol=1e-300)


# Optimizers.

@pytest.mark.parametrize("objective", ["rmse", "max"])
@pytest.mark.parametrize("k, s", [(1, None), (3, 20)])
def test_banded_gradient_matches_finite_differences(objective, k, s):
  n, rng = 64, np.random.default_rng(3)
  c = np.r_[1.0, np.sort(rng.uniform(0, 0.6, 11))[::-1]]
  options = dict(n=n, participations=k, min_separation=s,
                 objective=objective)
  value, grad = mf.banded_objective(c, **options)
  numeric = _central_differences(
      lambda x: mf.banded_objective(x, **options)[0], c)
  np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)
  # Its value is the squared error of the strategy.
  error = mf.rmse if objective == "rmse" else mf.max_error
  pattern = {} if k == 1 else dict(participations=k, min_separation=s)
  assert np.sqrt(value) == pytest.approx(
      error(strategies.Toeplitz(c), n, **pattern), rel=1e-12)


def test_blt_gradient_matches_finite_differences():
  n, rng = 80, np.random.default_rng(4)
  a = workloads.prefix_sum_coefficients(n)
  for k_eff, s, objective in ((1, 1, "rmse"), (3, 20, "max")):
    w = optimize._error_weights(n, objective)
    x = np.r_[rng.uniform(-1, 4, 3), rng.uniform(-3, 0, 3)]
    grad = optimize._blt_loss(x, a, k_eff, s, w)[1]
    numeric = _central_differences(
        lambda y: optimize._blt_loss(y, a, k_eff, s, w)[0], x, step=1e-4)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("n, bands", sorted(BANDED))
def test_banded_reference_figures(n, bands):
  strategy = mf.optimize_banded(n, bands)
  assert strategy.bands == bands and strategy.coefficients_[0] == 1.0
  rmse, max_error = _errors(strategy, n)
  assert rmse == pytest.approx(BANDED[n, bands][0], rel=5e-4)
  assert max_error == pytest.approx(BANDED[n, bands][1], rel=2e-3)


def test_banded_between_identity_and_dense_optimum():
  n, dense_optimum = 256, 2.524
  rmses = [mf.rmse(mf.optimize_banded(n, b), n) for b in (1, 4, 16, 64, n)]
  assert rmses[0] == pytest.approx(mf.rmse(strategies.Identity(), n))
  assert all(np.diff(rmses) < 0)
  assert rmses[-1] == pytest.approx(2.617, abs=1e-3)  # full Toeplitz
  assert dense_optimum < rmses[-1] < dense_optimum * 1.04


@pytest.mark.parametrize("buffers, reference", [(2, 3.084), (4, 3.057)])
def test_blt_reference_figures(buffers, reference):
  strategy = mf.optimize_blt(1024, buffers)
  assert strategy.buffers == buffers
  assert np.sum(strategy.omega) < 1
  assert mf.rmse(strategy, 1024) == pytest.approx(reference, rel=5e-3)


def test_max_optimized_blt_matches_sqrt_toeplitz_max_error():
  n = 1024
  strategy = mf.optimize_blt(n, 4, objective="max")
  assert mf.max_error(strategy, n) == pytest.approx(
      mf.max_error(strategies.sqrt_toeplitz(n), n), rel=5e-3)


def test_dense_optimum_reference_figures():
  n = 256
  strategy = mf.optimize_dense(n)
  c = strategy.matrix(n)
  np.testing.assert_allclose(c, np.tril(c))
  np.testing.assert_allclose(np.linalg.norm(c, axis=0), 1.0, rtol=1e-12)
  rmse, max_error = _errors(strategy, n)
  assert rmse == pytest.approx(2.524, rel=5e-3)
  assert max_error == pytest.approx(2.749, rel=5e-3)
  assert rmse < mf.rmse(strategies.sqrt_toeplitz(n), n)


def test_multiple_participations_reference_figures():
  n = 1024
  four = dict(participations=4, min_separation=256)
  sixteen = dict(participations=16, min_separation=64)
  assert mf.rmse(strategies.sqrt_toeplitz(n), n, **four) == pytest.approx(
      7.54, abs=5e-3)
  assert mf.rmse(strategies.sqrt_toeplitz(n), n, **sixteen) == (
      pytest.approx(23.90, abs=5e-3))
  banded = mf.optimize_banded(n, 256, **four)
  assert mf.rmse(banded, n, **four) == pytest.approx(6.44, abs=5e-3)
  banded = mf.optimize_banded(n, 64, **sixteen)
  assert mf.rmse(banded, n, **sixteen) == pytest.approx(16.26, abs=5e-3)
  blt = mf.optimize_blt(n, 3, **four)
  assert mf.rmse(blt, n, **four) == pytest.approx(6.67, rel=5e-3)
  blt = mf.optimize_blt(n, 3, **sixteen)
  assert mf.rmse(blt, n, **sixteen) == pytest.approx(17.22, rel=5e-3)


def test_banded_needs_bands_within_min_separation():
  with pytest.raises(ValueError, match="bands ≤ min_separation"):
    mf.optimize_banded(1024, 128, participations=16, min_separation=64)
  with pytest.raises(ValueError, match="objective"):
    mf.optimize_banded(64, 4, objective="mean")
  # A single participation that fits (k_eff = 1) needs no such condition.
  mf.optimize_banded(64, 32, participations=2, min_separation=64)
