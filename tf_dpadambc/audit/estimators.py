"""ε lower bounds from canary scores, at a stated confidence.

An audit can refute a privacy claim (a lower bound above the claimed ε means
a bug), never prove one. Every function here is pure NumPy/SciPy: it takes
attack scores and returns an :class:`EpsilonLowerBound`.

Convention: a larger score means "more likely IN" (negate a loss first); the
decision rule is "in" iff score > τ. ``confidence`` is 1 − α, where α is the
probability, over the randomness of the mechanism and of the canaries, that
the reported bound exceeds the true ε.

Estimators:

* :func:`epsilon_clopper_pearson`: many trials, (ε, δ) from Clopper–Pearson
  bounds on FPR and FNR (Jagielski et al. 2020; Nasr et al. 2021).
* :func:`epsilon_gdp`: many trials, a μ-GDP lower bound turned into ε at δ
  (Nasr et al. 2023). Tighter, but its ε assumes a Gaussian trade-off curve.
* :func:`epsilon_one_run`: one training run, m canaries each in with
  probability ½ (Steinke, Nasr & Jagielski 2023).
* :func:`epsilon_one_run_fdp`: one training run, analysed through an f-DP
  trade-off family (Mahloujifar, Melis & Chaudhuri 2024).
"""
import dataclasses
import math

import numpy as np
from scipy import optimize
from scipy import special
from scipy import stats

_SPLIT = "split"
_FIXED = "fixed"
_GRID = "bonferroni"


@dataclasses.dataclass(frozen=True)
class EpsilonLowerBound:
  """An audit's ε lower bound and what it was computed from.

  Attributes:
    epsilon: the lower bound (≥ 0); the mechanism is not (ε', δ)-DP for any
      ε' < epsilon, with probability ≥ ``confidence`` (for the Gaussian
      methods, if its trade-off curve is Gaussian; their ``mu`` holds
      regardless).
    delta: the δ the bound is for.
    confidence: 1 − α, after every correction (split, Bonferroni).
    method: which estimator.
    hypotheses: how many thresholds or guess counts α was divided among
      (Bonferroni); 1 for a fixed threshold or a held-out split.
    threshold: τ ("in" iff score > τ), for the many-trials estimators.
    selection: how τ (or the guess counts) was chosen: ``"fixed"``,
      ``"split"`` (on a held-out half) or ``"bonferroni"`` (over a grid).
    false_positives, false_negatives, num_in, num_out: the counts the bound
      was computed from (the evaluation half after a split).
    fpr_upper, fnr_upper: their one-sided Clopper–Pearson upper bounds.
    mu: the μ-GDP lower bound (GDP estimators).
    num_canaries, k_plus, k_minus, guesses, correct: one-run audits (m,
      guesses "in" and "out", r = k₊ + k₋ and v).
  """
  epsilon: float
  delta: float
  confidence: float
  method: str
  hypotheses: int = 1
  threshold: float | None = None
  selection: str | None = None
  false_positives: int | None = None
  false_negatives: int | None = None
  num_in: int | None = None
  num_out: int | None = None
  fpr_upper: float | None = None
  fnr_upper: float | None = None
  mu: float | None = None
  num_canaries: int | None = None
  k_plus: int | None = None
  k_minus: int | None = None
  guesses: int | None = None
  correct: int | None = None

  def __str__(self):
    head = (f"ε ≥ {self.epsilon:.3f} at δ = {self.delta:g} with "
            f"{100 * self.confidence:g}% confidence ({self.method}")
    if self.hypotheses > 1:
      head += f", Bonferroni over {self.hypotheses}"
    head += ")"
    parts = []
    if self.threshold is not None:
      parts.append(f"threshold {self.threshold:.6g} ({self.selection})")
    if self.num_in is not None:
      parts.append(f"FP {self.false_positives}/{self.num_out}, "
                   f"FN {self.false_negatives}/{self.num_in}, "
                   f"FPR⁺ {self.fpr_upper:.4g}, FNR⁺ {self.fnr_upper:.4g}")
    if self.num_canaries is not None:
      parts.append(f"{self.correct} of {self.guesses} guesses correct "
                   f"(k₊ = {self.k_plus}, k₋ = {self.k_minus}) among "
                   f"{self.num_canaries} canaries")
    if self.mu is not None:
      parts.append(f"μ ≥ {self.mu:.4f}")
    return head + "".join(f"; {p}" for p in parts)


