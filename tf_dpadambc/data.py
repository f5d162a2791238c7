"""Input pipelines whose participation pattern the accounting knows.

``model.fit(x, y, shuffle=True)`` (Keras' default) reshuffles every epoch, so
an example can sit in the last batch of one epoch and the first of the next:
with correlated (DP-MF) noise its participations are then only 1 step apart,
which raises the sensitivity of a banded strategy. :func:`cyclic_batches`
shuffles once and repeats the same batches in the same order every epoch:
each example participates once per epoch, exactly ``steps_per_epoch`` steps
apart — the "cyclic" participation ``CorrelatedNoise`` is calibrated for
(Choquette-Choo et al. 2023; ``dp_event(..., sampling="cyclic")``).

:func:`poisson_batches` draws every batch by Poisson sampling — each example
independently with probability q = B/N, afresh at every step — the sampling
whose amplification the headline ε (``compute_epsilon``'s default) assumes
(Abadi et al. 2016). Pair it with an optimizer built with
``expected_batch_size=B``.
"""
import dataclasses
import numbers
import secrets

import numpy as np
from scipy import stats
import tensorflow as tf

from tf_dpadambc.accounting import events


def steps_per_epoch(num_examples, batch_size):
  """ceil(N / B): the batches of one epoch (the last may be smaller)."""
  return events.batches_per_epoch(num_examples, batch_size)


def cyclic_batches(x, y=None, batch_size=32, sample_weight=None, *, seed):
  """A ``tf.data.Dataset`` of the same batches, in the same order, every epoch.

  The examples are permuted once by ``seed``, then cut into ceil(N/B)
  batches; iterating the dataset again (the next epoch of ``model.fit``)
  yields the same sequence. Pass it to ``model.fit`` without ``batch_size``.

  The "cyclic" accounting assumes ONE permutation for the whole run: build
  the dataset again only with the same ``seed`` (e.g. when resuming), and
  resume only at an epoch boundary (``model.fit`` restarts the dataset from
  its first batch). The permutation need not be secret.

  Args:
    x, y, sample_weight: NumPy arrays (or nests of them) with N rows.
    batch_size: B.
    seed: the permutation's seed (required, so that a rebuilt dataset keeps
      the same order).
  """
  parts = tuple(p for p in (x, y, sample_weight) if p is not None)
  sizes = {len(a) for a in tf.nest.flatten(parts)}
  if len(sizes) != 1:
    raise ValueError(f"x, y and sample_weight have different lengths {sizes}.")
  n = sizes.pop()
  if seed is None:
    raise ValueError("cyclic_batches needs an explicit seed: the cyclic "
                     "accounting assumes one permutation for the whole run.")
  if not 1 <= batch_size <= n:
    raise ValueError(f"batch_size must be in [1, {n}]; got {batch_size}.")
  rng = np.random.default_rng(seed)
  order = rng.permutation(n)
  permuted = tf.nest.map_structure(lambda a: np.asarray(a)[order], parts)
  dataset = tf.data.Dataset.from_tensor_slices(
      permuted if len(permuted) > 1 else permuted[0])
  return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)


# Default bound on P(some step of one epoch draws more than max_batch_size
# examples). Over E epochs the bound is E times this: far below any δ in use,
# so the stop on overflow (an event the ε does not cover) adds nothing that
# matters to δ.
OVERFLOW_PROBABILITY = 1e-9


def _check_poisson_size(num_examples, expected_batch_size):
  if (isinstance(expected_batch_size, bool)
      or not isinstance(expected_batch_size, numbers.Integral)
      or not 1 <= expected_batch_size <= num_examples):
    raise ValueError(f"expected_batch_size must be an integer in [1, N = "
                     f"{num_examples}]; got {expected_batch_size!r}.")
  return int(expected_batch_size)


def poisson_overflow_probability(num_examples, expected_batch_size,
                                 max_batch_size, steps=1):
  """Union bound on P(one of ``steps`` Poisson batches exceeds the padding).

  min(1, steps · P(X > M)) with X ~ Binomial(N, q), q = B/N (scipy's exact
  binomial tail).
  """
  q = _check_poisson_size(num_examples, expected_batch_size) / num_examples
  tail = float(stats.binom.sf(max_batch_size, num_examples, q))
  return min(1.0, steps * tail)


