"""Update rules against NumPy, noise statistics, Φ, accumulation, config."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc.core import clipping
from tf_dpadambc.core import per_example
from tests.conftest import drive

C, SIGMA, B = 0.5, 1.3, 32
PHI = (SIGMA * C / B) ** 2
STREAM = np.random.default_rng(7).normal(0, 0.01, size=(12, 6)).astype("float32")
INIT = np.linspace(-1, 1, 6).astype("float32")


def _noisy_stream(seed, steps=len(STREAM)):
  """The private means ḡ_t the optimizers see with this seed.

  DPSGD with η = 1 moves θ by exactly −ḡ_t, and the noise depends only on
  (seed, step, parameter index): every optimizer with the same seed receives
  the same ḡ_t.
  """
  traj = drive(dp.DPSGD(C, SIGMA, learning_rate=1.0, seed=seed), INIT,
               STREAM[:steps], B)
  prev = np.concatenate([[INIT], traj[:-1]])
  return prev - np.stack(traj)


def _numpy_adam(grads, lr, b1, b2, direction):
  theta, m, v, out = INIT.astype("float64"), 0.0, 0.0, []
  for t, g in enumerate(grads.astype("float64"), start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    theta = theta - lr * direction(m / (1 - b1 ** t), v / (1 - b2 ** t))
    out.append(theta)
  return np.stack(out)


def test_noisy_stream_has_the_clean_mean_plus_noise():
  noisy = _noisy_stream(3)
  assert np.all(np.abs(noisy - STREAM) > 0)  # noise was added
  # ...with std σC/B (weak check on 72 values; the strong one is below).
  assert 0.5 < np.std(noisy - STREAM) / (SIGMA * C / B) < 1.5


def test_dpsgd_momentum_matches_numpy():
  g = _noisy_stream(11)
  traj = drive(dp.DPSGD(C, SIGMA, learning_rate=0.1, momentum=0.9, seed=11),
               INIT, STREAM, B)
  theta, u = INIT.astype("float64"), 0.0
  for t, gt in enumerate(g):
    u = 0.9 * u - 0.1 * gt
    theta = theta + u
    np.testing.assert_allclose(traj[t], theta, rtol=1e-5, atol=1e-6)


def test_dpadam_matches_numpy_adam_on_the_noisy_stream():
  g = _noisy_stream(5)
  traj = drive(dp.DPAdam(C, SIGMA, learning_rate=0.01, epsilon=1e-7, seed=5),
               INIT, STREAM, B)
  want = _numpy_adam(g, 0.01, 0.9, 0.999,
                     lambda m, v: m / (np.sqrt(v) + 1e-7))
  np.testing.assert_allclose(np.stack(traj), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gamma_prime", [1e-8, 1e-4])
def test_dpadambc_matches_numpy_with_phi(gamma_prime):
  g = _noisy_stream(9)
  opt = dp.DPAdamBC(C, SIGMA, learning_rate=1e-3, gamma_prime=gamma_prime,
                    seed=9)
  traj = drive(opt, INIT, STREAM, B)
  want = _numpy_adam(
      g, 1e-3, 0.9, 0.999,
      lambda m, v: m / np.sqrt(np.maximum(v - PHI, gamma_prime)))
  np.testing.assert_allclose(np.stack(traj), want, rtol=1e-4, atol=1e-6)
  # Φ_t is exactly (σC/B)² at every step for a constant batch size.
  # (float32 EMA and 1/(1−β2^t): relative error ~1e-5)
  np.testing.assert_allclose(float(opt.phi(len(STREAM))), PHI, rtol=1e-4)
  np.testing.assert_allclose(float(opt.noise_variance), PHI, rtol=1e-5)


def test_dpadambc_with_zero_phi_is_adam_without_epsilon():
  with pytest.warns(UserWarning, match="NOT differentially private"):
    bc = dp.DPAdamBC(C, 0.0, learning_rate=1e-2, gamma_prime=1e-30)
  with pytest.warns(UserWarning):
    adam = dp.DPAdam(C, 0.0, learning_rate=1e-2, epsilon=0.0)
  np.testing.assert_allclose(np.stack(drive(bc, INIT, STREAM, B)),
                             np.stack(drive(adam, INIT, STREAM, B)),
                             rtol=1e-6)


def test_noise_std_is_sigma_c_over_b():
  # 200k coordinates of pure noise: the sample std has relative standard
  # error 1/sqrt(2n) = 0.16%; tolerance 1% (≈ 6 standard errors).
  n = 200_000
  opt = dp.DPSGD(C, SIGMA, learning_rate=1.0, seed=21)
  first, both = drive(opt, np.zeros(n), [np.zeros(n)] * 2, B)
  assert abs(np.std(first) / (SIGMA * C / B) - 1) < 0.01
  assert abs(np.mean(first)) < 5 * SIGMA * C / B / np.sqrt(n)
  # The next step draws independent noise (|ρ| < 0.01 ≈ 4.5 standard errors).
  assert abs(np.corrcoef(first, both - first)[0, 1]) < 0.01


def test_unseeded_optimizers_draw_different_noise():
  a = drive(dp.DPSGD(C, SIGMA, learning_rate=1.0), np.zeros(100),
            [np.zeros(100)], B)[0]
  b = drive(dp.DPSGD(C, SIGMA, learning_rate=1.0), np.zeros(100),
            [np.zeros(100)], B)[0]
  assert not np.allclose(a, b)


def test_dpadam_second_moment_is_biased_by_phi_and_bc_removes_it():
  # Pure-noise gradients: v̂ estimates E[ḡ²] = Φ. Mean over 100k coordinates
  # after 40 steps: each v̂ has relative std ≈ sqrt(2/40); the mean's is
  # ≈ 0.07%, tolerance 1%.
  n, steps = 100_000, 40
  for cls in (dp.DPAdam, dp.DPAdamBC):
    opt = cls(C, SIGMA, learning_rate=1e-9, seed=4)
    drive(opt, np.zeros(n), [np.zeros(n)] * steps, B)
    v_hat = opt._velocities[0].numpy() / (1 - 0.999 ** steps)
    assert abs(np.mean(v_hat) / PHI - 1) < 0.01
    if cls is dp.DPAdamBC:
      corrected = np.mean(v_hat) - float(opt.phi(steps))
      assert abs(corrected) < 0.01 * PHI


def test_accumulation_is_one_step_over_the_logical_batch():
  # Two physical batches of B/2 units with accumulation == one batch of B.
  seed, n = 13, 50_000
  g = np.random.default_rng(0).normal(size=n).astype("float32") * 0.01
  one = drive(dp.DPSGD(C, SIGMA, learning_rate=1.0, seed=seed),
              np.zeros(n), [g], B)[0]
  acc = dp.DPSGD(C, SIGMA, learning_rate=1.0, seed=seed,
                 gradient_accumulation_steps=2)
  var = keras.Variable(np.zeros(n, "float32"))
  for _ in range(2):
    acc.apply_private(
        clipping.assume_clipped([g * B / 2]), B // 2, B // 2, [var])
  np.testing.assert_allclose(var.numpy(), one, rtol=1e-5, atol=1e-7)
  assert acc.steps_taken == 1
  np.testing.assert_allclose(float(acc.noise_variance), PHI, rtol=1e-5)
  # Noise of the logical batch: std σC/B, not σC/(B/2).
  assert abs(np.std(var.numpy() + g) / (SIGMA * C / B) - 1) < 0.02


def test_aggregated_gradients_are_refused():
  opt = dp.DPAdamBC(C, SIGMA)
  var = keras.Variable(np.zeros(3, "float32"))
  with pytest.raises(RuntimeError, match="make_private"):
    opt.apply_gradients([(np.ones(3, "float32"), var)])
  with pytest.raises(RuntimeError, match="not clipped"):
    opt.apply([np.ones(3, "float32")], [var])


@pytest.mark.parametrize("kwargs, match", [
    (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=-1.0, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=float("nan"), noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=1.0, noise_multiplier=-0.1), "noise_multiplier"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, gamma_prime=0.0), "gamma_prime"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=0), "num_microbatches"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, gradient_accumulation_steps=1.5),
     "gradient_accumulation_steps"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, beta_2=1.0), "beta_2"),
])
def test_invalid_parameters_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dp.DPAdamBC(**kwargs)


@pytest.mark.parametrize("cls, extra", [
    (dp.DPSGD, dict(momentum=0.5, nesterov=True)),
    (dp.DPAdam, dict(epsilon=1e-6, beta_1=0.8)),
    (dp.DPAdamBC, dict(gamma_prime=3e-9, beta_2=0.99)),
])
def test_config_round_trip(cls, extra):
  opt = cls(l2_norm_clip=0.7, noise_multiplier=1.1, num_microbatches=4,
            gradient_accumulation_steps=3, seed=5, weight_decay=0.01, **extra)
  config = opt.get_config()
  clone = cls.from_config(config)
  assert clone.get_config() == config
  for key, value in extra.items():
    assert config[key] == value
  restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
  assert type(restored) is cls and restored.get_config() == config


def test_secret_seed_is_not_serialized():
  assert dp.DPAdamBC(1.0, 1.0).get_config()["seed"] is None


@pytest.mark.parametrize("make, name, value", [
    (lambda: dp.DPSGD(1.0, 0.5), "noise_multiplier", 8.0),
    (lambda: dp.DPSGD(1.0, 0.5), "l2_norm_clip", 2.0),
    (lambda: dp.DPSGD(1.0, 0.5), "expected_batch_size", 10),
    (lambda: dp.DPSGD(1.0, 0.5), "accumulation_steps", 2),
    (lambda: dp.DPSGD(1.0, 0.5), "num_microbatches", 4),
    (lambda: dp.DPSGD(1.0, 0.5), "noise", None),
    (lambda: dp.DPSGD(1.0, 0.5), "privatizer", None),
    (lambda: dp.DPAdamJME(1.0, 0.5), "square_weight", 10.0),
    (lambda: dp.DPAdamJME(1.0, 0.5), "adjacency", "replace_one"),
    (lambda: dp.DP2RMSProp(1.0, 0.5), "preconditioned_clip_norm", 9.0),
    (lambda: dp.DP2RMSProp(1.0, 0.5), "sgd_steps", 1)])
def test_privacy_parameters_are_fixed_once_the_optimizer_is_made(make, name,
                                                                  value):
  # The accounting applies them to every step already taken, and a traced
  # step keeps the old value: a schedule that set noise_multiplier 0.5 → 8
  # after an epoch had ε 0.695 reported for a run of 16.5.
  optimizer = make()
  before = getattr(optimizer, name)
  with pytest.raises(AttributeError, match="fixed when the optimizer"):
    setattr(optimizer, name, value)
  assert getattr(optimizer, name) is before
  optimizer.learning_rate = 0.05  # what is not privacy stays settable
  np.testing.assert_allclose(float(optimizer.learning_rate), 0.05)


def test_apply_private_takes_only_a_clipped_sum():
  # A raw gradient sum released as clipped has no bounded sensitivity (a
  # review: 7,286 times the bound, counted as private steps).
  var = keras.Variable(np.zeros(3, "float32"))
  opt = dp.DPSGD(1.0, 1.0, learning_rate=1.0)
  with pytest.raises(TypeError, match="assume_clipped"):
    opt.apply_private([np.array([1e4, 0.0, 0.0], "float32")], 1, 1, [var])
  assert opt.steps_taken == 0
  np.testing.assert_array_equal(var.numpy(), np.zeros(3))
  opt.apply_private(clipping.assume_clipped([np.zeros(3, "float32")]), 1, 1,
                    [var])
  assert opt.steps_taken == 1


def test_apply_per_unit_takes_only_per_unit_gradients():
  # Rows of a batched jacobian are per-example only if the model never
  # mixes examples (a review: a lag-feature model's jacobian rows fed to
  # apply_per_unit moved the weights by 3C/B for a bound of 2C/B).
  var = keras.Variable(np.zeros(3, "float32"))
  opt = dp.DPSGD(1.0, 0.0, learning_rate=1.0)
  rows = [tf.constant([[1e4, 0.0, 0.0], [0.0, 3.0, 4.0]])]
  with pytest.raises(TypeError, match="assume_per_unit"):
    opt.apply_per_unit(rows, 2, 2, [var])
  assert opt.steps_taken == 0
  np.testing.assert_array_equal(var.numpy(), np.zeros(3))
  opt.apply_per_unit(per_example.assume_per_unit(rows), 2, 2, [var])
  # Each row clipped to C = 1, summed, divided by B = 2 (σ = 0, lr = 1).
  np.testing.assert_allclose(var.numpy(), [-0.5, -0.3, -0.4], rtol=1e-6)
