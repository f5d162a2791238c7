"""advise(): Ganesh et al. (2025) §4.4 regimes, exact boundaries, verdict."""
import dataclasses
import math

import keras
import pytest

from tf_dpadambc import advisor
from tf_dpadambc import theory


def _max_parameters(bound):
  """Largest integer m with bound ≥ c·√m (β2 = 0.999)."""
  return math.floor((bound / advisor.regime_constant(0.999))**2)


def test_regime_constant_is_ganesh_015():
  assert advisor.regime_constant(0.999) == pytest.approx(1999**-0.25)
  assert advisor.regime_constant(0.999) == pytest.approx(0.15, abs=0.001)
  # Appendix C, Eq. 6, general β2.
  assert advisor.regime_constant(0.99) == pytest.approx(
      (0.01**2 / (1 - 0.99**2))**0.25)


def test_optimistic_condition_flips_exactly_at_the_threshold():
  # B/σ = 640: Eq. 2 holds up to m = (640/c)².
  m = _max_parameters(256 / 0.4)
  inside = advisor.advise(256, 0.4, 0.1, m)
  outside = advisor.advise(256, 0.4, 0.1, m + 1)
  assert inside.optimistic_condition and not outside.optimistic_condition
  assert inside.regime == advisor.INTERMEDIATE
  assert outside.regime == advisor.HIGH_DIMENSIONAL
  assert inside.b_over_sigma >= inside.threshold
  assert outside.b_over_sigma < outside.threshold


def test_pessimistic_condition_flips_exactly_at_the_threshold():
  # √B/σ = 40: Eq. 3 holds up to m = (40/c)².
  m = _max_parameters(math.sqrt(256) / 0.4)
  inside = advisor.advise(256, 0.4, 0.1, m)
  outside = advisor.advise(256, 0.4, 0.1, m + 1)
  assert inside.pessimistic_condition and not outside.pessimistic_condition
  assert inside.regime == advisor.LOW_DIMENSIONAL
  assert outside.regime == advisor.INTERMEDIATE


def test_min_batch_sizes_are_the_boundaries():
  advice = advisor.advise(256, 1.0, 1.0, 1_000_000)
  assert advice.regime == advisor.INTERMEDIATE
  b_low = advice.min_batch_size_pessimistic
  assert advisor.advise(math.ceil(b_low), 1.0, 1.0, 1_000_000).regime == (
      advisor.LOW_DIMENSIONAL)
  assert advisor.advise(math.floor(b_low), 1.0, 1.0, 1_000_000).regime == (
      advisor.INTERMEDIATE)
  b_opt = advisor.advise(2, 1.0, 1.0, 1_000_000).min_batch_size_optimistic
  assert advisor.advise(math.ceil(b_opt), 1.0, 1.0,
                        1_000_000).optimistic_condition
  assert not advisor.advise(math.floor(b_opt), 1.0, 1.0,
                            1_000_000).optimistic_condition


def test_quantities():
  advice = advisor.advise(256, 0.4, 0.1, 4_400_000)
  assert advice.phi == theory.phi(256, 0.1, 0.4)
  assert advice.b_over_sigma == pytest.approx(640)
  assert advice.sqrt_b_over_sigma == pytest.approx(40)
  assert advice.threshold == pytest.approx(0.1496 * math.sqrt(4_400_000),
                                           rel=1e-3)
  assert advice.dpsgdm_learning_rate_factor == pytest.approx(640)
  # γ' range: Tang et al.'s tuned γ'/Φ; SNLI (this very Φ) used 1e-10, the
  # low end, and CIFAR10 5e-8 at Φ = (2/8192)².
  lo, hi = advice.gamma_prime_range
  assert lo == pytest.approx(1e-10)
  assert hi == pytest.approx(advice.phi * 5e-8 / (2 / 8192)**2)
  with pytest.raises(dataclasses.FrozenInstanceError):
    advice.regime = advisor.LOW_DIMENSIONAL


def test_gradient_accumulation_multiplies_the_batch():
  a = advisor.advise(128, 0.4, 0.1, 10_000, gradient_accumulation_steps=2)
  b = advisor.advise(256, 0.4, 0.1, 10_000)
  assert a.batch_size == b.batch_size == 256
  assert (a.phi, a.regime, a.threshold) == (b.phi, b.regime, b.threshold)
  assert "gradient_accumulation_steps" in str(advisor.advise(
      128, 1.0, 1.0, 10**7, gradient_accumulation_steps=2))


def test_ganesh_tinybert_settings():
  # m ≈ 4.4M, B = 2048: σ = 1 fails the pessimistic condition; σ ≈ 0.134
  # passes both (where they still saw 45–50% negative v̂ − Φ: the caveat).
  assert advisor.advise(2048, 1.0, 1.0, 4_400_000).regime == (
      advisor.INTERMEDIATE)
  low = advisor.advise(2048, 0.134, 1.0, 4_400_000)
  assert low.regime == advisor.LOW_DIMENSIONAL
  assert "45–50%" in str(low)


def test_text_names_the_right_variants():
  high = str(advisor.advise(256, 1.0, 1.0, 10**8))
  assert "Regime: high-dimensional" in high
  assert "DPAdamBC (bias correction) and DPAdamIME" in high
  assert "not recommended" in high
  assert "DPAdamSTP (scale-then-privatize): the recommended" in high
  assert "fails" in high and "holds" not in high.split("Regime")[0]

  middle = str(advisor.advise(256, 0.4, 0.1, 4_400_000))
  assert "Regime: intermediate" in middle
  assert "works only if per-example gradients are well aligned" in middle

  low = str(advisor.advise(4096, 0.5, 1.0, 10_000))
  assert "Regime: low-dimensional" in low
  assert "DPAdamBC (bias correction): this is the regime where it can help" in (
      low)
  for text in (high, middle, low):
    for name in ("DPAdamBC", "DPAdamIME", "DPAdamSTP", "DPAdam (no correction)",
                 "Φ = (σC/B)²", "γ'"):
      assert name in text


def test_model_parameters_are_counted():
  model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(5),
                            keras.layers.BatchNormalization()])
  # Dense 10·5 + 5; BatchNormalization 5 + 5 trainable (+10 not trainable).
  advice = advisor.advise(256, 1.0, 1.0, model=model)
  assert advice.num_parameters == 65


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_parameters=None), "exactly one"),
    (dict(model=keras.Sequential([keras.layers.Dense(3)])), "exactly one"),
    (dict(num_parameters=0), "num_parameters"),
    (dict(num_parameters=1.5), "num_parameters"),
    (dict(num_parameters=True), "num_parameters"),
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=0.5), "logical batch"),
    (dict(l2_norm_clip=0), "l2_norm_clip"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    (dict(beta_2=1.0), "beta_2"),
    (dict(beta_1=-0.5), "beta_1"),
])
def test_invalid_input_raises(kwargs, match):
  args = dict(batch_size=256, noise_multiplier=1.0, l2_norm_clip=1.0,
              num_parameters=1000)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    advisor.advise(**args)


def test_unbuilt_or_foreign_model_raises():
  with pytest.raises(ValueError, match="build it first"):
    advisor.advise(256, 1.0, 1.0,
                   model=keras.Sequential([keras.layers.Dense(3)]))
  with pytest.raises(ValueError, match="Keras model"):
    advisor.advise(256, 1.0, 1.0, model=object())