# --- Gaussian differential privacy ----------------------------------------


def _log_gdp_delta(mu, epsilon):
  # log δ(ε) of μ-GDP, computed as log(A − B) from log A and log B: the
  # difference of two tiny tails would cancel in the linear domain.
  log_a = stats.norm.logcdf(-epsilon / mu + mu / 2)
  log_b = epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2)
  if log_b >= log_a:
    return -math.inf
  return log_a + math.log1p(-math.exp(log_b - log_a))


def gdp_delta(mu, epsilon):
  """δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) of μ-GDP.

  Dong, Roth & Su 2019 (arXiv 1905.02383), Corollary 2.13; μ-GDP is the
  Gaussian mechanism with sensitivity 1 and noise std 1/μ.
  """
  if mu <= 0:
    return 0.0
  if math.isinf(mu):
    return 1.0
  return math.exp(_log_gdp_delta(mu, epsilon))


def gdp_epsilon(mu, delta):
  """The smallest ε ≥ 0 with :func:`gdp_delta` (μ, ε) ≤ δ (root finding).

  Exact ε of the Gaussian mechanism with noise multiplier σ = 1/μ
  (Balle & Wang 2018's analytic calibration, inverted).
  """
  if not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1); got {delta}.")
  if mu <= 0:
    return 0.0
  if math.isinf(mu):
    return math.inf
  log_delta = math.log(delta)
  def gap(eps):  # > 0 while δ(ε) > δ; decreasing in ε
    return max(_log_gdp_delta(mu, eps), -1e4) - log_delta
  if gap(0.0) <= 0:
    return 0.0
  hi = max(1.0, mu * mu / 2 + 2 * mu)
  while gap(hi) > 0:
    hi *= 2
  return float(optimize.brentq(gap, 0.0, hi, xtol=1e-12, rtol=1e-12))


# --- many trials: thresholds, Clopper–Pearson, GDP ------------------------


def _clopper_pearson_upper(k, n, alpha):
  """One-sided (1 − α) Clopper–Pearson upper bound on p from k of n.

  The p with P[Binomial(n, p) ≤ k] = α: the (1 − α) quantile of
  Beta(k + 1, n − k); 1 when k = n.
  """
  k = np.asarray(k)
  with np.errstate(invalid="ignore"):
    upper = stats.beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1))
  return np.where(k < n, upper, 1.0)


def _errors(in_sorted, out_sorted, thresholds):
  """(false positives, false negatives) of "in iff score > τ", per τ."""
  thresholds = np.asarray(thresholds, dtype=float)
  fn = np.searchsorted(in_sorted, thresholds, side="right")
  fp = out_sorted.size - np.searchsorted(out_sorted, thresholds, side="right")
  return fp, fn


def _cp_epsilon(fpr_upper, fnr_upper, delta):
  """max(log((1 − δ − FNR⁺)/FPR⁺), log((1 − δ − FPR⁺)/FNR⁺)), clipped at 0.

  Both inequalities of (ε, δ)-DP applied to the event "guess in" and to its
  complement (the privacy region of Kairouz, Oh & Viswanath 2015).
  """
  with np.errstate(divide="ignore", invalid="ignore"):
    a = np.log(np.maximum(1 - delta - fnr_upper, 0)) - np.log(fpr_upper)
    b = np.log(np.maximum(1 - delta - fpr_upper, 0)) - np.log(fnr_upper)
  return np.maximum(np.nan_to_num(np.maximum(a, b), nan=0.0, neginf=0.0), 0.0)


