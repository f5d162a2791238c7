"""Variant optimizers against NumPy: every family × estimator, JME, STP, DP².

Conventions (as in test_optimizers.py): the noise depends only on
(seed, step, parameter index), so DPSGD with η = 1 and the same seed reveals
the noise every variant draws. Trajectories are float32 against float64
references: rtol 1e-4 / atol 1e-6 unless a comment says otherwise.
Statistical checks use ≥ 100k coordinates; each tolerance is several
standard errors (stated where it is used).
"""
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dpadambc as dp
from tests.conftest import drive
from tf_dpadambc.core import clipping
from tf_dpadambc.core import noise

C, SIGMA, B = 0.5, 1.3, 32
PHI = (SIGMA * C / B) ** 2
STREAM = np.random.default_rng(7).normal(0, 0.01, size=(12, 6)).astype("float32")
INIT = np.linspace(-1, 1, 6).astype("float32")

ADAM_HP = dict(beta_1=0.8, beta_2=0.95)
RMS_HP = dict(rho=0.8)
ADAGRAD_HP = dict(initial_accumulator_value=0.05)
FAMILIES = {"adam": ADAM_HP, "rmsprop": RMS_HP, "adagrad": ADAGRAD_HP}
CLASSES = {
    ("adam", "post"): dp.DPAdam, ("rmsprop", "post"): dp.DPRMSProp,
    ("adagrad", "post"): dp.DPAdagrad,
    ("adam", "bc"): dp.DPAdamBC, ("rmsprop", "bc"): dp.DPRMSPropBC,
    ("adagrad", "bc"): dp.DPAdagradBC,
    ("adam", "ime"): dp.DPAdamIME, ("rmsprop", "ime"): dp.DPRMSPropIME,
    ("adagrad", "ime"): dp.DPAdagradIME,
    ("adam", "stp"): dp.DPAdamSTP, ("rmsprop", "stp"): dp.DPRMSPropSTP,
    ("adagrad", "stp"): dp.DPAdagradSTP,
}


