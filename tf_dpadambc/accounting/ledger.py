"""What ran, for the once-per-epoch accounting: passes over the data, batches.

The once-per-epoch ("shuffle") guarantee assumes only that every example is
in at most one physical batch per pass over the data (an epoch). The ε of a
run then depends on how many passes its released steps touched and on which
logical steps hold batches of two passes (gradient accumulation: k physical
batches per noise release), not on ceil(N/B): an epoch of a
``drop_remainder`` dataset, of ``steps_per_epoch`` batches or of a truncated
dataset is shorter, and a run of E such epochs is E participations.

:class:`LedgerState` is the record, kept as a few integers: the committed
position (physical batches), counts and lengths of the passes, and the
worst case, over where each pass puts an example, of the releases holding it
once, twice or more (a release holding it c times has sensitivity cΔ: for the
Gaussian mechanism, exactly as private as c² releases at Δ). The worst case
is maintained incrementally by a small dynamic program over the release that
is still open at the committed position.

:class:`AccountingLedger` binds it to an optimizer, whose ``iterations`` and
physical-batch counter give the position, and stores it in one int64
optimizer variable (``dp_accounting_ledger``) so that it is saved and
restored with the optimizer. Keras epochs are recorded by
:class:`EpochRecorder` (installed on ``fit`` by ``make_private``) and by the
privacy callbacks; a custom loop calls ``optimizer.accounting_ledger
.end_epoch()`` after each pass. Batches no epoch accounts for (a custom loop
that does not, ``fit`` over data of unknown size with ``steps_per_epoch``,
``fit`` over data whose epochs need not be passes: :func:`fit_data`, which
reads a tf.data pipeline's ops) are accounted as if each were a pass of its
own: an upper bound on ε, which the statement says.
"""
import collections
import dataclasses
import inspect

import keras
import numpy as np
import tensorflow as tf

from tf_dpadambc.accounting import pipelines

# Why the accounting is an upper bound (bits of LedgerState.reasons).
UNKNOWN = 1          # batches ran outside any recorded epoch
NOT_PASSES = 2       # fit's epochs need not be passes over the data
ABORTED = 4          # an epoch began but its end was never recorded
SUB_EPOCHS = 8       # steps_per_epoch: each epoch counted as a whole pass
REBASED = 16         # restored mid-accumulation: unreleased batches dropped
LONG_EPOCH = 32      # an epoch held more batches than one pass over N can
MAY_REPEAT = 64      # fit's data can hold an example twice within an epoch
STRADDLES = 128      # tf_keras: steps_per_epoch cut arrays across passes

REASONS = {
    UNKNOWN: "{unknown} physical batch(es) ran outside a recorded epoch (a "
             "custom training loop, or fit without make_private's epoch "
             "tracking); each was accounted as if it could hold any example "
             "(as its own epoch). In a custom loop, call "
             "optimizer.accounting_ledger.end_epoch() after each pass over "
             "the data",
    NOT_PASSES: "fit ran with steps_per_epoch on data of unknown or infinite "
                "size (e.g. a repeated tf.data.Dataset), so its epochs need "
                "not be passes over the data; their batches were accounted "
                "as if each could hold any example",
    ABORTED: "an epoch began whose end was never recorded; its batches were "
             "accounted as if each could hold any example",
    LONG_EPOCH: "the epochs held more batches or examples than passes over "
                "the N training examples can (the data repeats within an "
                "epoch, e.g. Dataset.repeat before fit, possibly cut by "
                "steps_per_epoch, or a dataset longer than one pass), so "
                "every batch was accounted as if it could hold any example",
    MAY_REPEAT: "fit's data is not known to hold each example at most once "
                "per epoch (a tf.data pipeline with a transformation that "
                "can emit an element more than once — repeat, concatenate, "
                "window, flat_map/interleave, a map that reads data by index "
                "or runs Python — or a Python generator, PyDataset or other "
                "data fit cannot see into), so its epochs need not be passes "
                "over the data; their batches were accounted as if each "
                "could hold any example",
    STRADDLES: "tf_keras' fit ran on arrays with a steps_per_epoch other "
               "than their number of batches, so its epochs ran across two "
               "reshuffled passes (an example can be in two batches of one "
               "epoch); their batches were accounted as if each could hold "
               "any example",
}
NOTES = {
    SUB_EPOCHS: "fit ran with steps_per_epoch: each of its epochs was counted "
                "as a full pass over the data (several such epochs may share "
                "one pass, so ε may be lower)",
    REBASED: "a run was restored in the middle of an accumulated logical "
             "batch; those unreleased batches were dropped and the "
             "accounting kept what had been released",
}

STATE_SIZE = 32
_VERSION = 1
# Slot 23 holds the physical batches the model ran under the DP optimizers
# it was compiled with before this one, slot 24 the most batches one
# iteration of a dataset fit trained on holds, slot 25 a digest of the cyclic
# Poisson sampler's partition (0 in ledgers saved before it was recorded),
# slot 26 the smallest N a Poisson
# dataset fed to fit sampled from, slots 27..31 the cyclic Poisson record
# (the branches use at most 13 + 5·2 = 23 slots: the dynamic program keeps
# ≤ 2 branches).
_PRIOR_SLOT = 23
_DATA_SLOT = 24
_PARTITION_SLOT = 25
_POISSON_SLOT = 26
_CP_SLOT = 27
CP_BROKEN = 1
CP_FIXED_SEED = 2


