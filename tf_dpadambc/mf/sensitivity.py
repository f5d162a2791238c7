"""Sensitivity of a strategy C under multiple participations.

Participation model ("b-min-sep", Choquette-Choo et al. 2023, "(Amplified)
banded matrix factorization"): an example takes part in at most k steps
(``participations``) of the n steps 0..n−1, any two of them at least s steps
apart (``min_separation``); cyclic participation every s steps is the special
case the notes use. At most k_eff = min(k, ⌈n/s⌉) participations fit. Then

    sens(C) = max over participation vectors u of ‖C u‖₂,

u the 0/1 indicator of an allowed set π (|π| ≤ k, gaps ≥ s). This is NP-hard
in general; :func:`sensitivity` returns it exactly where the structure of C
allows and a valid upper bound otherwise (never an under-estimate: the
privacy guarantee rests on it).

=======================================  ====================================
case                                     sens²
=======================================  ====================================
k_eff = 1                                max column norm² (exact)
Identity                                 k_eff (exact)
Toeplitz/BLT, c ≥ 0 non-increasing       packed pattern 0, s, 2s, … (exact)
bandwidth ≤ s (pattern columns ⟂)        max_π Σ_{i∈π} ‖C e_i‖² (exact, DP)
anything else                            upper bound: sensitivity_upper_bound
=======================================  ====================================

NumPy only; nothing here imports TensorFlow.
"""
import itertools
import math

import numpy as np

from tf_dpadambc.mf import strategies


def _positive_int(name, value):
  if int(value) != value or value < 1:
    raise ValueError(f"{name} must be an integer ≥ 1; got {value!r}.")
  return int(value)


def _check_pattern(n, participations, min_separation):
  return (_positive_int("n (the number of steps)", n),
          _positive_int("participations", participations),
          _positive_int("min_separation", min_separation))


