"""Strategy matrices C of the matrix-factorization (DP-MF) mechanism.

DP-MF factors the workload A = B·C and privately releases C·G + Z for the
stream of clipped-gradient sums G: the optimizer then sees, at step t,

    g_t + σ·Δ·sens(C)·(C⁻¹ z)_t,        z_t ~ N(0, I) independent,

so noise added early is partly cancelled later (Denisov et al. 2022;
Choquette-Choo et al. 2023; Ganesh et al. 2025, Algorithm 1). C is lower
triangular; C = I is DP-SGD. Every strategy here can be streamed inside the
train step (``tf_dpadambc.core.correlated_noise``):

=====================  ===================================  ===================
strategy               C                                    streaming memory
=====================  ===================================  ===================
:class:`Identity`      I (independent noise, DP-SGD)        none
:class:`Toeplitz`      c_0..c_{b−1} on the first b diagonals  (b−1) × model
                       (banded; sqrt-Toeplitz, BandMF)
:class:`BLT`           c_0 = 1, c_k = Σ_i ω_i θ_i^{k−1}     d buffers × model
                       (McMahan et al. 2024)
:class:`Dense`         any invertible lower-triangular n×n  none (O(t) draws
                                                            per step)
=====================  ===================================  ===================

All arrays are float64 NumPy; nothing here imports TensorFlow.
"""
import dataclasses

import numpy as np
import scipy.linalg
import scipy.signal


def _impulse(n):
  delta = np.zeros(int(n))
  delta[0] = 1.0
  return delta


class Strategy:
  """A lower-triangular strategy C, defined for any number of steps n."""

  def matrix(self, n):
    """C restricted to the first n steps (n×n)."""
    raise NotImplementedError

  def inverse(self, n):
    """C⁻¹ for the first n steps (n×n); row t holds the noise weights of step t."""
    raise NotImplementedError

  def inverse_row_norms_squared(self, n):
    """‖row_t(C⁻¹)‖², t < n: the variance of (C⁻¹z)_t per coordinate."""
    return np.sum(np.square(self.inverse(n)), axis=1)

  @property
  def buffers(self):
    """Model-sized buffers the streaming noise keeps (0: none)."""
    return 0


@dataclasses.dataclass(frozen=True)
class Identity(Strategy):
  """C = I: independent noise in every step (DP-SGD)."""

  def matrix(self, n):
    return np.eye(int(n))

  def inverse(self, n):
    return np.eye(int(n))

  def inverse_row_norms_squared(self, n):
    return np.ones(int(n))


@dataclasses.dataclass(frozen=True, eq=False)
class _Toeplitz(Strategy):
  """A lower-triangular Toeplitz C, given its generating series."""

  def coefficients(self, n):
    """c_0..c_{n−1}, the first column of C."""
    raise NotImplementedError

  def inverse_coefficients(self, n):
    """r_0..r_{n−1}, the first column of C⁻¹ (the series 1/C(x))."""
    raise NotImplementedError

  def matrix(self, n):
    c = self.coefficients(n)
    return scipy.linalg.toeplitz(c, np.zeros_like(c))

  def inverse(self, n):
    r = self.inverse_coefficients(n)
    return scipy.linalg.toeplitz(r, np.zeros_like(r))

  def inverse_row_norms_squared(self, n):
    return np.cumsum(np.square(self.inverse_coefficients(n)))


@dataclasses.dataclass(frozen=True, eq=False)
class Toeplitz(_Toeplitz):
  """Lower-triangular Toeplitz C with b = len(c) bands: C_{t,j} = c_{t−j}.

  With b < n, C is b-banded and (C⁻¹z)_t = (z_t − Σ_{j=1}^{b−1} c_j x_{t−j})/c_0
  streams from the b−1 previous outputs (Choquette-Choo et al. 2023,
  Algorithm 9). Build one with :func:`sqrt_toeplitz` or
  ``tf_dpadambc.mf.optimize_banded``.
  """
  coefficients_: np.ndarray

  def __post_init__(self):
    c = np.asarray(self.coefficients_, dtype=np.float64).ravel()
    if c.size == 0 or not np.all(np.isfinite(c)) or c[0] <= 0:
      raise ValueError("Toeplitz strategy coefficients must be finite with "
                       f"c_0 > 0; got {self.coefficients_!r}.")
    object.__setattr__(self, "coefficients_", c)

  @property
  def bands(self):
    return self.coefficients_.size

  @property
  def buffers(self):
    return self.bands - 1

  def coefficients(self, n):
    c = np.zeros(int(n))
    m = min(int(n), self.bands)
    c[:m] = self.coefficients_[:m]
    return c

  def inverse_coefficients(self, n):
    return scipy.signal.lfilter([1.0], self.coefficients_, _impulse(n))

  def __repr__(self):
    return f"Toeplitz(bands={self.bands}, c[:4]={self.coefficients_[:4]})"