@dataclasses.dataclass(frozen=True)
class Releases:
  """Worst-case multiplicities of one example over the closed releases.

  single: releases holding it once; double: twice (σ/2); more_squares: Σ c²
  over the releases holding it c ≥ 3 times (more_count of them).
  """
  single: int = 0
  double: int = 0
  more_squares: int = 0
  more_count: int = 0

  @property
  def total(self):
    """Σ c²: the run is as private as this many releases at sensitivity Δ."""
    return self.single + 4 * self.double + self.more_squares

  def close(self, c, times=1):
    """Adds ``times`` closed releases that hold the example c times."""
    if c <= 0 or times <= 0:
      return self
    if c == 1:
      return dataclasses.replace(self, single=self.single + times)
    if c == 2:
      return dataclasses.replace(self, double=self.double + times)
    return dataclasses.replace(self,
                               more_squares=self.more_squares + c * c * times,
                               more_count=self.more_count + times)


def _best(candidates):
  best = None
  for r in candidates:
    if best is None or r.total > best.total:
      best = r
  return best


def _merge(pairs):
  """{c: best Releases} from (c, Releases) pairs."""
  out = {}
  for c, r in pairs:
    if c not in out or r.total > out[c].total:
      out[c] = r
  return out


@dataclasses.dataclass
class LedgerState:
  """The record of what ran (see the module docstring). Positions count
  physical batches: batch i (0-based) is in release i // k."""
  k: int = 1                 # physical batches per logical step (release)
  position: int = 0          # end of the committed history
  open: bool = False         # an epoch began at `position` and has not ended
  passes: int = 0            # recorded epochs (passes) committed
  unknown: int = 0           # batches committed outside any recorded epoch
  min_len: int = 0           # fewest batches in a recorded epoch (0: none)
  max_len: int = 0           # most batches in a recorded epoch
  last_len: int = 0          # batches in the last pass (1 for unknown ones)
  min_separation: int = 0    # fewest batches in a pass other than the last
  reasons: int = 0
  span: int = 0              # passes that intersect the open release
  max_span: int = 0          # most passes intersecting one closed release
  # c -> worst case over the closed releases, with c occurrences placed in
  # the open release (the one holding batch `position`, if position % k).
  branches: dict = dataclasses.field(default_factory=lambda: {0: Releases()})
  # Cyclic Poisson sampling verified step by step (accounting.cyclic): the
  # sampler's b, B and N, the physical batches that took group t mod b at
  # step t, and flags (CP_BROKEN: a batch did not; CP_FIXED_SEED).
  cp_groups: int = 0
  cp_batch_size: int = 0
  cp_examples: int = 0
  cp_batches: int = 0
  cp_flags: int = 0
  # A digest of the sampler's partition into b groups: two samplers with the
  # same b, B, N but other partitions (another partition_seed) can sample an
  # example at adjacent steps (Theorem 4 needs b steps between them).
  cp_partition: int = 0
  # The smallest N of the Poisson datasets (data.poisson_batches or
  # cyclic_poisson_batches) fit trained on: their q = B/N is at least B over
  # it, so an accounting with a larger N would understate ε (0: none seen).
  poisson_examples: int = 0
  # Physical batches released by the DP optimizers the model was compiled
  # with before this one (their releases are in its weights).
  prior_batches: int = 0
  # The most batches one iteration of a finite dataset fit trained on holds
  # (its cardinality; 0: none known). Keras never runs an epoch across two
  # iterations of a dataset, so with steps_per_epoch its epochs are parts of
  # one iteration, which must itself be a pass: more batches than one pass
  # over N can hold means the data repeats.
  data_batches: int = 0

  # ------------------------------------------------------------ encoding
  def encode(self):
    """A fixed-size int64 vector (all zeros: a fresh ledger)."""
    out = np.zeros(STATE_SIZE, np.int64)
    out[:13] = [_VERSION, self.position, int(self.open), self.passes,
                self.unknown, self.min_len, self.max_len, self.last_len,
                self.min_separation, self.reasons, self.span, self.max_span,
                len(self.branches)]
    if 13 + 5 * len(self.branches) > _PRIOR_SLOT:
      raise ValueError("Accounting ledger: too many open branches.")
    for i, (c, r) in enumerate(sorted(self.branches.items())):
      out[13 + 5 * i:18 + 5 * i] = [c, r.single, r.double, r.more_squares,
                                    r.more_count]
    out[_POISSON_SLOT] = self.poisson_examples
    out[_PRIOR_SLOT] = self.prior_batches
    out[_DATA_SLOT] = self.data_batches
    out[_PARTITION_SLOT] = self.cp_partition
    out[_CP_SLOT:_CP_SLOT + 5] = [self.cp_groups, self.cp_batch_size,
                                  self.cp_examples, self.cp_batches,
                                  self.cp_flags]
    return out

  @classmethod
  def decode(cls, values, k):
    v = [int(x) for x in np.asarray(values).reshape(-1)]
    if not v or v[0] == 0:
      return cls(k=k)
    if v[0] != _VERSION:
      raise ValueError(f"Unknown accounting ledger format {v[0]}.")
    branches = {}
    for i in range(v[12]):
      c, *counts = v[13 + 5 * i:18 + 5 * i]
      branches[c] = Releases(*counts)
    return cls(k=k, position=v[1], open=bool(v[2]), passes=v[3],
               unknown=v[4], min_len=v[5], max_len=v[6], last_len=v[7],
               min_separation=v[8], reasons=v[9], span=v[10],
               max_span=v[11], branches=branches or {0: Releases()},
               cp_groups=v[_CP_SLOT], cp_batch_size=v[_CP_SLOT + 1],
               cp_examples=v[_CP_SLOT + 2], cp_batches=v[_CP_SLOT + 3],
               cp_flags=v[_CP_SLOT + 4], poisson_examples=v[_POISSON_SLOT],
               prior_batches=v[_PRIOR_SLOT], data_batches=v[_DATA_SLOT],
               cp_partition=v[_PARTITION_SLOT])

  def copy(self):
    return dataclasses.replace(self, branches=dict(self.branches))

  # ------------------------------------------------------ the recording
  def _note_length(self, length):
    if self.last_len:
      self.min_separation = (min(self.min_separation, self.last_len)
                             if self.min_separation else self.last_len)
    self.last_len = length

  def _add_pass(self, end):
    """One pass over [position, end): each example in at most one of its
    batches, so in at most one release among those it intersects; the
    worst case places it where Σ c² grows most."""
    k, start = self.k, self.position
    first, last = start // k, (end - 1) // k
    shared = start % k != 0  # the first release holds earlier batches
    closes = end % k == 0    # the last release ends with this pass
    branches = self.branches if shared else {0: _best(
        r.close(c) for c, r in self.branches.items())}
    span = (self.span if shared else 0) + 1
    if first == last:  # inside one release: the example goes there
      forced = {c + 1: r for c, r in branches.items()}
      if closes:
        self.max_span = max(self.max_span, span)
        self.branches = {0: _best(r.close(c) for c, r in forced.items())}
        self.span = 0
      else:
        self.branches, self.span = forced, span
    else:
      self.max_span = max(self.max_span, span)
      if last - first > 1 or closes:  # whole releases of this pass alone
        self.max_span = max(self.max_span, 1)
      with_it = _best(r.close(c + 1) for c, r in branches.items())
      without = _best(r.close(c) for c, r in branches.items())
      if closes:
        self.branches = {0: _best([with_it, without.close(1)])}
        self.span = 0
      else:
        # In the first (or a whole) release, or in the open last one.
        elsewhere = ([with_it, without.close(1)] if last - first > 1
                     else [with_it])
        self.branches = _merge([(0, _best(elsewhere)), (1, without)])
        self.span = 1
    self.position = end

  def _add_unknown(self, end):
    """Batches [position, end) of no known pass: each its own pass."""
    k = self.k
    while self.position < end and self.position % k:
      self._add_pass(self.position + 1)
    whole = (end - self.position) // k
    if whole:
      closed = _best(r.close(c) for c, r in self.branches.items())
      self.branches = {0: closed.close(k, whole)}
      self.max_span = max(self.max_span, k)
      self.position += whole * k
    while self.position < end:
      self._add_pass(self.position + 1)

  def commit(self, end, known, reason=UNKNOWN):
    """Commits [position, end) as one pass (``known``) or as batches of no
    known pass (flagging ``reason``)."""
    if end <= self.position:
      return
    length = end - self.position
    if known:
      self._add_pass(end)
      self.passes += 1
      self.min_len = min(self.min_len, length) if self.min_len else length
      self.max_len = max(self.max_len, length)
      self._note_length(length)
    else:
      self._add_unknown(end)
      self.unknown += length
      self.reasons |= reason
      if length > 1:
        self._note_length(1)
      self._note_length(1)

  def rebase(self, position):
    """The optimizer is behind the record (restored mid-accumulation: the
    pending batches were dropped, never released): forget the open release
    and continue from ``position``."""
    if position >= self.position:
      return
    dropped = self.position - position
    self.branches = {0: _best(self.branches.values())}
    self.span = 0
    if self.last_len:
      self.last_len = max(1, self.last_len - dropped)
    self.position = position
    self.reasons |= REBASED

  def begin(self, position):
    """An epoch (pass) begins at ``position``."""
    self.rebase(position)
    if self.open and position == self.position:
      return
    self.commit(position, known=False,
                reason=ABORTED if self.open else UNKNOWN)
    self.open = True

  def end(self, position):
    """The batches since the last commit were one pass; none is open."""
    self.rebase(position)
    self.commit(position, known=True)
    self.open = False

  def abandon(self, position, reason):
    """The epoch open at ``position`` is not a pass after all (the tf_keras
    guard learns it once fit's first epoch began): what follows is recorded
    as batches of no known pass (``reason``), never as an epoch."""
    self.rebase(position)
    self.commit(position, known=False, reason=reason)
    self.open = False

  def close_open(self, position):
    """Ends an open epoch (an interrupted ``fit``: its batches so far are a
    prefix of one pass); no-op when none is open."""
    if self.open:
      self.end(position)

  # ---------------------------------------------------------- reporting
  def structure(self, position, extra_pass=0):
    """The :class:`RunStructure` of the run up to ``position`` (an open
    epoch counts as a pass so far), plus an ``extra_pass`` of that many
    batches (a look-ahead)."""
    state = self.copy()
    state.rebase(position)
    state.commit(position, known=state.open)
    if extra_pass:
      state.commit(position + extra_pass, known=True)
      position += extra_pass
    if position % state.k:
      # The open release has not been released: what it holds is not out.
      releases = _best(state.branches.values())
    else:
      releases = _best(r.close(c) for c, r in state.branches.items())
    return RunStructure(
        steps=position // state.k, batches=position,
        passes=state.passes, unknown_batches=state.unknown,
        min_epoch_batches=state.min_len, max_epoch_batches=state.max_len,
        last_epoch_batches=state.last_len,
        min_separation=state.min_separation, releases=releases,
        max_multiplicity=max(1, state.max_span), reasons=state.reasons,
        k=state.k)


