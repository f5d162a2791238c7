"""The Keras 3 shell shared by every private optimizer.

A :class:`DPOptimizer` owns the privacy mechanism — clip norm C, noise
multiplier σ, microbatching, gradient accumulation, the secret noise seed —
and turns clipped sums into one private mean gradient per logical step
through its privatizer (``tf_dpadambc.privatizer``). Subclasses only say how
that private mean moves the weights (``build`` + ``update_step``, as in any
Keras optimizer) and declare what they release (``TRAITS``, see
``traits.py``, which also says how to add a variant).

The privacy argument in three files: what is clipped (``core/clipping.py``,
per unit, at :meth:`DPOptimizer.clip_spec`), what is noised (this file's
``_release``, through ``privatizer.py``), what is accounted
(``accounting/run.py``).

It takes its input through :meth:`DPOptimizer.apply_private`, called by the
train step that :func:`tf_dpadambc.make_private` installs. The ordinary Keras
entry points (``apply``, ``apply_gradients``) receive gradients that were
neither clipped per example nor noised, so they raise.
"""
import collections

import keras
import tensorflow as tf

from tf_dpadambc import mechanisms
from tf_dpadambc import privatizer as privatizer_lib
from tf_dpadambc._checks import check_count  # noqa: F401 (re-exported)
from tf_dpadambc._checks import check_decay  # noqa: F401 (re-exported)
from tf_dpadambc._checks import check_positive  # noqa: F401 (re-exported)
from tf_dpadambc.accounting import ledger as ledger_lib
from tf_dpadambc.accounting import run
from tf_dpadambc.core import clipping
from tf_dpadambc.core import diagnostics
from tf_dpadambc.core import ghost
from tf_dpadambc.keras.optimizers import arguments
from tf_dpadambc.keras.optimizers import distributed
from tf_dpadambc.keras.optimizers import state as state_lib
from tf_dpadambc.keras.optimizers.arguments import check_clip  # noqa: F401 (re-exported)
from tf_dpadambc.keras.optimizers.traits import EstimatorTraits

PACKAGE = "tf_dpadambc"
Release = privatizer_lib.Release  # (re-exported)

_AGGREGATED_GRADIENTS_ERROR = (
    "{name} received aggregated gradients through `apply`/`apply_gradients`. "
    "Those gradients were not clipped per example nor noised, so applying them "
    "would train without differential privacy. Keras 3's default train step "
    "cannot produce private gradients: make the model private before "
    "compiling, e.g.\n\n"
    "    model = tf_dpadambc.make_private(model)\n"
    "    model.compile(optimizer={name}(...), loss=..., metrics=[...])\n"
    "    model.fit(...)\n\n"
    "(also after `keras.models.load_model`). In a custom training loop, use "
    "`tf_dpadambc.private_gradient_sum(...)` and "
    "`optimizer.apply_private(...)`.")

RunRecord = collections.namedtuple("RunRecord", [
    "max_batch_examples", "max_batch_units", "max_physical_examples",
    "examples_seen"])
RunRecord.__doc__ = """What the accounting needs of a run (0 before build):
the largest logical batch in examples and in clipped units, the largest
physical batch, and the examples of all physical batches."""


def register(args_doc):
  """Class decorator: append the shared ``Args`` text, register for saving."""
  def decorate(cls):
    cls.__doc__ += args_doc
    return keras.saving.register_keras_serializable(package=PACKAGE)(cls)
  return decorate


def _after_inputs(*inputs):
  """Control dependencies on the graph tensors among ``inputs`` (nests):
  the ops created under it run only once the batch's data exists."""
  tensors = [t for t in tf.nest.flatten(inputs)
             if tf.is_tensor(t) and not isinstance(t, tf.Variable)
             and hasattr(t, "graph") and not tf.executing_eagerly()]
  return tf.control_dependencies(tensors)


def _private(name):
  """Read access to ``PrivateState.<name>`` under the historical name."""
  return property(lambda self: getattr(self._private, name))