def _gdp_mu(fpr_upper, fnr_upper):
  """μ ≥ Φ⁻¹(1 − FPR⁺) − Φ⁻¹(FNR⁺), clipped at 0.

  μ-GDP forces FNR ≥ Φ(Φ⁻¹(1 − FPR) − μ) for every test (Dong et al. 2019),
  so upper bounds on both rates give a lower bound on μ.
  """
  return np.maximum(stats.norm.isf(fpr_upper) - stats.norm.ppf(fnr_upper), 0.0)


def _scores(name, scores):
  scores = np.asarray(scores, dtype=float)
  if scores.ndim != 1 or scores.size == 0:
    raise ValueError(f"{name} must be a non-empty 1-D array; got shape "
                     f"{scores.shape}.")
  if not np.all(np.isfinite(scores)):
    raise ValueError(f"{name} must be finite.")
  return scores


def _check(delta, confidence):
  if not 0 <= delta < 1:
    raise ValueError(f"delta must be in [0, 1); got {delta}.")
  if not 0.5 <= confidence < 1:
    raise ValueError(f"confidence must be in [0.5, 1); got {confidence}.")


def _split(scores, seed):
  # A seeded permutation, not alternate elements: it stays valid when the
  # caller hands in sorted (value-ordered) scores.
  perm = np.random.default_rng(seed).permutation(scores.size)
  half = scores.size // 2
  return scores[perm[:half]], scores[perm[half:]]


def _many_trials(in_scores, out_scores, delta, confidence, threshold,
                 split_seed, value):
  """Chooses τ as asked, then bounds FPR and FNR at τ (α/2 each).

  ``value(fpr_upper, fnr_upper)`` is the (vectorised) quantity maximised
  over thresholds; returns (threshold, selection, hypotheses, fp, fn,
  fpr_upper, fnr_upper, n_in, n_out).
  """
  _check(delta, confidence)
  in_scores = _scores("in_scores", in_scores)
  out_scores = _scores("out_scores", out_scores)
  alpha = 1 - confidence

  def evaluate(in_s, out_s, thresholds, alpha_each):
    in_sorted, out_sorted = np.sort(in_s), np.sort(out_s)
    fp, fn = _errors(in_sorted, out_sorted, thresholds)
    fpr_u = _clopper_pearson_upper(fp, out_s.size, alpha_each)
    fnr_u = _clopper_pearson_upper(fn, in_s.size, alpha_each)
    best = int(np.argmax(value(fpr_u, fnr_u)))
    return (float(np.asarray(thresholds, float).reshape(-1)[best]),
            int(np.reshape(fp, -1)[best]), int(np.reshape(fn, -1)[best]),
            float(np.reshape(fpr_u, -1)[best]),
            float(np.reshape(fnr_u, -1)[best]))

  if threshold is None:
    if in_scores.size < 2 or out_scores.size < 2:
      raise ValueError("A held-out split needs at least 2 in and 2 out "
                       "scores; pass a threshold fixed in advance.")
    in_select, in_bound = _split(in_scores, split_seed)
    out_select, out_bound = _split(out_scores, split_seed + 1)
    candidates = np.union1d(in_select, out_select)
    # Scored at the stricter α/(2 · candidates): a τ whose bound rests on a
    # few lucky counts in the tails (often zero) then loses to one that
    # replicates on the other half. Validity does not depend on this.
    tau = evaluate(in_select, out_select, candidates,
                   alpha / (2 * candidates.size))[0]
    rest = evaluate(in_bound, out_bound, [tau], alpha / 2)
    return (tau, _SPLIT, 1, *rest[1:], in_bound.size, out_bound.size)
  grid = np.asarray(threshold, dtype=float).reshape(-1)
  if grid.size == 0 or not np.all(np.isfinite(grid)):
    raise ValueError("threshold must be None, a finite number, or a "
                     "non-empty grid of finite numbers.")
  fixed = np.ndim(threshold) == 0
  found = evaluate(in_scores, out_scores, grid, alpha / (2 * grid.size))
  return (found[0], _FIXED if fixed else _GRID, grid.size, *found[1:],
          in_scores.size, out_scores.size)


