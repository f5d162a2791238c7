"""A privacy statement in plain language, in the spirit of TF-Privacy's."""
import math
import warnings

from tf_dpadambc.accounting import epsilon as epsilon_lib
from tf_dpadambc.accounting import events
from tf_dpadambc.accounting import ledger as ledger_lib
from tf_dpadambc.accounting import run


def privacy_statement(num_examples, batch_size, epochs, noise_multiplier,
                      delta, accountant="rdp", used_microbatching=False):
  """Explains what ε a training run has, and under which assumptions.

  Gives both figures TF-Privacy gives: Poisson sampling (each example in each
  step independently with probability B/N; the tighter, amplified figure,
  earned by ``tf_dpadambc.data.poisson_batches`` with an optimizer built with
  ``expected_batch_size=B``) and each example once per epoch (shuffled
  fixed-size batches, what ``model.fit(..., batch_size=B)`` does; no
  amplification is proven for it). This plans a run: steps are those
  ``model.fit`` takes on N examples in batches of B, epochs · ceil(N/B).
  For a finished run, :func:`optimizer_privacy_statement` says which figure
  holds, from the steps and epochs that actually ran (a ``drop_remainder``
  or truncated pipeline has shorter epochs: more of them for the same
  steps).

  ``used_microbatching=True`` accounts microbatches of several examples, whose
  sensitivity is 2C under add/remove adjacency (effective σ/2).
  """
  sigma = noise_multiplier / 2 if used_microbatching else noise_multiplier
  steps = epsilon_lib.training_steps(num_examples, batch_size, epochs)
  def event(sampling):
    return events.dp_sgd_event(sigma, num_examples, batch_size, steps,
                               sampling)
  return _format(num_examples, batch_size, steps, noise_multiplier, sigma,
                 delta, accountant, event("poisson"), event("shuffle"))


def optimizer_privacy_statement(optimizer, num_examples, delta,
                                accountant="rdp", batch_size=None):
  """The statement for the training a DP optimizer has performed so far
  (:func:`_statement`), with a warning first where this process released
  more than the ledger now holds (an earlier checkpoint restored)."""
  text = _statement(optimizer, num_examples, delta, accountant, batch_size)
  ledger = ledger_lib.ledger_of(optimizer)
  if ledger is None or not getattr(optimizer, "built", False):
    return text
  lines = []
  moved = ledger.rolled_back()
  if moved is not None:
    lines.append(_warning(
        f"{optimizer.name}'s ledger was restored in this process to "
        f"{moved[1]:,} physical batches after it had released {moved[0]:,}: "
        "the ε below is the restored run's and does not count the releases "
        "made before the restore (their checkpoints and models are outputs "
        "too). Account both runs together, or restore into a new process's "
        "run only what you release."))
  lost = ledger.unaccounted_prior_batches()
  if lost:
    lines.append(_warning(
        f"this model ran {lost:,} physical batches under the DP optimizer(s) "
        f"it was compiled with before {optimizer.name}, whose ledger this "
        "process does not have (the run was saved and loaded since): the ε "
        "below does not count them. Compose their dp_event with this one's."))
  elif ledger.prior_run is not None:
    lines.append(
        f"  includes the run this model had before it was compiled with "
        f"{optimizer.name}: {ledger.state().prior_batches:,} physical "
        f"batch(es) under {ledger.prior_run.name} (and any before it), "
        "composed with this run.")
  if not lines:
    return text
  head, _, rest = text.partition("\n")
  return "\n".join([head, *lines, rest])


def _warning(message):
  warnings.warn(message)
  return f"  WARNING: {message}"


