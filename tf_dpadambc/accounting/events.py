"""The privacy mechanisms of private training, as dp_accounting DpEvents.

Every variant in this library releases, once per logical step, the clipped sum
of a sampled batch plus Gaussian noise of std σ·sensitivity: the DP-SGD event.
Describing it as a DpEvent lets dp_accounting's accountants (RDP, PLD) do all
of the arithmetic.
"""
import math

import dp_accounting

SAMPLINGS = ("poisson", "shuffle")


def batches_per_epoch(num_examples, batch_size):
  """ceil(N / B): how many batches make an epoch."""
  return int(math.ceil(num_examples / batch_size))


def _check(num_examples, batch_size, noise_multiplier, sampling):
  if num_examples < 1 or batch_size < 1:
    raise ValueError("num_examples and batch_size must be ≥ 1; got "
                     f"{num_examples} and {batch_size}.")
  if batch_size > num_examples:
    raise ValueError(f"batch_size={batch_size} exceeds num_examples="
                     f"{num_examples}.")
  if not noise_multiplier >= 0 or not math.isfinite(noise_multiplier):
    raise ValueError(f"noise_multiplier must be ≥ 0; got {noise_multiplier}.")
  if sampling not in SAMPLINGS:
    raise ValueError(f"sampling must be one of {SAMPLINGS}; got {sampling!r}.")


def dp_sgd_event(noise_multiplier, num_examples, batch_size, steps,
                 sampling="poisson", steps_per_epoch=None):
  """The DpEvent of ``steps`` private steps with batches of ``batch_size``.

  Args:
    noise_multiplier: σ, noise std divided by the L2 sensitivity.
    num_examples: N, the training set size.
    batch_size: B, the (expected) logical batch size in examples.
    steps: number of logical steps (noise releases).
    sampling: ``"poisson"``: every example joins each batch independently with
      probability q = B/N (amplification by sampling applies);
      ``"shuffle"``: each example is used once per epoch, the guarantee of one
      Gaussian mechanism per epoch with no amplification (what TF-Privacy
      reports for shuffled fixed-size batches). Its adjacency is zero-out
      (one example's gradient replaced by zero): with fixed-size batches N
      is public, the number of batches and the last one's size depend on it.
    steps_per_epoch: for ``"shuffle"``, logical steps per pass over the data
      (may be fractional with gradient accumulation); default ceil(N / B).

  Returns:
    ``NonPrivateDpEvent`` when σ = 0; ``NoOpDpEvent`` for zero steps.
  """
  _check(num_examples, batch_size, noise_multiplier, sampling)
  if noise_multiplier == 0:
    return dp_accounting.NonPrivateDpEvent()
  return sampled_event(dp_accounting.GaussianDpEvent(noise_multiplier),
                       num_examples, batch_size, steps, sampling,
                       steps_per_epoch)


def sampled_event(step_event, num_examples, batch_size, steps,
                  sampling="poisson", steps_per_epoch=None):
  """``steps`` releases of ``step_event`` (one per logical step), sampled.

  ``"poisson"``: each release sees a Poisson sample of rate q = B/N,
  composed ``steps`` times; ``"shuffle"``: an example is in one release per
  epoch, so the run is ``step_event`` composed once per started epoch.
  """
  _check(num_examples, batch_size, 0, sampling)
  if steps == 0:
    return dp_accounting.NoOpDpEvent()
  if sampling == "poisson":
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(batch_size / num_examples,
                                            step_event), int(steps))
  per_epoch = steps_per_epoch or batches_per_epoch(num_examples, batch_size)
  # Every started pass over the data counts as one more participation.
  epochs = int(math.ceil(steps / per_epoch - 1e-9))
  return dp_accounting.SelfComposedDpEvent(step_event, epochs)


def composed(event, count):
  """``event`` released ``count`` times (NoOp for none)."""
  if count <= 0:
    return dp_accounting.NoOpDpEvent()
  return dp_accounting.SelfComposedDpEvent(event, int(count))


