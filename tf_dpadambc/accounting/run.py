"""What a DP optimizer's run spent: its DpEvent and the σ it is accounted at.

Free functions of an optimizer (as jax_privacy's ``dpsgd_event``): they read
what the optimizer declares — σ, its privatizer, ``traits`` — and what it
recorded (``run_record``, ``accounting_ledger``), and never change it. The
optimizers' ``dp_event``, ``accounted_noise_multiplier``,
``effective_noise_multiplier`` and ``logical_steps_per_epoch`` delegate here.

Under add/remove-one-example adjacency (Poisson batches) or zero-out
adjacency (fixed-size batches: one example's gradient replaced by zero, N
public) one unit's clipped gradient moves the clipped sum by at most Δ = C,
so each release is a Gaussian mechanism of multiplier σ; the accounted σ is
lower where a release can move by more:

* a microbatch of several examples: 2C (its clipped mean can flip), σ/2;
* a logical step spanning m epochs (gradient accumulation) can hold an
  example m times: σ/m;
* a release whose sensitivity exceeds what its noise pays for (JME under
  replace-one): σ·``accounting_noise_factor``.
"""
import collections

import dp_accounting
import keras
import tensorflow as tf

from tf_dpadambc.accounting import cyclic
from tf_dpadambc.accounting import events
from tf_dpadambc.accounting import ledger as ledger_lib
from tf_dpadambc.core import diagnostics

RunRecord = collections.namedtuple("RunRecord", [
    "max_batch_examples", "max_batch_units", "max_physical_examples",
    "examples_seen"])
RunRecord.__doc__ = """What the accounting needs of a run (0 before build):
the largest logical batch in examples and in clipped units, the largest
physical batch, and the examples of all physical batches."""


class RunRecorder:
  """The saved record of what an optimizer's run released.

  Saved optimizer variables (created with the optimizer's ``add_variable``,
  in this order, which the Keras formats' indices rely on): the largest
  logical batch in examples and in units, the last Φ, the largest physical
  batch, the examples of all physical batches (more than passes × N means
  the recorded epochs were not passes over the data), and the ledger of
  epochs and their batches (``accounting.ledger``), then the last step's
  diagnostics (``core.diagnostics``). Nothing here is secret: counts and Φ
  are public (functions of B, σ, C), the diagnostics post-process releases.
  """

  def __init__(self, add_variable, ledger, diagnostic_names):
    def scalar(name, dtype="int64"):
      return add_variable((), initializer="zeros", dtype=dtype, name=name)
    self.max_batch_examples = scalar("dp_max_batch_examples")
    self.max_batch_units = scalar("dp_max_batch_units")
    self.noise_variance = scalar("dp_noise_variance", "float32")
    self.max_physical_examples = scalar("dp_max_physical_examples")
    self.examples_seen = scalar("dp_examples_seen")
    self.ledger = add_variable(
        (ledger_lib.STATE_SIZE,), dtype="int64", name="dp_accounting_ledger",
        initializer=keras.initializers.Constant(ledger.initial_values()))
    self.diagnostics = {name: scalar(name, "float32")
                        for name in diagnostic_names}

  def note_batch(self, num_examples):
    """One physical batch of ``num_examples`` fed."""
    self.max_physical_examples.assign(
        tf.maximum(self.max_physical_examples, num_examples))
    self.examples_seen.assign_add(num_examples)

  def note_release(self, num_units, num_examples, noise_variance):
    """One logical step released over ``num_units`` units with Φ."""
    self.noise_variance.assign(noise_variance)
    self.max_batch_units.assign(tf.maximum(self.max_batch_units, num_units))
    self.max_batch_examples.assign(
        tf.maximum(self.max_batch_examples, num_examples))

  def note_diagnostics(self, statistics):
    """The step's ``core.diagnostics.MomentStatistics``, summarized."""
    if statistics:
      for name, value in diagnostics.summarize(statistics).items():
        if name in self.diagnostics:
          self.diagnostics[name].assign(value)

  def values(self):
    return RunRecord(*(int(v.numpy()) for v in (
        self.max_batch_examples, self.max_batch_units,
        self.max_physical_examples, self.examples_seen)))


def units_hold_several_examples(optimizer):
  """True once a step showed units of several examples (microbatches);
  before any step, whether microbatching is configured."""
  record = optimizer.run_record
  if record.max_batch_units:
    return record.max_batch_examples > record.max_batch_units
  return optimizer.num_microbatches is not None


def effective_noise_multiplier(optimizer):
  """σ·factor, halved where units hold several examples (sensitivity 2C, as
  TF-Privacy's ``used_microbatching=True``)."""
  if optimizer.query is not None:
    raise ValueError("With a DPQuery the accounting follows the query's "
                     "DpEvent: use dp_event().")
  sigma = optimizer.noise_multiplier * optimizer.traits.accounting_noise_factor
  return sigma / 2 if units_hold_several_examples(optimizer) else sigma


