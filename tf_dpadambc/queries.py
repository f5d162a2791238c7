"""TF-Privacy DPQuery objects as the privatization stage of our optimizers.

Any ``DPQuery`` (``GaussianSumQuery``, ``QuantileAdaptiveClipSumQuery``,
``NormalizedQuery``, tree aggregation / ``RestartQuery``, or our own
``mechanisms``) can replace the clipping and the Gaussian noise of a step:

    DPAdamBC(query=QuantileAdaptiveClipSumQuery(...), learning_rate=1e-3)

One logical step then runs the DPQuery protocol on the step's per-unit
gradients g_u:

    params  = derive_sample_params(state_t)
    sample  = Σ_u preprocess_record(params, g_u)        (vectorized over u)
    result, state_{t+1}, event = get_noised_result(sample, state_t)
    ḡ = result / B     (sum queries; a ``NormalizedQuery`` divides itself)

The global state lives in optimizer variables, read and assigned inside the
compiled step: adaptive clipping really advances under ``model.fit``
(TF-Privacy's own Keras optimizers keep it in a Python attribute, so it
does not — their issue #111).

Accounting: the query's per-step ``DpEvent`` is evaluated (eagerly, from the
current global state) when ε is asked for, made concrete and composed over
the run's steps and sampling (``accounting.events.sampled_event``). An event
that cannot be accounted (``UnsupportedDpEvent`` of tree aggregation, a
non-private event, one that changes across steps) raises
:class:`NotAccountable` instead of giving an ε.

Φ (the noise variance per coordinate of ḡ, which bias correction subtracts)
is read from the global state of the queries whose noise std is known
(Gaussian sum queries, adaptive clipping, normalized queries, our own
mechanisms); other queries serve only the variants that do not need Φ.

TF-Privacy itself cannot be imported on TensorFlow ≥ 2.16 without its skip
flag: :mod:`tf_dpadambc.tf_privacy` imports it.
"""
import contextlib
import random
import secrets

import dp_accounting
import tensorflow as tf
from tensorflow.python.eager import context  # pylint: disable=g-direct-tensorflow-import

from tf_dpadambc import mechanisms
from tf_dpadambc import privatizer
from tf_dpadambc.core import ghost


class NotAccountable(ValueError):
  """The query's DpEvent does not give a trustworthy ε.

  ``not_private`` is True when the event says the release is not private
  (no noise), False when it is merely beyond dp_accounting (tree
  aggregation's ``UnsupportedDpEvent``).
  """

  def __init__(self, message, not_private=False):
    super().__init__(message)
    self.not_private = not_private


# What tf_dpadambc knows of a query, by its exact class: the only place that
# asks. A subclass may change how a record is clipped or summed, so it gets
# only the DPQuery protocol (per-unit preprocess_record, folded accumulate):
# exact, slower. TF-Privacy's classes are known by module and name
# (TF-Privacy is optional, and cannot be imported on TensorFlow ≥ 2.16
# without its skip flag); ours by type.
_TF_PRIVACY_KINDS = {"NormalizedQuery": "normalized",
                     "QuantileAdaptiveClipSumQuery": "adaptive",
                     "GaussianSumQuery": "gaussian"}


def _from_tf_privacy(query):
  return type(query).__module__.split(".")[0] == "tensorflow_privacy"


def _kind(query):
  """``"normalized"``, ``"adaptive"``, ``"gaussian"`` (a Gaussian sum
  query, or our IndependentNoise), ``"correlated"`` (our CorrelatedNoise)
  or None (any other query, subclasses included: only its DPQuery protocol
  is used)."""
  if type(query) is mechanisms.CorrelatedNoise:
    return "correlated"
  if type(query) is mechanisms.IndependentNoise:
    return "gaussian"
  if _from_tf_privacy(query):
    return _TF_PRIVACY_KINDS.get(type(query).__name__)
  return None


def _sums(query):
  """True for sum queries, whose records accumulate by addition: ours and
  TF-Privacy's own (a subclass elsewhere folds its accumulate instead)."""
  return type(query) in (mechanisms.IndependentNoise,
                         mechanisms.CorrelatedNoise) or (
                             _from_tf_privacy(query) and "SumAggregationDPQuery"
                             in {c.__name__ for c in type(query).__mro__})