def poisson_max_batch_size(num_examples, expected_batch_size, steps=1,
                           overflow_probability=OVERFLOW_PROBABILITY):
  """The smallest M with steps · P(Binomial(N, B/N) > M) ≤ overflow_probability.

  The padded shape :func:`poisson_batches` uses by default, with ``steps``
  the steps of one epoch: no step of an epoch overflows except with
  probability ≤ ``overflow_probability`` (1e-9).
  """
  b = _check_poisson_size(num_examples, expected_batch_size)
  return _binomial_max(num_examples, b / num_examples, b, steps,
                       overflow_probability)


def _binomial_max(n, q, floor, steps, overflow_probability):
  """The smallest M ≥ floor with steps · P(Binomial(n, q) > M) ≤ the bound
  (at most n)."""
  if not 0 < overflow_probability < 1:
    raise ValueError("overflow_probability must be in (0, 1); got "
                     f"{overflow_probability}.")
  target = overflow_probability / steps
  m = int(min(n, max(floor, stats.binom.isf(target, n, q))))
  # isf is a float search: settle the boundary with the exact tail.
  while m < n and stats.binom.sf(m, n, q) > target:
    m += 1
  while m > 1 and stats.binom.sf(m - 1, n, q) <= target:
    m -= 1
  return m


def _materialize(dataset):
  """A finite tf.data.Dataset of single examples -> a nest of NumPy arrays."""
  cardinality = int(dataset.cardinality())
  if cardinality == tf.data.INFINITE_CARDINALITY:
    raise ValueError(
        "poisson_batches needs a finite dataset: every step samples from all "
        "N examples, and q = B/N needs N. Remove .repeat().")
  if cardinality == tf.data.UNKNOWN_CARDINALITY:
    raise ValueError(
        "poisson_batches needs a dataset of known size N (q = B/N); this "
        "one's cardinality is unknown (e.g. after filter or from a "
        "generator). If you know N, declare it with "
        "dataset.apply(tf.data.experimental.assert_cardinality(N)).")
  for spec in tf.nest.flatten(dataset.element_spec):
    if spec.shape.rank and spec.shape[0] is None:
      raise ValueError(
          "poisson_batches samples individual examples, but the dataset's "
          f"elements have an unknown leading dimension ({spec}): it looks "
          "batched. Pass the unbatched dataset (dataset.unbatch()).")
  rows = list(dataset.as_numpy_iterator())
  if not rows:
    raise ValueError("poisson_batches: the dataset is empty.")
  return tf.nest.map_structure(lambda *r: np.stack(r), *rows)