def _statement(optimizer, num_examples, delta, accountant, batch_size):
  """The statement for the training a DP optimizer has performed so far.

  Uses the optimizer's own DpEvents: the steps it took, the epochs it ran
  with their real numbers of batches (its ``accounting_ledger``; never an
  assumed ceil(N/B) per epoch), its logical batch size and effective noise
  multiplier (microbatching; σ/2 for a logical step whose accumulated
  batches span two epochs), and says which ε holds for the sampling the run
  used, how it was accounted, and why it is an upper bound where the epochs
  could not be known:

  * ``expected_batch_size=B`` (batches from ``data.poisson_batches``): the
    Poisson-sampled ε, with q = B/N; no once-per-epoch figure (an example
    can be in several steps of an epoch).
  * otherwise (fixed-size batches, e.g. ``model.fit``'s shuffled
    ``batch_size``): the once-per-epoch ε; the Poisson figure is shown
    labelled as NOT applying to the run.
  """
  poisson = getattr(optimizer, "expected_batch_size", None) is not None
  batch_size = batch_size or (optimizer.expected_batch_size if poisson
                              else optimizer.logical_batch_size)
  if not batch_size:
    raise ValueError("The optimizer has taken no private step yet; pass "
                     "batch_size.")
  if getattr(optimizer, "query", None) is not None:
    return _format_query(optimizer, num_examples, batch_size, delta,
                         accountant)
  if optimizer.is_correlated:
    return _format_correlated(optimizer, num_examples, batch_size, delta,
                              accountant)
  def event(sampling):
    return optimizer.dp_event(num_examples, batch_size, sampling)
  structure = None if poisson else _run_structure(optimizer, num_examples)
  sigma = (optimizer.accounted_noise_multiplier(num_examples)
           if structure is None else optimizer.effective_noise_multiplier)
  return _format(num_examples, batch_size, optimizer.steps_taken,
                 optimizer.noise_multiplier, sigma, delta,
                 accountant, event("poisson"),
                 None if poisson else event("shuffle"),
                 reason=optimizer.accounting_reason or (
                     None if structure is None else _MICROBATCHES),
                 run_sampling="poisson" if poisson else "fixed",
                 how=_how_accounted(structure, sigma))


def _run_structure(optimizer, num_examples):
  """The RunStructure of the optimizer's ledger, None before any step."""
  ledger = ledger_lib.ledger_of(optimizer)
  if ledger is None or not optimizer.built or not optimizer.steps_taken:
    return None
  inner = getattr(optimizer, "keras_optimizer", optimizer)
  return run.run_structure(inner, num_examples=num_examples)


def _how_accounted(structure, sigma=None):
  """Lines: the epochs the once-per-epoch ε composes, and why it is an
  upper bound where it is."""
  if structure is None:
    return []
  lines = [f"  accounted from what ran: {structure.describe()}; each example "
           "in at most one batch per epoch (never an assumed ceil(N/B) "
           "batches per epoch)."]
  r = structure.releases
  if sigma is not None and (r.double or r.more_count):
    lines.append(
        "  gradient accumulation: a logical step whose batches span two "
        "epochs can hold one example twice (sensitivity 2Δ: σ/2 = "
        f"{sigma / 2:g}); the worst placement of an example has {r.double} "
        "such step(s)"
        + (f" and {r.more_count} spanning three or more epochs (σ/c)"
           if r.more_count else "")
        + f", composed with {r.single} step(s) at σ = {sigma:g}.")
  reasons = structure.upper_bound_reasons()
  if reasons:
    lines.append("  ε is an upper bound because " + "; ".join(reasons) + ".")
  if structure.notes():
    lines.append("  Note: " + "; ".join(structure.notes()) + ".")
  return lines


_ADD_REMOVE = (
    "adjacency: adding or removing one training example (q = B/N and the "
    "number of steps are taken as fixed before training; they are computed "
    "from N, which is treated as public)")

_ZERO_OUT = (
    "adjacency: zero-out — one training example replaced by one whose "
    "gradient is zero. N is public: with fixed-size batches the number of "
    "batches and the last one's size depend on it, so adding or removing an "
    "example is NOT covered")

_PLANNING = (
    "adjacency: adding or removing one training example for the Poisson "
    "figure (q and the steps fixed in advance, from a public N); zero-out "
    "(one example's gradient replaced by zero, N public) for the "
    "once-per-epoch figure")


def _replace_one_line(event, delta, accountant):
  """The replace-one ε of a fixed-size-batch run, [] where none applies."""
  try:
    swapped = events.replace_one(event)
  except ValueError:
    return []
  value = epsilon_lib.epsilon_of_event(swapped, delta, accountant)
  return [f"  ε ≤ {value:.3f} if one example is replaced by any other "
          "(replace-one: twice the zero-out sensitivity, every σ halved)."]


