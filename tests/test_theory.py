"""Tang et al. (AAAI 2024): Eq. 3 against simulation; Proposition 3, Table 3."""
import keras
import numpy as np
import pytest

from tf_dpadambc import theory

# Tang et al.'s SNLI setting (Table 3, Figs. 1–2).
B, C, SIGMA, BETA_2 = 256, 0.1, 0.4, 0.999
STEPS = (10, 100, 1000, 10000)
# Table 3 as printed, block B = 256, C = 0.1, σ = 0.4, β2 = 0.999.
TABLE_3 = {
    0.01: (1.005e-07, 3.180e-08, 1.046e-08, 7.110e-09),
    0.05: (8.388e-08, 2.654e-08, 8.725e-09, 5.933e-09),
    0.10: (7.559e-08, 2.391e-08, 7.863e-09, 5.347e-09),
}


def _three_digits(x):
  return float(f"{x:.3e}")


# Every entry but (α = 0.01, t = 10): see test_table_3_misprint.
@pytest.mark.parametrize("alpha, index", [
    (alpha, index) for alpha in sorted(TABLE_3) for index in range(4)
    if (alpha, index) != (0.01, 0)])
def test_table_3_to_three_significant_digits(alpha, index):
  got = theory.bias_correction_error_bound(B, C, SIGMA, BETA_2, STEPS[index],
                                           alpha)
  assert _three_digits(got) == TABLE_3[alpha][index]
  # Second block of Table 3: C = 1.0, so Φ and the bound are 100x larger.
  got = theory.bias_correction_error_bound(B, 1.0, SIGMA, BETA_2,
                                           STEPS[index], alpha)
  assert _three_digits(got) == pytest.approx(100 * TABLE_3[alpha][index])


def test_table_3_alpha_005_row_vectorized():
  got = theory.bias_correction_error_bound(B, C, SIGMA, BETA_2, STEPS, 0.05)
  assert [_three_digits(x) for x in got] == list(TABLE_3[0.05])


def test_table_3_misprint():
  """At α = 0.01, t = 10 the paper prints the sub-Gaussian formula's value
  although δ lies beyond ν²/b, where Proposition 3 takes the other branch."""
  phi = theory.phi(B, C, SIGMA)
  c = (1 - BETA_2) / (1 - BETA_2**10)
  nu = 4 * phi * np.sqrt((1 - BETA_2**20) / (1 - BETA_2**2))
  b = 4 * phi
  delta_gauss = nu * np.sqrt(2 * np.log(2 / 0.01))
  assert delta_gauss > nu**2 / b  # outside the sub-Gaussian branch
  assert _three_digits(c * delta_gauss) == 1.005e-07  # what Table 3 prints
  got = theory.bias_correction_error_bound(B, C, SIGMA, BETA_2, 10, 0.01)
  assert got == pytest.approx(c * 2 * b * np.log(2 / 0.01), rel=1e-12)
  assert _three_digits(got) == 1.039e-07


def test_bound_is_continuous_and_decreasing_in_alpha():
  phi = theory.phi(B, C, SIGMA)
  t = 10
  nu = 4 * phi * np.sqrt((1 - BETA_2**(2 * t)) / (1 - BETA_2**2))
  switch = 2 * np.exp(-nu**2 / (2 * (4 * phi)**2))  # where the branches meet
  alphas = np.concatenate([np.geomspace(1e-4, 0.99, 400),
                           switch * (1 + np.array([-1e-9, 0, 1e-9]))])
  alphas.sort()
  xi = theory.bias_correction_error_bound(B, C, SIGMA, BETA_2, t, alphas)
  assert np.all(np.diff(xi) <= 0)
  near = theory.bias_correction_error_bound(
      B, C, SIGMA, BETA_2, t, switch * (1 + np.array([-1e-9, 1e-9])))
  assert near[0] == pytest.approx(near[1], rel=1e-8)