@dataclasses.dataclass(frozen=True)
class RunStructure:
  """What the once-per-epoch accounting of a run composes.

  steps: logical steps (releases) up to here; batches: physical batches.
  passes: recorded epochs; unknown_batches: batches of no recorded epoch
  (each accounted as its own pass). releases: worst-case multiplicities
  (:class:`Releases`). max_multiplicity: most passes one release touched.
  min_separation: fewest batches in a pass other than the last (0: at most
  one pass). reasons: bits of why ε is an upper bound (and notes).
  """
  steps: int
  batches: int
  passes: int
  unknown_batches: int
  min_epoch_batches: int
  max_epoch_batches: int
  last_epoch_batches: int
  min_separation: int
  releases: Releases
  max_multiplicity: int
  reasons: int
  k: int

  @property
  def participations(self):
    """Passes an example can be in: recorded epochs plus unknown batches."""
    return self.passes + self.unknown_batches

  @property
  def is_upper_bound(self):
    return bool(self.reasons & (UNKNOWN | NOT_PASSES | ABORTED | LONG_EPOCH
                                | MAY_REPEAT | STRADDLES))

  def upper_bound_reasons(self):
    """Why ε is an upper bound (sentences; empty if it is not one)."""
    return [text.format(unknown=self.unknown_batches)
            for bit, text in REASONS.items() if self.reasons & bit]

  def notes(self):
    """Other remarks on how the run was accounted (sentences)."""
    return [text for bit, text in NOTES.items() if self.reasons & bit]

  def describe(self):
    """One line: the epochs and batches the accounting composed."""
    parts = []
    if self.passes:
      if self.min_epoch_batches == self.max_epoch_batches:
        per = f"{self.min_epoch_batches} batch(es) each"
      else:
        per = (f"{self.min_epoch_batches} to {self.max_epoch_batches} "
               "batches")
      parts.append(f"{self.passes} epoch(s) as run ({per})")
    if self.unknown_batches:
      parts.append(f"{self.unknown_batches} batch(es) of no recorded epoch, "
                   "each counted as an epoch")
    return " + ".join(parts) or "no epochs yet"

  def logical_steps_per_epoch(self):
    """Conservative logical steps per pass: the fewest in any pass but the
    last (≥ 1), so that steps / it bounds the passes and floor(it) the
    separation of two uses of an example; None before a second pass."""
    if not self.min_separation:
      return None
    return max(1.0, self.min_separation / self.k)

  def accounting_steps_per_epoch(self):
    """:meth:`logical_steps_per_epoch`, or the whole run while it has held
    at most one pass (one participation)."""
    return self.logical_steps_per_epoch() or float(max(1, self.steps))