def check_query(query):
  """``query`` if it implements the DPQuery protocol, else TypeError."""
  needed = ("initial_global_state", "derive_sample_params",
            "initial_sample_state", "preprocess_record",
            "accumulate_preprocessed_record", "get_noised_result")
  missing = [m for m in needed if not callable(getattr(query, m, None))]
  if missing:
    raise TypeError(
        f"query={query!r} is not a TF-Privacy DPQuery (no {missing}). Pass "
        "e.g. tf_dpadambc.tf_privacy.GaussianSumQuery(l2_norm_clip, stddev).")
  return query


_PROBE_STEPS = 4


def _vectorize_l2_loss():
  """Gives ``L2Loss`` a vectorization rule: ½Σx² over all but the unit axis.

  Queries clip with ``tf.clip_by_global_norm``, whose ``L2Loss`` has no pfor
  converter, so ``tf.vectorized_map`` would loop over the units one by one.
  (TensorFlow-internal registry; without it the loop is slower, not wrong.)
  """
  try:
    from tensorflow.python.ops.parallel_for import pfor  # pylint: disable=g-import-not-at-top
    @pfor.RegisterPFor("L2Loss")
    def _l2_loss(pfor_input):  # pylint: disable=unused-variable
      t = pfor_input.stacked_input(0)
      return pfor.wrap(0.5 * tf.reduce_sum(
          tf.square(t), axis=tf.range(1, tf.rank(t))), True)
  except (ImportError, AttributeError, AssertionError, ValueError):
    pass  # absent internals, or the rule exists already


_vectorize_l2_loss()


# Queries whose global state is public: clip norms, noise stds and adaptive
# clipping's estimates, all post-processing of released (noised) values.
# Exact class names: a subclass may add state of its own.
_PUBLIC_STATE = frozenset({"GaussianSumQuery", "QuantileAdaptiveClipSumQuery",
                           "IndependentNoise"})


def _public_state(query):
  if type(query).__name__ == "NormalizedQuery":
    return _public_state(getattr(query, "_numerator", None))
  return type(query).__name__ in _PUBLIC_STATE


def _leaf_shapes(state):
  return [tf.convert_to_tensor(t).shape for t in tf.nest.flatten(state)]


