"""ε against dp_accounting computed directly; σ calibration; statements."""
import logging
import math

import dp_accounting
import pytest

import tf_dpadambc as dp


def _direct(q, sigma, steps, delta, accountant):
  acc = (dp_accounting.rdp.RdpAccountant() if accountant == "rdp"
         else dp_accounting.pld.PLDAccountant())
  acc.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
      steps))
  return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_equals_direct_dp_accounting(accountant):
  eps = dp.compute_epsilon(60_000, 256, 3, 1.1, 1e-5, accountant=accountant)
  # model.fit takes epochs · ceil(N/B) steps.
  want = _direct(256 / 60_000, 1.1, 3 * math.ceil(60_000 / 256), 1e-5,
                 accountant)
  assert eps == pytest.approx(want, rel=1e-9)


def test_matches_tf_privacy_reference_statement():
  # TF-Privacy's compute_dp_sgd_privacy_statement(60000, 256, 3, 1.1, 1e-5,
  # used_microbatching=True) prints 18.950 (once per epoch) and 5.824
  # (Poisson, over ceil(3·60000/256) = 704 steps). We count the 705 steps
  # model.fit takes (3 · ceil(60000/256)), one more: a slightly larger ε.
  text = dp.privacy_statement(60_000, 256, 3, 1.1, 1e-5,
                              used_microbatching=True)
  assert "ε = 18.950 if each example" in text
  assert _direct(256 / 60_000, 0.55, 704, 1e-5, "rdp") == pytest.approx(
      5.824, abs=5e-4)
  poisson = _direct(256 / 60_000, 0.55, 705, 1e-5, "rdp")
  assert f"ε = {poisson:.3f} with Poisson" in text
  assert poisson > 5.824


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_noise_multiplier_round_trip(accountant):
  n, b, epochs = 4_000, 200, 2
  sigma = dp.compute_noise_multiplier(n, b, epochs, 3.0, 1e-5,
                                      accountant=accountant)
  eps = dp.compute_epsilon(n, b, epochs, sigma, 1e-5, accountant=accountant)
  assert eps <= 3.0
  assert eps > 3.0 * 0.99  # σ is not needlessly large
  assert dp.compute_epsilon(n, b, epochs, sigma * 0.97, 1e-5,
                            accountant=accountant) > 3.0


def test_more_noise_less_epsilon_and_shuffle_costs_more():
  a = dp.compute_epsilon(5_000, 100, 4, 1.0, 1e-5)
  b = dp.compute_epsilon(5_000, 100, 4, 2.0, 1e-5)
  s = dp.compute_epsilon(5_000, 100, 4, 1.0, 1e-5, sampling="shuffle")
  assert b < a < s


def test_steps_are_those_fit_takes():
  # N = 1000, B = 300: fit runs 4 batches per epoch, 40 in 10 epochs.
  eps = dp.compute_epsilon(1000, 300, 10, 1.0, 1e-5, sampling="shuffle")
  assert eps == pytest.approx(dp.epsilon_of_event(
      dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0),
                                        10), 1e-5))
  assert dp.compute_epsilon(1000, 300, 10, 1.0, 1e-5) == pytest.approx(
      _direct(0.3, 1.0, 40, 1e-5, "rdp"))


def test_non_private_is_said_plainly():
  assert dp.compute_epsilon(1000, 10, 1, 0.0, 1e-5) == math.inf
  assert isinstance(dp.dp_sgd_event(0.0, 1000, 10, 5),
                    dp_accounting.NonPrivateDpEvent)
  assert "NOT PRIVATE" in dp.privacy_statement(1000, 10, 1, 0.0, 1e-5)


@pytest.mark.parametrize("kwargs", [
    dict(num_examples=100, batch_size=200, steps=1, noise_multiplier=1.0),
    dict(num_examples=100, batch_size=10, steps=1, noise_multiplier=-1.0),
    dict(num_examples=100, batch_size=10, steps=1, noise_multiplier=1.0,
         sampling="sometimes"),
])
def test_bad_accounting_input(kwargs):
  with pytest.raises(ValueError):
    dp.dp_sgd_event(**kwargs)


def test_bad_delta():
  with pytest.raises(ValueError, match="delta"):
    dp.compute_epsilon(1000, 10, 1, 1.0, 0.0)


def test_rdp_convergence_warnings_are_dropped_and_numbers_unchanged(caplog):
  # q = 0.3, σ = 1: dp_accounting cannot evaluate orders 1.1 … 1.8 and warns
  # once per order; our calls drop that message (scoped to them), and ε is
  # dp_accounting's own.
  with caplog.at_level(logging.WARNING):
    eps = dp.compute_epsilon(1000, 300, 10, 1.0, 1e-5)
    sigma = dp.compute_noise_multiplier(1000, 300, 10, 8.0, 1e-5)
  assert not [r for r in caplog.records
              if "failed to converge" in r.getMessage()]
  assert sigma > 0
  with caplog.at_level(logging.WARNING):
    direct = _direct(0.3, 1.0, 40, 1e-5, "rdp")
  assert eps == direct
  # The control: dp_accounting itself warns here (0.5 and later; 0.4.3, the
  # TF-Privacy configuration, does not, and has nothing to filter).
  if not [r for r in caplog.records if "failed to converge" in r.getMessage()]:
    pytest.skip("this dp-accounting version does not warn for this case")