_MICROBATCHES = ("microbatches of several examples can change by 2C when one "
                 "example is added or removed")


_TWO_C = ("some steps can change by 2C when one example is added or removed — "
          "microbatches of several examples, or an accumulated batch spanning "
          "two epochs")


def _format(num_examples, batch_size, steps, noise_multiplier, sigma, delta,
            accountant, poisson_event, shuffle_event, reason=None,
            run_sampling=None, how=()):
  """``run_sampling``: None (planning: both figures), ``"poisson"`` or
  ``"fixed"`` (a run: the figure that holds for it first). ``how``: lines
  saying how the run's once-per-epoch ε was accounted."""
  expected = "expected " if run_sampling == "poisson" else ""
  lines = [
      "Differential privacy statement (tf_dpadambc)",
      f"  training examples N = {num_examples:,}, {expected}batch size B = "
      f"{batch_size}"
      f" (q = B/N = {batch_size / num_examples:.4g}), steps = {steps:,} "
      f"({steps * batch_size / num_examples:.3g} epochs of N examples)",
      f"  noise multiplier σ = {noise_multiplier:g}"
      + (f" (accounted as σ = {sigma:g}: {reason or _TWO_C})"
         if sigma < noise_multiplier else ""),
      f"  δ = {delta:g}; accountant: {accountant.upper()} (dp_accounting)",
      "  " + {"poisson": _ADD_REMOVE, "fixed": _ZERO_OUT}.get(run_sampling,
                                                             _PLANNING),
  ]
  if noise_multiplier == 0:
    lines.append(
        "  NOT PRIVATE: noise_multiplier = 0 adds no noise. The gradients were "
        "clipped, but no ε holds (ε = ∞).")
    return "\n".join(lines)
  poisson = epsilon_lib.epsilon_of_event(poisson_event, delta, accountant)
  if run_sampling == "poisson":
    lines += [
        "  sampling: Poisson — every step, each example joined the batch "
        "independently with probability q (tf_dpadambc.data.poisson_batches)"
        "; the noisy sum was divided by the expected batch size B, not by "
        "the realized one.",
        f"  ε = {poisson:.3f} with Poisson sampling: the guarantee of this "
        "run (amplification by subsampling; Abadi et al. 2016).",
        "  (No once-per-epoch figure: with Poisson sampling an example can "
        "be in several steps of an epoch.)",
        _ASSUMPTIONS,
        "  It also assumes the sampling randomness stayed secret "
        "(poisson_batches' default seed=None) and that the dataset was "
        "not rebuilt with a fixed seed mid-run.",
    ]
  else:
    shuffle = epsilon_lib.epsilon_of_event(shuffle_event, delta, accountant)
    once = (f"  ε = {shuffle:.3f} if each example is used exactly once per "
            "epoch (shuffled fixed-size batches; no amplification by "
            "sampling assumed)")
    hypothetical = (
        f"  ε = {poisson:.3f} with Poisson sampling (each example joins each "
        "batch independently with probability q)")
    poisson_how = (
        "tf_dpadambc.data.poisson_batches(x, y, expected_batch_size="
        f"{batch_size}) with the optimizer's expected_batch_size="
        f"{batch_size}")
    if run_sampling == "fixed":
      lines += [
          "  sampling: fixed-size batches (e.g. model.fit's shuffled "
          "batch_size); the optimizer has no expected_batch_size.",
          once + ": the guarantee of this run.",
          *_replace_one_line(shuffle_event, delta, accountant),
          *how,
          hypothetical + " does NOT apply to this run: its batches were not "
          f"Poisson samples. It would with {poisson_how}.",
      ]
    else:
      lines += [
          hypothetical + ".",
          once + ".",
          *_replace_one_line(shuffle_event, delta, accountant),
          "  model.fit's shuffled fixed-size batches earn only the second "
          "figure; the first holds for Poisson-sampled batches: "
          f"{poisson_how}.",
      ]
    lines.append(_ASSUMPTIONS)
  if math.isinf(poisson):
    lines.append("  (ε is unbounded for these parameters.)")
  return "\n".join(lines)