class QueryRelease(privatizer.Privatizer):
  """A DPQuery driven once per logical step, with its state in variables:
  the :class:`~tf_dpadambc.privatizer.Privatizer` of ``query=``.

  Args:
    query: the DPQuery.
  """

  # Its state and noise are per process; it clips every record itself.
  replica_refusal = "a DPQuery (its state and noise are per process)"
  clips_records = True

  def __init__(self, query):
    self.query = check_query(query)
    kind = _kind(query)
    # Sum queries accumulate by addition: Σ over the vectorized records is
    # exactly accumulate_preprocessed_record folded over them.
    self.sums = _sums(query)
    self.normalizes = kind == "normalized"
    self._initial_event = None
    self._varying = None

  @property
  def secret_stream(self):
    return not self.public_state

  def poisson_refusal(self):
    return "a DPQuery (it normalises by the realized number of units)"

  def adds_noise(self, noise_multiplier):
    del noise_multiplier  # (the query's own)
    return self.is_private

  # ------------------------------------------------------------ the state
  def initial_state(self, templates):
    """The initial global state, eagerly, and which leaves change shape.

    Probes a few releases on a zero sample (discarded) to learn the query's
    event and which state tensors change shape from step to step (tree
    aggregation's buffers grow at steps 2, 4, 8, ...): those need variables
    of unknown shape.
    """
    self._record_shapes = [tuple(t.shape) for t in templates]
    with tf.init_scope():
      state = self.query.initial_global_state()
      sample = self.query.initial_sample_state(list(templates))
      self._shapes = _leaf_shapes(state)
      probe, event = state, None
      for _ in range(_PROBE_STEPS):
        _, probe, step_event = self.query.get_noised_result(sample, probe)
        event = event or step_event  # the first release's
        self._shapes = [a.most_specific_compatible_shape(b) for a, b in zip(
            self._shapes, _leaf_shapes(probe))]
      try:
        self._initial_event = self._concrete(event)
      except NotAccountable as e:
        self._initial_event = e  # raised when an ε is asked for
    return state

  @property
  def public_state(self):
    """True when the query's global state is known to hold nothing secret
    (the optimizer saves it then; otherwise it is never saved: tree
    aggregation keeps noise seeds, past noise and un-noised cumulative sums
    there)."""
    return _public_state(self.query)

  @property
  def is_private(self):
    """False when the query's event says it adds no noise (known after
    :meth:`initial_state`)."""
    return not getattr(self._initial_event, "not_private", False)

  @property
  def state_shapes(self):
    """Per leaf of the global state, its shape over steps (None where a
    dimension grows)."""
    return self._shapes

  # ----------------------------------------------------------- one step
  def sample_state(self, state, per_unit_records, templates, unit_mask=None):
    """Σ_u preprocess_record(params_t, g_u) over the units with mask 1.

    Args:
      state: the global state (tensors).
      per_unit_records: list of tensors [U, *shape], one per variable.
      templates: the variables (shapes of one record).
      unit_mask: optional [U] bool: units to leave out (padding rows of a
        Poisson batch), which must not count as records (adaptive clipping
        would count them as unclipped).
    """
    params = self.query.derive_sample_params(state)
    records = list(per_unit_records)
    preprocessed = tf.vectorized_map(
        lambda r: self.query.preprocess_record(params, r), records,
        fallback_to_while_loop=True)
    flat = tf.nest.flatten(preprocessed)
    if unit_mask is not None:  # (exactly 0, also for a non-finite record)
      flat = [ghost.masked(t, unit_mask) for t in flat]
    initial = self.query.initial_sample_state(list(templates))
    if self.sums:
      summed = [tf.reduce_sum(t, axis=0) for t in flat]
      return tf.nest.map_structure(
          tf.add, initial,
          tf.nest.pack_sequence_as(initial, [
              tf.cast(s, i.dtype) for s, i in zip(
                  summed, tf.nest.flatten(initial))]))
    stacked = tf.nest.pack_sequence_as(preprocessed, flat)
    return tf.foldl(self.query.accumulate_preprocessed_record, stacked,
                    initializer=initial)

  # ------------------------------------- L2-clipping queries: ghost speed
  def clip_norm(self, state, query=None):
    """C_t if the query clips each record to global L2 norm C_t and needs
    nothing else of a record than the clipped record and its norm; None
    otherwise (then only :meth:`sample_state` applies).

    Then the train step can clip with ghost norms (no per-unit gradients)
    and :meth:`sample_from_clipped` builds the same sample state.
    """
    query = self.query if query is None else query
    kind = _kind(query)
    params = query.derive_sample_params(state)
    if kind == "normalized":
      return self.clip_norm(state.numerator_state, query._numerator)  # pylint: disable=protected-access
    if kind == "adaptive":
      return params.sum_params
    if kind in ("gaussian", "correlated"):
      return params
    return None

  def sample_of_clipped_sum(self, state, result, templates, unit_mask=None):
    """:meth:`sample_from_clipped` of a ``core.clipping.ClippedSum``: its
    records are the units with a finite norm and in ``unit_mask`` (real,
    not padding). Not gated on ``result.mismatch``: a verdict on the whole
    batch would make every record's presence depend on all examples."""
    norms = tf.convert_to_tensor(result.norms)
    mask = tf.math.is_finite(norms)
    if unit_mask is not None:
      mask &= unit_mask
    return self.sample_from_clipped(state, result.grads, norms, templates,
                                    mask)

  def sample_from_clipped(self, state, clipped_sum, norms, templates,
                          unit_mask, query=None):
    """The sample state Σ_u preprocess_record(params, g_u) from Σ_u clip(g_u)
    and the per-unit norms ‖g_u‖ (only for queries with a :meth:`clip_norm`).

    ``unit_mask`` ([U] bool): the units that are records (real, finite,
    verified); the clipped sum already excludes the others.
    """
    query = self.query if query is None else query
    kind = _kind(query)
    if kind == "normalized":
      return self.sample_from_clipped(state.numerator_state, clipped_sum,
                                      norms, templates, unit_mask,
                                      query._numerator)  # pylint: disable=protected-access
    initial = query.initial_sample_state(list(templates))
    if kind == "adaptive":
      # Andrew et al.'s estimator counts the records with ‖g_u‖ ≤ C_t.
      estimator = query._quantile_estimator_query  # pylint: disable=protected-access
      params = query.derive_sample_params(state).quantile_estimator_params
      counts = tf.vectorized_map(
          lambda norm: estimator.preprocess_record(params, norm),
          tf.where(unit_mask, norms, tf.zeros_like(norms)))
      counts = tf.where(unit_mask, counts, tf.zeros_like(counts))
      return initial._replace(
          sum_state=_added(initial.sum_state, clipped_sum),
          quantile_estimator_state=initial.quantile_estimator_state
          + tf.reduce_sum(counts))
    return _added(initial, clipped_sum)

  def release(self, ctx, clipped_sum, num_units):
    """The query's release; its new global state goes to the variables
    (``ctx.state``). Φ is NaN where the noise std is unknown (it then only
    feeds diagnostics: the variants that subtract it refuse such queries)."""
    mean, new_state, phi = self.noised_mean(clipped_sum, ctx.state.query_state(),
                                            num_units)
    ctx.state.assign_query_state(new_state)
    if phi is None:
      phi = tf.constant(float("nan"), tf.float32)
    return privatizer.Release(mean, None, phi)

  def noised_mean(self, sample_state, state, num_units):
    """(private mean ḡ as a list, new global state, Φ or None).

    ḡ = result / B for sum queries (B = ``num_units``), the result itself
    for a ``NormalizedQuery``; Φ = (noise std / B)² where the std is known.
    """
    with secret_op_seeds():
      result, new_state, _ = self.query.get_noised_result(sample_state, state)
    result = tf.nest.flatten(result)
    std, denominator = self.noise_stddev(state), None
    if self.normalizes:
      denominator = tf.cast(self.query._denominator, tf.float32)  # pylint: disable=protected-access
    else:
      denominator = tf.cast(num_units, tf.float32)
      result = [r / tf.cast(denominator, r.dtype) for r in result]
    phi = None if std is None else tf.square(std / denominator)
    return result, new_state, phi

  def noise_stddev(self, state, query=None):
    """Std of the noise the query adds to the sum, or None if unknown."""
    query = self.query if query is None else query
    kind = _kind(query)
    if kind == "normalized":
      return self.noise_stddev(state.numerator_state,
                               query._numerator)  # pylint: disable=protected-access
    if kind == "adaptive":
      return tf.cast(state.sum_state.stddev, tf.float32)
    if kind == "gaussian":
      return tf.cast(state.stddev, tf.float32)
    return None  # unknown; CorrelatedNoise's varies by step (use noise=)

  def metrics(self, state):
    """The query's own metrics (e.g. the adaptive clip norm)."""
    derive = getattr(self.query, "derive_metrics", None)
    return dict(derive(state)) if derive else {}

  # --------------------------------------------------------- accounting
  def step_event(self, state, divisor=1.0):
    """The concrete DpEvent of one release from ``state``.

    ``divisor`` divides every Gaussian noise multiplier: 2 where a unit holds
    several examples (add/remove of one example moves a microbatch's record
    by up to twice its bound). Raises :class:`NotAccountable`.
    """
    with tf.init_scope():
      sample = self.query.initial_sample_state(
          [tf.zeros(s) for s in self._record_shapes])
      _, _, event = self.query.get_noised_result(sample, state)
      event = self._concrete(event)
    if isinstance(self._initial_event, NotAccountable):
      raise self._initial_event
    if event != self._initial_event:
      raise NotAccountable(
          f"The DpEvent of {type(self.query).__name__} changed during "
          f"training ({self._initial_event} at the start, {event} now): "
          "tf_dpadambc composes one per-step event and refuses to report an "
          "ε for a query whose privacy varies by step. Account it yourself "
          "with dp_accounting.")
    return _divide(event, divisor)

  def _concrete(self, event):
    try:
      return _concrete(event)
    except NotAccountable as e:
      raise NotAccountable(
          f"{type(self.query).__name__} reports {event!r}, which "
          f"dp_accounting cannot turn into an ε ({e}). tf_dpadambc refuses "
          "to print an ε for it rather than a wrong one. Tree aggregation "
          "(DP-FTRL) needs its own analysis: use noise=CorrelatedNoise(...) "
          "with a tree or banded strategy, which tf_dpadambc accounts, or "
          "account the run yourself.", e.not_private) from None