# -------------------------------------------------------------- optimizer
def attached(optimizer):
  """The optimizer's :class:`AccountingLedger`, created on first use (a plain
  attribute: its state is saved through the optimizer's ledger variable)."""
  if "_tf_dpadambc_ledger" not in optimizer.__dict__:
    object.__setattr__(optimizer, "_tf_dpadambc_ledger",
                       AccountingLedger(optimizer))
  return optimizer.__dict__["_tf_dpadambc_ledger"]


class AccountingLedger:
  """The ledger of one DP optimizer (``optimizer.accounting_ledger``).

  Custom training loops call :meth:`end_epoch` after each pass over the data
  (each example in at most one of the batches since the previous call), and
  may call :meth:`begin_epoch` at the start of each (batches outside
  begin/end are then accounted as unknown). Without either, every batch is
  accounted as possibly holding any example: an upper bound on ε.
  """

  def __init__(self, optimizer):
    self._optimizer = optimizer
    self._pending = None  # the state before the optimizer is built
    self.recorder = None  # the EpochRecorder of a running fit, if any
    # register_dataset was called (this process): a custom loop or
    # train_on_batch feeds Poisson batches on the caller's word.
    self.declared_poisson = False
    # The furthest position this optimizer object reached in this process
    # (never saved): a restore of an earlier checkpoint moves the ledger
    # back with the weights, and what was released before it is not in the
    # ledger any more (rolled_back).
    self.furthest = 0
    # The DP optimizer the model was compiled with before this one, in this
    # process (follow_run); its run composes with this one's.
    self.prior_run = None
    # The FitData of the tf_keras fit running (set by tf_keras.guards), read
    # by the privacy callbacks that record its epochs; None elsewhere.
    self.running_fit_data = None

  @property
  def _k(self):
    return int(getattr(self._optimizer, "accumulation_steps", 1) or 1)

  def position(self):
    """Physical batches of the run that count: logical steps · k, plus
    those accumulated toward the next one."""
    optimizer = self._optimizer
    k = self._k
    position = int(optimizer.iterations.numpy()) * k
    if k > 1 and optimizer.built:
      accumulated = optimizer._physical_step  # pylint: disable=protected-access
      position += int(accumulated.numpy()) % k
    return position

  def _variable(self):
    recorder = getattr(self._optimizer, "run_recorder", None)
    return None if recorder is None else recorder.ledger

  def initial_values(self):
    """The encoded state for the variable the optimizer builds."""
    return (self._pending or LedgerState(k=self._k)).encode()

  def state(self):
    """The current :class:`LedgerState` (a copy)."""
    variable = self._variable() if self._optimizer.built else None
    if variable is None:
      return (self._pending or LedgerState(k=self._k)).copy()
    return LedgerState.decode(variable.numpy(), self._k)

  def _store(self, state):
    variable = self._variable() if self._optimizer.built else None
    if variable is None:
      self._pending = state
    else:
      variable.assign(state.encode())

  def _update(self, change):
    state = self.state()
    position = self.position()
    self.furthest = max(self.furthest, position)
    change(state, position)
    self._store(state)

  def rolled_back(self):
    """``(furthest, now)`` if this process's run reached a position (physical
    batches) beyond the ledger's now — an earlier checkpoint restored in
    the same process — else None."""
    position = self.position()
    self.furthest = max(self.furthest, position)
    return (self.furthest, position) if position < self.furthest else None

  def begin_epoch(self):
    """A pass over the data begins now."""
    self._update(lambda s, p: s.begin(p))

  def end_epoch(self):
    """The physical batches since the last epoch boundary were one pass over
    the data: each example in at most one of them."""
    self._update(lambda s, p: s.end(p))

  def close_open_epoch(self):
    """Ends an epoch left open (interrupted); no-op otherwise."""
    self._update(lambda s, p: s.close_open(p))

  def record_unknown(self, reason=UNKNOWN):
    """The batches since the last boundary belong to no known pass."""
    self._update(lambda s, p: s.commit(p, known=False, reason=reason))

  def note_data_batches(self, batches):
    """fit trains on a finite dataset of ``batches`` batches per iteration."""
    if batches and batches > 0:
      self._update(lambda s, _: setattr(
          s, "data_batches", max(s.data_batches, int(batches))))

  def begin_fit(self, data):
    """A tf_keras fit on data classified by :func:`fit_data` runs (the
    tf_keras guard; Keras 3's :func:`track_fit` uses an EpochRecorder): the
    privacy callbacks record its epochs as passes only if they are. An epoch
    already opened by them (fit's first, before its step was traced) is
    abandoned when they are not."""
    self.running_fit_data = data
    self.note_data_batches(data.batches)
    if not data.passes:
      self._update(lambda s, p: s.abandon(p, data.reason)
                   if s.open else None)

  def callback_epoch_begin(self):
    """A privacy callback saw an epoch begin (no tracked fit records it)."""
    if self.running_fit_data is None or self.running_fit_data.passes:
      self.begin_epoch()

  def callback_epoch_end(self):
    """A privacy callback saw an epoch end (no tracked fit records it)."""
    if self.running_fit_data is None or self.running_fit_data.passes:
      self.end_epoch()
    else:
      self.record_unknown(self.running_fit_data.reason)

  def record_cyclic_poisson(self, change):
    """Applies ``change(state, position)`` to the cyclic Poisson record
    (accounting.cyclic's recorder)."""
    self._update(change)

  def follow_run(self, previous):
    """This optimizer continues the training ``previous`` (another DP
    optimizer) did on the same model: the model was compiled again. Its
    ``dp_event`` composes that run's; the count of its batches is saved."""
    before = ledger_of(previous)
    if before is None or previous is self._optimizer:
      return
    own = before.position() if getattr(previous, "built", False) else 0
    if not own and before.prior_run is not None:
      # It released nothing (compiled, never fit): continue what it did.
      self.follow_run(before.prior_run)
      return
    batches = before.state().prior_batches + own
    if not batches:
      return
    if own:
      self.prior_run = previous
    self._update(lambda s, _: setattr(s, "prior_batches", batches))

  def unaccounted_prior_batches(self):
    """Physical batches of earlier runs of the model (recorded before a
    save) that this process cannot account: those of the runs before the
    first one :attr:`prior_run`'s chain still knows (0 if none)."""
    if self.prior_run is None:
      return self.state().prior_batches
    return ledger_of(self.prior_run).unaccounted_prior_batches()

  def record_poisson_examples(self, num_examples):
    """fit is about to train on Poisson batches sampled from N examples."""
    def note(state, _):
      state.poisson_examples = (min(state.poisson_examples, num_examples)
                                if state.poisson_examples else num_examples)
    self._update(note)

  def check_poisson_examples(self, num_examples):
    """Refuses to account Poisson steps with an N larger than the smallest
    one their batches were sampled from (q = B/N would be understated)."""
    sampled = self.state().poisson_examples
    if sampled and num_examples > sampled:
      raise ValueError(
          f"The Poisson batches {self._optimizer.name} trained on were "
          f"sampled from N = {sampled:,} examples (q = B/{sampled:,}); "
          f"accounting them with num_examples = {num_examples:,} would take "
          f"q = B/{num_examples:,} and understate ε. Pass num_examples = "
          f"{sampled:,}, the size of the data the batches were drawn from.")

  def flag(self, reason):
    self._update(lambda s, p: setattr(s, "reasons", s.reasons | reason))

  def structure(self, extra_epoch_batches=0, longest_pass=None,
                conservative=False):
    """The :class:`RunStructure` of what ran (see LedgerState.structure).

    ``longest_pass``: the most physical batches one pass over the training
    set can hold (ceil(N / b)), where N is known. A recorded epoch longer
    than that repeats data, so it cannot be one pass: then every batch is
    accounted as its own pass (an upper bound, said in the statement). So
    is a dataset fit trained on whose one iteration holds more batches
    (``data_batches``: its epochs, cut by steps_per_epoch, were parts of
    an iteration that was not a pass).
    ``conservative``: the caller knows the epochs were not passes (more
    examples ran than they can hold): every batch its own pass.
    """
    position = self.position()
    state = self.state()
    result = state.structure(position, extra_epoch_batches)
    if conservative or (longest_pass and max(
        result.max_epoch_batches, state.data_batches) > longest_pass):
      everything = LedgerState(k=self._k)
      everything.commit(position + extra_epoch_batches, known=False,
                        reason=LONG_EPOCH)
      result = everything.structure(position + extra_epoch_batches)
    return result


