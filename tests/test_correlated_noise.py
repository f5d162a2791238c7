"""Correlated (DP-MF) noise in the train step: streaming equals C⁻¹z, the
optimizers add exactly that noise, Φ under MF matches Monte Carlo, a run
split over fit calls continues its noise (saved runs refuse to resume
mid-stream: tests/test_serialization.py), every variant trains with it, the
DPQuery protocol, and the accounting."""
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc.core import clipping
from tf_dpadambc import mechanisms
from tf_dpadambc import mf
from tf_dpadambc.core import noise as core_noise
import test_variants_training as variants

_RNG = np.random.default_rng(0)
_DENSE = np.tril(_RNG.uniform(-0.3, 0.3, (10, 10)), -1) + np.diag(
    _RNG.uniform(0.8, 1.5, 10))

STRATEGIES = {
    "identity": mf.Identity(),
    "banded": mf.Toeplitz([1.0, 0.6, 0.3, 0.1]),
    "sqrt_toeplitz": mf.sqrt_toeplitz(8),
    "blt": mf.BLT([0.9, 0.4], [0.3, 0.2]),
    "dense": mf.Dense(_DENSE),
}
SEED = (7, 8)


def _seed_of(stream=0):
  def seed_of(j):
    s = core_noise.step_seed(SEED, j)
    return s if stream == 0 else core_noise.sub_seed(s, stream)
  return seed_of


def _stream(mechanism, templates, steps, stddev=1.0):
  """The mechanism's noise for steps 0..steps−1, threading its state."""
  state = None
  if mechanism.state_shape(templates[0].shape) is not None:
    state = [tf.zeros(mechanism.state_shape(t.shape)) for t in templates]
  out = []
  for t in range(steps):
    noise, state = mechanism.sample(templates, stddev, _seed_of(), t, state)
    out.append([n.numpy() for n in noise])
  return out


# ------------------------------------------------- 1. streaming = C⁻¹ z
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_streaming_noise_equals_the_dense_inverse_times_z(name):
  strategy = STRATEGIES[name]
  steps = 13  # past the dense strategy's 10 steps: it continues as I
  mechanism = mechanisms.CorrelatedNoise(strategy, steps=10)
  templates = [tf.zeros((3, 5)), tf.zeros((4,))]
  got = _stream(mechanism, templates, steps, stddev=2.0)
  z = [[a.numpy() for a in core_noise.gaussian_noise_like(
      templates, 1.0, _seed_of()(j))] for j in range(steps)]
  inverse = strategy.inverse(steps)
  for t in range(steps):
    for p in range(len(templates)):
      want = 2.0 * mechanism.sensitivity * sum(
          inverse[t, j] * z[j][p] for j in range(t + 1))
      np.testing.assert_allclose(got[t][p], want, rtol=1e-5, atol=1e-5)


def test_banded_state_holds_bands_minus_one_buffers_and_blt_its_buffers():
  assert mechanisms.CorrelatedNoise(
      mf.Toeplitz(np.ones(16)), 20).state_shape((3, 4)) == (15, 3, 4)
  blt = mf.BLT([0.9, 0.5, 0.2, 0.1], [0.1, 0.1, 0.1, 0.1])
  assert mechanisms.CorrelatedNoise(blt, 20).state_shape((7,)) == (4, 7)
  assert mechanisms.CorrelatedNoise(mf.Identity(), 20).state_shape((7,)) is None


