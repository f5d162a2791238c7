"""ε for a training run, and σ for a target ε, with dp_accounting."""
import math

import dp_accounting

from tf_dpadambc.accounting import events

ACCOUNTANTS = ("rdp", "pld")


def make_accountant(accountant="rdp"):
  """A fresh dp_accounting accountant: ``"rdp"`` (as TF-Privacy) or ``"pld"``."""
  if accountant == "rdp":
    return dp_accounting.rdp.RdpAccountant()
  if accountant == "pld":
    return dp_accounting.pld.PLDAccountant()
  raise ValueError(f"accountant must be one of {ACCOUNTANTS}; got "
                   f"{accountant!r}.")


def epsilon_of_event(event, delta, accountant="rdp"):
  """ε at δ of a DpEvent; ``inf`` for a non-private event."""
  if not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1); got {delta}.")
  if isinstance(event, dp_accounting.NonPrivateDpEvent):
    return math.inf
  acc = make_accountant(accountant)
  acc.compose(event)
  return float(acc.get_epsilon(delta))


def training_steps(num_examples, batch_size, epochs):
  """The steps ``model.fit`` takes: ceil(epochs · ceil(N / B)).

  (TF-Privacy counts ceil(epochs · N / B), one step short per epoch when B
  does not divide N.)
  """
  return int(math.ceil(epochs * events.batches_per_epoch(num_examples,
                                                       batch_size) - 1e-9))


def compute_epsilon(num_examples, batch_size, epochs, noise_multiplier, delta,
                    accountant="rdp", sampling="poisson"):
  """ε of DP training with Poisson sampling (or ``sampling="shuffle"``).

  Holds for every tf_dpadambc variant with these (N, B, epochs, σ): each
  releases one Gaussian mechanism of multiplier σ per step, everything else
  being post-processing. Add/remove-one-example adjacency.

  Returns ``math.inf`` (not private) when ``noise_multiplier == 0``.
  """
  event = events.dp_sgd_event(
      noise_multiplier, num_examples, batch_size,
      training_steps(num_examples, batch_size, epochs), sampling)
  return epsilon_of_event(event, delta, accountant)


def compute_noise_multiplier(num_examples, batch_size, epochs, target_epsilon,
                             delta, accountant="rdp", sampling="poisson",
                             tolerance=1e-3):
  """The smallest σ whose ε (as :func:`compute_epsilon`) is ≤ target_epsilon."""
  if not target_epsilon > 0:
    raise ValueError(f"target_epsilon must be > 0; got {target_epsilon}.")
  steps = training_steps(num_examples, batch_size, epochs)

  def calibrate(name, bracket):
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: make_accountant(name),
        lambda sigma: events.dp_sgd_event(sigma, num_examples, batch_size,
                                          steps, sampling),
        target_epsilon, delta, bracket_interval=bracket, tol=tolerance))

  sigma_rdp = calibrate(
      "rdp", dp_accounting.LowerEndpointAndGuess(1e-2, 1.0))
  if accountant == "rdp":
    return sigma_rdp
  # PLD is tighter than RDP (its σ is smaller) but costly for tiny σ: search
  # only below the RDP answer.
  make_accountant(accountant)  # validates the name
  return calibrate(accountant, dp_accounting.ExplicitBracketInterval(
      sigma_rdp / 4, sigma_rdp))


def compute_mf_noise_multiplier(target_epsilon, delta, accountant="rdp",
                                tolerance=1e-3):
  """σ of a DP-MF run (``CorrelatedNoise``) with ε ≤ target_epsilon.

  The noise of a correlated run is calibrated to sens(C) for its planned
  participation, so the whole run is one Gaussian mechanism of multiplier σ
  (``events.correlated_noise_event``), whatever the number of steps or
  epochs. (Amplified BandMF with cyclic Poisson sampling needs less: see
  ``CorrelatedNoise.accounting_event``.)
  """
  if not target_epsilon > 0:
    raise ValueError(f"target_epsilon must be > 0; got {target_epsilon}.")
  make_accountant(accountant)  # validates the name
  return float(dp_accounting.calibrate_dp_mechanism(
      lambda: make_accountant(accountant),
      lambda sigma: events.correlated_noise_event(sigma, 1.0, 1.0),
      target_epsilon, delta,
      bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-2, 1.0),
      tol=tolerance))