_ASSUMPTIONS = (
    "  The guarantee covers the trained model and anything computed from "
    "it. It does not cover the training logs (loss, metrics, the clipped "
    "and non-finite counts are computed without noise). It assumes each "
    "example is one individual's data (for users with several examples, "
    "it protects examples, not users), that hyper-parameters were not "
    "tuned on the private data, and that the noise seed stays secret.")


def _format_query(optimizer, num_examples, batch_size, delta, accountant):
  """The statement of a run privatized by a TF-Privacy DPQuery: its own
  per-step DpEvent, composed; no ε where that event cannot be accounted."""
  from tf_dpadambc import queries  # pylint: disable=g-import-not-at-top
  steps = optimizer.steps_taken
  lines = [
      "Differential privacy statement (tf_dpadambc), DPQuery "
      f"{type(optimizer.query.query).__name__}",
      f"  training examples N = {num_examples:,}, batch size B = {batch_size}"
      f" (q = B/N = {batch_size / num_examples:.4g}), steps = {steps:,}",
      f"  δ = {delta:g}; accountant: {accountant.upper()} (dp_accounting)",
      "  " + _ZERO_OUT,
  ]
  try:
    shuffle_event = optimizer.dp_event(num_examples, batch_size, "shuffle")
    shuffle, poisson = (epsilon_lib.epsilon_of_event(
        event, delta, accountant) for event in (
            shuffle_event,
            optimizer.dp_event(num_examples, batch_size, "poisson")))
  except queries.NotAccountable as e:
    lines.append(f"  NO ε: {e}")
    return "\n".join(lines)
  lines += [
      "  per-step event: the query's own DpEvent "
      f"({optimizer.query_step_event()})",
      f"  ε = {shuffle:.3f} if each example is used exactly once per epoch "
      "(fixed-size batches): the guarantee of this run.",
      *_replace_one_line(shuffle_event, delta, accountant),
      *_how_accounted(_run_structure(optimizer, num_examples)),
      f"  ε = {poisson:.3f} with Poisson sampling does NOT apply to this run "
      "(its batches were not Poisson samples).",
      _ASSUMPTIONS]
  return "\n".join(lines)