def effective_participations(n, participations, min_separation):
  """k_eff = min(k, ⌈n/s⌉): how many participations fit into n steps."""
  n, k, s = _check_pattern(n, participations, min_separation)
  return min(k, -(-n // s))


def _suffix_levels(weights, participations, min_separation):
  """Yields f_j, j = 1..k: f_j[..., p] = max Σ_{i∈π} w_i over allowed π ⊆
  {p, …, n−1} with |π| ≤ j (∅ allowed), padded with s zeros (p ≥ n).

  Recurrence f_j(p) = max(0, max_{p′≥p} w_{p′} + f_{j−1}(p′ + s)): one
  reversed cumulative maximum per level, vectorized over the leading axes.
  """
  w = np.asarray(weights, dtype=np.float64)
  n, s = w.shape[-1], int(min_separation)
  best = np.zeros(w.shape[:-1] + (n + s,))
  for _ in range(int(participations)):
    g = w + best[..., s:s + n]
    f = np.maximum.accumulate(g[..., ::-1], axis=-1)[..., ::-1]
    best = best.copy()
    best[..., :n] = np.maximum(f, 0.0)
    yield best


def max_weight_pattern(weights, participations, min_separation):
  """max_π Σ_{i∈π} w_i over sets π ⊆ {0..n−1}, |π| ≤ k, gaps ≥ s (∅ → 0).

  A dynamic program over positions, O(k·n), vectorized over the leading axes
  of ``weights`` (the last axis is the position).
  """
  best = None
  for best in _suffix_levels(weights, participations, min_separation):
    pass
  return best[..., 0]


def packed_column_sum(coefficients, k_eff, s):
  """C u for Toeplitz C (first column c) and u = e_0 + e_s + … + e_{(k−1)s}."""
  c = np.asarray(coefficients, dtype=np.float64)
  n = c.size
  y = np.zeros(n)
  for j in range(k_eff):
    y[j * s:] += c[:n - j * s]
  return y


def packed_toeplitz_sensitivity_squared(coefficients, participations,
                                        min_separation):
  """sens² = Σ_{t<n} (Σ_{j<k_eff} c_{t−js})² for a lower-triangular Toeplitz
  C with non-negative, non-increasing first column c (n = len(c)).

  Exact for such C: every entry (CᵀC)_{ij} = Σ_m c_m c_{m+|i−j|} (m < n −
  max(i, j)) is ≥ 0 and shrinks as the gap |i − j| or the later index grows,
  so packing the participations at 0, s, …, (k_eff − 1)s maximizes every term
  of uᵀCᵀCu (Choquette-Choo et al. 2023; McMahan et al. 2024 for BLTs). The
  caller checks the coefficient conditions.
  """
  c = np.asarray(coefficients, dtype=np.float64)
  k_eff = effective_participations(c.size, participations, min_separation)
  y = packed_column_sum(c, k_eff, int(min_separation))
  return float(y @ y)


def blt_coefficients(theta, omega, n):
  """c_0 = 1, c_k = Σ_i ω_i θ_i^{k−1}: a BLT's first column in closed form
  (no recursion, so every term keeps its sign)."""
  theta = np.asarray(theta, dtype=np.float64)
  omega = np.asarray(omega, dtype=np.float64)
  k = np.arange(int(n) - 1)
  tail = np.power.outer(theta, k).T @ omega
  return np.concatenate([[1.0], tail])


def blt_single_participation_sensitivity_squared(theta, omega, n):
  """‖C e_0‖² = 1 + Σ_{i,j} ω_iω_j (1 − (θ_iθ_j)^{n−1})/(1 − θ_iθ_j).

  The first column of a BLT has the largest norm, so this is sens² for one
  participation (Dvijotham et al. 2024; McMahan et al. 2024): the geometric
  sum Σ_{k<n−1} (θ_iθ_j)^k of c_k² = (Σ_i ω_i θ_i^{k−1})².
  """
  theta = np.asarray(theta, dtype=np.float64)
  omega = np.asarray(omega, dtype=np.float64)
  tt = np.outer(theta, theta)
  geometric = -np.expm1((int(n) - 1) * np.log(tt)) / (1.0 - tt)
  return float(1.0 + omega @ geometric @ omega)


def _allowed_patterns(n, participations, min_separation):
  n, k, s = _check_pattern(n, participations, min_separation)
  for size in range(1, min(k, n) + 1):
    for pattern in itertools.combinations(range(n), size):
      if all(b - a >= s for a, b in zip(pattern, pattern[1:])):
        yield pattern


def brute_force_sensitivity(matrix, participations, min_separation):
  """Exact max_π ‖C u_π‖₂ by enumerating every allowed pattern (small n).

  Exponential in n: for tests (n ≤ ~16).
  """
  c = np.asarray(matrix, dtype=np.float64)
  n = c.shape[1]
  patterns = list(_allowed_patterns(n, participations, min_separation))
  u = np.zeros((n, len(patterns)))
  for col, pattern in enumerate(patterns):
    u[list(pattern), col] = 1.0
  return float(np.sqrt(np.max(np.sum(np.square(c @ u), axis=0))))


def _row_pattern_bounds(x, participations, min_separation):
  """T_i = max over allowed π ∋ i of Σ_{j∈π} x_ij (x ≥ 0, n×n).

  π = {i} ∪ (≤ a steps at ≤ i − s) ∪ (≤ b steps at ≥ i + s), a + b = k − 1:
  the suffix DP on row i gives the right part, the DP on the reversed row the
  left part; the two never conflict (they are ≥ 2s apart).
  """
  n, k, s = x.shape[0], int(participations), int(min_separation)
  rows = np.arange(n)
  right = [np.zeros(n)]
  for level in _suffix_levels(x, k - 1, s):
    right.append(level[rows, rows + s])
  left = [np.zeros(n)]
  for level in _suffix_levels(x[:, ::-1], k - 1, s):
    left.append(level[rows, n - 1 - rows + s])
  best = np.max([left[a] + right[k - 1 - a] for a in range(k)], axis=0)
  return np.diag(x) + best


def sensitivity_upper_bound(matrix, participations, min_separation):
  """An UPPER BOUND on sens(C) for any C (exact only in special cases).

  With X = |CᵀC| (entrywise), ‖C u_π‖² = Σ_{i,j∈π} (CᵀC)_ij ≤ Σ_{i∈π} T_i,
  T_i = max over allowed π ∋ i of Σ_{j∈π} X_ij, so
  sens² ≤ max_π Σ_{i∈π} T_i (both maxima by dynamic programs over positions,
  O(k·n²)). The triangle inequality ‖C u_π‖ ≤ Σ_{i∈π} ‖C e_i‖ gives a second
  bound; the smaller one is returned. Neither is tight in general, but both
  are valid for every C.
  """
  c = np.asarray(matrix, dtype=np.float64)
  n = c.shape[1]
  k = effective_participations(n, participations, min_separation)
  if k == 1:
    return float(np.max(np.linalg.norm(c, axis=0)))
  x = np.abs(c.T @ c)
  gram = max_weight_pattern(_row_pattern_bounds(x, k, min_separation), k,
                            min_separation)
  triangle = max_weight_pattern(np.sqrt(np.diag(x)), k, min_separation)
  return float(min(np.sqrt(gram), triangle))


def _bandwidth(matrix):
  """Number of non-zero diagonals on and below the main one."""
  rows, cols = np.nonzero(matrix)
  return int(np.max(rows - cols)) + 1 if rows.size else 0


def _toeplitz_coefficients(strategy, n):
  if isinstance(strategy, strategies.BLT):
    return blt_coefficients(strategy.theta, strategy.omega, n)
  return strategy.coefficients(n)


def _orthogonal_columns_sensitivity(column_norms_squared, k, s):
  """Exact when the columns of every allowed pattern are orthogonal
  (bandwidth ≤ s): ‖C u_π‖² = Σ_{i∈π} ‖C e_i‖²."""
  return float(np.sqrt(max_weight_pattern(column_norms_squared, k, s)))


def _toeplitz_sensitivity(strategy, n, k, s):
  c = _toeplitz_coefficients(strategy, n)
  if k == 1:  # column norms of a Toeplitz C shrink with the column index
    return float(np.linalg.norm(c))
  if np.all(c >= 0) and np.all(np.diff(c) <= 0):
    return float(np.sqrt(packed_toeplitz_sensitivity_squared(c, k, s)))
  if _bandwidth(c[:, None]) <= s:
    column_norms_squared = np.cumsum(np.square(c))[::-1]
    return _orthogonal_columns_sensitivity(column_norms_squared, k, s)
  return sensitivity_upper_bound(strategy.matrix(n), k, s)


def sensitivity(strategy, n, participations=1, min_separation=1):
  """sens(C) = max over allowed participation vectors u of ‖C u‖₂.

  ``strategy``: a :class:`~tf_dpadambc.mf.strategies.Strategy` or an n×n
  matrix C; k = ``participations`` steps per example at most, any two at
  least s = ``min_separation`` apart (k = 1: the max column norm). Exact for
  the identity, single participation, non-negative non-increasing Toeplitz
  strategies (sqrt-Toeplitz, BLT with Σω ≤ 1) and bandwidth ≤ s (BandMF with
  b ≤ s); otherwise the valid upper bound of :func:`sensitivity_upper_bound`.
  """
  n, _, s = _check_pattern(n, participations, min_separation)
  k = effective_participations(n, participations, min_separation)
  if isinstance(strategy, strategies.Identity):
    return math.sqrt(k)
  if isinstance(strategy, strategies._Toeplitz):
    return _toeplitz_sensitivity(strategy, n, k, s)
  c = (strategy.matrix(n) if isinstance(strategy, strategies.Strategy)
       else np.asarray(strategy, dtype=np.float64))
  if c.shape != (n, n):
    raise ValueError(f"C must be {n}×{n}; got {c.shape}.")
  column_norms_squared = np.sum(np.square(c), axis=0)
  lower = not np.any(np.triu(c, 1))
  if k == 1 or (lower and _bandwidth(c) <= s):
    return _orthogonal_columns_sensitivity(column_norms_squared, k, s)
  return sensitivity_upper_bound(c, k, s)
