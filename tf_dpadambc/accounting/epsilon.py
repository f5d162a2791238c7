"""ε for a training run, and σ for a target ε, with dp_accounting.

dp_accounting's RDP accountant evaluates the subsampled Gaussian at
fractional orders by a series that does not always converge for small orders
(1.1 … 1.9, and 2.1 … 2.5 at q ≥ 0.5) and large sampling rates q: it then
leaves that order out of the minimum over orders and logs "_compute_log_a_frac
failed to converge … Excluding this order", once per order and per call. The
ε stays a valid upper bound (a minimum over fewer orders), and those orders
matter only for ε ≳ 10 (they are minimizers only when log(1/δ)/(α − 1) is
small). Our calls therefore drop that one message (:func:`_quiet_rdp`); the
numbers are dp_accounting's, unchanged.
"""
import contextlib
import logging
import math

import dp_accounting

from tf_dpadambc.accounting import events

ACCOUNTANTS = ("rdp", "pld")
_NOT_CONVERGED = "_compute_log_a_frac failed to converge"


class _DropNotConverged(logging.Filter):

  def filter(self, record):
    return not str(record.msg).startswith(_NOT_CONVERGED)


@contextlib.contextmanager
def _quiet_rdp():
  """Drops dp_accounting's "failed to converge … Excluding this order"
  warnings (see the module docstring) while our accounting runs."""
  logger, drop = logging.getLogger("absl"), _DropNotConverged()
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


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
  with _quiet_rdp():
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
  being post-processing. Poisson sampling: add/remove-one-example adjacency
  (q and the steps fixed before training, from a public N). ``"shuffle"``
  (fixed-size batches): zero-out adjacency, one example replaced by one with
  zero gradient, N public — adding or removing an example changes the
  number of batches or the last one's divisor, which this ε does not cover.

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
    with _quiet_rdp():
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
  with _quiet_rdp():
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: make_accountant(accountant),
        lambda sigma: events.correlated_noise_event(sigma, 1.0, 1.0),
        target_epsilon, delta,
        bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-2, 1.0),
        tol=tolerance))
