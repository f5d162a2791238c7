"""Cyclic Poisson sampling, verified: the ledger records that it ran.

Amplified BandMF (Choquette-Choo et al. 2023, Theorem 4) holds only if step t
took a Poisson sample of group t mod b. A flag saying "cyclic Poisson" would
be trusted, not verified; instead, :class:`CyclicPoissonRecorder` (installed
by ``make_private``'s ``fit`` when its data is a
``data.cyclic_poisson_batches`` dataset, as returned) checks, batch by batch,
that the optimizer's position (physical batches released so far) advanced by
exactly the dataset's batches, and that every epoch (which restarts the
dataset at group 0) began at a step ≡ 0 (mod b). It counts such batches in
the optimizer's ledger, which is saved and restored with the optimizer.

:func:`verified_groups` then gives b only if every batch the optimizer ever
ran was counted, for the same sampler (b, B, N and partition), with no
broken step;
otherwise it raises with the reason, and the amplified ε is not the run's.
"""
import hashlib

import keras
import numpy as np

from tf_dpadambc.accounting import ledger as ledger_lib


def partition_digest(partition):
  """A positive 62-bit digest of a cyclic Poisson partition (b arrays of
  example indices, in order)."""
  digest = hashlib.blake2b(digest_size=8)
  for group in partition:
    indices = np.asarray(group, np.int64)
    digest.update(np.int64(indices.size).tobytes())
    digest.update(indices.tobytes())
  return (int.from_bytes(digest.digest(), "little") >> 2) or 1


def _inner(optimizer):
  return getattr(optimizer, "keras_optimizer", optimizer)


class CyclicPoissonRecorder(keras.callbacks.Callback):
  """Counts the batches of a cyclic Poisson dataset that step t ≡ group t
  (mod b) in the optimizer's ledger (see the module docstring)."""

  def __init__(self, sampling):
    super().__init__()
    self.sampling = sampling
    self._ok = False
    self._start = self._last = 0

  def _ledger(self):
    return ledger_lib.ledger_of(getattr(self.model, "optimizer", None))

  def on_train_begin(self, logs=None):
    ledger = self._ledger()
    if ledger is None:
      return
    optimizer = _inner(self.model.optimizer)
    s = self.sampling
    if s.groups > 1 and not optimizer.is_correlated:
      raise ValueError(
          f"{optimizer.name}: cyclic Poisson batches with b = {s.groups} "
          "groups and independent noise. The Poisson accounting of this "
          "optimizer (q = B/N every step) would under-state ε for them (an "
          "example is sampled with probability B·b/N every b-th step). Use "
          "data.poisson_batches, or groups=1.")
    if optimizer.expected_batch_size != s.expected_batch_size:
      raise ValueError(
          f"{optimizer.name}: cyclic Poisson batches of expected size "
          f"{s.expected_batch_size} need an optimizer built with "
          f"expected_batch_size={s.expected_batch_size} (it divides by B, "
          "never by the realized batch size, and accounts the sampling); "
          f"it has expected_batch_size={optimizer.expected_batch_size}.")

    partition = partition_digest(s.partition)

    def start(state, position):
      mine = (s.groups, s.expected_batch_size, s.num_examples, partition)
      if not state.cp_groups:
        (state.cp_groups, state.cp_batch_size, state.cp_examples,
         state.cp_partition) = mine
      elif (state.cp_groups, state.cp_batch_size, state.cp_examples,
            state.cp_partition) != mine:
        # Two samplers in one run (another partition_seed, b, B or N): an
        # example can be in groups sampled at adjacent steps.
        state.cp_flags |= ledger_lib.CP_BROKEN
      if not s.secret_seed:
        state.cp_flags |= ledger_lib.CP_FIXED_SEED
    ledger.record_cyclic_poisson(start)

  def on_epoch_begin(self, epoch, logs=None):
    ledger = self._ledger()
    if ledger is None:
      return
    self._start = self._last = ledger.position()
    # The dataset restarts at group 0: this epoch's batch j is group j mod b
    # and runs at step start + j, which must be ≡ j (mod b).
    self._ok = self._start % self.sampling.groups == 0
    if not self._ok:
      ledger.record_cyclic_poisson(
          lambda st, p: setattr(st, "cp_flags",
                                st.cp_flags | ledger_lib.CP_BROKEN))

  def on_train_batch_end(self, batch, logs=None):
    ledger = self._ledger()
    if ledger is None:
      return
    position = ledger.position()
    ok = (self._ok and position == self._start + batch + 1
          and batch < self.sampling.steps_per_epoch)
    added = position - self._last
    self._last = position

    def count(state, _):
      if ok:
        state.cp_batches += added
      else:
        state.cp_flags |= ledger_lib.CP_BROKEN
    ledger.record_cyclic_poisson(count)


def recorder_for(x):
  """A recorder for ``fit``'s ``x`` if it is a cyclic Poisson dataset."""
  sampling = getattr(x, "cyclic_poisson", None)
  if sampling is None:
    return None
  return CyclicPoissonRecorder(sampling)


def verified_groups(optimizer, num_examples, batch_size=None):
  """b, if the ledger verified that every batch the optimizer released was
  a cyclic Poisson sample of group t mod b (b groups of N examples, expected
  batch size B); else ValueError saying why the amplified ε is not this
  run's."""
  ledger = ledger_lib.ledger_of(optimizer)
  if ledger is None:
    raise ValueError("This optimizer keeps no accounting ledger.")
  state, position = ledger.state(), ledger.position()
  prefix = ("The amplified BandMF ε (cyclic Poisson sampling) does not hold "
            "for this run: ")
  if not state.cp_groups:
    raise ValueError(
        prefix + "none of its batches was verified to come from "
        "tf_dpadambc.data.cyclic_poisson_batches (pass that dataset, as "
        "returned, to the fit of a make_private model).")
  if state.cp_flags & ledger_lib.CP_BROKEN:
    raise ValueError(
        prefix + "some step did not take group t mod b of one cyclic "
        "Poisson dataset (an epoch began at a step not ≡ 0 mod b, e.g. after "
        "an interrupted epoch or with fit's steps_per_epoch; a step was "
        "skipped; or two different samplers were used).")
  if state.cp_batches != position:
    raise ValueError(
        prefix + f"only {state.cp_batches} of its {position} batches were "
        "verified cyclic Poisson samples (the others came from other data).")
  if state.cp_examples != num_examples:
    raise ValueError(
        prefix + f"its sampler split N = {state.cp_examples} examples, not "
        f"N = {num_examples}.")
  if batch_size not in (None, state.cp_batch_size):
    raise ValueError(
        prefix + f"its expected batch size was {state.cp_batch_size}, not "
        f"{batch_size}.")
  return state.cp_groups


def fixed_sampling_seed(optimizer):
  """True if a verified cyclic Poisson run used a given (non-secret) seed."""
  ledger = ledger_lib.ledger_of(optimizer)
  return bool(ledger is not None
              and ledger.state().cp_flags & ledger_lib.CP_FIXED_SEED)