# ---------------------------------------- 2. what the optimizer adds
@pytest.mark.parametrize("name", ["banded", "blt", "dense"])
def test_optimizer_adds_sigma_c_sens_times_the_stream_over_b(name):
  """DPSGD (no momentum, η = 1) on zero clipped sums moves the weights by
  exactly −σC·sens(C)·(C⁻¹z)_t / B, drawn with the optimizer's own seeds."""
  clip, sigma, units, steps = 0.7, 1.3, 5, 6
  mechanism = mechanisms.CorrelatedNoise(STRATEGIES[name], steps=steps)
  opt = dp.DPSGD(clip, sigma, learning_rate=1.0, seed=3, noise=mechanism)
  var = tf.Variable(tf.zeros((4, 3)))
  moves = []
  for _ in range(steps):
    before = var.numpy().copy()
    opt.apply_private(
        clipping.assume_clipped([tf.zeros((4, 3))]), units, units, [var])
    moves.append(before - var.numpy())
  seed_pair = opt._seed_pair
  z = [core_noise.gaussian_noise_like(
      [tf.zeros((4, 3))], 1.0, core_noise.step_seed(seed_pair, j))[0].numpy()
       for j in range(steps)]
  inverse = STRATEGIES[name].inverse(steps)
  for t in range(steps):
    want = sigma * clip * mechanism.sensitivity * sum(
        inverse[t, j] * z[j] for j in range(t + 1)) / units
    np.testing.assert_allclose(moves[t], want, rtol=1e-4, atol=1e-6)
    # Φ of the step: (σC/B)²·sens²·‖row_t(C⁻¹)‖².
    np.testing.assert_allclose(
        float(mechanism.variance_factor(t)),
        mechanism.sensitivity ** 2 * np.sum(inverse[t] ** 2), rtol=1e-5)


def test_ime_second_release_is_correlated_on_its_own_stream():
  mechanism = mechanisms.CorrelatedNoise(STRATEGIES["blt"], steps=8)
  opt = dp.DPAdamIME(1.0, 1.0, seed=5, noise=mechanism)
  var = tf.Variable(tf.zeros((3,)))
  opt.apply_private(clipping.assume_clipped([tf.zeros((3,))]), 4, 4, [var])
  states = opt._noise_state
  assert set(states) == {0, 1}
  first, second = states[0][0].numpy(), states[1][0].numpy()
  assert np.all(first != 0) and np.all(second != 0)
  assert not np.allclose(first, second)


def test_stp_noises_the_scaled_gradient_with_one_shared_strategy():
  """Scale-then-privatize with DP-MF (Ganesh et al. 2025, §4.5): the MF
  stream is added in the scaled geometry, the same C for every coordinate:
  s_t ⊙ ḡ_t = (Σ clip(s_t ⊙ g_u) + σC·sens(C)·(C⁻¹z)_t) / B."""
  clip, sigma, units, steps = 1.0, 0.5, 4, 6
  strategy = STRATEGIES["banded"]
  mechanism = mechanisms.CorrelatedNoise(strategy, steps=steps)
  opt = dp.DPAdamSTP(clip, sigma, beta_1=0.0, scale_epsilon=0.1, seed=4,
                     noise=mechanism)
  var = tf.Variable(tf.zeros((3, 2)))
  z = [core_noise.gaussian_noise_like(
      [tf.zeros((3, 2))], 1.0, core_noise.step_seed(opt._seed_pair, j)
  )[0].numpy() for j in range(steps)]
  inverse = strategy.inverse(steps)
  scales = []
  for t in range(steps):
    scale = opt.preconditioner([var])[0].numpy() if opt.built else 10.0
    opt.apply_private(
        clipping.assume_clipped([tf.zeros((3, 2))]), units, units, [var])
    g_bar = opt._momentums[0].numpy()  # β1 = 0: m_t = ḡ_t
    want = sigma * clip * mechanism.sensitivity * sum(
        inverse[t, j] * z[j] for j in range(t + 1)) / units
    np.testing.assert_allclose(scale * g_bar, want, rtol=1e-4, atol=1e-6)
    scales.append(scale)
  assert not np.allclose(scales[-1], scales[1])  # s_t really changed