@pytest.mark.parametrize("t", [10, 100])
@pytest.mark.parametrize("nu_scale", [2.0, 4.0])
def test_bound_holds_by_monte_carlo(t, nu_scale):
  # Clean gradients 0: v̂^corr − v̂^clean = c_t Σ β2^{t-τ} z_τ² − Φ exactly.
  phi = theory.phi(B, C, SIGMA)
  rng = np.random.default_rng(0)
  z2 = rng.standard_normal((20_000, t))**2 * phi
  weights = BETA_2**np.arange(t - 1, -1, -1) * (1 - BETA_2) / (1 - BETA_2**t)
  deviation = np.abs(z2 @ weights - phi)
  for alpha in (0.05, 0.1):
    xi = theory.bias_correction_error_bound(B, C, SIGMA, BETA_2, t, alpha,
                                            nu_scale=nu_scale)
    assert np.mean(deviation >= xi) <= alpha
  # The proof's constant (k = 2) is the tighter of the two valid bounds.
  assert (theory.bias_correction_error_bound(B, C, SIGMA, BETA_2, t, 0.05,
                                             nu_scale=2.0)
          < theory.bias_correction_error_bound(B, C, SIGMA, BETA_2, t, 0.05))


def test_bound_without_noise_is_zero():
  assert theory.bias_correction_error_bound(B, C, 0.0, BETA_2, 10, 0.05) == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha=0.0), "alpha"), (dict(alpha=1.0), "alpha"),
    (dict(alpha=[0.05, 1.5]), "alpha"), (dict(alpha="0.05"), "alpha"),
    (dict(step=0), "step"), (dict(step=1.5), "step"), (dict(step=True), "step"),
    (dict(step=[1, -2]), "step"), (dict(step=[]), "step"),
    (dict(beta_2=1.0), "beta_2"), (dict(beta_2=-0.1), "beta_2"),
    (dict(batch_size=0), "batch_size"), (dict(l2_norm_clip=-1), "l2_norm_clip"),
    (dict(noise_multiplier=-0.1), "noise_multiplier"),
    (dict(noise_multiplier=float("nan")), "noise_multiplier"),
    (dict(nu_scale=0), "nu_scale"),
])
def test_bound_rejects_invalid_arguments(kwargs, match):
  args = dict(batch_size=B, l2_norm_clip=C, noise_multiplier=SIGMA,
              beta_2=BETA_2, step=10, alpha=0.05)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    theory.bias_correction_error_bound(**args)


def test_phi_reuses_dp_noise_variance():
  assert theory.phi(B, C, SIGMA) == pytest.approx(2.441e-8, rel=1e-3)
  with pytest.raises(ValueError, match="batch_size"):
    theory.phi(0, C, SIGMA)


@pytest.mark.parametrize("lr, b, c, sigma, want", [
    # Tang et al. §3 and Appendix D: the t → ∞ DP-SGDM rates they quote.
    (1e-3, 256, 0.1, 0.4, 0.64),     # "≈ 0.645"
    (1e-2, 256, 0.1, 0.4, 6.4),      # "≈ 6.4"
    (1e-3, 256, 1.0, 1.0, 0.0256),   # "≈ 0.026" / "≈ 0.0256"
    (1e-3, 2048, 1.0, 1.0, 0.2048),  # "≈ 0.2048"
])
def test_eq3_values_quoted_in_the_paper(lr, b, c, sigma, want):
  assert theory.dpsgdm_equivalent_learning_rate(lr, b, c, sigma) == (
      pytest.approx(want, rel=1e-12))