class DPOptimizer(distributed.CrossReplicaOptimizer):
  """Base class of the private optimizers: the Gaussian mechanism, once per step.

  Args:
    l2_norm_clip: C > 0, the L2 bound on each unit's (example's or
      microbatch's) gradient; or a list with one bound C_k per trainable
      variable (per-layer clipping: the noise std is σ·‖(C_k)‖₂, and Φ uses
      it too).
    noise_multiplier: σ ≥ 0; the noise added to the clipped sum has std σC.
      ``0`` is accepted for debugging but the training is then NOT private
      (a warning is issued and the privacy report says so).
    num_microbatches: ``None`` clips every example (the default and the
      tightest accounting). An integer M splits each physical batch into M
      microbatches whose mean gradients are clipped; it must divide the batch
      size. Microbatches of more than one example double the sensitivity
      under add/remove adjacency, which the accounting takes into account.
    gradient_accumulation_steps: ``None`` or k ≥ 1: one logical private step
      over k physical batches. Clipped sums accumulate, the noise is drawn
      once, and the mean divides by the logical batch's number of units B;
      Φ and the accounting use that logical batch.
    seed: ``None`` (a secret seed from the OS) or an integer that makes the
      noise reproducible. Anyone who knows the seed can remove the noise: use
      it for debugging and tests, and keep it secret. No seed is ever saved,
      not even a given one (``get_config`` says ``seed=None``): pass it again
      to the optimizer that resumes a run.
    clipping: ``"standard"`` (g·min(1, C/‖g‖)) or ``"automatic"``
      (g·C/(‖g‖+γ), Bu et al., NeurIPS 2023: every unit is normalized, so C
      only scales the step; its sensitivity is still C).
    automatic_gamma: γ > 0 of automatic clipping.
    noise: the noise mechanism (``tf_dpadambc.mechanisms``):
      ``IndependentNoise()`` (the default, DP-SGD's) or
      ``CorrelatedNoise(strategy, steps, ...)`` (DP-MF: noise correlated
      across steps, σΔ·sens(C)·(C⁻¹z)_t; Φ follows its per-step variance).
    query: instead of ``l2_norm_clip``/``noise_multiplier``/``noise``, a
      TF-Privacy DPQuery (``tf_dpadambc.tf_privacy.GaussianSumQuery``,
      ``QuantileAdaptiveClipSumQuery``, tree aggregation, ...) that clips and
      noises each step (``tf_dpadambc.queries``): its global state advances
      inside the compiled step, its DpEvent is what ``dp_event`` composes.
      For the variants that release the plain clipped sum
      (``TRAITS.releases_plain_sum``); needs per-unit gradients
      (clipping="vectorized" speed) unless the query clips by L2 norm.
    expected_batch_size: ``None`` (fixed-size batches) or B ≥ 1: every batch
      is a Poisson sample of expected size B (``data.poisson_batches``). The
      mean then divides by B, never by the realized batch size (which is not
      private; as Opacus), Φ = (σC/B)², and ``dp_event`` accounts Poisson
      sampling with q = B/N — only. Not with ``num_microbatches``, gradient
      accumulation, correlated noise, a DPQuery or IME.
    learning_rate, **kwargs: as for ``keras.optimizers.Optimizer``
      (``weight_decay`` gives decoupled weight decay, at no privacy cost).

  The private mean of a logical step with B units is
  ḡ = (Σ_u clip_C(g_u) + N(0, σ²C² I)) / B, per-coordinate noise variance
  Φ = (σC/B)² (B: the units actually in the step, or ``expected_batch_size``);
  with correlated noise Var_t = (σC/B)²·sens(C)²·‖row_t(C⁻¹)‖².

  Subclass contract: ``TRAITS`` (``traits.py``), ``build``/``update_step``
  (reading the release through :attr:`step_context`), and optionally the
  hooks ``_privatize(ctx, ...)``, ``_on_private_step(ctx)``,
  ``_step_sensitivity()``, ``clip_spec``, ``before_step(model)``.
  """

  TRAITS = EstimatorTraits()
  accounting_reason = None  # why the accounted σ is below σ, if a class knows

  # Historical names of the unsaved state (tests and tools read them).
  _seed_pair, _seed_variable = _private("seed_pair"), _private("seed_variable")
  _seed, _noise_state = _private("seed"), _private("noise_state")
  _accumulated_sums = _private("accumulated_sums")
  _accumulated_units = _private("accumulated_units")
  _physical_step = _private("physical_step")
  _query_variables = _private("query_variables")
  _uses_square_sum = property(lambda self: self.traits.uses_square_sum)

  def __init__(self, l2_norm_clip=None, noise_multiplier=None,
               learning_rate=0.001, num_microbatches=None,
               gradient_accumulation_steps=None, seed=None,
               clipping="standard", automatic_gamma=0.01, noise=None,
               query=None, expected_batch_size=None, name=None, **kwargs):
    # Keras requires super().__init__() before any attribute is set.
    checked = arguments.validated(
        type(self), l2_norm_clip, noise_multiplier, num_microbatches,
        gradient_accumulation_steps, seed, clipping, automatic_gamma, noise,
        query, expected_batch_size, kwargs)
    super().__init__(learning_rate=learning_rate,
                     name=name or self.__class__.__name__, **kwargs)
    for attribute, value in checked.items():
      setattr(self, attribute, value)
    # The one privatization stage, chosen here (privatizer.py).
    self.privatizer = self.query or self.noise
    # Secret or un-noised state: one object no tracking sees (state.py).
    state_lib.keep_unsaved(self, "_private",
                           state_lib.PrivateState(self, seed))
    arguments.warn_if_not_private(self)

  @property
  def traits(self):
    """This optimizer's :class:`~.traits.EstimatorTraits` (``TRAITS``)."""
    return self.TRAITS

  @property
  def DIAGNOSTICS(self):  # pylint: disable=invalid-name
    return self.traits.diagnostics

  @property
  def is_private(self):
    """False when no noise is added (noise_multiplier == 0, a DPQuery without
    noise) or the class is a non-private research baseline."""
    if self.traits.not_private_reason:
      return False
    return self.query.is_private if self.query is not None else (
        self.noise_multiplier > 0)

  @property
  def sensitivity(self):
    """L2 bound of one unit's clipped gradient: C, or ‖(C_k)‖₂ per layer."""
    if self.query is not None:
      raise ValueError("With a DPQuery the sensitivity is the query's; see "
                       "its DpEvent (dp_event).")
    return self._clip_spec_for(self.l2_norm_clip).sensitivity

  def _clip_spec_for(self, clip_norm):
    return clipping.as_spec(clip_norm)._replace(
        automatic_gamma=(self.automatic_gamma if self.clipping == "automatic"
                         else None))

  def clip_spec(self, trainable_variables):
    """The :class:`~tf_dpadambc.core.clipping.ClipSpec` of the next step.

    The train step clips units with it. Preconditioned variants (scale-then-
    privatize, delayed or public preconditioners) put their current scale
    s_t in it; it depends only on already released values.
    """
    self._variables_of_step(trainable_variables)
    return self._clip_spec_for(self.l2_norm_clip)._replace(
        square_sum=self.traits.uses_square_sum)

  def query_clip_spec(self, trainable_variables):
    """The ClipSpec of this step for a DPQuery that clips by L2 norm (so the
    train step can use ghost clipping), or None."""
    self._variables_of_step(trainable_variables)
    clip = self.query.clip_norm(self._private.query_state())
    return None if clip is None else clipping.ClipSpec(clip)

  def _step_sensitivity(self):
    """Δ of this step's clipped sum (a step-dependent tensor for DP²); None
    where the privatizer clips the records itself (a DPQuery)."""
    return None if self.privatizer.clips_records else self.sensitivity

  def before_step(self, model):
    """Hook of the train step, before any private computation: public work
    only (a public preconditioner's refresh). The base does nothing."""
    del model

  def replica_refusal(self):
    """Why the step cannot add the clipped sums of synchronous replicas and
    release them once, or None."""
    return self.privatizer.replica_refusal

  # ---------------------------------------------------------------- state
  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    def scalar(name, dtype="int64"):
      return self.add_variable((), initializer="zeros", dtype=dtype, name=name)
    # Saved: what the accounting needs (see run_record), the last Φ, the
    # ledger of epochs (accounting.ledger) and the diagnostics.
    self._max_batch_examples = scalar("dp_max_batch_examples")
    self._max_batch_units = scalar("dp_max_batch_units")
    self._noise_variance = scalar("dp_noise_variance", "float32")
    self._max_physical_examples = scalar("dp_max_physical_examples")
    self._examples_seen = scalar("dp_examples_seen")
    self._ledger_variable = self.add_variable(
        (ledger_lib.STATE_SIZE,), dtype="int64", name="dp_accounting_ledger",
        initializer=keras.initializers.Constant(
            self.accounting_ledger.initial_values()))
    self._diagnostics = {name: scalar(name, "float32")
                         for name in self.traits.diagnostics}
    if isinstance(self.l2_norm_clip, list) and (
        len(self.l2_norm_clip) != len(variables)):
      raise ValueError(
          f"{len(self.l2_norm_clip)} per-layer clip norms for "
          f"{len(variables)} trainable variables: give one per variable.")
    private = self._private  # unsaved: sums, seed, streams (state.py)
    if self.accumulation_steps > 1:
      private.build_accumulation(variables, self.traits.uses_square_sum)
      # Physical batches fed so far: saved, mirrored by an unsaved copy.
      self._physical_batches = scalar("dp_physical_batches")
    private.build_noise(variables, self.privatizer, self.traits.noise_streams)
    if self.query is not None:
      query_state = self.query.initial_state(variables)
      arguments.check_query_state(self, query_state)
      private.build_query(self.query, query_state, self.add_variable)
    private.build_seed()

  @property
  def noise_variance(self):
    """Φ of the last logical step: (σC/B)², per coordinate of ḡ."""
    return self._noise_variance

  def diagnostics(self):
    """The last step's diagnostics, name -> scalar (logged by ``fit``).

    ``dp_v_over_phi``: mean over coordinates of v̂/Φ — near 1 when the
    second moment is mostly DP noise. ``dp_clamped_fraction``: coordinates
    where v̂ − Φ < γ' (bias correction). ``dp_negative_v_fraction``:
    coordinates with v̂ < 0 (independent / joint moment estimation).
    """
    if not self.built:
      return {}
    return {name: v.value for name, v in self._diagnostics.items()}

  def query_metrics(self):
    """The DPQuery's metrics now (e.g. ``clip``, the adaptive clip norm)."""
    if self.query is None or not self.built:
      return {}
    return self.query.metrics(self._private.query_state())

  @property
  def is_correlated(self):
    """True when the noise is correlated across steps (DP-MF)."""
    return not isinstance(self.noise, mechanisms.IndependentNoise)

  @property
  def steps_taken(self):
    """Number of logical private steps performed (noise releases)."""
    return int(self.iterations.numpy())

  @property
  def logical_batch_size(self):
    """Largest logical batch (in examples) seen so far; 0 before training."""
    return self.run_record.max_batch_examples

  @property
  def run_record(self):
    """The :class:`RunRecord` of the run so far (for ``accounting.run``)."""
    if not self.built:
      return RunRecord(0, 0, 0, 0)
    return RunRecord(*(int(v.numpy()) for v in (
        self._max_batch_examples, self._max_batch_units,
        self._max_physical_examples, self._examples_seen)))

  @property
  def accounting_ledger(self):
    """What ran, for the once-per-epoch accounting
    (:class:`~tf_dpadambc.accounting.ledger.AccountingLedger`): the epochs
    (passes over the data) and their physical batches, recorded by ``fit``
    (after ``make_private``) and the privacy callbacks, saved with the
    optimizer. A custom training loop calls its ``end_epoch()`` after each
    pass over the data; otherwise its batches are accounted as unknown
    (an upper bound on ε)."""
    ledger = self.__dict__.get("_tf_dpadambc_ledger")
    if ledger is None:
      ledger = ledger_lib.AccountingLedger(self)
      state_lib.keep_unsaved(self, "_tf_dpadambc_ledger", ledger)
    return ledger

  # ---------------------------------------------------------- the guard
  def apply(self, grads, trainable_variables=None):
    raise RuntimeError(
        _AGGREGATED_GRADIENTS_ERROR.format(name=self.__class__.__name__))

  # -------------------------------------------------- the private path
  def apply_private(self, clipped_sum, num_units, num_examples,
                    trainable_variables=None, clipped_square_sum=None):
    """Feeds one physical batch's clipped sum Σ_u clip_C(g_u) to the optimizer.

    With gradient accumulation the sums are stored until the k-th physical
    batch; then (and otherwise at once) the Gaussian noise is drawn once and
    the weights are updated.

    Args:
      clipped_sum: list of tensors shaped like the trainable variables, each
        unit clipped as :meth:`clip_spec` says; or a
        :class:`~tf_dpadambc.core.clipping.ClippedSum`.
      num_units: number of clipped units in this physical batch.
      num_examples: number of examples in this physical batch.
      trainable_variables: the variables, in the order of ``clipped_sum``.
      clipped_square_sum: Σ_u clip(g_u)², for optimizers that need it (joint
        moment estimation); taken from a ``ClippedSum`` when given one.
    """
    if self.privatizer.clips_records:
      raise TypeError(
          f"{self.name} privatizes with a DPQuery, which clips each unit "
          "itself: feed it per-unit gradients with apply_per_unit().")
    # Every op of the step waits for this batch's data: where the input
    # iterator ends inside a compiled step (an empty dataset, the end of an
    # epoch of unknown size), nothing runs. Keras would otherwise still
    # advance `iterations` (ops independent of the data run anyway), and a
    # step that released nothing would be counted.
    with _after_inputs(clipped_sum, clipped_square_sum, num_units):
      if isinstance(clipped_sum, clipping.ClippedSum):
        clipped_sum, clipped_square_sum = (clipped_sum.grads,
                                           clipped_sum.square_grads)
      self._feed(clipped_sum, clipped_square_sum, num_units, num_examples,
                 trainable_variables)

  def apply_per_unit(self, per_unit_grads, num_units, num_examples,
                     trainable_variables=None, unit_mask=None):
    """Feeds one physical batch's per-unit gradients g_u ([U, ...] each).

    Clips them with :meth:`clip_spec` and calls :meth:`apply_private`; with
    a DPQuery, accumulates Σ_u preprocess_record(g_u) and releases it.
    ``unit_mask`` ([U] bool) leaves out padding rows. Returns the
    ``ClippedSum`` (None with a query).
    """
    variables = self._variables_of_step(trainable_variables)
    if not self.privatizer.clips_records:
      result = clipping.materialized_clipped_sum(
          [g if unit_mask is None else ghost.masked(g, unit_mask)
           for g in per_unit_grads], self.clip_spec(variables))
      self.apply_private(result, num_units, num_examples, variables)
      return result
    sample = self.query.sample_state(self._private.query_state(),
                                     per_unit_grads, variables, unit_mask)
    with _after_inputs(sample, num_units):  # as apply_private
      self._feed(sample, None, num_units, num_examples, variables)
    return None

  def apply_query_clipped(self, result, num_units, num_examples,
                          trainable_variables=None, unit_mask=None):
    """Feeds a DPQuery with a ``ClippedSum`` clipped at :meth:`query_clip_spec`:
    the same sample state as :meth:`apply_per_unit` gives, without per-unit
    gradients."""
    variables = self._variables_of_step(trainable_variables)
    norms = tf.convert_to_tensor(result.norms)
    mask = tf.math.is_finite(norms) & ~tf.convert_to_tensor(result.mismatch)
    if unit_mask is not None:
      mask &= unit_mask
    sample = self.query.sample_from_clipped(
        self._private.query_state(), result.grads, norms, variables, mask)
    with _after_inputs(sample, num_units):  # as apply_private
      self._feed(sample, None, num_units, num_examples, variables)

  def _variables_of_step(self, trainable_variables):
    if trainable_variables is None:
      trainable_variables = self._trainable_variables
    trainable_variables = list(trainable_variables)
    if not self.built:
      self.build(trainable_variables)
    return trainable_variables

  def _feed(self, clipped_sum, clipped_square_sum, num_units, num_examples,
            variables):
    """One physical batch's clipped sum (a DPQuery: its sample state) into
    the pending logical step, released at once or at the k-th batch."""
    variables = self._variables_of_step(variables)
    squares = self.traits.uses_square_sum
    if squares and clipped_square_sum is None:
      raise ValueError(
          f"{self.__class__.__name__} needs the sum of squared clipped "
          "gradients: clip with `optimizer.clip_spec(...)` (the train step "
          "of make_private does).")
    squares = list(clipped_square_sum) if squares else None
    num_units = tf.cast(num_units, tf.int64)
    num_examples = tf.cast(num_examples, tf.int64)
    if self.expected_batch_size is not None:
      # Poisson batches: the realized size is not private, so the mean
      # divides by the expected size B (Φ = (σC/B)²) and the accounting
      # records B (Abadi et al. 2016; Opacus normalises the same way).
      num_units = num_examples = tf.constant(self.expected_batch_size,
                                             tf.int64)
    self._max_physical_examples.assign(
        tf.maximum(self._max_physical_examples, num_examples))
    self._examples_seen.assign_add(num_examples)

    def release(sums, square_sums, units, examples):
      self._release(sums, square_sums, units, examples, variables)
    if self.accumulation_steps == 1:
      release(clipped_sum, squares, num_units, num_examples)
    else:
      self._private.accumulate(self._physical_batches, clipped_sum, squares,
                               num_units, num_examples,
                               self.accumulation_steps, release)

  def _release(self, clipped_sum, clipped_square_sum, num_units,
               num_examples, variables):
    """One logical step: noise once, normalise by B, update the weights —
    at most once per step index and seed (``PrivateState.guard_release``)."""
    self._private.guard_release(
        tf.cast(self._iterations.value, tf.int64),
        self.privatizer.secret_stream,
        lambda: self._release_now(clipped_sum, clipped_square_sum, num_units,
                                  num_examples, variables))

  def _release_now(self, clipped_sum, clipped_square_sum, num_units,
                   num_examples, variables):
    # Releases are ordered like `variables`, which may be a subset of the
    # variables the optimizer was built with: update_step maps its variable
    # index to the release's position (StepContext.position).
    indices = [self._get_variable_index(v) for v in variables]
    if self.is_correlated and indices != list(range(
        len(self._trainable_variables))):
      raise ValueError(
          "Correlated (DP-MF) noise streams every variable's noise from its "
          "past draws, so every step must update all the variables the "
          f"optimizer was built with, in order ({len(variables)} of "
          f"{len(self._trainable_variables)} given). Freeze layers before "
          "the first step, or use a new optimizer after freezing.")
    ctx = privatizer_lib.StepContext(
        variables, {index: i for i, index in enumerate(indices)}, None,
        None, self.noise_multiplier, self._private)
    state_lib.keep_unsaved(self, "_step_context", ctx)
    ctx.sample, new_states = self._sampler()
    ctx.sensitivity = self._step_sensitivity()
    release = self._privatize(ctx, clipped_sum, clipped_square_sum,
                              num_units)
    self._private.commit_streams(new_states, variables)
    ctx.release = release._replace(
        noise_variance=release.noise_variance
        * self.privatizer.variance_factor(self._iterations))
    self._noise_variance.assign(ctx.release.noise_variance)
    self._max_batch_units.assign(tf.maximum(self._max_batch_units, num_units))
    self._max_batch_examples.assign(
        tf.maximum(self._max_batch_examples, num_examples))
    self._on_private_step(ctx)
    for tap, value in zip(getattr(self, "_release_tap", None) or [],
                          ctx.release.first):
      tap.assign(tf.cast(value, tap.dtype))
    # Keras' own apply: weight decay, update_step per variable, iterations += 1.
    keras.optimizers.Optimizer.apply(self, ctx.release.first, variables)
    if ctx.statistics:
      for name, value in diagnostics.summarize(ctx.statistics).items():
        if name in self._diagnostics:
          self._diagnostics[name].assign(value)
    state_lib.keep_unsaved(self, "_step_context", None)

  @property
  def step_context(self):
    """The :class:`~tf_dpadambc.privatizer.StepContext` of the step being
    released (None outside one): ``update_step`` reads the release, the
    variable positions and reports statistics through it."""
    return self.__dict__.get("_step_context")

  def _sampler(self):
    """The step's ``sample(templates, stddev, stream)`` and the dict its new
    streaming states go to (``PrivateState.sampler``)."""
    return self._private.sampler(self.noise, self._iterations,
                                 self.step_context.variables)

  def _privatize(self, ctx, clipped_sum, clipped_square_sum, num_units):
    """The release of the step's clipped sum: the privatizer's (DP-SGD's
    Gaussian mechanism, or the DPQuery's). Variants that release more (IME,
    JME) or in another geometry (scale-then-privatize) override this."""
    del clipped_square_sum
    return self.privatizer.release(ctx, clipped_sum, num_units)

  def _on_private_step(self, ctx):
    """Hook for per-step (not per-variable) state, before ``update_step``."""
    del ctx  # (a body AutoGraph can convert)

  def tap_releases(self, variables):
    """For auditing (``tf_dpadambc.audit``): keeps each step's release ḡ_t —
    the noisy gradient the update is computed from, already private — in
    unsaved variables shaped like ``variables`` (the model's trainable
    variables, in order); :attr:`last_release` reads them. A white-box
    auditor that sees every release is the strongest adversary the ε claim
    covers (the update is post-processing of the release)."""
    state_lib.keep_unsaved(self, "_release_tap", [
        self._private.variable(v.shape, f"audit_release_{i}", "float32")
        for i, v in enumerate(variables)])

  @property
  def last_release(self):
    """The last step's release ḡ_t (NumPy arrays), after :meth:`tap_releases`."""
    return [t.numpy() for t in self._release_tap]

  # ------------------------------------------------------- accounting
  # The arithmetic is accounting/run.py's; these are its public names.
  @property
  def effective_noise_multiplier(self):
    """σ for accounting under add/remove-one-example adjacency: σ/2 where
    units hold several examples (a microbatch's clipped mean moves by up to
    2C), σ·``traits.accounting_noise_factor`` where a release has more
    sensitivity than its noise pays for."""
    return run.effective_noise_multiplier(self)

  @property
  def accounting_noise_factor(self):
    return self.traits.accounting_noise_factor

  def dp_event(self, num_examples, batch_size=None, sampling="poisson",
               steps=None, extra_epoch_batches=0):
    """The dp_accounting DpEvent of the training this optimizer performed.

    Args:
      num_examples: size N of the training set.
      batch_size: expected logical batch size; defaults to the largest seen
        (``expected_batch_size`` for Poisson batches).
      sampling: ``"poisson"`` (each example in each step independently with
        probability B/N: what ``compute_epsilon`` assumes; batches from
        ``data.poisson_batches`` with ``expected_batch_size``) or
        ``"shuffle"`` (each example once per epoch, no amplification). With
        correlated noise: ``"cyclic"`` (fixed batch order every epoch),
        ``"shuffle"`` or ``"cyclic_poisson"`` (amplified BandMF, expected
        batch size B); see ``CorrelatedNoise.accounting_event``.
      steps: ``None``: the run as it happened — the steps taken and, once
        per epoch, the epochs :attr:`accounting_ledger` recorded with their
        real numbers of batches (a logical step whose batches span two
        epochs can hold an example twice: σ/2 for that step). Another number
        of logical steps plans a run (as ``compute_epsilon``): epochs of the
        fewest batches seen, ceil(N/b) before any.
      extra_epoch_batches: also account one more epoch of this many physical
        batches after the run (``PrivacyBudget``'s look-ahead).
    """
    return run.dp_event(self, num_examples, batch_size, sampling, steps,
                        extra_epoch_batches)

  def accounted_noise_multiplier(self, num_examples):
    """The smallest σ the accounting uses for N examples
    (``accounting.run.accounted_noise_multiplier``)."""
    return run.accounted_noise_multiplier(self, num_examples)

  def logical_steps_per_epoch(self, num_examples):
    """Logical steps per pass over the data (``accounting.run``)."""
    return run.logical_steps_per_epoch(self, num_examples)

  def query_step_event(self):
    """The DpEvent of one release of the DPQuery, as accounted (Raises
    ``queries.NotAccountable`` where no ε can be trusted)."""
    return run.query_step_event(self)

  # ----------------------------------------------------------- saving
  # Every format saves `variables` (the Keras formats through
  # save_own_variables, TF's through the object graph); the secret or
  # un-noised state is in none of them (state.py says what a restore does).
  def _saved_variables(self):
    """What every format saves: the tracked variables, nothing secret."""
    return list(self.variables)

  def save_own_variables(self, store):
    """Saves the optimizer state (Keras formats), which holds nothing secret:
    not the accumulated clipped sums (not noised yet), not the seed, not a
    noise stream's state (see ``state.py``)."""
    for i, variable in enumerate(self._saved_variables()):
      store[str(i)] = variable.numpy()

  def load_own_variables(self, store):
    variables = self._saved_variables()
    unbuilt = 1 + isinstance(self._learning_rate, keras.Variable)
    if len(store.keys()) == unbuilt < len(variables):
      # Saved before the first step (e.g. model.save right after compile):
      # only the step counter and learning rate; the rest starts fresh.
      variables = variables[:unbuilt]
    elif len(store.keys()) != len(variables):
      raise ValueError(
          f"Cannot restore {self.name}: the file holds {len(store.keys())} "
          f"variables, this optimizer has {len(variables)}"
          + ("" if self.built else " (build it first: "
             "optimizer.build(model.trainable_variables))") + ".")
    for i, variable in enumerate(variables):
      variable.assign(store[str(i)])
    self._restart_after_restore()

  def _restart_after_restore(self):
    if self.built:  # (unbuilt: nothing drawn, nothing pending)
      self._private.restart(
          self._physical_batches if self.accumulation_steps > 1 else None,
          self.privatizer.secret_stream, self.seed is not None)

  # ---------------------------------------------------------- config
  def get_config(self):
    if self.query is not None:
      raise NotImplementedError(
          f"{self.name} holds a TF-Privacy DPQuery, which is not a Keras "
          "object and cannot be serialized. Save the weights "
          "(model.save_weights, or model.save(..., include_optimizer=False)) "
          "and build the optimizer again with its query.")
    config = super().get_config()
    config.update({
        "l2_norm_clip": self.l2_norm_clip,
        "noise_multiplier": self.noise_multiplier,
        "num_microbatches": self.num_microbatches,
        "gradient_accumulation_steps": (
            None if self.accumulation_steps == 1 else self.accumulation_steps),
        "seed": None,  # never saved, not even a given one
        "clipping": self.clipping,
        "automatic_gamma": self.automatic_gamma,
        "noise": mechanisms.serialize(self.noise),
        "expected_batch_size": self.expected_batch_size,
    })
    return config