# ------------------------------------------ 3. Φ under correlated noise
def test_mf_bias_of_v_hat_matches_monte_carlo_within_two_percent():
  """E[v̂_t] = g² + (1−β2)/(1−β2^t)·Σ_i β2^{t−i}(σC/B)²sens²‖row_i(C⁻¹)‖²
  (Ganesh et al. 2025, App. A, corrected: row norms of C⁻¹, no extra β2),
  over 200k coordinates with a fixed gradient g independent of the noise."""
  clip, sigma, units, beta_2, m = 1.0, 2.0, 8, 0.9, 200_000
  strategy = mf.sqrt_toeplitz(16)
  mechanism = mechanisms.CorrelatedNoise(strategy, steps=40)
  opt = dp.DPAdamBC(clip, sigma, beta_2=beta_2, seed=9, noise=mechanism)
  var = tf.Variable(tf.zeros((m,)))
  g = 0.05
  per_step = (sigma * clip / units) ** 2 * mechanism.sensitivity ** 2 * (
      strategy.inverse_row_norms_squared(40))
  for t in range(1, 41):
    opt.apply_private(
        clipping.assume_clipped([tf.fill((m,), g * units)]), units, units,
        [var])
    want_phi = (1 - beta_2) / (1 - beta_2 ** t) * sum(
        beta_2 ** (t - i) * per_step[i - 1] for i in range(1, t + 1))
    np.testing.assert_allclose(float(opt.phi()), want_phi, rtol=1e-5)
    if t in (1, 5, 16, 40):
      v_hat = float(tf.reduce_mean(opt.second_moment(var)))
      assert abs(v_hat - (g ** 2 + want_phi)) < 0.02 * (g ** 2 + want_phi), t
  # Row norms of C⁻¹ grow (here by 29%): a constant (σC/B)²sens² Φ would
  # under-correct late steps.
  assert per_step[39] / per_step[0] > 1.25


# ------------------------------------------------ 4. stream continuity
@pytest.mark.parametrize("name", ["banded", "blt", "dense"])
def test_a_run_split_over_fit_calls_draws_exactly_the_uninterrupted_noise(
    name):
  # The stream's state lives in (unsaved) optimizer variables, so it goes on
  # across fit calls; a restored run refuses instead (test_serialization).
  def optimizer():
    return dp.DPAdamBC(1.0, 0.9, learning_rate=0.01, seed=21,
                       noise=mechanisms.CorrelatedNoise(STRATEGIES[name], 8))

  keras.utils.set_random_seed(1)
  model = variants._private(optimizer())
  initial = model.get_weights()
  model.fit(variants.X, variants.Y, batch_size=8, epochs=2, shuffle=False,
            verbose=0)
  uninterrupted = model.get_weights()

  split = variants._private(optimizer(), model=variants._model())
  split.set_weights(initial)
  for _ in range(2):
    split.fit(variants.X, variants.Y, batch_size=8, epochs=1, shuffle=False,
              verbose=0)
  assert split.optimizer.steps_taken == 4
  for a, b in zip(split.get_weights(), uninterrupted):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ------------------------------------ 5. every variant trains with MF
@pytest.mark.parametrize("cls, extra", variants.ALL,
                         ids=[c.__name__ for c, _ in variants.ALL])
def test_every_variant_trains_with_correlated_noise(cls, extra):
  mechanism = mechanisms.CorrelatedNoise(STRATEGIES["blt"], steps=4)
  opt = variants._quiet(cls, 1.0, 0.8, learning_rate=0.01, seed=2,
                        noise=mechanism, **extra)
  model = variants._private(opt)
  before = model.get_weights()
  model.fit(variants.X, variants.Y, batch_size=8, epochs=2, verbose=0)
  assert opt.steps_taken == 4
  after = model.get_weights()
  assert all(np.all(np.isfinite(w)) for w in after)
  assert any(np.any(a != b) for a, b in zip(after, before))
  for states in opt._noise_state.values():
    assert any(np.any(s.numpy() != 0) for s in states if s is not None)
  assert opt.get_config()["noise"]["class_name"] == "CorrelatedNoise"


def test_config_round_trip_of_every_strategy():
  for strategy in STRATEGIES.values():
    mechanism = mechanisms.CorrelatedNoise(strategy, 10, participations=2,
                                           min_separation=5)
    opt = dp.DPAdamBC(1.0, 1.0, noise=mechanism)
    again = dp.DPAdamBC.from_config(opt.get_config())
    assert again.get_config() == opt.get_config()
    np.testing.assert_allclose(again.noise.strategy.inverse(10),
                               strategy.inverse(10))
    assert again.noise.sensitivity == mechanism.sensitivity