def poisson_batches(x, y=None, *, expected_batch_size, sample_weight=None,
                    steps_per_epoch=None, max_batch_size=None, seed=None):
  """Poisson-sampled batches padded to one fixed shape: a ``tf.data.Dataset``.

  Every step, each of the N examples joins the batch independently with
  probability q = B/N, with fresh randomness at every step of every epoch:
  the sampling under which DP-SGD's privacy is amplified (Abadi et al. 2016;
  Mironov, Talwar & Zhang 2019), i.e. what ``compute_epsilon`` (sampling
  ``"poisson"``) assumes. Fixed-size shuffled batches (``model.fit``'s
  ``batch_size``) do not earn that ε.

  Batch sizes are random, X ~ Binomial(N, q). Every batch is padded to
  ``max_batch_size`` = M rows, so that a compiled (XLA) train step sees one
  shape. Elements are ``(x, y, sample_weight)``: padded rows are copies of
  example 0 with weight exactly 0 (they contribute exactly 0 to the clipped
  sum), real rows carry the user's weight (1 without ``sample_weight``).
  Pass the dataset to ``model.fit`` without ``batch_size``, for a model whose
  optimizer has ``expected_batch_size=B``: it divides the noisy clipped sum
  by B, never by the realized batch size X (X is not private; Opacus
  normalises by the expected batch size for the same reason), and accounts
  with q = B/N.

      ds = tf_dpadambc.data.poisson_batches(x, y, expected_batch_size=256)
      model.compile(optimizer=tf_dpadambc.DPAdamBC(
          1.0, sigma, expected_batch_size=256), loss=..., jit_compile=True)
      model.fit(ds, epochs=10)

  A batch larger than M is never truncated (that would change the sampling
  the ε assumes): iterating raises an error that names M and the overflow
  probability. By default M is :func:`poisson_max_batch_size` for one epoch:
  P(some step of an epoch overflows) ≤ 1e-9 (binomial tail, union bound over
  its steps), so ≤ E·1e-9 over E epochs. That stop is the only output the ε
  does not describe; its probability adds at most that much to δ.

  Args:
    x, y, sample_weight: NumPy arrays (or nests of them, e.g. dicts) with N
      rows; ``y`` may be None. Or ``x`` is a finite ``tf.data.Dataset`` of
      single (unbatched) examples — ``x``, ``(x, y)`` or ``(x, y, w)`` — of
      known cardinality N, with ``y`` and ``sample_weight`` None. It is read
      once and held in host memory as NumPy arrays (the memory of the whole
      dataset): sampling needs random access to every example at every step.
      Infinite datasets and those of unknown size are refused.
    expected_batch_size: B, an integer in [1, N]; q = B/N.
    steps_per_epoch: steps (batches) per iteration of the dataset, i.e. per
      ``fit`` epoch; default round(N/B), so that an epoch sees each example
      once in expectation (and ``compute_epsilon``'s step count,
      epochs · ceil(N/B), matches when B divides N).
    max_batch_size: M ≥ B, the padded batch size; see above.
    seed: None (the default) draws the sampling randomness from the OS
      (``secrets``): it must stay secret, like the noise seed — who knows
      which examples were in which step learns more than the ε allows. An
      integer makes the batches reproducible, for tests and debugging only.
      The dataset continues its random stream from epoch to epoch; to resume
      a run, build a new dataset with ``seed=None`` (rebuilding with the same
      seed would replay the same batches, which the accounting does not
      allow).

  Returns:
    A ``tf.data.Dataset`` of ``steps_per_epoch`` elements ``(x, y, w)`` with
    leading dimension M; each iteration draws new batches.
  """
  data, weights, n = _prepare(x, y, sample_weight)
  b = _check_poisson_size(n, expected_batch_size)
  q = b / n
  if steps_per_epoch is None:
    steps_per_epoch = max(1, round(n / b))
  steps_per_epoch = _count("steps_per_epoch", steps_per_epoch)
  if max_batch_size is None:
    max_batch_size = poisson_max_batch_size(n, b, steps_per_epoch)
  m = _count("max_batch_size", max_batch_size)
  if not b <= m <= n:
    raise ValueError(f"max_batch_size must be in [expected_batch_size = {b}, "
                     f"N = {n}]; got {m}.")
  if seed is None:
    seed = secrets.randbits(128)
  elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
    raise ValueError(f"seed must be None or an integer; got {seed!r}.")
  # One stream for the dataset's life: every iteration (epoch) continues it.
  rng = np.random.default_rng(seed)

  def overflow(size):
    p = poisson_overflow_probability(n, b, m)
    return ValueError(
        f"A Poisson batch drew {size} examples, more than max_batch_size = "
        f"{m} (probability {p:.3g} per step at N = {n}, B = {b}). Batches are "
        "never truncated: that would change the sampling the ε assumes. "
        "Build the dataset again with a larger max_batch_size, e.g. "
        "tf_dpadambc.data.poisson_max_batch_size(N, B, steps, "
        "overflow_probability=1e-12), and a new (secret) seed.")

  def batches():
    for _ in range(steps_per_epoch):
      yield _padded_sample(rng, n, q, m, data, weights, overflow)

  dataset = _padded_dataset(batches, data, weights, m, steps_per_epoch)
  dataset.poisson_sampling = PoissonSampling(
      num_examples=n, expected_batch_size=b, steps_per_epoch=steps_per_epoch)
  return dataset


@dataclasses.dataclass(frozen=True)
class PoissonSampling:
  """What a :func:`poisson_batches` dataset samples (attached to it as
  ``dataset.poisson_sampling``): ``make_private``'s ``fit`` checks that a
  Poisson optimizer (``expected_batch_size``) is fed such a dataset, of its
  own expected batch size."""
  num_examples: int
  expected_batch_size: int
  steps_per_epoch: int


def _sampling_of(x):
  for name in ("poisson_sampling", "cyclic_poisson"):
    sampling = getattr(x, name, None)
    if sampling is not None:
      return sampling
  return None


def poisson_sampling_of(x):
  """The expected batch size of ``x`` if it is a dataset of
  :func:`poisson_batches` or :func:`cyclic_poisson_batches` as returned
  (None otherwise)."""
  sampling = _sampling_of(x)
  return None if sampling is None else sampling.expected_batch_size


def poisson_num_examples_of(x):
  """The N such a dataset samples from (None for other data)."""
  sampling = _sampling_of(x)
  return None if sampling is None else sampling.num_examples


def _count(name, value):
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
      value < 1):
    raise ValueError(f"{name} must be an integer ≥ 1; got {value!r}.")
  return int(value)