XLA_ERROR = (
    "tf_dpadambc: {query} draws its noise with TensorFlow's stateful random "
    "ops, which XLA compiles to the same numbers in every process, seeded or "
    "not (a review: two runs' releases differed by their un-noised sums to "
    "2.2e-8, for noise of std 0.31): no noise at all for whoever runs the "
    "same code. Compile without XLA (jit_compile=False), or use this "
    "library's own mechanisms (tf_dpadambc.IndependentNoise, CorrelatedNoise, "
    "or no query=: the optimizers' noise is keyed by a secret seed).")


def check_not_under_xla(query, jit_compile):
  """Refuses a DPQuery whose noise is TensorFlow's own random ops in a step
  compiled by XLA (``jit_compile`` True): this library's mechanisms draw
  stateless noise from a secret seed, and are fine."""
  query = getattr(query, "query", query)  # a QueryRelease's DPQuery
  # Any true value (np.bool_, 1, "auto" left unresolved) may compile with
  # XLA (a review: np.bool_(True) passed an `is True` test).
  if query is not None and bool(jit_compile) and not isinstance(
      query, mechanisms.NoiseMechanism):
    raise ValueError(XLA_ERROR.format(query=type(query).__name__))


@contextlib.contextmanager
def secret_op_seeds():
  """TensorFlow's seeded random ops made in this block take seeds no one
  knows, even where a global seed is set.

  A DPQuery draws its noise with TensorFlow's own random ops (``seed=None``).
  With a global seed (``tf.random.set_seed``, ``keras.utils.set_random_seed``)
  their seeds follow from it: every trace of a step drew the same noise, so
  the difference of two runs' releases was the difference of their
  un-noised sums (a review: exact to 3.6e-7 at σC = 5). Here the graph's
  seed (tracing) or the eager context's seed and op-seed generator are
  swapped for secret ones from the OS for the block, and put back after (the
  user's own random ops go on as they would have). Without a global seed the
  ops are seeded from the OS already: nothing changes."""
  if tf.executing_eagerly():
    ctx = context.context()
    if ctx._seed is None:  # pylint: disable=protected-access
      yield
      return
    saved = ctx._seed, ctx._rng  # pylint: disable=protected-access
    ctx._seed = secrets.randbits(31)  # pylint: disable=protected-access
    ctx._rng = random.Random(secrets.randbits(64))  # pylint: disable=protected-access
    try:
      yield
    finally:
      ctx._seed, ctx._rng = saved  # pylint: disable=protected-access
    return
  graph = tf.compat.v1.get_default_graph()
  if graph.seed is None:
    yield
    return
  saved = graph.seed
  graph.seed = secrets.randbits(31)
  try:
    yield
  finally:
    graph.seed = saved