# ------------------------------------------------------- 6. bad input
def test_bad_mechanism_arguments_fail_clearly():
  with pytest.raises(TypeError, match="mf strategy"):
    mechanisms.CorrelatedNoise(np.eye(3), 3)
  with pytest.raises(ValueError, match="min_separation is required"):
    mechanisms.CorrelatedNoise(mf.Identity(), 10, participations=2)
  with pytest.raises(ValueError, match="takes l2_norm_clip"):
    dp.DPAdam(1.0, 1.0, noise=mechanisms.IndependentNoise(1.0, 1.0))
  with pytest.raises(TypeError, match="noise mechanism"):
    dp.DPAdam(1.0, 1.0, noise="mf")
  # 0 is not "unset": it would silently calibrate for one participation.
  with pytest.raises(ValueError, match="min_separation"):
    mechanisms.CorrelatedNoise(mf.Toeplitz([1.0, 0.5]), 10, participations=5,
                               min_separation=0)
  with pytest.raises(ValueError, match="steps"):
    mechanisms.CorrelatedNoise(mf.Identity(), None)
  with pytest.raises(ValueError, match="banded correlated noise"):
    dp.DPAdam(1.0, 1.0).noise.accounting_event(1.0, 10, "cyclic_poisson",
                                               10, 100)


def test_correlated_noise_refuses_a_step_on_a_subset_of_the_variables():
  opt = dp.DPAdam(1.0, 1.0, noise=mechanisms.CorrelatedNoise(
      STRATEGIES["blt"], 4))
  a, b = tf.Variable(tf.zeros(3)), tf.Variable(tf.zeros(2))
  opt.apply_private(
      clipping.assume_clipped([tf.zeros(3), tf.zeros(2)]), 4, 4, [a, b])
  with pytest.raises(ValueError, match="every step must update all"):
    opt.apply_private(clipping.assume_clipped([tf.zeros(3)]), 4, 4, [a])


def test_dpquery_noise_ignores_the_global_seed():
  def noise():
    tf.random.set_seed(0)
    query = mechanisms.CorrelatedNoise(
        STRATEGIES["banded"], 4, l2_norm_clip=1.0, noise_multiplier=1.0,
        record_specs=[tf.TensorSpec((5,), tf.float64)])
    result, _, _ = query.get_noised_result(
        query.initial_sample_state(), query.initial_global_state())
    assert result[0].dtype == tf.float64
    return result[0].numpy()
  assert not np.allclose(noise(), noise())
  with pytest.raises(ValueError, match="record_specs"):
    mechanisms.CorrelatedNoise(STRATEGIES["banded"], 4, l2_norm_clip=1.0,
                               noise_multiplier=1.0).initial_global_state()


def test_accounting_without_a_step_uses_the_planned_batches_per_epoch():
  """Before training (no steps per epoch seen), dp_event(steps=…) derives
  the participation from N and B; it never falls back to the plan."""
  mechanism = mechanisms.CorrelatedNoise(mf.Toeplitz([1.0, 0.8, 0.6, 0.4]),
                                         40, participations=4,
                                         min_separation=10)
  opt = dp.DPAdam(1.0, 1.0, noise=mechanism)
  planned = opt.dp_event(100, batch_size=10, steps=40, sampling="cyclic")
  np.testing.assert_allclose(planned.noise_multiplier, 1.0)
  longer = opt.dp_event(100, batch_size=10, steps=400, sampling="cyclic")
  want = mechanism.sensitivity / mf.sensitivity(mechanism.strategy, 400, 40,
                                                10)
  np.testing.assert_allclose(longer.noise_multiplier, want)
  shuffled = opt.dp_event(100, batch_size=10, steps=40, sampling="shuffle")
  assert shuffled.noise_multiplier < 1.0
  assert isinstance(opt.dp_event(100, batch_size=10, steps=0,
                                 sampling="cyclic"),
                    dp_accounting.NoOpDpEvent)