def query_step_event(optimizer):
  """The DpEvent of one release of the optimizer's DPQuery, as accounted:
  Gaussian multipliers halved where units hold several examples."""
  if not optimizer.built:
    raise ValueError("The query's DpEvent is known after the first step.")
  return optimizer.query.step_event(
      optimizer._private.query_state(),  # pylint: disable=protected-access
      divisor=2 if units_hold_several_examples(optimizer) else 1)


def run_structure(optimizer, extra_epoch_batches=0, num_examples=None):
  """The ledger's RunStructure, or None before the first step. With N, an
  epoch longer than one pass over N examples (ceil(N / b) physical batches)
  is not taken for one pass."""
  if not optimizer.built or not (optimizer.steps_taken or extra_epoch_batches):
    return None
  record, ledger = optimizer.run_record, optimizer.accounting_ledger
  physical = record.max_physical_examples
  longest = (events.batches_per_epoch(num_examples, physical)
             if num_examples and physical else None)
  structure = ledger.structure(extra_epoch_batches, longest)
  if num_examples and record.examples_seen > num_examples * (
      structure.passes + structure.unknown_batches):
    # More examples went through than the recorded passes hold (a repeated
    # dataset cut into epochs by steps_per_epoch): the epochs were not
    # passes over the data.
    structure = ledger.structure(extra_epoch_batches, conservative=True)
  return structure