_THRESHOLD_DOC = """
  Choosing τ on the scores it is evaluated on would inflate the bound, so
  ``threshold`` says how τ is chosen:

  * ``None`` (default): a held-out split. Each of ``in_scores`` and
    ``out_scores`` is permuted with ``numpy.random.default_rng`` (seeds
    ``split_seed`` and ``split_seed + 1``); τ maximises the bound on the
    first halves (candidates: their scores; scored at the Bonferroni level
    over them, which favours thresholds that replicate), and the bound is
    computed at that τ on the second halves alone, at the full confidence.
    Any seed is valid; choosing the seed after seeing the results is not.
  * a number: τ fixed before seeing the scores.
  * a grid (1-D array of n values, fixed in advance): the best τ on all the
    scores, each rate bounded at significance α/(2n) (Bonferroni).
"""


def epsilon_clopper_pearson(in_scores, out_scores, delta, confidence=0.95,
                            threshold=None, *, split_seed=0):
  """ε lower bound from many trials, by Clopper–Pearson (Jagielski et al.).

  For the test "in iff score > τ", FP of the ``out_scores`` and FN of the
  ``in_scores`` are binomial; their one-sided Clopper–Pearson upper bounds
  FPR⁺, FNR⁺ at significance α/2 each (α = 1 − confidence) hold together
  with probability ≥ 1 − α, and (ε, δ)-DP would force both
  TPR ≤ e^ε FPR + δ and TNR ≤ e^ε FNR + δ, so

      ε ≥ max(log((1 − δ − FNR⁺)/FPR⁺), log((1 − δ − FPR⁺)/FNR⁺)) ∨ 0.

  Jagielski, Ullman & Oprea 2020 (arXiv 2006.07709); Nasr, Song, Thakurta,
  Papernot & Carlini 2021 (arXiv 2101.04535), Section 3.
  Each score comes from an independent trial (training run).
  """
  tau, sel, n, fp, fn, fpr_u, fnr_u, n_in, n_out = _many_trials(
      in_scores, out_scores, delta, confidence, threshold, split_seed,
      lambda fpr_u, fnr_u: _cp_epsilon(fpr_u, fnr_u, delta))
  return EpsilonLowerBound(
      epsilon=float(_cp_epsilon(fpr_u, fnr_u, delta)), delta=delta,
      confidence=confidence, method="clopper_pearson", hypotheses=n,
      threshold=tau, selection=sel, false_positives=fp, false_negatives=fn,
      num_in=n_in, num_out=n_out, fpr_upper=fpr_u, fnr_upper=fnr_u)