# --------------------------------------------------- 7. DPQuery protocol
def test_correlated_noise_is_a_dpquery_with_the_right_covariance():
  clip, sigma, steps, m = 0.5, 2.0, 6, 40_000
  strategy = STRATEGIES["blt"]
  query = mechanisms.CorrelatedNoise(
      strategy, steps, l2_norm_clip=clip, noise_multiplier=sigma,
      record_specs=[tf.TensorSpec((m,)), tf.TensorSpec((2,))])
  state = query.initial_global_state()
  params = query.derive_sample_params(state)
  assert float(params) == clip
  # Clipping of a record, accumulation and merging as a sum query.
  sample = query.initial_sample_state()
  record = [tf.zeros((m,)), tf.constant([3.0, 4.0])]
  sample = query.accumulate_record(params, sample, record)
  other = query.accumulate_record(params, query.initial_sample_state(),
                                  record)
  merged = query.merge_sample_states(sample, other)
  np.testing.assert_allclose(merged[1].numpy(), [0.6, 0.8], rtol=1e-6)
  noise = []
  for _ in range(steps):
    result, state, event = query.get_noised_result(
        query.initial_sample_state(), state)
    noise.append(result[0].numpy())
    assert isinstance(event, dp_accounting.UnsupportedDpEvent)
  assert int(state.step) == steps
  x = np.stack(noise)  # [steps, m]
  want = (sigma * clip * query.sensitivity) ** 2 * (
      strategy.inverse(steps) @ strategy.inverse(steps).T)
  got = x @ x.T / m
  # Entries of an empirical covariance over m coordinates have relative std
  # ≈ sqrt(2/m) ≈ 0.7% of the diagonal; allow 5%.
  assert np.max(np.abs(got - want)) < 0.05 * np.max(np.diag(want))


def test_independent_noise_as_a_dpquery_is_gaussian_sum_query():
  query = mechanisms.IndependentNoise(l2_norm_clip=2.0, noise_multiplier=1.5,
                                      record_specs=[tf.TensorSpec((50_000,))])
  state = query.initial_global_state()
  result, new_state, event = query.get_noised_result(
      [tf.ones((50_000,))], state)
  assert event == dp_accounting.GaussianDpEvent(1.5)
  assert abs(np.std(result[0].numpy() - 1.0) / 3.0 - 1) < 0.02
  assert int(new_state.step) == 1


def test_dpquery_use_needs_its_parameters():
  with pytest.raises(ValueError, match="l2_norm_clip and noise_multiplier"):
    mechanisms.CorrelatedNoise(mf.Identity(), 4).initial_global_state()


# --------------------------------------------------------- 8. accounting
def _trained(strategy, epochs, steps_per_epoch=2, batch=8, **kwargs):
  mechanism = mechanisms.CorrelatedNoise(strategy, **kwargs)
  opt = dp.DPAdam(1.0, 1.5, seed=1, noise=mechanism)
  model = variants._private(opt)
  model.fit(variants.X, variants.Y, batch_size=batch, epochs=epochs,
            shuffle=False, verbose=0)
  assert opt.steps_taken == epochs * steps_per_epoch
  return opt


def test_cyclic_run_as_planned_is_one_gaussian_at_sigma():
  banded = mf.Toeplitz([1.0, 0.5])
  opt = _trained(banded, epochs=3, steps=6, participations=3,
                 min_separation=2)
  event = opt.dp_event(variants.N, sampling="cyclic")
  assert isinstance(event, dp_accounting.GaussianDpEvent)
  np.testing.assert_allclose(event.noise_multiplier, 1.5, rtol=1e-12)
  # Reshuffled epochs: participations can be adjacent, the bands overlap and
  # the sensitivity grows, so the effective σ is smaller.
  shuffled = opt.dp_event(variants.N, sampling="shuffle")
  k1 = mf.sensitivity(banded, 6, 3, 1)
  assert k1 > opt.noise.sensitivity
  np.testing.assert_allclose(shuffled.noise_multiplier,
                             1.5 * opt.noise.sensitivity / k1)
  with pytest.raises(ValueError, match="no closed-form"):
    opt.dp_event(variants.N, sampling="poisson")
  statement = dp.optimizer_privacy_statement(opt, variants.N, 1e-5)
  assert "correlated noise" in statement and "cyclic" in statement