def test_eq3_schedule():
  steps = np.arange(1, 101)
  eta = theory.dpsgdm_equivalent_learning_rate(1e-3, B, C, SIGMA, 0.9,
                                               step=steps)
  assert eta.shape == (100,)
  sqrt_phi = np.sqrt(theory.phi(B, C, SIGMA))
  np.testing.assert_allclose(eta, 1e-3 * 0.1 / ((1 - 0.9**steps) * sqrt_phi),
                             rtol=1e-12)
  assert eta[0] == pytest.approx(1e-3 / sqrt_phi)  # t = 1: m̂_1 = ḡ_1
  assert np.all(np.diff(eta) < 0)
  assert eta[-1] == pytest.approx(
      theory.dpsgdm_equivalent_learning_rate(1e-3, B, C, SIGMA), rel=1e-4)
  assert isinstance(theory.dpsgdm_equivalent_learning_rate(
      1e-3, B, C, SIGMA, step=3), float)
  with_eps = theory.dpsgdm_equivalent_learning_rate(1e-3, B, C, SIGMA,
                                                    epsilon=1e-4)
  assert with_eps == pytest.approx(1e-4 / (sqrt_phi + 1e-4))


def test_eq3_rejects_invalid_arguments():
  with pytest.raises(ValueError, match="Φ = 0"):
    theory.dpsgdm_equivalent_learning_rate(1e-3, B, C, 0.0)
  with pytest.raises(ValueError, match="beta_1"):
    theory.dpsgdm_equivalent_learning_rate(1e-3, B, C, SIGMA, beta_1=1.0)
  with pytest.raises(ValueError, match="step"):
    theory.dpsgdm_equivalent_learning_rate(1e-3, B, C, SIGMA, step=0)
  with pytest.raises(ValueError, match="adam_learning_rate"):
    theory.dpsgdm_equivalent_learning_rate(0.0, B, C, SIGMA)
  with pytest.raises(ValueError, match="epsilon"):
    theory.dpsgdm_equivalent_learning_rate(1e-3, B, C, SIGMA, epsilon=-1.0)


def test_equivalent_momentum():
  mu = theory.dpsgdm_equivalent_momentum(0.9, np.arange(1, 201))
  assert mu[0] == 0
  np.testing.assert_allclose(mu[1:3], [0.9 * 0.1 / 0.19, 0.9 * 0.19 / 0.271])
  assert mu[-1] == pytest.approx(0.9)
  assert theory.dpsgdm_equivalent_momentum(0.9) == 0.9
  # μ_t = β1 η_t / η_{t-1}.
  eta = theory.dpsgdm_equivalent_learning_rate(1e-3, B, C, SIGMA,
                                               step=np.arange(1, 201))
  np.testing.assert_allclose(mu[1:], 0.9 * eta[1:] / eta[:-1])


# --- Eq. 3 against simulation ------------------------------------------------


def _adam(gradients, learning_rate, beta_1=0.9, beta_2=BETA_2):
  """NumPy Adam as DPAdam: θ ← θ − η m̂/(√v̂ + ε), ε = 0."""
  m = np.zeros(gradients.shape[1])
  v = np.zeros_like(m)
  theta = np.zeros_like(m)
  path = []
  for t, g in enumerate(gradients, 1):
    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g * g
    theta = theta - learning_rate * (m / (1 - beta_1**t)) / np.sqrt(
        v / (1 - beta_2**t))
    path.append(theta)
  return np.array(path)


def _sgd_velocity(gradients, learning_rates, momenta):
  """NumPy SGD in Keras's velocity form: u ← μu − ηg, θ ← θ + u."""
  u = np.zeros(gradients.shape[1])
  theta = np.zeros_like(u)
  path = []
  for g, lr, mu in zip(gradients, learning_rates, momenta):
    u = mu * u - lr * g
    theta = theta + u
    path.append(theta)
  return np.array(path)


def _relative_gap(reference, path):
  return np.max(np.abs(reference - path)) / np.max(np.abs(reference))


def _gradients(noise, steps, dim, signal, seed=0):
  """Gradients whose clean second moment (signal²) is ≪ Φ (noise variance)."""
  rng = np.random.default_rng(seed)
  sqrt_phi = np.sqrt(theory.phi(B, C, SIGMA))
  if noise == "rademacher":
    z = rng.choice([-1.0, 1.0], size=(steps, dim))
  else:
    z = rng.standard_normal((steps, dim))
  return signal * sqrt_phi * np.linspace(-1, 1, dim) + sqrt_phi * z