def epochs_per_logical_step(optimizer, num_examples):
  """m: the most epochs a window of k consecutive physical batches (a logical
  step; windows start at multiples of k) can intersect, with P batches per
  epoch (the fewest seen in an epoch, else ceil(N / b)): 1 if k divides P,
  k/P if P divides k, else ceil((k − 1)/P) + 1 (a window starting at an
  epoch's last batch)."""
  k = optimizer.accumulation_steps
  physical = optimizer.run_record.max_physical_examples
  if k == 1 or not physical:
    return 1
  p = events.batches_per_epoch(num_examples, physical)
  structure = run_structure(optimizer, num_examples=num_examples)
  if structure is not None and structure.min_epoch_batches:
    p = min(p, structure.min_epoch_batches)
  if p % k == 0:
    return 1
  if k % p == 0:
    return k // p
  return -(-(k - 1) // p) + 1


def accounted_noise_multiplier(optimizer, num_examples):
  """The smallest σ the accounting uses for N examples: the effective σ
  divided by the most epochs one logical step of the run touched (before the
  first step: the most a step could touch, :func:`epochs_per_logical_step`)."""
  structure = run_structure(optimizer, num_examples=num_examples)
  if structure is None:
    return (effective_noise_multiplier(optimizer)
            / epochs_per_logical_step(optimizer, num_examples))
  return effective_noise_multiplier(optimizer) / structure.max_multiplicity


def planned_noise_multiplier(optimizer, num_examples):
  """σ for a planned run: the worst a logical step could touch."""
  structure = run_structure(optimizer, num_examples=num_examples)
  touched = epochs_per_logical_step(optimizer, num_examples)
  if structure is not None:
    touched = max(touched, structure.max_multiplicity)
  return effective_noise_multiplier(optimizer) / touched


def logical_steps_per_epoch(optimizer, num_examples):
  """Logical steps per pass over the data: the fewest the run's epochs held
  (all but the last), else ceil(N / b) / k, b physical."""
  structure = run_structure(optimizer, num_examples=num_examples)
  if structure is not None and structure.logical_steps_per_epoch():
    return structure.logical_steps_per_epoch()
  physical = optimizer.run_record.max_physical_examples
  if not physical:
    return None
  return (events.batches_per_epoch(num_examples, physical)
          / optimizer.accumulation_steps)


def dp_event(optimizer, num_examples, batch_size=None, sampling=None,
             steps=None, extra_epoch_batches=0):
  """The dp_accounting DpEvent of the training ``optimizer`` performed,
  composed with the runs of the DP optimizers its model was compiled with
  before it in this process (their releases are in the weights too; each
  as it ran: Poisson or once per epoch). Arguments: :func:`own_event`."""
  own = own_event(optimizer, num_examples, batch_size, sampling, steps,
                  extra_epoch_batches)
  previous = optimizer.accounting_ledger.prior_run
  if previous is None:
    return own
  earlier = previous.dp_event(
      num_examples, sampling="shuffle" if previous.expected_batch_size is None
      else "poisson")
  return dp_accounting.ComposedDpEvent([earlier, own])


def own_event(optimizer, num_examples, batch_size=None, sampling=None,
              steps=None, extra_epoch_batches=0):
  """The dp_accounting DpEvent of the training ``optimizer`` itself performed.

  Args:
    optimizer: a DP optimizer.
    num_examples: size N of the training set.
    batch_size: expected logical batch size; defaults to the largest seen
      (``expected_batch_size`` for Poisson batches).
    sampling: None (default): the sampling the run used, ``"poisson"`` for
      an optimizer with ``expected_batch_size``, else ``"shuffle"`` (a
      review read ``dp_event(N)`` of a fixed-size run as its ε: the Poisson
      default it had then does not hold there). ``"poisson"`` (each example
      in each step independently with probability B/N: what the ε from
      ``compute_epsilon`` assumes; it holds for batches from
      ``data.poisson_batches`` with ``expected_batch_size``; for another run
      a what-if) or ``"shuffle"`` (each example once per epoch, no
      amplification). With
      correlated noise: ``"cyclic"`` (fixed batch order every epoch),
      ``"shuffle"`` or ``"cyclic_poisson"`` (amplified BandMF, expected batch
      size B); see ``CorrelatedNoise.accounting_event``. The Poisson events
      are under add/remove adjacency, the fixed-size ones (``"shuffle"``,
      ``"cyclic"``) under zero-out adjacency (N public; for replace-one,
      ``accounting.events.replace_one``).
    steps: ``None`` (default): the run as it happened — the steps taken and,
      once per epoch, the epochs ``optimizer.accounting_ledger`` recorded
      with their real numbers of batches (a logical step whose batches span
      two epochs can hold an example twice: σ/2 for that step). Another
      number of logical steps plans a run (as ``compute_epsilon``): epochs of
      the fewest batches seen, ceil(N/b) before any.
    extra_epoch_batches: also account one more epoch of this many physical
      batches after the run (``PrivacyBudget``'s look-ahead).
  """
  name = optimizer.__class__.__name__
  if optimizer.traits.not_private_reason:
    raise ValueError(f"{name} has no ε: {optimizer.traits.not_private_reason}")
  poisson = "cyclic_poisson" if optimizer.is_correlated else "poisson"
  expected = optimizer.expected_batch_size
  if sampling is None:
    sampling = "shuffle" if expected is None else poisson
  if expected is not None and sampling == "poisson":
    sampling = poisson  # the default: the run's own (banded MF: cyclic)
  if expected is not None and (sampling != poisson
                               or batch_size not in (None, expected)):
    raise ValueError(
        f"{name} takes Poisson-sampled batches (expected_batch_size="
        f"{expected}): only sampling={poisson!r} with that batch size "
        "describes them (an example can be in several steps of an epoch, so "
        "the once-per-epoch accounting does not hold); got "
        f"sampling={sampling!r}, batch_size={batch_size!r}.")
  if expected is not None:
    optimizer.accounting_ledger.check_poisson_examples(num_examples)
  batch_size = batch_size or optimizer.logical_batch_size
  if not batch_size:
    raise ValueError("No private step was taken yet: pass batch_size.")
  planned = steps is not None and steps != optimizer.steps_taken
  groups = None
  if sampling == "cyclic_poisson" and optimizer.is_correlated and not planned:
    # The run's amplified ε only if its ledger verified the sampler.
    groups = cyclic.verified_groups(optimizer, num_examples, batch_size)
  once_per_epoch = sampling in ("shuffle", "cyclic") and not planned
  structure = (run_structure(optimizer, extra_epoch_batches, num_examples)
               if once_per_epoch else None)
  query = optimizer.query is not None
  if structure is None:  # Poisson (steps are all that count), or a plan
    steps = ((optimizer.steps_taken if steps is None else steps)
             + extra_epoch_batches // optimizer.accumulation_steps)
    per_epoch = logical_steps_per_epoch(optimizer, num_examples)
    if query:
      return events.sampled_event(
          query_step_event(optimizer), num_examples, batch_size, steps,
          {"cyclic": "shuffle"}.get(sampling, sampling), per_epoch)
    sigma = (planned_noise_multiplier if planned
             else accounted_noise_multiplier)(optimizer, num_examples)
    return optimizer.noise.accounting_event(
        sigma, steps, sampling, batch_size, num_examples, per_epoch,
        **({"groups": groups} if groups else {}))
  if query:  # no accumulation: one use per epoch
    return events.composed(query_step_event(optimizer),
                           structure.participations)
  if not optimizer.is_correlated:
    return events.shuffled_gaussian_event(
        effective_noise_multiplier(optimizer), structure.releases)
  return optimizer.noise.accounting_event(
      effective_noise_multiplier(optimizer) / structure.max_multiplicity,
      structure.steps, sampling, batch_size, num_examples,
      structure.accounting_steps_per_epoch())