def _prepare(x, y, sample_weight):
  """(data = (x, y), weights [N], N) from arrays or an unbatched dataset."""
  if isinstance(x, tf.data.Dataset):
    if y is not None or sample_weight is not None:
      raise ValueError("With a tf.data.Dataset, y and sample_weight come from "
                       "the dataset's elements: pass them there.")
    element = _materialize(x)
    if isinstance(element, tuple) and len(element) in (2, 3):
      x, y = element[0], element[1]
      sample_weight = element[2] if len(element) == 3 else None
    elif isinstance(element, tuple):
      raise ValueError("Dataset elements must be x, (x, y) or (x, y, "
                       f"sample_weight); got a tuple of {len(element)}.")
    else:
      x = element
  arrays = tuple(None if a is None else tf.nest.map_structure(np.asarray, a)
                 for a in (x, y, sample_weight))
  sizes = {len(a) for a in tf.nest.flatten([a for a in arrays
                                            if a is not None])}
  if len(sizes) != 1:
    raise ValueError(f"x, y and sample_weight have different lengths {sizes}.")
  n = sizes.pop()
  weights = arrays[2]
  if weights is None:
    weights = np.ones(n, np.float32)
  elif weights.ndim != 1:
    raise ValueError("sample_weight must have one weight per example (shape "
                     f"[N]); got shape {weights.shape}.")
  elif not np.issubdtype(weights.dtype, np.floating):
    weights = weights.astype(np.float32)
  data = (arrays[0], arrays[1])
  return data, weights, n


def _padded_sample(rng, population, probability, rows, data, weights,
                   overflow):
  """One Poisson sample of ``population`` (a count N, or the example indices
  to draw from), padded to ``rows``: each member independently with
  ``probability``, drawn as a Binomial size then a uniform subset of that
  size (the same distribution, in O(|S|)). Padded rows are example 0 with
  weight 0. Raises ``overflow(size)`` rather than truncate the sample.
  Returns (x, y, weights) of the batch."""
  count = (int(population) if isinstance(population, numbers.Integral)
           else len(population))
  size = int(rng.binomial(count, probability))
  if size > rows:
    raise overflow(size)
  index = np.zeros(rows, np.int64)
  index[:size] = np.sort(rng.choice(population, size, replace=False))
  w = np.zeros(rows, weights.dtype)
  w[:size] = weights[index[:size]]
  xb, yb = tf.nest.map_structure(lambda a: a[index], data)
  return xb, yb, w


def _padded_dataset(batches, data, weights, m, steps_per_epoch):
  """A dataset of ``steps_per_epoch`` padded batches from a generator."""
  def spec(a):
    dtype = tf.string if a.dtype.kind in "OSU" else tf.as_dtype(a.dtype)
    return tf.TensorSpec((m,) + a.shape[1:], dtype)
  signature = (tf.nest.map_structure(spec, data[0]),
               (tf.NoneTensorSpec() if data[1] is None
                else tf.nest.map_structure(spec, data[1])),
               spec(weights))
  dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
  return dataset.apply(
      tf.data.experimental.assert_cardinality(steps_per_epoch)).prefetch(2)


@dataclasses.dataclass(frozen=True)
class CyclicPoissonSampling:
  """What a :func:`cyclic_poisson_batches` dataset samples (attached to it as
  ``dataset.cyclic_poisson``; the privacy accounting reads it).

  groups: b, the number of disjoint groups; group t mod b is sampled at
  step t. probability: p = B·b/N, each example of the group joins the step
  independently with it. partition: b arrays of example indices (public:
  fixed by ``partition_seed``, independent of the data). secret_seed: False
  when the sampling seed was given (tests and debugging only).
  """
  num_examples: int
  expected_batch_size: int
  groups: int
  probability: float
  steps_per_epoch: int
  partition: tuple
  secret_seed: bool

  def group_of(self, example):
    """The group (0..b−1) of example index ``example``."""
    for g, members in enumerate(self.partition):
      if example in set(members.tolist()):
        return g
    raise ValueError(f"No example {example} (N = {self.num_examples}).")