def epsilon_gdp(in_scores, out_scores, delta, confidence=0.95,
                threshold=None, *, split_seed=0):
  """ε lower bound from many trials through Gaussian DP (Nasr et al. 2023).

  With FPR⁺, FNR⁺ as in :func:`epsilon_clopper_pearson`,

      μ ≥ Φ⁻¹(1 − FPR⁺) − Φ⁻¹(FNR⁺)

  holds with probability ≥ confidence for any μ-GDP mechanism, and ε is that
  of μ-GDP at δ, the root of δ = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2).

  The μ bound is sound for any mechanism; the ε is a lower bound only if the
  mechanism's trade-off curve is Gaussian: exactly for the Gaussian mechanism
  and full-batch DP-SGD (a composition of them), approximately for
  Poisson-subsampled DP-SGD over many steps (Dong et al.'s central limit
  theorem). For other shapes (e.g. randomized response) it can exceed the
  true ε: refute a claim with :func:`epsilon_clopper_pearson`.

  Nasr, Hayes, Steinke, Balle, Tramèr, Jagielski, Carlini & Terzis 2023,
  "Tight Auditing of Differentially Private Machine Learning"
  (arXiv 2302.07956); Dong, Roth & Su 2019 (arXiv 1905.02383), Cor. 2.13.
  """
  tau, sel, n, fp, fn, fpr_u, fnr_u, n_in, n_out = _many_trials(
      in_scores, out_scores, delta, confidence, threshold, split_seed,
      _gdp_mu)
  mu = float(_gdp_mu(fpr_u, fnr_u))
  eps = gdp_epsilon(mu, delta) if delta > 0 else (math.inf if mu > 0
                                                   else 0.0)
  return EpsilonLowerBound(
      epsilon=eps, delta=delta, confidence=confidence, method="gdp",
      hypotheses=n, threshold=tau, selection=sel, false_positives=fp,
      false_negatives=fn, num_in=n_in, num_out=n_out, fpr_upper=fpr_u,
      fnr_upper=fnr_u, mu=mu)


epsilon_clopper_pearson.__doc__ += _THRESHOLD_DOC
epsilon_gdp.__doc__ += _THRESHOLD_DOC


# --- one run ---------------------------------------------------------------


def one_run_p_value(num_canaries, guesses, correct, epsilon, delta):
  """P[≥ v correct of r guesses] allowed by (ε, δ)-DP, m canaries.

  Steinke, Nasr & Jagielski 2023, Theorem 5.2 (computed as their
  Appendix D): with q = e^ε/(1 + e^ε), W ~ Binomial(r, q),

      β = P[W ≥ v],
      α = max_{1 ≤ i ≤ v} P[v − i ≤ W < v] / i,
      p = min(1, β + 2 m δ α).

  (i ≤ v is enough: beyond it the numerator stops growing.) With δ = 0, p
  is the binomial tail β.
  """
  m, r, v = int(num_canaries), int(guesses), int(correct)
  if not 0 <= v <= r <= m:
    raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ num_canaries; got "
                     f"{v}, {r}, {m}.")
  if v == 0:
    return 1.0
  q = special.expit(epsilon)
  beta = stats.binom.sf(v - 1, r, q)
  if delta == 0:
    return float(min(beta, 1.0))
  i = np.arange(1, v + 1)
  alpha = np.max(np.cumsum(stats.binom.pmf(v - i, r, q)) / i)
  return float(min(beta + 2 * m * delta * alpha, 1.0))


def _largest_rejected(excess):
  """sup{x ≥ 0: excess(x) < 0}: the largest parameter refuted.

  ``excess`` is continuous and nondecreasing in x (a p-value minus the
  significance, or a margin); found by bracketing and Brent's method.
  """
  if excess(0.0) >= 0:
    return 0.0
  lo, hi = 0.0, 1.0
  while excess(hi) < 0:
    lo, hi = hi, 2 * hi
    if hi > 1e4:  # refutes everything: only with certainty (e.g. m → ∞)
      return math.inf
  return float(optimize.brentq(excess, lo, hi, xtol=1e-9))


def _guesses(scores, is_in, k_plus, k_minus, tiebreak_seed):
  """(r, v): "in" for the k₊ highest scores, "out" for the k₋ lowest."""
  m = scores.size
  if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
    raise ValueError(f"need k_plus, k_minus ≥ 0 and k_plus + k_minus ≤ "
                     f"{m}; got {k_plus}, {k_minus}.")
  # Ties are broken by a seeded random order, never by position: the order
  # of the canaries may follow their membership (e.g. IN ones first), and a
  # guess must depend on the membership only through the scores.
  tiebreak = np.random.default_rng(tiebreak_seed).permutation(m)
  order = np.lexsort((tiebreak, scores))  # ascending score
  correct = (int(np.sum(is_in[order[m - k_plus:]])) if k_plus else 0)
  correct += int(np.sum(~is_in[order[:k_minus]]))
  return k_plus + k_minus, correct