def ledger_of(optimizer):
  """The AccountingLedger of a DP optimizer (or of the Keras 3 optimizer a
  tf_keras one drives); None for others."""
  inner = getattr(optimizer, "keras_optimizer", optimizer)
  return getattr(inner, "accounting_ledger", None)


# ------------------------------------------------------------------- fit
FitData = collections.namedtuple("FitData", ["passes", "reason", "batches",
                                             "why"])
FitData.__doc__ = """How fit's epochs on some data are accounted (:func:`fit_data`):
passes (each epoch one pass over the data, as the once-per-epoch ε assumes),
else the reason bit for the statement; the batches one iteration of a finite
dataset holds (0: unknown or not a dataset); why, a phrase (None: passes)."""


def _arrays(x):
  leaves = tf.nest.flatten(x)
  return bool(leaves) and all(
      isinstance(leaf, (np.ndarray, tf.Tensor, np.generic))
      or type(leaf).__module__.startswith("pandas") for leaf in leaves)


MIXING_ERROR = (
    "tf_dpadambc: fit's tf.data pipeline can put one example's data into "
    "other examples' elements: {why}. Then one example can move several "
    "units of a batch (a review: MixUp after batch() and weights normalized "
    "over the batch, 6.3C for a bound of 2C), which neither the clipping nor "
    "any accounting of batches bounds, so no ε would hold. Map single "
    "examples before .batch() (element-wise: augmentation, normalization), "
    "put batch-level preprocessing inside the model (make_private evaluates "
    "each example alone), and look data up before building the dataset "
    "(tokenize with your vocabulary into arrays).")