def cyclic_poisson_batches(x, y=None, *, expected_batch_size, groups,
                           sample_weight=None, steps_per_epoch=None,
                           max_batch_size=None, seed=None, partition_seed=0):
  """Cyclic Poisson sampling: the batches amplified BandMF assumes.

  The N examples are split once into b = ``groups`` disjoint groups of
  ⌊N/b⌋ or ⌈N/b⌉ examples (a permutation by ``partition_seed``, cut
  round-robin). Step t (counted from the start of the run) uses group
  t mod b only: each of its examples joins the batch independently with
  probability p = B·b/N, afresh at every visit. An example can then be in
  steps t ≡ its group (mod b) only, at least b steps apart.

  With a b̂-banded strategy, b̂ ≤ b (``CorrelatedNoise(mf.optimize_banded
  (...))`` or ``mf.Toeplitz``), the run is exactly as private as DP-SGD with
  the same σ, sampling probability p and ceil(n/b) steps (Choquette-Choo et
  al. 2023, "(Amplified) banded matrix factorization", Theorem 4; for b̂ < b
  the columns of C that one example touches are still orthogonal). That is
  the ε ``optimizer_privacy_statement`` reports for the run, once the
  optimizer's ledger has verified that every step it released took group
  t mod b of this dataset (see ``accounting.cyclic``): the optimizer needs
  ``expected_batch_size=B`` and ``make_private``'s ``fit``, the dataset is
  passed to ``fit`` as returned (any transformation loses the
  verification), and every epoch must start at a step t ≡ 0 (mod b)
  (``steps_per_epoch`` is a multiple of b; resume only at epoch
  boundaries).

  Batches are padded to ``max_batch_size`` rows with weight-0 copies of
  example 0, as :func:`poisson_batches`; the optimizer divides by B, never by
  the realized size. A batch larger than M is never truncated (iteration
  raises).

  Args:
    x, y, sample_weight: as :func:`poisson_batches`.
    expected_batch_size: B ≥ 1, with p = B·b/N ≤ 1.
    groups: b ≥ 1 (b = 1 is plain Poisson sampling).
    steps_per_epoch: a multiple of b; default b·max(1, round(N/(B·b))), so
      that an epoch sees each example about once in expectation.
    max_batch_size: M; default the smallest M with
      P(some step of an epoch draws more than M) ≤ 1e-9.
    seed: None (default) draws the sampling randomness from the OS and must
      stay secret; an integer is for tests and debugging.
    partition_seed: the (public) permutation that forms the groups; keep
      it for the whole run (also when resuming).

  Returns:
    A ``tf.data.Dataset`` of ``steps_per_epoch`` elements ``(x, y, w)``,
    with a ``cyclic_poisson`` attribute (:class:`CyclicPoissonSampling`).
  """
  data, weights, n = _prepare(x, y, sample_weight)
  big_b = _check_poisson_size(n, expected_batch_size)
  b = _count("groups", groups)
  if b > n:
    raise ValueError(f"groups = {b} exceeds N = {n}: every group needs an "
                     "example.")
  p = big_b * b / n
  if p > 1:
    raise ValueError(
        f"Cyclic Poisson sampling with b = {b} groups of about N/b = "
        f"{n / b:.4g} examples cannot give batches of expected size {big_b} "
        f"(p = B·b/N = {p:.4g} > 1): use fewer groups or a smaller batch.")
  if steps_per_epoch is None:
    steps_per_epoch = b * max(1, round(n / (big_b * b)))
  steps_per_epoch = _count("steps_per_epoch", steps_per_epoch)
  if steps_per_epoch % b:
    raise ValueError(
        f"steps_per_epoch = {steps_per_epoch} is not a multiple of groups = "
        f"{b}: every epoch must start with group 0, so that step t uses "
        "group t mod b across epochs.")
  order = np.random.default_rng(partition_seed).permutation(n)
  partition = tuple(np.sort(order[g::b]) for g in range(b))
  largest = max(len(members) for members in partition)
  if max_batch_size is None:
    max_batch_size = _binomial_max(largest, p, 1, steps_per_epoch,
                                   OVERFLOW_PROBABILITY)
  m = _count("max_batch_size", max_batch_size)
  if m > largest:
    m = largest  # no group can fill more rows than it has examples
  secret = seed is None
  if secret:
    seed = secrets.randbits(128)
  elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
    raise ValueError(f"seed must be None or an integer; got {seed!r}.")
  rng = np.random.default_rng(seed)

  def overflow(size):
    return ValueError(
        f"A cyclic Poisson batch drew {size} examples, more than "
        f"max_batch_size = {m}. Batches are never truncated (that would "
        "change the sampling the ε assumes): build the dataset again "
        "with a larger max_batch_size and a new (secret) seed.")

  def batches():
    for i in range(steps_per_epoch):
      members = partition[i % b]
      yield _padded_sample(rng, members, p, m, data, weights, overflow)

  dataset = _padded_dataset(batches, data, weights, m, steps_per_epoch)
  dataset.cyclic_poisson = CyclicPoissonSampling(
      num_examples=n, expected_batch_size=big_b, groups=b, probability=p,
      steps_per_epoch=steps_per_epoch, partition=partition,
      secret_seed=secret)
  return dataset