def _quiet(cls, *args, **kwargs):
  """Constructs an optimizer whose expected UserWarning is not under test."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    return cls(*args, **kwargs)


def _dpsgd_noise(seed, steps, shape, clip=C, batch=B):
  """z_t: the noise (in mean units, std σ·clip/B) DPSGD adds at each step."""
  traj = drive(dp.DPSGD(clip, SIGMA, learning_rate=1.0, seed=seed),
               np.zeros(shape, "float32"), [np.zeros(shape, "float32")] * steps,
               batch)
  prev = np.stack([np.zeros(shape, "float32")] + traj[:-1])
  return prev - np.stack(traj)


def _noisy_stream(seed, stream=STREAM):
  return stream + _dpsgd_noise(seed, len(stream), stream.shape[1:])


class _Family:
  """NumPy model of one moment family (adaptive.py), in float64."""

  def __init__(self, family, beta_1=None, beta_2=None, rho=None,
               initial_accumulator_value=0.0):
    self.family, self.b1, self.b2, self.rho = family, beta_1, beta_2, rho
    self.a0 = initial_accumulator_value if family == "adagrad" else 0.0
    self.m, self.v, self.bias, self.t = 0.0, self.a0, 0.0, 0

  def v_hat(self):
    """v̂ of the state so far (step 0: 0 for Adam, v₀ otherwise)."""
    if self.family == "adam":
      return 0.0 * self.v if self.t == 0 else self.v / (1 - self.b2 ** self.t)
    return self.v

  def step(self, g, x, variance):
    """Returns (first, v̂_t, Φ_t) after accumulating ḡ = g and x."""
    self.t += 1
    t = self.t
    if self.family == "adam":
      self.m = self.b1 * self.m + (1 - self.b1) * g
      self.v = self.b2 * self.v + (1 - self.b2) * x
      self.bias = self.b2 * self.bias + (1 - self.b2) * variance
      d = 1 - self.b2 ** t
      return self.m / (1 - self.b1 ** t), self.v / d, self.bias / d
    if self.family == "rmsprop":
      self.v = self.rho * self.v + (1 - self.rho) * x
      self.bias = self.rho * self.bias + (1 - self.rho) * variance
      return g, self.v, self.bias
    self.v = self.v + x
    self.bias = self.bias + variance
    return g, self.v, self.bias


def _run_reference(family, hp, firsts, seconds, variances, direction, lr,
                   init=INIT):
  fam = _Family(family, **hp)
  theta, out = init.astype("float64"), []
  for g, x, var in zip(firsts, seconds, variances):
    first, v_hat, phi = fam.step(np.asarray(g, "float64"),
                                 np.asarray(x, "float64"), var)
    theta = theta - lr * direction(first, v_hat, phi)
    out.append(theta)
  return np.stack(out)


def _post(eps):
  return lambda m, v, phi: m / (np.sqrt(v) + eps)


def _bc(gamma):
  return lambda m, v, phi: m / np.sqrt(np.maximum(v - phi, gamma))


def _clamped(eps, floor=0.0):
  return lambda m, v, phi: m / np.maximum(np.sqrt(np.maximum(v, 0)) + eps,
                                          floor)


def _numpy_clip(rows, clip):
  norms = np.linalg.norm(rows.astype("float64"), axis=-1, keepdims=True)
  return rows * np.minimum(1.0, clip / np.maximum(norms, 1e-30))


# ------------------------------------------------ 1. update rules vs NumPy
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_post_processing_matches_numpy(family):
  g = _noisy_stream(31)
  opt = CLASSES[family, "post"](C, SIGMA, learning_rate=0.01, epsilon=1e-6,
                                seed=31, **FAMILIES[family])
  traj = drive(opt, INIT, STREAM, B)
  want = _run_reference(family, FAMILIES[family], g, g ** 2,
                        [PHI] * len(g), _post(1e-6), 0.01)
  np.testing.assert_allclose(np.stack(traj), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bias_correction_matches_numpy_and_phi_formula(family):
  g = _noisy_stream(32)
  # γ' = 1e-6 ≫ the float32 error of v̂ − Φ (~1e-10): no coordinate sits on
  # the floor's edge by rounding alone.
  opt = CLASSES[family, "bc"](C, SIGMA, learning_rate=1e-3, gamma_prime=1e-6,
                              seed=32, **FAMILIES[family])
  traj = drive(opt, INIT, STREAM, B)
  want = _run_reference(family, FAMILIES[family], g, g ** 2,
                        [PHI] * len(g), _bc(1e-6), 1e-3)
  np.testing.assert_allclose(np.stack(traj), want, rtol=1e-4, atol=1e-6)
  t = len(STREAM)
  expected_phi = {"adam": PHI,                      # debiased EMA of Φ
                  "rmsprop": (1 - 0.8 ** t) * PHI,  # undebiased EMA
                  "adagrad": t * PHI}[family]       # Σ Var = tΦ
  # float32 accumulation over 12 steps: relative error ~1e-6.
  np.testing.assert_allclose(float(opt.phi()), expected_phi, rtol=1e-5)
  np.testing.assert_allclose(float(opt.noise_variance), PHI, rtol=1e-5)


def test_adagrad_bias_correction_keeps_the_initial_accumulator():
  # v = a₀ + Σḡ², and only the noise tΦ is removed: with a₀ = 10 ≫ Σḡ²
  # the step is ≈ η ḡ/√a₀; dropping a₀ would give steps ~100x larger.
  g = _noisy_stream(33)
  hp = dict(initial_accumulator_value=10.0)
  opt = dp.DPAdagradBC(C, SIGMA, learning_rate=0.1, seed=33, **hp)
  traj = drive(opt, INIT, STREAM, B)
  want = _run_reference("adagrad", hp, g, g ** 2, [PHI] * len(g),
                        _bc(1e-8), 0.1)
  np.testing.assert_allclose(np.stack(traj), want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(
      opt._velocities[0].numpy(), 10.0 + np.sum(g.astype("float64") ** 2, 0),
      rtol=1e-6)


def _ime_releases(seed, stream=STREAM, batch=B, clip=C):
  """(first, second) of IME at each step, from the core release function."""
  seed_pair = dp.DPSGD(clip, SIGMA, seed=seed)._seed_pair
  firsts, seconds = [], []
  for t, g in enumerate(stream):
    first, second, _ = noise.independent_moment_release(
        [tf.constant(g * batch)], clip, SIGMA, batch,
        noise.independent_sampler(noise.step_seed(seed_pair, t)))
    firsts.append(first[0].numpy())
    seconds.append(second[0].numpy())
  return np.stack(firsts), np.stack(seconds)


@pytest.mark.parametrize("family, floor", [("adam", 0.0), ("adam", 0.02),
                                           ("rmsprop", 0.0),
                                           ("adagrad", 0.0)])
def test_ime_matches_numpy(family, floor):
  seed = 34
  firsts, seconds = _ime_releases(seed)
  # The first release is ḡ_c + √2·z with z DPSGD's draw for this seed.
  z = _dpsgd_noise(seed, len(STREAM), STREAM.shape[1:])
  np.testing.assert_allclose(firsts, STREAM + math.sqrt(2) * z, rtol=1e-5,
                             atol=1e-7)
  assert np.mean(seconds < 0) > 0  # the unbiased x_t does go negative here
  opt = CLASSES[family, "ime"](C, SIGMA, learning_rate=0.01, epsilon=1e-3,
                               denominator_floor=floor, seed=seed,
                               **FAMILIES[family])
  traj = drive(opt, INIT, STREAM, B)
  want = _run_reference(family, FAMILIES[family], firsts, seconds,
                        [2 * PHI] * len(STREAM), _clamped(1e-3, floor), 0.01)
  np.testing.assert_allclose(np.stack(traj), want, rtol=1e-4, atol=1e-6)
  # Φ of IME: the variance 2(σC/B)² of the noise in its first release.
  np.testing.assert_allclose(float(opt.noise_variance), 2 * PHI, rtol=1e-5)


@pytest.mark.parametrize("cls", [dp.DPAdamIME, dp.DPRMSPropIME,
                                 dp.DPAdagradIME])
def test_ime_release_statistics(cls):
  # β = 0 / ρ = 0 / a₀ = 0: after one step the optimizer state holds the
  # releases themselves (Adam: m = first, v = second; others: v = second).
  n, seed = 200_000, 35
  hp = {dp.DPAdamIME: dict(beta_1=0.0, beta_2=0.0),
        dp.DPRMSPropIME: dict(rho=0.0),
        dp.DPAdagradIME: dict(initial_accumulator_value=0.0)}[cls]
  clean = np.full(n, 0.03, "float32")
  opt = cls(C, SIGMA, learning_rate=1e-9, seed=seed, **hp)
  drive(opt, np.zeros(n), [clean], B)
  second = opt._velocities[0].numpy().astype("float64") - clean.astype(
      "float64") ** 2
  want_std = math.sqrt(2) * SIGMA * (2 * B + 1) * C ** 2 / B ** 2
  # Sample std over 200k: relative s.e. 0.16%; tolerance 1%. The mean's
  # s.e. is std/√n; tolerance 5 s.e.
  assert abs(np.std(second) / want_std - 1) < 0.01
  assert abs(np.mean(second)) < 5 * want_std / math.sqrt(n)
  z = _dpsgd_noise(seed, 1, (n,))[0]
  if cls is dp.DPAdamIME:
    first = opt._momentums[0].numpy()
    np.testing.assert_allclose(first, clean + math.sqrt(2) * z, rtol=1e-5,
                               atol=1e-8)
    # z1 and z2 are independent draws: |ρ| < 0.01 (4.5 standard errors).
    assert abs(np.corrcoef(first - clean, second)[0, 1]) < 0.01
  assert abs(np.std(z) / (SIGMA * C / B) - 1) < 0.01


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scale_then_privatize_matches_algorithm_8(family):
  """Algorithm 8 in NumPy, fed clipped sums built with the optimizer's spec."""
  rng = np.random.default_rng(36)
  steps, units, dim, clip, seed = 10, 8, 6, 1.0, 36
  grads = rng.normal(0, 0.05, size=(steps, units, dim)).astype("float32")
  grads[:, 0] *= 20  # one large unit per step
  z = _dpsgd_noise(seed, steps, (dim,), clip=clip, batch=units)
  hp = FAMILIES[family]
  opt = CLASSES[family, "stp"](clip, SIGMA, learning_rate=0.01,
                               scale_epsilon=0.05, epsilon=1e-6, seed=seed,
                               **hp)
  var = keras.Variable(INIT)
  fam = _Family(family, **hp)
  theta = INIT.astype("float64")
  for t in range(steps):
    spec = opt.clip_spec([var])
    s = 1.0 / (np.sqrt(np.maximum(fam.v_hat(), 0)) + 0.05) * np.ones(dim)
    # s_t comes from v̂_{t−1}; float32 state: rtol 1e-4.
    np.testing.assert_allclose(spec.scale[0].numpy(), s, rtol=1e-4)
    opt.apply_private(clipping.materialized_clipped_sum(
        [tf.constant(grads[t])], spec), units, units, [var])
    clipped = _numpy_clip(s * grads[t].astype("float64"), clip).sum(0)
    g_tilde = (clipped / units + z[t]) / s
    first, v_hat, _ = fam.step(g_tilde, g_tilde ** 2, 0.0)
    theta = theta - 0.01 * first / (np.sqrt(v_hat) + 1e-6)
    np.testing.assert_allclose(var.numpy(), theta, rtol=1e-4, atol=1e-6)
  # Φ is the noise variance in the scaled geometry: (σC/B)².
  np.testing.assert_allclose(float(opt.noise_variance),
                             (SIGMA * clip / units) ** 2, rtol=1e-5)


def test_stp_first_step_is_dpsgd_clipped_at_c_times_scale_epsilon():
  # v̂₀ = 0 for Adam: s₁ = 1/ε_s1 for every coordinate.
  opt = dp.DPAdamSTP(1.0, SIGMA, scale_epsilon=0.25)
  var = keras.Variable(INIT)
  np.testing.assert_allclose(opt.clip_spec([var]).scale[0].numpy(), 4.0)
  ada = dp.DPAdagradSTP(1.0, SIGMA, scale_epsilon=0.25,
                        initial_accumulator_value=0.09)
  np.testing.assert_allclose(ada.clip_spec([var]).scale[0].numpy(),
                             1 / (0.3 + 0.25), rtol=1e-6)