def test_running_past_the_plan_lowers_the_accounted_sigma():
  opt = _trained(mf.sqrt_toeplitz(4), epochs=2, steps=2)
  event = opt.dp_event(variants.N, sampling="cyclic")
  planned = mf.sensitivity(mf.sqrt_toeplitz(4), 2, 1, 2)
  actual = mf.sensitivity(mf.sqrt_toeplitz(4), 4, 2, 2)
  np.testing.assert_allclose(event.noise_multiplier, 1.5 * planned / actual)
  assert event.noise_multiplier < 1.5


def test_cyclic_poisson_is_amplified_banded_mf():
  banded = mf.Toeplitz([1.0, 0.4])
  opt = _trained(banded, epochs=2, steps=4)
  # The run's fixed-size batches were not cyclic Poisson: no amplified ε for
  # it; the mechanism's formula (a plan) is still there.
  with pytest.raises(ValueError, match="not hold for this run"):
    opt.dp_event(variants.N, batch_size=2, sampling="cyclic_poisson")
  event = opt.noise.accounting_event(
      opt.accounted_noise_multiplier(variants.N), opt.steps_taken,
      "cyclic_poisson", 2, variants.N)
  column = np.linalg.norm([1.0, 0.4])
  want = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          2 * 2 / variants.N, dp_accounting.GaussianDpEvent(
              1.5 * opt.noise.sensitivity / column)), 2)
  assert event == want
  blt = _trained(STRATEGIES["blt"], epochs=1, steps=2)
  with pytest.raises(ValueError, match="banded strategy"):
    blt.noise.accounting_event(1.5, blt.steps_taken, "cyclic_poisson", 2,
                               variants.N)


def test_cyclic_batches_repeat_the_same_order_every_epoch():
  x = np.arange(10, dtype="float32")[:, None]
  dataset = dp.data.cyclic_batches(x, np.arange(10), batch_size=4, seed=0)
  first = [b[1].numpy().tolist() for b in dataset]
  second = [b[1].numpy().tolist() for b in dataset]
  assert first == second and len(first) == 3
  assert sorted(sum(first, [])) == list(range(10))
  assert first[0] != [0, 1, 2, 3]  # permuted once
  with pytest.raises(ValueError, match="different lengths"):
    dp.data.cyclic_batches(x, np.arange(9), batch_size=4, seed=0)
  with pytest.raises(ValueError, match="explicit seed"):
    dp.data.cyclic_batches(x, np.arange(10), batch_size=4, seed=None)


def test_for_cyclic_training_plans_steps_participations_and_separation():
  mechanism = mechanisms.CorrelatedNoise.for_cyclic_training(
      mf.Toeplitz([1.0, 0.5]), num_examples=100, batch_size=30, epochs=3)
  assert (mechanism.steps, mechanism.participations,
          mechanism.min_separation) == (12, 3, 4)
  np.testing.assert_allclose(mechanism.sensitivity,
                             np.sqrt(3 * (1 + 0.25)))


def test_zero_noise_multiplier_with_correlated_noise_is_not_private():
  # σ = 0 with correlated noise is as non-private as without: warned, ε = ∞.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt = dp.DPAdam(1.0, 0.0, noise=mechanisms.CorrelatedNoise(
        mf.Identity(), 4))
  assert any("NOT differentially private" in str(w.message) for w in caught)
  assert not opt.is_private


def test_mf_noise_multiplier_makes_the_run_one_gaussian_at_the_target():
  sigma = dp.compute_mf_noise_multiplier(4.0, 1e-5)
  eps = dp.epsilon_of_event(dp_accounting.GaussianDpEvent(sigma), 1e-5)
  assert 3.99 < eps <= 4.0
  # An independent-noise run of 10 epochs (shuffled) needs √10-ish more σ.
  independent = dp.compute_noise_multiplier(1500, 100, 10, 4.0, 1e-5,
                                            sampling="shuffle")
  assert independent > 2.5 * sigma