def shuffled_gaussian_event(noise_multiplier, releases):
  """The once-per-epoch DpEvent of a run, from what it ran.

  Each example is in at most one physical batch per epoch (pass over the
  data), so in at most one logical step per epoch — or, where a logical
  step's k batches span several epochs (gradient accumulation), in that
  step once per epoch it spans. ``releases``
  (:class:`~tf_dpadambc.accounting.ledger.Releases`) counts, for the worst
  placement of an example, the logical steps holding it once (Gaussian
  mechanism of multiplier σ), twice (sensitivity 2Δ: σ/2) and c ≥ 3 times
  (σ/c, written as c² releases at σ, exactly as private for the Gaussian
  mechanism). Without accumulation: one Gaussian(σ) per epoch run.
  """
  if noise_multiplier == 0:
    return dp_accounting.NonPrivateDpEvent()
  parts = [composed(dp_accounting.GaussianDpEvent(sigma), count)
           for sigma, count in ((noise_multiplier, releases.single),
                                (noise_multiplier / 2, releases.double),
                                (noise_multiplier, releases.more_squares))
           if count]
  if not parts:
    return dp_accounting.NoOpDpEvent()
  return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)


def replace_one(event):
  """``event`` under replace-one adjacency, from its zero-out accounting.

  Replacing example x by y is zero-out of x then of y: by the triangle
  inequality every release can move by at most twice its zero-out
  sensitivity, so every Gaussian mechanism's multiplier halves (σ → σ/2).
  An upper bound (where units are microbatches, 2C already bounds any
  change). Only for runs without amplification by sampling, whose events
  compose Gaussians; anything else raises ``ValueError``.
  """
  if isinstance(event, (dp_accounting.NoOpDpEvent,
                        dp_accounting.NonPrivateDpEvent)):
    return event
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return dp_accounting.GaussianDpEvent(event.noise_multiplier / 2)
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    return dp_accounting.SelfComposedDpEvent(replace_one(event.event),
                                             event.count)
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return dp_accounting.ComposedDpEvent(
        [replace_one(e) for e in event.events])
  raise ValueError(f"No replace-one accounting for {type(event).__name__}.")


def correlated_noise_event(noise_multiplier, calibrated_sensitivity,
                           sensitivity):
  """The DpEvent of a whole DP-MF run without amplification.

  The run releases C·G + Z with noise std σ·Δ·s_cal per coordinate of Z,
  where s_cal is the sensitivity the noise was calibrated for; one example
  moves C·G by at most Δ·sens(C) for the participation pattern actually used
  (``tf_dpadambc.mf.sensitivity``). That is one Gaussian mechanism with
  multiplier σ·s_cal/sens(C) (Choquette-Choo et al. 2023, §2; Denisov et al.
  2022), composed once whatever the number of steps.
  """
  if noise_multiplier == 0:
    return dp_accounting.NonPrivateDpEvent()
  return dp_accounting.GaussianDpEvent(
      noise_multiplier * calibrated_sensitivity / sensitivity)


def amplified_banded_event(noise_multiplier, sampling_probability, steps,
                           bands):
  """Amplified BandMF (Choquette-Choo et al. 2023, Theorem 4).

  A b-banded C whose columns have norm ≤ 1, with the examples split into b
  groups and step t Poisson-sampling group (t mod b) with probability p
  ("cyclic Poisson sampling"), is exactly as private as DP-SGD with the
  same σ and p run for ceil(n/b) steps.
  """
  if not 0 < sampling_probability <= 1:
    raise ValueError("sampling_probability must be in (0, 1]; got "
                     f"{sampling_probability}.")
  if noise_multiplier == 0:
    return dp_accounting.NonPrivateDpEvent()
  if steps == 0:
    return dp_accounting.NoOpDpEvent()
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          sampling_probability,
          dp_accounting.GaussianDpEvent(noise_multiplier)),
      int(math.ceil(steps / bands)))