def test_noiseless_preconditioner_uses_the_clean_mean_for_v():
  g = _noisy_stream(37)
  with pytest.warns(UserWarning, match="NOT differentially private"):
    opt = dp.NoiselessPreconditionerAdam(C, SIGMA, learning_rate=0.01,
                                         epsilon=1e-6, seed=37, **ADAM_HP)
  traj = drive(opt, INIT, STREAM, B)
  want = _run_reference("adam", ADAM_HP, g, STREAM ** 2, [PHI] * len(g),
                        _post(1e-6), 0.01)
  np.testing.assert_allclose(np.stack(traj), want, rtol=1e-4, atol=1e-6)
  # ...and v is not the noisy one (the noise variance 4e-4 ≫ ḡ_c² ≈ 1e-4).
  v_hat = opt._velocities[0].numpy() / (1 - 0.95 ** len(STREAM))
  assert np.mean(v_hat) < 0.5 * PHI


@pytest.mark.parametrize("adjacency", ["add_remove", "replace_one"])
def test_jme_matches_numpy(adjacency):
  rng = np.random.default_rng(38)
  steps, units, dim, clip, seed = 8, 8, 6, 0.5, 38
  lam = 1 / (2 * clip ** 2)
  grads = rng.normal(0, 0.2, size=(steps, units, dim)).astype("float32")
  opt = dp.DPAdamJME(clip, SIGMA, learning_rate=0.01, epsilon=1e-3,
                     adjacency=adjacency, seed=seed, **ADAM_HP)
  delta = (math.sqrt(clip ** 2 + lam * clip ** 4) if adjacency == "add_remove"
           else clip)
  z = _dpsgd_noise(seed, steps, (dim,), clip=clip, batch=units)
  var = keras.Variable(INIT)
  firsts, seconds = [], []
  for t in range(steps):
    spec = opt.clip_spec([var])
    assert spec.square_sum
    result = clipping.materialized_clipped_sum([tf.constant(grads[t])], spec)
    clipped = _numpy_clip(grads[t], clip)
    np.testing.assert_allclose(result.square_grads[0].numpy(),
                               np.sum(clipped ** 2, 0), rtol=1e-5)
    # The release the optimizer makes, from the core function; its first
    # half must be DPSGD's draw scaled from σC to σΔ.
    # (The sums are float64 until the noise; the optimizer draws the noise
    # in the variables' dtype: float32 templates draw the same here.)
    as32 = lambda ts: [tf.cast(x, tf.float32) for x in ts]
    first, second, _ = noise.joint_moment_release(
        as32(result.grads), as32(result.square_grads), SIGMA * delta, lam,
        units, noise.independent_sampler(noise.step_seed(opt._seed_pair, t)))
    np.testing.assert_allclose(first[0].numpy(),
                               clipped.sum(0) / units + delta / clip * z[t],
                               rtol=1e-5, atol=1e-7)
    firsts.append(first[0].numpy())
    seconds.append(second[0].numpy())
    opt.apply_private(result, units, units, [var])
  want = _run_reference("adam", ADAM_HP, firsts, seconds, [0.0] * steps,
                        _clamped(1e-3), 0.01)
  np.testing.assert_allclose(var.numpy(), want[-1], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(opt.noise_variance),
                             (SIGMA * delta / units) ** 2, rtol=1e-5)


def test_jme_needs_the_square_sum():
  opt = dp.DPAdamJME(C, SIGMA)
  var = keras.Variable(INIT)
  with pytest.raises(ValueError, match="squared clipped"):
    opt.apply_private(
        clipping.assume_clipped([np.zeros(6, "float32")]), B, B, [var])


# ------------------------------------------------------------- 2. limits
@pytest.mark.parametrize("ime, post", [(dp.DPAdamIME, dp.DPAdam),
                                       (dp.DPRMSPropIME, dp.DPRMSProp),
                                       (dp.DPAdagradIME, dp.DPAdagrad)])
def test_ime_without_noise_is_the_plain_optimizer(ime, post):
  hp = {dp.DPAdam: ADAM_HP, dp.DPRMSProp: RMS_HP,
        dp.DPAdagrad: ADAGRAD_HP}[post]
  with pytest.warns(UserWarning, match="NOT differentially private"):
    a = ime(C, 0.0, learning_rate=0.01, epsilon=1e-5, **hp)
  with pytest.warns(UserWarning, match="NOT differentially private"):
    b = post(C, 0.0, learning_rate=0.01, epsilon=1e-5, **hp)
  assert not a.is_private
  np.testing.assert_allclose(np.stack(drive(a, INIT, STREAM, B)),
                             np.stack(drive(b, INIT, STREAM, B)), rtol=1e-6)


def test_jme_without_noise_on_single_units_is_adam():
  # One unit per batch: mean of squares = square of the mean.
  with pytest.warns(UserWarning):
    jme = dp.DPAdamJME(C, 0.0, learning_rate=0.01, epsilon=1e-5)
  with pytest.warns(UserWarning):
    adam = dp.DPAdam(C, 0.0, learning_rate=0.01, epsilon=1e-5)
  a, b = keras.Variable(INIT), keras.Variable(INIT)
  for g in STREAM:
    jme.apply_private(
        clipping.assume_clipped([g]), 1, 1, [a], clipped_square_sum=[g * g])
    adam.apply_private(clipping.assume_clipped([g]), 1, 1, [b])
  np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


@pytest.mark.parametrize("bc, post", [(dp.DPRMSPropBC, dp.DPRMSProp),
                                      (dp.DPAdagradBC, dp.DPAdagrad),
                                      (dp.DPAdamBC, dp.DPAdam)])
def test_bias_correction_without_noise_is_the_optimizer_without_epsilon(
    bc, post):
  hp = {dp.DPAdam: ADAM_HP, dp.DPRMSProp: RMS_HP,
        dp.DPAdagrad: dict(initial_accumulator_value=0.0)}[post]
  with pytest.warns(UserWarning):
    a = bc(C, 0.0, learning_rate=1e-2, gamma_prime=1e-30, **hp)
  with pytest.warns(UserWarning):
    b = post(C, 0.0, learning_rate=1e-2, epsilon=0.0, **hp)
  np.testing.assert_allclose(np.stack(drive(a, INIT, STREAM, B)),
                             np.stack(drive(b, INIT, STREAM, B)), rtol=1e-6)
  assert float(a.phi()) == 0.0


@pytest.mark.parametrize("s", [0.25, 3.0])
def test_clipping_a_scaled_gradient_is_clipping_at_a_rescaled_norm(s):
  rng = np.random.default_rng(39)
  grads = [tf.constant(rng.normal(size=(16, 3, 4)).astype("float32")
                       * np.geomspace(0.01, 10, 16)[:, None, None]
                       .astype("float32")),
           tf.constant(rng.normal(size=(16, 5)).astype("float32")
                       * np.geomspace(0.01, 10, 16)[:, None]
                       .astype("float32"))]
  scale = [tf.fill((3, 4), s), tf.fill((5,), s)]
  scaled = clipping.materialized_clipped_sum(
      grads, clipping.ClipSpec(1.5, scale=scale))
  plain = clipping.materialized_clipped_sum(grads, 1.5 / s)
  for a, b in zip(scaled.grads, plain.grads):
    np.testing.assert_allclose(a.numpy() / s, b.numpy(), rtol=1e-5,
                               atol=1e-6)
  assert int(scaled.num_clipped) == int(plain.num_clipped)
  assert 0 < int(plain.num_clipped) < 16