def _added(initial, clipped_sum):
  flat = tf.nest.flatten(initial)
  return tf.nest.pack_sequence_as(initial, [
      i + tf.cast(c, i.dtype) for i, c in zip(flat, clipped_sum)])


def _number(value):
  return float(tf.get_static_value(value) if tf.is_tensor(value) else value)


def _concrete(event):
  """A copy of ``event`` with Python numbers; NotAccountable if impossible."""
  if isinstance(event, (dp_accounting.GaussianDpEvent,
                        dp_accounting.LaplaceDpEvent)):
    multiplier = _number(event.noise_multiplier)
    if not multiplier > 0:
      raise NotAccountable(f"a {type(event).__name__} with noise multiplier "
                           f"{multiplier} is not private", not_private=True)
    return type(event)(multiplier)
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return dp_accounting.ComposedDpEvent([_concrete(e) for e in event.events])
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    return dp_accounting.SelfComposedDpEvent(_concrete(event.event),
                                             int(_number(event.count)))
  if isinstance(event, dp_accounting.PoissonSampledDpEvent):
    return dp_accounting.PoissonSampledDpEvent(
        _number(event.sampling_probability), _concrete(event.event))
  if isinstance(event, dp_accounting.NoOpDpEvent):
    return event
  if isinstance(event, dp_accounting.NonPrivateDpEvent):
    raise NotAccountable("the query is not private", not_private=True)
  if isinstance(event, dp_accounting.UnsupportedDpEvent):
    raise NotAccountable("UnsupportedDpEvent")
  raise NotAccountable(f"no rule for {type(event).__name__}")


def _divide(event, divisor):
  """Every Gaussian multiplier divided by ``divisor`` (sensitivity × divisor)."""
  if divisor == 1:
    return event
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return dp_accounting.GaussianDpEvent(event.noise_multiplier / divisor)
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return dp_accounting.ComposedDpEvent(
        [_divide(e, divisor) for e in event.events])
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    return dp_accounting.SelfComposedDpEvent(_divide(event.event, divisor),
                                             event.count)
  if isinstance(event, dp_accounting.PoissonSampledDpEvent):
    return dp_accounting.PoissonSampledDpEvent(
        event.sampling_probability, _divide(event.event, divisor))
  if isinstance(event, dp_accounting.NoOpDpEvent):
    return event
  raise NotAccountable(
      f"units of several examples double the sensitivity, and "
      f"{type(event).__name__} has no rule to account that: use "
      "num_microbatches=None with this query.")
