"""The white-box audit through the real private step: soundness and power.

Each audit trains the canary model with ``make_private`` + ``fit`` and the
optimizer under test, reads every release, and bounds ε from below at 95%
(``audit.estimators``). Sound: the bound stays below the claim. Powerful:
it reaches a stated fraction of the claim, and a deliberately broken
mechanism (noise halved, or noise missing on a path) is flagged.
"""
import dataclasses

import numpy as np
import pytest

import tf_dpadambc as dp
from tf_dpadambc import mf
from tf_dpadambc.accounting import epsilon as epsilon_lib
from tf_dpadambc.audit import canaries
from tf_dpadambc.audit import cli
from tf_dpadambc.audit import estimators

DELTA = 1e-5
N_CANARIES, N_BACKGROUND, B, EPOCHS = 2000, 2000, 400, 4


def _bounds(scores):
  return cli.estimate(scores, 0.95)


def _audit(make, sampling="shuffle", **kwargs):
  options = dict(num_canaries=N_CANARIES, num_background=N_BACKGROUND,
                 batch_size=B, epochs=EPOCHS, delta=DELTA, sampling=sampling,
                 seed=1)
  options.update(kwargs)
  return canaries.white_box_scores(make, **options)


def _sigma(epsilon, sampling="shuffle", batch=B):
  return epsilon_lib.compute_noise_multiplier(
      num_examples=N_CANARIES + N_BACKGROUND, batch_size=batch, epochs=EPOCHS,
      target_epsilon=epsilon, delta=DELTA, sampling=sampling)


# At ε = 2 the in/out gap is small: 5,000 canaries give the power that
# 2,000 give at ε ≥ 4 (with 2,000, GDP reached 41% of the claim at ε = 2).
# Even so the one-run bound varies with the noise seed: over 12 runs (seeds
# 1-5 and 11, with the Box–Muller and with TensorFlow's sampler) GDP reached
# 61% of the claim on average, 37% at the least; hence 40% there.
@pytest.mark.parametrize("name,epsilon,m,power", [("DPSGD", 2.0, 5000, 0.4),
                                                  ("DPSGD", 8.0, 2000, 0.5),
                                                  ("DPAdamBC", 4.0, 2000, 0.5)])
def test_white_box_audit_is_sound_and_has_power(name, epsilon, m, power):
  background = N_CANARIES + N_BACKGROUND - m if m < 4000 else 1000
  batch = (m + background) // 10
  sigma = epsilon_lib.compute_noise_multiplier(
      num_examples=m + background, batch_size=batch, epochs=EPOCHS,
      target_epsilon=epsilon, delta=DELTA, sampling="shuffle")
  cls = getattr(dp, name)
  # A fixed noise seed: the bound is a random variable (one run), and the
  # test must not be flaky; any seed shows the same power on average.
  scores = _audit(lambda c: cls(c, sigma, learning_rate=0.1, seed=11),
                  num_canaries=m, num_background=background, batch_size=batch)
  assert scores.claimed_epsilon == pytest.approx(epsilon, rel=0.02)
  # The scores are what the mechanism implies: in-mean − out-mean = √E/σ
  # standard deviations (Gaussian mechanism, E participations).
  mu = (scores.in_scores.mean() - scores.out_scores.mean()) / np.std(
      scores.out_scores)
  assert mu == pytest.approx(np.sqrt(EPOCHS) / sigma, rel=0.15)
  bounds = _bounds(scores)
  for method, bound in bounds.items():
    assert bound <= scores.claimed_epsilon, (method, bounds)
  assert bounds["GDP"] >= power * scores.claimed_epsilon, bounds


def test_a_mechanism_with_half_the_noise_is_flagged():
  sigma = _sigma(4.0)
  scores = _audit(lambda c: dp.DPSGD(c, sigma / 2, learning_rate=0.1, seed=11))
  claim = 4.0  # what the correct mechanism claims
  assert _bounds(scores)["GDP"] > claim


def test_a_path_that_adds_no_noise_is_flagged(monkeypatch):
  # A bug that skips the noise on one path (here: the sampler returns 0).
  sigma = _sigma(4.0)
  optimizer_cls = dp.DPSGD

  class Broken(optimizer_cls):
    def _sampler(self):
      sample, states = super()._sampler()
      return (lambda templates, stddev, stream=0: [
          0.0 * z for z in sample(templates, stddev, stream)]), states
  scores = _audit(lambda c: Broken(c, sigma, learning_rate=0.1, seed=11),
                  num_canaries=400, num_background=400, batch_size=200,
                  epochs=1)
  assert _bounds(scores)["one-run"] > scores.claimed_epsilon


@pytest.mark.parametrize("variant", ["vectorized", "accumulation", "poisson",
                                     "banded_mf"])
def test_audit_of_other_paths_stays_below_the_claim(variant):
  sampling, batch, kwargs, options = "shuffle", B, {}, {}
  if variant == "vectorized":
    options["clipping"] = "vectorized"
  if variant == "accumulation":
    batch, kwargs["gradient_accumulation_steps"] = B // 2, 2
  if variant == "poisson":
    sampling = "poisson"
    kwargs["expected_batch_size"] = B
  sigma = _sigma(4.0, sampling)
  if variant == "banded_mf":
    sampling = "cyclic"
    steps = (N_CANARIES + N_BACKGROUND) // B * EPOCHS
    kwargs["noise"] = dp.CorrelatedNoise.for_cyclic_training(
        mf.optimize_banded(steps, bands=4), N_CANARIES + N_BACKGROUND, B,
        EPOCHS)
    sigma = 1.0
  scores = _audit(lambda c: dp.DPSGD(c, sigma, learning_rate=0.1, seed=11, **kwargs),
                  sampling=sampling, batch_size=batch, **options)
  bounds = _bounds(scores)
  assert 0 < bounds["GDP"] <= scores.claimed_epsilon, bounds
  assert bounds["one-run"] <= scores.claimed_epsilon, bounds


def test_black_box_canaries_stay_below_the_claim():
  from sklearn import datasets  # pylint: disable=import-outside-toplevel
  import keras  # pylint: disable=import-outside-toplevel
  x, y = datasets.load_digits(return_X_y=True)
  x = (x / 16.0).astype("float32")

  def build():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
  scores = canaries.black_box_scores(
      lambda c: dp.DPSGD(c, 0.8, learning_rate=0.5), x, y, num_canaries=100,
      num_classes=10, build_model=build, batch_size=100, epochs=5)
  assert len(scores.in_scores) + len(scores.out_scores) == 100
  for bound in _bounds(scores).values():
    assert bound <= scores.claimed_epsilon


def test_cli_writes_the_report(tmp_path):
  out = tmp_path / "audit"
  rows = cli.run(cli.parse_args([
      "--variants", "DPSGD", "--epsilon", "4", "--canaries", "400",
      "--background", "400", "--batch-size", "200", "--epochs", "2",
      "--out", str(out)]))
  text = (out / "results.md").read_text()
  assert "| DPSGD | white-box gradient |" in text
  assert (out / "scores_DPSGD.png").stat().st_size > 0
  (_, _, scores, bounds, _), = rows
  assert max(bounds.values()) <= scores.claimed_epsilon