@pytest.mark.parametrize("stp, post", [(dp.DPAdamSTP, dp.DPAdam),
                                       (dp.DPRMSPropSTP, dp.DPRMSProp),
                                       (dp.DPAdagradSTP, dp.DPAdagrad)])
def test_stp_with_a_constant_scale_is_the_plain_optimizer_at_c_over_s(
    stp, post):
  # g̃ = (Σ clip_C(s g_u) + N(0, σ²C²)) / (B s)
  #   = (Σ clip_{C/s}(g_u) + N(0, σ²(C/s)²)) / B, with the same draws.
  s, clip, units, seed = 4.0, 1.0, 8, 40
  hp = {dp.DPAdam: ADAM_HP, dp.DPRMSProp: RMS_HP,
        dp.DPAdagrad: ADAGRAD_HP}[post]
  a = stp(clip, SIGMA, learning_rate=0.01, epsilon=1e-4, seed=seed, **hp)
  object.__setattr__(a, "preconditioner",
                     lambda *unused: [tf.fill((6,), s)])
  b = post(clip / s, SIGMA, learning_rate=0.01, epsilon=1e-4, seed=seed, **hp)
  va, vb = keras.Variable(INIT), keras.Variable(INIT)
  rng = np.random.default_rng(40)
  for _ in range(6):
    g = [tf.constant(rng.normal(0, 0.3, size=(units, 6)).astype("float32"))]
    a.apply_private(clipping.materialized_clipped_sum(g, a.clip_spec([va])),
                    units, units, [va])
    b.apply_private(clipping.materialized_clipped_sum(g, b.clip_spec([vb])),
                    units, units, [vb])
  np.testing.assert_allclose(va.numpy(), vb.numpy(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ 3. JME
@pytest.mark.parametrize("adjacency", ["add_remove", "replace_one"])
def test_jme_noise_on_both_halves(adjacency):
  n, clip, seed = 200_000, 0.5, 41
  lam = 1 / (2 * clip ** 2)
  opt = dp.DPAdamJME(clip, SIGMA, learning_rate=1e-9, beta_1=0.0, beta_2=0.0,
                     adjacency=adjacency, seed=seed)
  var = keras.Variable(np.zeros(n, "float32"))
  zeros = np.zeros(n, "float32")
  opt.apply_private(
      clipping.assume_clipped([zeros]), B, B, [var], clipped_square_sum=[zeros])
  first = opt._momentums[0].numpy().astype("float64")   # β1 = 0: m = first
  second = opt._velocities[0].numpy().astype("float64")  # β2 = 0: v = second
  std = SIGMA * (math.sqrt(clip ** 2 + lam * clip ** 4)
                 if adjacency == "add_remove" else clip)
  # Sample std of 200k draws: relative s.e. 0.16%, tolerance 1%.
  assert abs(np.std(first) / (std / B) - 1) < 0.01
  assert abs(np.std(second) / (std / (math.sqrt(lam) * B)) - 1) < 0.01
  assert abs(np.corrcoef(first, second)[0, 1]) < 0.01
  # The first half is DPSGD's draw at σC scaled to σΔ.
  z = _dpsgd_noise(seed, 1, (n,), clip=clip)[0]
  np.testing.assert_allclose(first, z * std / (SIGMA * clip), rtol=1e-5,
                             atol=1e-9)
  diag = opt.diagnostics()
  # v̂ is pure zero-mean noise: half the coordinates are negative
  # (s.e. 0.0011 over 200k; tolerance 0.01).
  assert abs(float(diag["dp_negative_v_fraction"]) - 0.5) < 0.01
  assert float(diag["dp_negative_v_fraction"]) == pytest.approx(
      np.mean(second < 0), abs=1e-6)


def test_jme_effective_noise_multiplier_and_dp_event():
  clip, lam = 0.5, 1.0  # λC² = 0.25 ≤ 1/2
  ar = dp.DPAdamJME(clip, 1.2, square_weight=lam)
  ro = dp.DPAdamJME(clip, 1.2, square_weight=lam, adjacency="replace_one")
  assert ar.add_remove_sensitivity == pytest.approx(
      math.sqrt(clip ** 2 + lam * clip ** 4))
  assert ar.effective_noise_multiplier == pytest.approx(1.2)
  want = 1.2 * clip / math.sqrt(clip ** 2 + lam * clip ** 4)
  assert ro.effective_noise_multiplier == pytest.approx(want)
  assert ro.effective_noise_multiplier < 1.2
  # The reported DpEvent uses the discounted σ.
  var = keras.Variable(np.zeros(3, "float32"))
  zeros = [np.zeros(3, "float32")]
  ro.apply_private(
      clipping.assume_clipped(zeros), 64, 64, [var], clipped_square_sum=zeros)
  event = ro.dp_event(6400, sampling="poisson")
  assert event.event.event.noise_multiplier == pytest.approx(want)
  # Default λ = 1/(2C²): σ·C/sqrt(C² + C²/2) = σ·sqrt(2/3).
  default = dp.DPAdamJME(clip, 1.2, adjacency="replace_one")
  assert default.effective_noise_multiplier == pytest.approx(
      1.2 * math.sqrt(2 / 3))


def test_jme_replace_one_statement_names_the_joint_release():
  opt = dp.DPAdamJME(0.5, 1.2, adjacency="replace_one")
  var = keras.Variable(np.zeros(3, "float32"))
  zeros = [np.zeros(3, "float32")]
  opt.apply_private(
      clipping.assume_clipped(zeros), 64, 64, [var], clipped_square_sum=zeros)
  text = dp.optimizer_privacy_statement(opt, 6400, 1e-5)
  assert "accounted as σ = 0.979796" in text  # σ·sqrt(2/3): right number
  # ...but the reason given must be JME's add/remove sensitivity
  # sqrt(C² + λC⁴), not microbatches or accumulation (neither is used).
  assert "microbatches" not in text
  assert "joint" in text.lower() or "JME" in text


def test_jme_replace_one_refuses_too_large_a_square_weight():
  clip = 0.5
  free = 1 / (2 * clip ** 2)
  dp.DPAdamJME(clip, 1.0, adjacency="replace_one", square_weight=free)
  with pytest.raises(ValueError, match="1/\\(2C²\\)"):
    dp.DPAdamJME(clip, 1.0, adjacency="replace_one", square_weight=free * 1.01)
  dp.DPAdamJME(clip, 1.0, adjacency="add_remove", square_weight=free * 10)
  with pytest.raises(ValueError, match="adjacency"):
    dp.DPAdamJME(clip, 1.0, adjacency="swap")
  with pytest.raises(ValueError, match="per-layer"):
    dp.DPAdamJME([0.5, 0.5], 1.0)


def _joint_change(a, b, lam):
  """‖(a − b, √λ (a² − b²))‖ for clipped unit gradients a, b (rows)."""
  return np.sqrt(np.sum((a - b) ** 2, -1)
                 + lam * np.sum((a * a - b * b) ** 2, -1))


def _library_clip(rows, clip):
  clipped, _, _, _ = clipping.clip_per_unit(
      [tf.constant(rows.astype("float32"))], clip)
  return clipped[0].numpy().astype("float64")


@pytest.mark.parametrize("dim", [2, 5])
def test_jme_sensitivity_claims(dim):
  rng = np.random.default_rng(42)
  clip = 0.7
  free = 1 / (2 * clip ** 2)
  # Random pairs (norms spread around C so many are clipped onto the sphere).
  n = 50_000
  raw = rng.normal(size=(2, n, dim)) * rng.uniform(0.2, 3, size=(2, n, 1))
  a, b = _library_clip(raw[0], clip), _library_clip(raw[1], clip)
  # Adversarial pairs: a = C(−u, w, 0…), b = C(w, −u, 0…), u² + w² = 1.
  angle = np.linspace(0, math.pi / 2, 2001)
  adv_a = np.zeros((angle.size, dim))
  adv_b = np.zeros((angle.size, dim))
  adv_a[:, 0], adv_a[:, 1] = -np.cos(angle), np.sin(angle)
  adv_b[:, 0], adv_b[:, 1] = np.sin(angle), -np.cos(angle)
  adv_a, adv_b = _library_clip(adv_a * clip, clip), _library_clip(
      adv_b * clip, clip)
  tol = 1e-5 * clip  # float32 clipping
  for lam in (free, 0.5 * free):
    assert np.max(_joint_change(a, b, lam)) <= 2 * clip + tol
    assert np.max(_joint_change(adv_a, adv_b, lam)) <= 2 * clip + tol
  # Just above 1/(2C²) the adversarial pair exceeds DP-SGD's 2C: with
  # p = (u+w)² the change² is 2C²p(1 + λC²(2−p)), maximal at
  # p = (1+2λC²)/(2λC²) < 2.
  for lam in (1.1 * free, 1.5 * free):
    worst = np.max(_joint_change(adv_a, adv_b, lam))
    x = lam * clip ** 2
    p = (1 + 2 * x) / (2 * x)
    assert worst > 2 * clip * (1 + 1e-4)
    assert worst == pytest.approx(
        math.sqrt(2 * clip ** 2 * p * (1 + x * (2 - p))), rel=1e-4)
  # Add/remove: ‖(g, √λ g²)‖ ≤ sqrt(C² + λC⁴), attained at g = C·e1.
  for lam in (free, 3 * free):
    bound = math.sqrt(clip ** 2 + lam * clip ** 4)
    zero = np.zeros_like(a)
    assert np.max(_joint_change(a, zero, lam)) <= bound + tol
    e1 = np.zeros((1, dim))
    e1[0, 0] = 5.0  # clipped to C·e1
    np.testing.assert_allclose(
        _joint_change(_library_clip(e1, clip), np.zeros((1, dim)), lam),
        bound, rtol=1e-6)
    # ...which is what the optimizer's noise pays for.
    assert dp.DPAdamJME(clip, 1.0, square_weight=lam).add_remove_sensitivity \
        == pytest.approx(bound)


# ----------------------------------------- 4. the non-private baseline
def test_noiseless_preconditioner_is_never_reported_private():
  with pytest.warns(UserWarning, match="NOT differentially private"):
    opt = dp.NoiselessPreconditionerAdam(1.0, 1.0)
  assert not opt.is_private
  drive(opt, INIT, STREAM[:2], B)
  with pytest.raises(ValueError, match="not differentially private"):
    opt.dp_event(1000)
  with pytest.raises(ValueError, match="not differentially private"):
    opt.dp_event(1000, batch_size=32, sampling="shuffle")
  with pytest.raises(ValueError, match="not differentially private"):
    dp.optimizer_privacy_statement(opt, 1000, 1e-5)
  with pytest.raises(ValueError, match="not differentially private"):
    dp.optimizer_privacy_statement(opt, 1000, 1e-5, batch_size=32)


# -------------------------------------------------------- 6. clipping
def test_per_layer_noise_std_and_phi():
  # Two variables clipped at (0.3, 0.4): sensitivity 0.5, on both.
  n, clips, seed = 100_000, [0.3, 0.4], 43
  opt = dp.DPSGD(clips, SIGMA, learning_rate=1.0, seed=seed)
  assert opt.sensitivity == pytest.approx(0.5)
  a, b = keras.Variable(np.zeros(n, "float32")), keras.Variable(
      np.zeros(n, "float32"))
  zeros = np.zeros(n, "float32")
  opt.apply_private(clipping.assume_clipped([zeros, zeros]), B, B, [a, b])
  std = SIGMA * 0.5 / B
  # 100k draws per tensor: relative s.e. 0.22%; tolerance 1.5%.
  for v in (a, b):
    assert abs(np.std(v.numpy()) / std - 1) < 0.015
  np.testing.assert_allclose(float(opt.noise_variance), std ** 2, rtol=1e-5)
  bc = dp.DPAdamBC(clips, SIGMA, seed=seed)
  bc.apply_private(
      clipping.assume_clipped([zeros, zeros]), B, B, [keras.Variable(zeros),
                                          keras.Variable(zeros)])
  # Φ₁ = ((1−β2)Φ)/(1−β2) in float32: relative error ~1e-5.
  np.testing.assert_allclose(float(bc.phi()), std ** 2, rtol=1e-4)
  ime = dp.DPAdamIME(clips, SIGMA, seed=seed)
  ime.apply_private(
      clipping.assume_clipped([zeros, zeros]), B, B, [keras.Variable(zeros),
                                           keras.Variable(zeros)])
  np.testing.assert_allclose(float(ime.noise_variance), 2 * std ** 2,
                             rtol=1e-5)


def test_per_layer_clipping_bounds_each_layer():
  rng = np.random.default_rng(44)
  units, clips = 16, [0.3, 2.0]
  a = rng.normal(size=(units, 3, 4)).astype("float32") * 5
  b = rng.normal(size=(units, 5)).astype("float32") * 0.01
  spec = dp.DPSGD(clips, 1.0).clip_spec([keras.Variable(np.zeros((3, 4))),
                                         keras.Variable(np.zeros(5))])
  assert spec.layer_clips == clips
  result = clipping.materialized_clipped_sum(
      [tf.constant(a), tf.constant(b)], spec)
  want_a = _numpy_clip(a.reshape(units, -1), 0.3).sum(0).reshape(3, 4)
  np.testing.assert_allclose(result.grads[0].numpy(), want_a, rtol=1e-5,
                             atol=1e-6)
  # Layer 2's small gradients are untouched (global clipping would have
  # scaled them down with layer 1).
  np.testing.assert_allclose(result.grads[1].numpy(), b.sum(0), rtol=1e-5)
  assert int(result.num_clipped) == units
  # Aligned large units: each layer's sum reaches exactly B·C_k.
  same = [np.broadcast_to(a[:1] * 100, a.shape),
          np.broadcast_to(b[:1] * 1e4, b.shape)]
  result = clipping.materialized_clipped_sum(
      [tf.constant(t) for t in same], spec)
  for got, c in zip(result.grads, clips):
    assert np.linalg.norm(got.numpy()) == pytest.approx(units * c, rel=1e-5)
  # Random units: ≤ B·C_k.
  result = clipping.materialized_clipped_sum(
      [tf.constant(a * 100), tf.constant(b * 1e4)], spec)
  for got, c in zip(result.grads, clips):
    assert np.linalg.norm(got.numpy()) <= units * c * (1 + 1e-6)


def test_per_layer_clip_count_mismatch_raises():
  two = [keras.Variable(np.zeros(3)), keras.Variable(np.zeros(2))]
  with pytest.raises(ValueError, match="3 per-layer clip norms for 2"):
    dp.DPAdamBC([0.1, 0.2, 0.3], 1.0).build(two)
  with pytest.raises(ValueError, match="3 per-layer clip norms for 2"):
    dp.DPAdamSTP([0.1, 0.2, 0.3], 1.0).clip_spec(two)
  with pytest.raises(ValueError, match="3 per-layer clip norms for 2"):
    dp.DPSGD([0.1, 0.2, 0.3], 1.0).apply_private(clipping.assume_clipped(
        [np.zeros(3, "float32"), np.zeros(2, "float32")]), 4, 4, two)
  with pytest.raises(ValueError, match="1 per-layer clip norms for 2"):
    clipping.materialized_clipped_sum(
        [tf.zeros((4, 3)), tf.zeros((4, 2))],
        clipping.ClipSpec(None, layer_clips=[1.0]))
  with pytest.raises(ValueError, match="empty list"):
    dp.DPSGD([], 1.0)
  with pytest.raises(ValueError, match=r"l2_norm_clip\[1\]"):
    dp.DPSGD([0.1, -1.0], 1.0)


def test_automatic_clipping_factor_at_the_core_level():
  rng = np.random.default_rng(45)
  gamma, clip = 0.01, 1.5
  grads = [rng.normal(size=(8, 3, 4)).astype("float32")
           * np.geomspace(1e-3, 1e3, 8)[:, None, None].astype("float32"),
           rng.normal(size=(8, 5)).astype("float32")]
  norms = np.sqrt(sum(np.sum(g.reshape(8, -1).astype("float64") ** 2, 1)
                      for g in grads))
  factor = clip / (norms + gamma)
  result = clipping.materialized_clipped_sum(
      [tf.constant(g) for g in grads],
      clipping.ClipSpec(clip, automatic_gamma=gamma))
  for got, g in zip(result.grads, grads):
    np.testing.assert_allclose(got.numpy(), np.tensordot(factor, g, 1),
                               rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(
      clipping.clip_factors(tf.constant(norms.astype("float32")), clip,
                            gamma).numpy(), factor, rtol=1e-5)
  spec = dp.DPSGD(clip, 1.0, clipping="automatic", automatic_gamma=gamma
                  ).clip_spec([keras.Variable(np.zeros(3))])
  assert spec.automatic_gamma == gamma
  assert dp.DPSGD(clip, 1.0).clip_spec(
      [keras.Variable(np.zeros(3))]).automatic_gamma is None
  with pytest.raises(ValueError, match="clipping"):
    dp.DPSGD(clip, 1.0, clipping="auto")


# ------------------------------------------------------ 7. weight decay
ALL_CLASSES = [dp.DPAdam, dp.DPAdamBC, dp.DPAdamIME, dp.DPAdamJME,
               dp.DPAdamSTP, dp.NoiselessPreconditionerAdam, dp.DPRMSProp,
               dp.DPRMSPropBC, dp.DPRMSPropIME, dp.DPRMSPropSTP, dp.DPAdagrad,
               dp.DPAdagradBC, dp.DPAdagradIME, dp.DPAdagradSTP,
               dp.DP2RMSProp, dp.DP2Adagrad, dp.DPAdamPublicPreconditioner,
               dp.DPSGD]


def _apply(opt, var, g):
  square = [g * g * B] if getattr(opt, "_uses_square_sum", False) else None
  opt.apply_private(
      clipping.assume_clipped([g * B]), B, B, [var], clipped_square_sum=square)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_decoupled_weight_decay(cls):
  # Both runs see the same noise and the update does not depend on θ, so
  # θ_wd,t = (1 − η·wd) θ_wd,t−1 + (θ_t − θ_t−1) exactly.
  lr, wd = 0.01, 2.0
  extra = dict(sgd_steps=2, adaptive_steps=2) if cls in (
      dp.DP2RMSProp, dp.DP2Adagrad) else {}
  plain = _quiet(cls, C, SIGMA, learning_rate=lr, seed=46, **extra)
  decayed = _quiet(cls, C, SIGMA, learning_rate=lr, seed=46,
                   weight_decay=wd, **extra)
  a, b = keras.Variable(INIT), keras.Variable(INIT)
  prev_a, want = INIT.astype("float64"), INIT.astype("float64")
  for g in STREAM[:4]:
    _apply(plain, a, g)
    _apply(decayed, b, g)
    want = (1 - lr * wd) * want + (a.numpy() - prev_a)
    prev_a = a.numpy().astype("float64")
    np.testing.assert_allclose(b.numpy(), want, rtol=1e-5, atol=1e-6)
  # The decay is visible: 0.98⁴ shrinks θ₀ = ±1 by 8%.
  assert np.max(np.abs(b.numpy() - a.numpy())) > 0.05


# ------------------------------------------------------- 8. diagnostics
def test_dpadam_v_over_phi_is_one_on_pure_noise():
  n, steps = 100_000, 20
  opt = dp.DPAdam(C, SIGMA, learning_rate=1e-9, seed=47)
  drive(opt, np.zeros(n), [np.zeros(n)] * steps, B)
  ratio = float(opt.diagnostics()["dp_v_over_phi"])
  v_hat = opt._velocities[0].numpy() / (1 - 0.999 ** steps)
  # Direct computation from the state (float32 sums over 100k: 1e-4).
  assert ratio == pytest.approx(np.mean(v_hat / float(opt.phi())), rel=1e-4)
  # Each v̂/Φ has mean 1 and std ≤ sqrt(2); the mean over 100k has s.e.
  # < 0.5%; tolerance 2%.
  assert abs(ratio - 1) < 0.02


@pytest.mark.parametrize("steps", [1, 10])
def test_dpadambc_clamped_fraction_on_pure_noise(steps):
  n, gamma = 100_000, 1e-8
  opt = dp.DPAdamBC(C, SIGMA, learning_rate=1e-9, gamma_prime=gamma,
                    seed=48)
  drive(opt, np.zeros(n), [np.zeros(n)] * steps, B)
  frac = float(opt.diagnostics()["dp_clamped_fraction"])
  v_hat = opt._velocities[0].numpy() / (1 - 0.999 ** steps)
  # A few of 100k coordinates sit within float32 rounding of the edge.
  assert frac == pytest.approx(np.mean(v_hat - float(opt.phi()) < gamma),
                               abs=1e-4)
  # v̂/Φ is a weighted mean of χ²₁ draws with weights β2^{t−i}: its CDF at
  # 1 + γ'/Φ, by Monte Carlo (t = 1: exactly P(χ²₁ < 1) ≈ 0.683).
  weights = 0.999 ** np.arange(steps)[::-1]
  weights /= weights.sum()
  mc = np.random.default_rng(0).chisquare(1, size=(200_000, steps)) @ weights
  want = np.mean(mc < 1 + gamma / PHI)
  if steps == 1:
    assert want == pytest.approx(stats.chi2.cdf(1 + gamma / PHI, 1),
                                 abs=0.005)
  # s.e. ≈ 0.0015 for each estimate; tolerance 0.01.
  assert abs(frac - want) < 0.01
  assert 0.5 < frac < 0.7


@pytest.mark.parametrize("cls", [dp.DPAdamIME, dp.DPRMSPropIME,
                                 dp.DPAdagradIME])
def test_ime_negative_fraction_on_pure_noise(cls):
  n = 100_000
  hp = dict(initial_accumulator_value=0.0) if cls is dp.DPAdagradIME else {}
  opt = cls(C, SIGMA, learning_rate=1e-9, seed=49, **hp)
  drive(opt, np.zeros(n), [np.zeros(n)] * 5, B)
  diag = opt.diagnostics()
  frac = float(diag["dp_negative_v_fraction"])
  assert frac == pytest.approx(np.mean(opt._velocities[0].numpy() < 0),
                               abs=2e-5)
  # v is a sum of zero-mean Gaussians: P(v < 0) = 1/2 (s.e. 0.0016).
  assert abs(frac - 0.5) < 0.01
  assert "dp_clamped_fraction" not in diag


def test_diagnostic_names_per_class():
  names = {cls: set(_quiet(cls, 1.0, 1.0).DIAGNOSTICS) for cls in ALL_CLASSES}
  for cls in (dp.DPAdam, dp.DPRMSProp, dp.DPAdagrad, dp.DPAdamSTP,
              dp.DPRMSPropSTP, dp.DPAdagradSTP,
              dp.NoiselessPreconditionerAdam):
    assert names[cls] == {"dp_v_over_phi"}
  for cls in (dp.DPAdamBC, dp.DPRMSPropBC, dp.DPAdagradBC):
    assert names[cls] == {"dp_v_over_phi", "dp_clamped_fraction"}
  for cls in (dp.DPAdamIME, dp.DPRMSPropIME, dp.DPAdagradIME, dp.DPAdamJME):
    assert names[cls] == {"dp_v_over_phi", "dp_negative_v_fraction"}
  for cls in (dp.DPSGD, dp.DP2RMSProp, dp.DP2Adagrad,
              dp.DPAdamPublicPreconditioner):
    assert names[cls] == set()


# ---------------------------------------------------------------- 9. DP²
@pytest.mark.parametrize("cls", [dp.DP2RMSProp, dp.DP2Adagrad])
def test_dp2_phases_against_numpy(cls):
  s1, s2, c1, c2, lr, eps, seed = 3, 2, 0.5, 2.0, 0.1, 1e-3, 50
  steps = 2 * (s1 + s2)
  stream = np.random.default_rng(50).normal(0.0, 0.05, size=(steps, 6))
  stream = stream.astype("float32")
  kwargs = dict(rho=0.7) if cls is dp.DP2RMSProp else {}
  opt = cls(c1, SIGMA, learning_rate=lr, preconditioned_clip_norm=c2,
            sgd_steps=s1, adaptive_steps=s2, epsilon=eps, seed=seed, **kwargs)
  z = _dpsgd_noise(seed, steps, (6,), clip=c1)  # std σC1/B
  sgd = drive(dp.DPSGD(c1, SIGMA, learning_rate=lr, seed=seed), INIT,
              stream[:s1], B)
  var = keras.Variable(INIT)
  theta, a, total = INIT.astype("float64"), np.zeros(6), np.zeros(6)
  for t in range(steps):
    in_sgd = t % (s1 + s2) < s1
    spec = opt.clip_spec([var])
    assert float(spec.l2_norm_clip) == (c1 if in_sgd else c2)
    want_scale = np.ones(6) if in_sgd else 1 / (np.sqrt(a) + eps)
    np.testing.assert_allclose(spec.scale[0].numpy(), want_scale, rtol=1e-5)
    opt.apply_private(clipping.assume_clipped([stream[t] * B]), B, B, [var])
    # Phase 2 releases with clip C2: the same draw scaled by C2/C1.
    released = stream[t] + (z[t] if in_sgd else c2 / c1 * z[t])
    theta = theta - lr * released
    np.testing.assert_allclose(var.numpy(), theta, rtol=1e-5, atol=1e-6)
    if t < s1:  # the first phase is DP-SGD with clip C1, same seed
      np.testing.assert_allclose(var.numpy(), sgd[t], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(opt.noise_variance),
                               (SIGMA * (c1 if in_sgd else c2) / B) ** 2,
                               rtol=1e-5)
    if in_sgd:
      total = total + released
    if t % (s1 + s2) == s1 - 1:  # end of the SGD phase: refresh A
      mean_sq = (total / s1) ** 2
      a = 0.7 * a + 0.3 * mean_sq if cls is dp.DP2RMSProp else a + mean_sq
      total = np.zeros(6)
    # A changes only at the end of an SGD phase (rtol 1e-5: float32 sums).
    np.testing.assert_allclose(opt._preconditioners[0].numpy(), a, rtol=1e-5,
                               atol=1e-12)
  assert np.all(a > 0)


def test_dp2_adaptive_phase_clips_the_preconditioned_gradient_at_c2():
  s1, c1, c2, units = 1, 0.5, 0.3, 8
  opt = dp.DP2Adagrad(c1, SIGMA, preconditioned_clip_norm=c2, sgd_steps=s1,
                      adaptive_steps=1, epsilon=1e-3, seed=51)
  var = keras.Variable(INIT)
  rng = np.random.default_rng(51)
  g0 = rng.normal(0, 0.1, size=(units, 6)).astype("float32")
  opt.apply_private(clipping.materialized_clipped_sum(
      [tf.constant(g0)], opt.clip_spec([var])), units, units, [var])
  a = opt._preconditioners[0].numpy().astype("float64")
  assert np.all(a > 0)
  spec = opt.clip_spec([var])
  g1 = rng.normal(0, 0.1, size=(units, 6)).astype("float32")
  result = clipping.materialized_clipped_sum([tf.constant(g1)], spec)
  scale = 1 / (np.sqrt(a) + 1e-3)
  np.testing.assert_allclose(result.grads[0].numpy(),
                             _numpy_clip(scale * g1, c2).sum(0), rtol=1e-4,
                             atol=1e-6)
  assert int(result.num_clipped) > 0


def test_dp2_rejects_per_layer_clips_and_bad_phases():
  with pytest.raises(ValueError, match="per layer"):
    dp.DP2RMSProp([0.1, 0.2], 1.0)
  with pytest.raises(ValueError, match="sgd_steps"):
    dp.DP2RMSProp(0.1, 1.0, sgd_steps=0)
  with pytest.raises(ValueError, match="adaptive_steps"):
    dp.DP2Adagrad(0.1, 1.0, adaptive_steps=1.5)


# ----------------------------------------- 10. public preconditioner
def test_public_preconditioner_side_information_sets_the_scale():
  side = [np.full((3, 2), 0.04, "float32"), np.array([0.0, 1.0], "float32")]
  variables = [keras.Variable(np.zeros((3, 2))), keras.Variable(np.zeros(2))]
  opt = dp.DPAdamPublicPreconditioner(1.0, 1.0, preconditioner=side,
                                      epsilon=1e-3)
  spec = opt.clip_spec(variables)
  for got, a in zip(spec.scale, side):
    np.testing.assert_allclose(got.numpy(), 1 / (np.sqrt(a) + 1e-3),
                               rtol=1e-6)
  opt.set_preconditioner([np.ones((3, 2)), np.full(2, 4.0)])
  np.testing.assert_allclose(opt.clip_spec(variables).scale[1].numpy(),
                             1 / (2 + 1e-3), rtol=1e-6)
  with pytest.raises(ValueError, match="1 preconditioner arrays for 2"):
    opt.set_preconditioner([np.ones((3, 2))])
  with pytest.raises(ValueError, match="≥ 0 and shaped"):
    opt.set_preconditioner([np.ones((2, 3)), np.ones(2)])
  with pytest.raises(ValueError, match="≥ 0 and shaped"):
    opt.set_preconditioner([np.ones((3, 2)), -np.ones(2)])
  with pytest.warns(UserWarning, match="without public_data"):
    dp.DPAdamPublicPreconditioner(1.0, 1.0)


def test_public_preconditioner_update_is_debiased_momentum():
  g = _noisy_stream(52)
  opt = dp.DPAdamPublicPreconditioner(C, SIGMA, learning_rate=0.05,
                                      beta_1=0.7, seed=52,
                                      preconditioner=[np.ones(6)])
  traj = drive(opt, INIT, STREAM, B)
  theta, m = INIT.astype("float64"), 0.0
  for t, gt in enumerate(g, start=1):
    m = 0.7 * m + 0.3 * gt
    theta = theta - 0.05 * m / (1 - 0.7 ** t)
    np.testing.assert_allclose(traj[t - 1], theta, rtol=1e-5, atol=1e-6)


def test_public_refresh_replaces_then_averages():
  var = [keras.Variable(np.zeros(2, "float32"))]
  opt = dp.DPAdamPublicPreconditioner(1.0, 1.0, preconditioner=[np.ones(2)],
                                      beta_2=0.9)
  opt.build(var)
  opt.observe_public_gradients([tf.constant([2.0, 3.0])], var)
  np.testing.assert_allclose(opt._public_moments[0].numpy(), [4.0, 9.0])
  opt.observe_public_gradients([tf.constant([1.0, 0.0])], var)
  np.testing.assert_allclose(opt._public_moments[0].numpy(),
                             [0.9 * 4 + 0.1, 0.9 * 9], rtol=1e-6)
  assert int(opt._refreshes.numpy()) == 2


# ---------------------------------------- 5. restored state, unit level
STATEFUL = [dp.DPAdam, dp.DPAdamBC, dp.DPAdamIME, dp.DPAdamJME, dp.DPAdamSTP,
            dp.DPRMSPropSTP, dp.DPAdagradSTP, dp.DPAdagradBC, dp.DP2RMSProp,
            dp.DP2Adagrad, dp.DPAdamPublicPreconditioner]


@pytest.mark.parametrize("cls", STATEFUL, ids=lambda c: c.__name__)
def test_continuing_from_saved_optimizer_variables_equals_uninterrupted(cls):
  # save_own_variables / load_own_variables (what model.save and load_model
  # call) carry everything the next steps depend on: STP's v̂, DP²'s A and
  # phase, the public moment, the noise step counter.
  extra = dict(sgd_steps=2, adaptive_steps=2) if cls in (
      dp.DP2RMSProp, dp.DP2Adagrad) else {}
  if cls is dp.DPAdamPublicPreconditioner:
    extra = dict(preconditioner=[np.full(6, 0.3)])

  def make():
    return _quiet(cls, C, SIGMA, learning_rate=0.01, seed=53, **extra)

  straight, first = make(), make()
  a, b = keras.Variable(INIT), keras.Variable(INIT)
  for g in STREAM[:6]:
    _apply(straight, a, g)
  for g in STREAM[:3]:
    _apply(first, b, g)
  store = {}
  first.save_own_variables(store)
  resumed = make()
  c = keras.Variable(b.numpy())
  resumed.build([c])
  resumed.load_own_variables(store)
  assert resumed.steps_taken == 3
  for g in STREAM[3:6]:
    _apply(resumed, c, g)
  np.testing.assert_allclose(c.numpy(), a.numpy(), rtol=1e-6, atol=1e-7)


# ------------------- training a subset of the variables the optimizer built
@pytest.mark.parametrize("cls", [
    dp.DPAdamBC,  # control: only Keras' own per-variable indexing
    dp.DPAdamIME, dp.DPRMSPropIME, dp.DPAdagradIME, dp.DPAdamJME,
    dp.NoiselessPreconditionerAdam, dp.DPAdamSTP, dp.DPRMSPropSTP,
    dp.DPAdagradSTP, dp.DP2RMSProp, dp.DP2Adagrad,
    dp.DPAdamPublicPreconditioner], ids=lambda c: c.__name__)
def test_training_a_subset_equals_a_fresh_optimizer_on_the_subset(cls):
  # Keras optimizers may update a subset of the variables they were built
  # with (a layer frozen after the first fit). The step's releases are
  # ordered like the variables passed in; scales (STP, DP², public) must be
  # those of the variables being trained. (At commit 92ab9d3, IME/JME/the
  # noiseless baseline indexed the release by the optimizer's index and
  # STP/DP²/public zipped the scales of all built variables with the subset.)
  units = 8
  extra = dict(sgd_steps=1, adaptive_steps=2) if cls in (
      dp.DP2RMSProp, dp.DP2Adagrad) else {}
  side = [np.full(3, 4.0), np.full(3, 0.25), np.full(3, 0.01)]

  def make(preconditioner):
    kwargs = dict(extra)
    if cls is dp.DPAdamPublicPreconditioner:
      kwargs["preconditioner"] = preconditioner
    return _quiet(cls, 1.0, SIGMA, learning_rate=0.01, seed=54, **kwargs)

  built = make(side)
  a, b, c = (keras.Variable(np.zeros(3, "float32")) for _ in range(3))
  built.build([a, b, c])
  fresh = make(side[1:])
  b2, c2 = (keras.Variable(np.zeros(3, "float32")) for _ in range(2))
  fresh.build([b2, c2])
  rng = np.random.default_rng(54)
  for _ in range(4):
    grads = [tf.constant(rng.normal(0, m, size=(units, 3)).astype("float32"))
             for m in (1.0, 0.01)]
    for opt, variables in ((built, [b, c]), (fresh, [b2, c2])):
      spec = opt.clip_spec(variables)
      if spec.scale is not None:
        assert len(spec.scale) == 2
      result = clipping.materialized_clipped_sum(
          grads, spec._replace(square_sum=True))
      opt.apply_private(result, units, units, variables)
  np.testing.assert_array_equal(a.numpy(), np.zeros(3))
  np.testing.assert_allclose(b.numpy(), b2.numpy(), rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(c.numpy(), c2.numpy(), rtol=1e-6, atol=1e-8)
  assert np.any(b.numpy() != 0)


def test_step_noise_is_drawn_in_the_variables_dtypes():
  """The step's sampler draws each variable's noise in the variable's dtype
  (float32 Box–Muller for a float32 variable, whatever the float64 clipped
  sum it is added to), and refuses templates that do not match the
  variables one to one (zip would drop a tensor)."""
  from tf_dpadambc.keras.optimizers import base  # pylint: disable=import-outside-toplevel
  var = keras.Variable(np.zeros(1000, "float32"))
  seed = tf.constant([3, 4], tf.int64)
  sample = base._in_variable_dtypes(  # pylint: disable=protected-access
      noise.independent_sampler(seed), [var])
  got = sample([tf.zeros(1000, tf.float64)], 2.0)[0]
  assert got.dtype == tf.float64
  want = noise.independent_sampler(seed)([tf.zeros(1000, tf.float32)], 2.0)[0]
  np.testing.assert_array_equal(got.numpy(), want.numpy().astype(np.float64))
  with pytest.raises(ValueError, match="one template per variable"):
    sample([tf.zeros(1000, tf.float64)] * 2, 2.0)