def _format_correlated(optimizer, num_examples, batch_size, delta,
                       accountant):
  """The statement of a DP-MF run: one Gaussian mechanism per participation
  pattern, and amplified BandMF where the strategy is banded."""
  mechanism = optimizer.noise
  steps = optimizer.steps_taken
  structure = _run_structure(optimizer, num_examples)
  per_epoch = (structure.accounting_steps_per_epoch() if structure
               else optimizer.logical_steps_per_epoch(num_examples)
               or events.batches_per_epoch(num_examples, batch_size))
  sigma = optimizer.accounted_noise_multiplier(num_examples)
  lines = [
      "Differential privacy statement (tf_dpadambc), correlated noise (DP-MF)",
      f"  training examples N = {num_examples:,}, batch size B = {batch_size}"
      f", steps = {steps:,} ({steps * batch_size / num_examples:.3g} epochs)",
      f"  noise multiplier σ = {optimizer.noise_multiplier:g}"
      + (f" (accounted as σ = {sigma:g}: "
         f"{optimizer.accounting_reason or _TWO_C})"
         if sigma < optimizer.noise_multiplier else ""),
      f"  strategy {mechanism.strategy!r}, calibrated for n = "
      f"{mechanism.steps} steps, k = {mechanism.participations} "
      f"participation(s) ≥ {mechanism.min_separation} steps apart: "
      f"sens(C) = {mechanism.sensitivity:.4g}; step t adds "
      "σ·C·sens(C)·(C⁻¹z)_t to the clipped sum",
      f"  δ = {delta:g}; accountant: {accountant.upper()} (dp_accounting)",
      "  " + (_ADD_REMOVE if getattr(optimizer, "expected_batch_size", None)
              is not None else _ZERO_OUT),
  ]
  if optimizer.noise_multiplier == 0:
    lines.append("  NOT PRIVATE: noise_multiplier = 0 adds no noise (ε = ∞).")
    return "\n".join(lines)

  def epsilon(sampling, adjacency=lambda event: event):
    event = adjacency(optimizer.dp_event(num_examples, batch_size, sampling))
    return epsilon_lib.epsilon_of_event(event, delta, accountant)

  def hypothetical():
    """The amplified ε had the batches been cyclic Poisson (b = bands)."""
    event = mechanism.accounting_event(sigma, steps, "cyclic_poisson",
                                       batch_size, num_examples)
    return epsilon_lib.epsilon_of_event(event, delta, accountant)

  if getattr(optimizer, "expected_batch_size", None) is not None:
    return "\n".join(lines + _cyclic_poisson_lines(
        optimizer, num_examples, batch_size, steps, epsilon, hypothetical))

  for sampling, how in (
      ("cyclic", "if the batches repeat in the same order every epoch "
                 "(tf_dpadambc.data.cyclic_batches with one seed for the "
                 "whole run, resumed only at epoch boundaries)"),
      ("shuffle", "if the data are reshuffled every epoch (model.fit's "
                  "default; an example can be in consecutive steps)")):
    k, s = mechanism.participation(steps, sampling, per_epoch)
    lines.append(f"  ε = {epsilon(sampling):.3f} {how}: k = {k} "
                 f"participation(s) ≥ {s} step(s) apart (replace-one: ε ≤ "
                 f"{epsilon(sampling, events.replace_one):.3f}).")
  lines += _how_accounted(structure)
  try:
    amplified = hypothetical()
    lines.append(
        f"  ε = {amplified:.3f} IF the batches were cyclic-Poisson sampled "
        "(amplified BandMF, Choquette-Choo et al. 2023, Thm 4: examples split "
        "into b groups, step t samples group t mod b with probability B·b/N)"
        "; it does NOT apply to this run, whose batches were fixed-size. It "
        "would with tf_dpadambc.data.cyclic_poisson_batches and the "
        f"optimizer's expected_batch_size={batch_size}.")
  except ValueError:
    pass  # not banded: no amplification result applies
  lines += [
      "  Plain Poisson sampling has no closed-form ε with correlated noise: "
      "none is reported for it.",
      _ASSUMPTIONS,
      "  The noise stream is never saved: a run restored from a file cannot "
      "resume it mid-stream (the optimizer refuses).",
  ]
  return "\n".join(lines)


def _cyclic_poisson_lines(optimizer, num_examples, batch_size, steps, epsilon,
                          hypothetical):
  """A banded DP-MF run on Poisson batches: the amplified ε if the ledger
  verified cyclic Poisson sampling, else no ε (and why)."""
  from tf_dpadambc.accounting import cyclic  # pylint: disable=g-import-not-at-top
  try:
    groups = cyclic.verified_groups(optimizer, num_examples, batch_size)
  except ValueError as e:
    lines = [f"  NO ε holds for this run's random-size batches. {e}"]
    try:
      lines.append(f"  (ε = {hypothetical():.3f} would hold for {steps:,} "
                   "steps of verified cyclic Poisson batches.)")
    except ValueError:
      pass
    return lines + [_ASSUMPTIONS]
  amplified = epsilon("cyclic_poisson")
  p = batch_size * groups / num_examples
  lines = [
      f"  sampling: cyclic Poisson, verified — the examples were split into "
      f"b = {groups} groups and every one of the {steps:,} steps took a "
      f"Poisson sample (probability p = B·b/N = {p:.4g}) of group t mod b "
      "(tf_dpadambc.data.cyclic_poisson_batches; recorded step by step in "
      "the optimizer's ledger); the noisy sum was divided by the expected "
      "batch size B.",
      f"  ε = {amplified:.3f} with cyclic Poisson sampling: the guarantee of "
      "this run (amplified BandMF, Choquette-Choo et al. 2023, Theorem 4: as "
      f"private as DP-SGD with the same σ and p for ceil({steps}/{groups}) "
      "steps).",
      _ASSUMPTIONS,
      "  It also assumes the sampling randomness stayed secret "
      "(cyclic_poisson_batches' default seed=None)"
      + (" — this run's sampling seed was GIVEN (tests and debugging only): "
         "whoever knows it knows the batches" if cyclic.fixed_sampling_seed(
             optimizer) else "") + ".",
      "  The noise stream is never saved: a run restored from a file cannot "
      "resume it mid-stream (the optimizer refuses).",
  ]
  return lines