def sqrt_toeplitz_coefficients(n):
  """Coefficients of (1 − x)^(−1/2): c_0 = 1, c_k = c_{k−1}(2k − 1)/(2k)."""
  k = np.arange(1, int(n))
  return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def sqrt_toeplitz(bands):
  """The square-root factorization of prefix sums, C = A^{1/2}, truncated to
  ``bands`` diagonals (Fichtenberger, Henzinger & Upadhyay 2023).

  Untruncated (bands ≥ n) C·C = A exactly and it is near-optimal for a single
  participation; truncation makes it streamable with bands − 1 buffers.
  """
  return Toeplitz(sqrt_toeplitz_coefficients(bands))


@dataclasses.dataclass(frozen=True, eq=False)
class BLT(_Toeplitz):
  """Buffered linear Toeplitz C: c_0 = 1, c_k = Σ_i ω_i θ_i^{k−1} (k ≥ 1).

  C(x) = 1 + Σ_i ω_i x/(1 − θ_i x) (McMahan, Xu & Zhang 2024; Dvijotham et al.
  2024). Solving C x = z online needs d = len(θ) buffers:
  x_t = z_t − Σ_i ω_i s_i, then s_i ← θ_i s_i + x_t.
  The closed-form sensitivities need θ ∈ (0, 1), ω > 0 (checked).
  """
  theta: np.ndarray
  omega: np.ndarray

  def __post_init__(self):
    theta = np.asarray(self.theta, dtype=np.float64).ravel()
    omega = np.asarray(self.omega, dtype=np.float64).ravel()
    if theta.size != omega.size or theta.size == 0:
      raise ValueError("BLT needs as many decays θ as weights ω (≥ 1).")
    if not (np.all(theta > 0) and np.all(theta < 1) and np.all(omega > 0)):
      raise ValueError(f"BLT needs θ in (0, 1) and ω > 0; got θ={theta}, "
                       f"ω={omega}.")
    object.__setattr__(self, "theta", theta)
    object.__setattr__(self, "omega", omega)

  @property
  def buffers(self):
    return self.theta.size

  def rational(self):
    """(numerator, denominator) of C(x), coefficients in increasing powers."""
    factors = [np.array([1.0, -t]) for t in self.theta]
    den = np.array([1.0])
    for f in factors:
      den = np.convolve(den, f)
    num = np.concatenate([den, [0.0]])
    for i, w in enumerate(self.omega):
      rest = np.array([0.0, w])  # ω_i x Π_{j≠i}(1 − θ_j x)
      for j, f in enumerate(factors):
        if j != i:
          rest = np.convolve(rest, f)
      num[:rest.size] += rest
    return num, den

  def coefficients(self, n):
    num, den = self.rational()
    return scipy.signal.lfilter(num, den, _impulse(n))

  def inverse_coefficients(self, n):
    num, den = self.rational()
    return scipy.signal.lfilter(den, num, _impulse(n))

  def __repr__(self):
    return f"BLT(theta={self.theta}, omega={self.omega})"


@dataclasses.dataclass(frozen=True, eq=False)
class Dense(Strategy):
  """Any invertible lower-triangular n×n C (e.g. ``optimize_dense``).

  Optimized for its n steps; beyond them C continues as the identity
  (independent noise), so a longer run stays private and its sensitivity is
  computed on the extended matrix. Streaming regenerates z_j from the step
  seeds (O(t) draws at step t), so it suits small n.
  """
  matrix_: np.ndarray

  def __post_init__(self):
    c = np.asarray(self.matrix_, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
      raise ValueError(f"Dense strategy needs a square matrix; got {c.shape}.")
    if not np.allclose(c, np.tril(c)) or np.any(np.diag(c) <= 0):
      raise ValueError("Dense strategy needs a lower-triangular C with a "
                       "positive diagonal.")
    object.__setattr__(self, "matrix_", np.tril(c))

  @property
  def steps(self):
    return self.matrix_.shape[0]

  def _extend(self, block, n):
    n = int(n)
    if n <= self.steps:
      return block[:n, :n].copy()
    return scipy.linalg.block_diag(block, np.eye(n - self.steps))

  def matrix(self, n):
    return self._extend(self.matrix_, n)

  def inverse(self, n):
    inverse = scipy.linalg.solve_triangular(self.matrix_, np.eye(self.steps),
                                            lower=True)
    return self._extend(inverse, n)

  def __repr__(self):
    return f"Dense(steps={self.steps})"


def to_config(strategy):
  """A JSON-friendly dict that :func:`from_config` turns back into ``strategy``."""
  if isinstance(strategy, Identity):
    return {"type": "Identity"}
  if isinstance(strategy, Toeplitz):
    return {"type": "Toeplitz", "coefficients": strategy.coefficients_.tolist()}
  if isinstance(strategy, BLT):
    return {"type": "BLT", "theta": strategy.theta.tolist(),
            "omega": strategy.omega.tolist()}
  if isinstance(strategy, Dense):
    return {"type": "Dense", "matrix": strategy.matrix_.tolist()}
  raise TypeError(f"Not a known strategy: {strategy!r}.")


def from_config(config):
  kind = config["type"]
  if kind == "Identity":
    return Identity()
  if kind == "Toeplitz":
    return Toeplitz(config["coefficients"])
  if kind == "BLT":
    return BLT(config["theta"], config["omega"])
  if kind == "Dense":
    return Dense(config["matrix"])
  raise ValueError(f"Unknown strategy type {kind!r}.")