def _default_grid(m):
  """(k₊, k₋) for r = 10, 20, 50, 100, … < m and r = m guesses, each split
  evenly between "in" and "out" or all "in"."""
  totals = [r for r in (c * 10**e for e in range(1, 10) for c in (1, 2, 5))
            if r < m] + [m]
  grid = []
  for r in totals:
    for pair in (((r + 1) // 2, r // 2), (r, 0)):
      if pair not in grid:
        grid.append(pair)
  return grid


def _one_run(scores, is_in, delta, confidence, k_plus, k_minus, grid,
             tiebreak_seed, bound):
  """Evaluates ``bound(m, r, v, α)`` over the guess counts asked for."""
  _check(delta, confidence)
  scores = _scores("scores", scores)
  is_in = np.asarray(is_in)
  if is_in.shape != scores.shape or not np.all((is_in == 0) | (is_in == 1)):
    raise ValueError("is_in must be booleans, one per score.")
  is_in = is_in.astype(bool)
  m = scores.size
  if grid is None:
    if k_plus is None and k_minus is None:
      grid, selection = _default_grid(m), _GRID
    else:
      grid, selection = [(k_plus or 0, k_minus or 0)], _FIXED
  else:
    if k_plus is not None or k_minus is not None:
      raise ValueError("Pass either k_plus/k_minus or grid, not both.")
    grid, selection = [tuple(int(k) for k in pair) for pair in grid], _GRID
    if not grid:
      raise ValueError("grid must list at least one (k_plus, k_minus).")
  significance = (1 - confidence) / len(grid)
  best = None
  for kp, km in grid:
    r, v = _guesses(scores, is_in, int(kp), int(km), tiebreak_seed)
    eps, extra = bound(m, r, v, significance)
    if best is None or eps > best[0]:
      best = (eps, extra, int(kp), int(km), r, v)
  eps, extra, kp, km, r, v = best
  return dict(epsilon=eps, delta=delta, confidence=confidence,
              hypotheses=len(grid), selection=selection, num_canaries=m,
              k_plus=kp, k_minus=km, guesses=r, correct=v, **extra)


_GUESS_DOC = """
  ``k_plus``/``k_minus``: guess counts fixed in advance (one of them None
  means 0). If both are None, a grid of (k₊, k₋) (``grid``, fixed in
  advance, or by default r = 10, 20, 50, 100, … < m and r = m guesses, split
  evenly between "in" and "out" or all "in") is searched and the
  significance divided by its size (Bonferroni). Ties among scores are
  broken by a random order seeded with ``tiebreak_seed``, never by the
  canaries' positions.
"""


def epsilon_one_run(scores, is_in, delta, confidence=0.95, k_plus=None,
                    k_minus=None, *, grid=None, tiebreak_seed=0):
  """ε lower bound from one training run (Steinke, Nasr & Jagielski 2023).

  m canaries, each included independently with probability ½ (``is_in``);
  the auditor guesses "in" for the k₊ highest ``scores`` and "out" for the
  k₋ lowest, and v of its r = k₊ + k₋ guesses are right. Under (ε, δ)-DP,
  P[V ≥ v] ≤ p(ε) of :func:`one_run_p_value` (their Theorem 5.2, δ term
  included), so every ε with p(ε) ≤ α = 1 − confidence is refuted; the
  bound is the largest such ε (p is nondecreasing in ε; root finding).

  "Privacy Auditing with One (1) Training Run", NeurIPS 2023,
  arXiv 2305.08846.
  """
  def bound(m, r, v, significance):
    eps = _largest_rejected(
        lambda e: one_run_p_value(m, r, v, e, delta) - significance)
    return eps, {}
  return EpsilonLowerBound(method="one_run", **_one_run(
      scores, is_in, delta, confidence, k_plus, k_minus, grid, tiebreak_seed,
      bound))


# --- one run, f-DP (Mahloujifar et al. 2024) --------------------------------


def _fdp_excess(inverse_blow_up, m, guesses, correct, significance):
  """r'/m − (r_0 + h_0): negative iff v of r' guesses refute f-DP at level τ.

  Mahloujifar, Melis & Chaudhuri 2024, Algorithm 3 (with abstentions), for
  two outcomes (in/out): with f̄(x) = 1 − f(x) and r' = guesses,

      r_v = τ v/m,  h_v = τ (r' − v)/m,
      for i = v − 1, …, 0:
        h_i = max(h_{i+1}, f̄⁻¹(r_{i+1})),
        r_i = r_{i+1} + i/(r' − i) · (h_i − h_{i+1}),

  and the claim is refuted iff r_0 + h_0 > r'/m.
  """
  if correct == 0:
    return 1.0
  r = significance * correct / m
  h = significance * (guesses - correct) / m
  for i in range(correct - 1, -1, -1):
    h_new = max(h, inverse_blow_up(r))
    if h_new == h:  # then neither moves again
      break
    r = min(r + i / (guesses - i) * (h_new - h), 1.0)
    h = h_new
  return guesses / m - (r + h)


FDP_FAMILIES = ("gaussian", "approx_dp")


def epsilon_one_run_fdp(scores, is_in, delta, confidence=0.95, k_plus=None,
                        k_minus=None, *, family="gaussian", grid=None,
                        tiebreak_seed=0):
  """ε lower bound from one run through f-DP (Mahloujifar et al. 2024).

  Same game and guesses as :func:`epsilon_one_run`; the claim tested is that
  the mechanism is f-DP for a trade-off curve f of a one-parameter family,
  by the recursion of their Algorithm 3 (``_fdp_excess``), and the bound is
  the largest parameter refuted:

  * ``family="gaussian"`` (default; their choice for DP-SGD): f = G_μ,
    f̄⁻¹(y) = Φ(Φ⁻¹(y) − μ); returns the largest refuted μ (``mu``) and ε =
    ε of μ-GDP at δ. As for :func:`epsilon_gdp`, μ is sound for any
    mechanism, ε only for a Gaussian trade-off curve.
  * ``family="approx_dp"``: f of (ε, δ)-DP itself,
    f̄⁻¹(y) = max(0, (y − δ)e^{−ε}, 1 − δ − e^ε (1 − y)); a lower bound on
    ε with no assumption on the mechanism's shape.

  "Auditing f-Differential Privacy in One Run", Mahloujifar, Melis &
  Chaudhuri 2024, arXiv 2410.22235.
  """
  if family not in FDP_FAMILIES:
    raise ValueError(f"family must be one of {FDP_FAMILIES}; got {family!r}.")

  def bound(m, r, v, significance):
    if family == "gaussian":
      mu = _largest_rejected(lambda mu: _fdp_excess(
          lambda y: special.ndtr(special.ndtri(y) - mu), m, r, v,
          significance))
      eps = gdp_epsilon(mu, delta) if delta > 0 else (
          math.inf if mu > 0 else 0.0)
      return eps, {"mu": mu}

    def excess(eps):
      grow = math.exp(eps)
      return _fdp_excess(
          lambda y: max(0.0, (y - delta) / grow, 1 - delta - (1 - y) * grow),
          m, r, v, significance)
    return _largest_rejected(excess), {}

  return EpsilonLowerBound(method=f"one_run_fdp_{family}", **_one_run(
      scores, is_in, delta, confidence, k_plus, k_minus, grid, tiebreak_seed,
      bound))


epsilon_one_run.__doc__ += _GUESS_DOC
epsilon_one_run_fdp.__doc__ += _GUESS_DOC