def test_eq3_reproduces_adam_step_by_step():
  # Noise ±√Φ (variance Φ, constant magnitude): v̂_t ≈ Φ from t = 1, so the
  # early steps, where the (1-β1^t) factor matters most, test Eq. 3 alone.
  steps, lr = 300, 1e-3
  g = _gradients("rademacher", steps, 64, signal=0.02)
  t = np.arange(1, steps + 1)
  eta = theory.dpsgdm_equivalent_learning_rate(lr, B, C, SIGMA, step=t)
  mu = theory.dpsgdm_equivalent_momentum(0.9, t)
  adam = _adam(g, lr)
  exact = _relative_gap(adam, _sgd_velocity(g, eta, mu))
  assert exact < 0.015
  # Each wrong mapping is far off (their gaps are 10-35%).
  wrong = {
      "constant rate η_∞": _sgd_velocity(g, np.full(steps, eta[-1]), mu),
      "Eq. 3 rate, constant μ = β1 (keras SGD)": _sgd_velocity(
          g, eta, np.full(steps, 0.9)),
      "Eq. 3 rate x1.1": _sgd_velocity(g, 1.1 * eta, mu),
      "Eq. 3 rate x0.9": _sgd_velocity(g, 0.9 * eta, mu),
  }
  for name, path in wrong.items():
    assert _relative_gap(adam, path) > max(0.05, 5 * exact), name
  # With keras SGD's constant μ, the constant rate η_∞ beats the schedule.
  constant_mu = np.full(steps, 0.9)
  assert (_relative_gap(adam, _sgd_velocity(g, np.full(steps, eta[-1]),
                                            constant_mu))
          < _relative_gap(adam, _sgd_velocity(g, eta, constant_mu)))


def test_eq3_tracks_adam_with_gaussian_noise():
  # DP's Gaussian noise: v̂_t only concentrates around Φ as t grows, so the
  # agreement is looser, but still far better than a mis-scaled schedule.
  steps, lr = 1500, 1e-3
  g = _gradients("gaussian", steps, 64, signal=0.05)
  t = np.arange(1, steps + 1)
  eta = theory.dpsgdm_equivalent_learning_rate(lr, B, C, SIGMA, step=t)
  mu = theory.dpsgdm_equivalent_momentum(0.9, t)
  adam = _adam(g, lr)
  exact = _relative_gap(adam, _sgd_velocity(g, eta, mu))
  assert exact < 0.07
  assert _relative_gap(adam, _sgd_velocity(g, 1.25 * eta, mu)) > 3 * exact


class _Table(keras.optimizers.schedules.LearningRateSchedule):

  def __init__(self, rates):
    self.rates = keras.ops.convert_to_tensor(np.asarray(rates, "float32"))

  def __call__(self, step):
    return keras.ops.take(self.rates, step)  # Keras' iterations = t − 1


def test_keras_sgd_is_the_velocity_form_with_constant_momentum():
  """keras.optimizers.SGD applies the rate inside the velocity: with the
  Eq. 3 schedule and a constant μ it is the "constant μ" path above, not
  DP-Adam's equivalent (hence dpsgdm_equivalent_momentum)."""
  steps = 40
  g = _gradients("gaussian", steps, 4, signal=0.05).astype("float32")
  eta = theory.dpsgdm_equivalent_learning_rate(1e-3, B, C, SIGMA,
                                               step=np.arange(1, steps + 1))
  opt = keras.optimizers.SGD(_Table(eta), momentum=0.9)
  var = keras.Variable(np.zeros(4, "float32"))
  path = []
  for grad in g:
    opt.apply([grad], [var])
    path.append(var.numpy().copy())
  want = _sgd_velocity(g.astype("float64"), eta, np.full(steps, 0.9))
  np.testing.assert_allclose(np.array(path), want, rtol=1e-4, atol=1e-8)