def fit_data(x, steps_per_epoch=None, batch_size=None, validation_split=0.,
             tf_keras=False):
  """Whether ``fit``'s epochs on ``x`` are passes over the data: the one
  decision for Keras 3 (:func:`track_fit`) and tf_keras (its guard).

  Passes: arrays or tensors (the frameworks' own array pipelines: each
  epoch one permutation), and finite ``tf.data`` datasets whose pipeline
  emits each element at most once (``pipelines.classify``). A pipeline
  whose elements can carry other examples' data (a lookup, a map mixing a
  batch's rows) is refused: ``ValueError``. Neither
  framework runs an epoch across two iterations of such a dataset (with
  ``steps_per_epoch`` they cut one iteration into epochs, each counted as a
  pass). Not passes (every batch accounted as if it could hold any example):
  infinite datasets (``NOT_PASSES``), pipelines that can emit an element
  twice, Python generators, ``PyDataset``/``Sequence`` and any other input
  (``MAY_REPEAT``), and on tf_keras, arrays cut by a ``steps_per_epoch``
  other than their number of batches (its array pipeline runs the epochs'
  permutations back to back: ``STRADDLES``).
  """
  if isinstance(x, tf.data.Dataset):
    cardinality = int(x.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
      return FitData(False, NOT_PASSES, 0, "the dataset is infinite")
    kind, problem = pipelines.classify(x)
    if kind == pipelines.MIXES:
      raise ValueError(MIXING_ERROR.format(why=problem))
    if problem:
      return FitData(False, MAY_REPEAT, 0, problem)
    return FitData(True, 0, max(cardinality, 0), None)
  if _arrays(x):
    if tf_keras and steps_per_epoch:
      rows = int(tf.nest.flatten(x)[0].shape[0])
      rows = int(np.floor(rows * (1. - (validation_split or 0.))))
      batch = batch_size or (-(-rows // steps_per_epoch) or 32)
      if steps_per_epoch != -(-rows // batch):
        return FitData(False, STRADDLES, 0,
                       "steps_per_epoch cuts tf_keras' passes over arrays")
    return FitData(True, 0, 0, None)
  return FitData(False, MAY_REPEAT, 0,
                 f"fit cannot see into a {type(x).__name__}")


def _finite(x):
  """True if ``fit`` stops an epoch where the data ends (its size is known
  and finite): NumPy arrays and tensors, finite ``tf.data`` datasets,
  ``keras.utils.PyDataset``. Then no epoch spans two passes."""
  if isinstance(x, tf.data.Dataset):
    return int(x.cardinality()) >= 0
  if isinstance(x, keras.utils.PyDataset):
    return True
  leaves = tf.nest.flatten(x)
  return bool(leaves) and all(
      isinstance(leaf, (np.ndarray, tf.Tensor, np.generic))
      or type(leaf).__module__.startswith("pandas") for leaf in leaves)


class EpochRecorder(keras.callbacks.Callback):
  """Records ``fit``'s epochs in the optimizer's ledger, as passes over the
  data when they are (``epochs_are_passes``), else as unknown batches."""

  def __init__(self, epochs_are_passes=True, sub_epochs=False,
               reason=NOT_PASSES):
    super().__init__()
    self.epochs_are_passes = epochs_are_passes
    self.sub_epochs = sub_epochs
    self.reason = reason

  def _ledger(self):
    return ledger_of(getattr(self.model, "optimizer", None))

  def on_train_begin(self, logs=None):
    ledger = self._ledger()
    if ledger is not None and self.sub_epochs:
      ledger.flag(SUB_EPOCHS)

  def on_epoch_begin(self, epoch, logs=None):
    ledger = self._ledger()
    if ledger is not None and self.epochs_are_passes:
      ledger.begin_epoch()

  def on_epoch_end(self, epoch, logs=None):
    ledger = self._ledger()
    if ledger is None:
      return
    if self.epochs_are_passes:
      ledger.end_epoch()
    else:
      ledger.record_unknown(self.reason)

  def finish(self):
    """After ``fit`` (also when it raised): an epoch cut short is a prefix
    of one pass; unrecorded batches of non-pass epochs are unknown."""
    ledger = self._ledger()
    if ledger is None:
      return
    if self.epochs_are_passes:
      ledger.close_open_epoch()
    else:
      ledger.record_unknown(self.reason)


_FIT_MARK = "_tf_dpadambc_ledger_fit"


def track_fit(model):
  """Wraps ``model.fit`` so that every run records its epochs in the DP
  optimizer's ledger (``make_private`` calls it)."""
  fit = model.fit
  if getattr(fit, _FIT_MARK, False):
    return
  signature = inspect.signature(type(model).fit)

  def tracked_fit(*args, **kwargs):
    try:
      bound = signature.bind(model, *args, **kwargs)
    except TypeError:
      return fit(*args, **kwargs)  # let Keras report the bad call
    arguments = bound.arguments
    check_poisson_data(getattr(model, "optimizer", None),
                        arguments.get("x"))
    steps_per_epoch = arguments.get("steps_per_epoch")
    ledger = ledger_of(getattr(model, "optimizer", None))
    if _is_poisson(getattr(model, "optimizer", None)):
      # Poisson batches: the ε counts steps, not epochs (unchanged).
      finite = _finite(arguments.get("x"))
      data = FitData(steps_per_epoch is None or finite, NOT_PASSES, 0, None)
    else:
      data = fit_data(arguments.get("x"), steps_per_epoch)
      if ledger is not None:
        ledger.note_data_batches(data.batches)
    recorder = EpochRecorder(
        epochs_are_passes=data.passes,
        sub_epochs=steps_per_epoch is not None and data.passes,
        reason=data.reason)
    # Cyclic Poisson batches: verified step by step (accounting.cyclic).
    from tf_dpadambc.accounting import cyclic  # pylint: disable=g-import-not-at-top
    cyclic_recorder = cyclic.recorder_for(arguments.get("x"))
    ours = [recorder] + ([cyclic_recorder] if cyclic_recorder else [])
    callbacks = arguments.get("callbacks")
    if callbacks is None:
      callbacks = ours
    elif isinstance(callbacks, keras.callbacks.CallbackList):
      callbacks.callbacks.extend(ours)  # (it has no append)
    else:
      callbacks = ours + list(callbacks)
    arguments["callbacks"] = callbacks
    for callback in ours:
      callback.set_model(model)
    if ledger is not None:
      ledger.recorder = recorder
    try:
      return fit(*bound.args[1:], **bound.kwargs)
    finally:
      if ledger is not None:
        ledger.recorder = None
      recorder.finish()

  setattr(tracked_fit, _FIT_MARK, True)
  tracked_fit.__doc__ = fit.__doc__
  object.__setattr__(model, "fit", tracked_fit)


def _is_poisson(optimizer):
  return getattr(getattr(optimizer, "keras_optimizer", optimizer),
                 "expected_batch_size", None) is not None


def check_poisson_data(optimizer, x):
  """A Poisson optimizer (``expected_batch_size`` B, whose ε assumes every
  example joined every step independently with probability B/N) takes the
  batches of ``data.poisson_batches`` (or ``cyclic_poisson_batches``) of
  that B, as returned: fixed-size batches (with sample weights, which
  Keras makes from ``class_weight``) or another B would be accounted at a
  sampling that never ran (a red-team review: ε 5.9 reported for 12.3)."""
  expected = getattr(getattr(optimizer, "keras_optimizer", optimizer),
                     "expected_batch_size", None)
  if expected is None:
    return
  from tf_dpadambc import data  # pylint: disable=g-import-not-at-top
  got = data.poisson_sampling_of(x)
  sampled = data.poisson_num_examples_of(x)
  if got is None:
    raise ValueError(
        f"{optimizer.name} has expected_batch_size={expected}: its ε "
        "assumes Poisson sampling, so fit takes the dataset of "
        f"tf_dpadambc.data.poisson_batches(x, y, expected_batch_size="
        f"{expected}) as x, as returned (no batch_size; a derived dataset, "
        "e.g. .prefetch(), loses the mark fit checks). For fixed-size "
        "batches, drop expected_batch_size (shuffle accounting).")
  if got != expected:
    raise ValueError(
        f"{optimizer.name} has expected_batch_size={expected}, but these "
        f"Poisson batches have an expected size of {got}: its division by B "
        "and its sampling rate B/N would not be the batches'. Build both "
        "with the same expected_batch_size.")
  ledger = ledger_of(optimizer)
  if ledger is not None:
    ledger.record_poisson_examples(sampled)


def declare_poisson_dataset(optimizer, dataset):
  """What ``tf_dpadambc.register_dataset`` does: :func:`check_poisson_data`
  of ``dataset`` (a Poisson optimizer takes only ``data.poisson_batches`` of
  its B; their N is recorded), and the caller's word, for this process,
  that the batches fed outside ``fit`` come from it."""
  check_poisson_data(optimizer, dataset)
  ledger = ledger_of(optimizer)
  if ledger is not None:
    ledger.declared_poisson = True


def require_poisson_dataset(optimizer, in_fit=False):
  """Raises ValueError if a Poisson optimizer (``expected_batch_size``) is
  about to release outside a ``fit`` that checked its data, without
  :func:`declare_poisson_dataset`: its ε assumes batches sampled with
  q = B/N, which ``fit`` checks of its ``x`` (:func:`check_poisson_data`)
  but ``train_on_batch`` and custom loops cannot see (a review: fixed-size
  batches with unit weights in a custom loop, ε 7.33 reported for 9.01; a
  Poisson fit, then fixed-size train_on_batch, 4.33 for 12.45). ``in_fit``:
  the caller knows a checking fit runs (tf_keras); Keras 3's records its
  epochs in the ledger while it runs."""
  ledger = ledger_of(optimizer)
  expected = getattr(getattr(optimizer, "keras_optimizer", optimizer),
                     "expected_batch_size", None)
  if (ledger is None or expected is None or in_fit
      or ledger.recorder is not None or ledger.declared_poisson):
    return
  raise ValueError(
      f"{optimizer.name} has expected_batch_size={expected}: its ε assumes "
      "Poisson batches, which fit checks of the dataset it is given and "
      "train_on_batch or a custom loop must declare. Call "
      "tf_dpadambc.register_dataset(optimizer, batches) with the dataset of "
      "tf_dpadambc.data.poisson_batches the batches come from, before "
      "training (or fit on that dataset). For fixed-size batches, drop "
      "expected_batch_size.")


def is_recording(optimizer):
  """True while a ``fit`` wrapped by :func:`track_fit` records the epochs."""
  ledger = ledger_of(optimizer)
  return ledger is not None and ledger.recorder is not None
