"""The Keras 3 shell shared by every private optimizer.

A :class:`DPOptimizer` owns the privacy mechanism — clip norm C, noise
multiplier σ, microbatching, gradient accumulation, the secret noise seed —
and turns clipped sums into one private mean gradient per logical step
through its privatizer (``tf_dpadambc.privatizer``). Subclasses only say how
that private mean moves the weights (``build`` + ``update_step``, as in any
Keras optimizer) and declare what they release (``TRAITS``, see
``traits.py``, which also says how to add a variant).

The privacy argument in three files: this one (what is clipped,
:meth:`DPOptimizer.clip_spec`, and the one release path ``_feed`` →
``_release`` → ``_release_now``), ``privatizer.py`` (what is noised) and
``accounting/run.py`` (what is accounted).

It takes its input through :meth:`DPOptimizer.apply_private`, called by the
train step that :func:`tf_dpadambc.make_private` installs. The ordinary Keras
entry points (``apply``, ``apply_gradients``) receive gradients that were
neither clipped per example nor noised, so they raise.
"""
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
from tf_dpadambc.core import ghost
from tf_dpadambc.core import per_example
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


def register(args_doc=""):
  """Class decorator of every public optimizer: appends the shared ``Args``
  text (if any) and registers the class for saving."""
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


def _in_variable_dtypes(sample, variables):
  """``sample`` drawing each variable's noise in its own dtype — float32
  for float16 and bfloat16 variables (the same float32 Box–Muller draws as
  for float32 ones, whatever the clipped sum's dtype) — returned in the
  dtype of the template it is added to: the float64 clipped sum
  (``clipping.sum_dtype``), rounded to the variable's dtype only once
  noised. Never the noise alone in float16: draws below 2⁻²⁵ rounded to 0
  there, each such coordinate releasing its clipped sum exactly (a review:
  37 in 10⁶ at σC = 10⁻³)."""
  def in_dtypes(templates, stddev, stream=0):
    templates = list(templates)
    if len(templates) != len(variables):  # (zip would drop tensors)
      raise ValueError(
          f"The step's noise sampler takes one template per variable "
          f"({len(variables)}), got {len(templates)}.")
    noise = sample([tf.zeros_like(t, dtype=_noise_dtype(v.dtype))
                    for t, v in zip(templates, variables)], stddev, stream)
    return [tf.cast(n, t.dtype) for n, t in zip(noise, templates)]
  return in_dtypes


def _noise_dtype(dtype):
  dtype = tf.as_dtype(dtype)
  return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


class DPOptimizer(distributed.CrossReplicaOptimizer):
  """Base class of the private optimizers: the Gaussian mechanism, once per step.

  The private mean of a logical step with B units is
  ḡ = (Σ_u clip_C(g_u) + N(0, σ²C² I)) / B, per-coordinate noise variance
  Φ = (σC/B)² (B: the units actually in the step, or ``expected_batch_size``);
  with correlated noise Var_t = (σC/B)²·sens(C)²·‖row_t(C⁻¹)‖².

  Subclass contract: ``TRAITS`` (``traits.py``), ``build``/``update_step``
  (reading the release through :attr:`step_context`), and optionally the
  hooks ``_privatize(ctx, ...)``, ``_on_private_step(ctx)``,
  ``_step_sensitivity()``, ``clip_spec``, ``before_step(model)``.
  The arguments (appended below) are documented and checked in
  ``arguments.py``.
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

  # What sets the noise, the sensitivity or the accounting: assigned once, in
  # __init__ (a subclass adds its own, e.g. JME's λ). The accounting reads
  # them for every step already taken, and a traced step keeps the values it
  # was traced with: changed later (a schedule callback setting
  # noise_multiplier), ε would describe noise that never ran. A red-team
  # review measured ε 0.695 reported for a run of 16.5.
  FIXED = arguments.FIXED

  def __setattr__(self, name, value):
    if name in type(self).FIXED and name in vars(self):
      raise AttributeError(
          f"{self.__class__.__name__}.{name} is fixed when the optimizer is "
          "made: the privacy accounting applies it to every step already "
          "taken, and a compiled train step keeps the value it was traced "
          "with. To change it, build a new optimizer (and account the two "
          "runs together).")
    super().__setattr__(name, value)

  traits = property(lambda self: self.TRAITS, doc="``TRAITS`` (traits.py).")

  DIAGNOSTICS = property(lambda self: self.traits.diagnostics)

  @property
  def is_private(self):
    """False when no noise is added (noise_multiplier == 0, a DPQuery without
    noise) or the class is a non-private research baseline."""
    return (not self.traits.not_private_reason
            and self.privatizer.adds_noise(self.noise_multiplier))

  @property
  def sensitivity(self):
    """L2 bound of one unit's clipped gradient: C, or ‖(C_k)‖₂ per layer."""
    if self.query is not None:
      raise ValueError("With a DPQuery the sensitivity is the query's; see "
                       "its DpEvent (dp_event).")
    return self._clip_spec().sensitivity

  def _clip_spec(self):
    gamma = self.automatic_gamma if self.clipping == "automatic" else None
    return clipping.as_spec(self.l2_norm_clip)._replace(automatic_gamma=gamma)

  def clip_spec(self, trainable_variables):
    """The ``core.clipping.ClipSpec`` the train step clips the next step's
    units with. Preconditioned variants put their scale s_t in it (from
    released values only)."""
    self._variables_of_step(trainable_variables)
    return self._clip_spec()._replace(square_sum=self.traits.uses_square_sum)

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
    """Train-step hook before the private gradient: public work only."""
    del model

  def replica_refusal(self):
    """Why replicas' clipped sums cannot be released once, or None."""
    return self.privatizer.replica_refusal

  # ---------------------------------------------------------------- state
  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    # Saved: what ran, for the accounting (accounting.run), and diagnostics.
    state_lib.keep_unsaved(self, "run_recorder", run.RunRecorder(
        self.add_variable, self.accounting_ledger, self.traits.diagnostics))
    arguments.check_clip_count(self.l2_norm_clip, variables)
    private = self._private  # unsaved: sums, seed, streams (state.py)
    if self.accumulation_steps > 1:
      private.build_accumulation(variables, self.traits.uses_square_sum)
      # Physical batches fed so far: saved, mirrored by an unsaved copy.
      self._physical_batches = self.add_variable(
          (), initializer="zeros", dtype="int64", name="dp_physical_batches")
    private.build_noise(variables, self.privatizer, self.traits.noise_streams)
    if self.query is not None:
      low = [v.name for v in variables
             if tf.as_dtype(v.dtype) in (tf.float16, tf.bfloat16)]
      if low:
        raise ValueError(
            f"{self.name}: a DPQuery sums and noises its records in the "
            f"variables' dtype, and {low} are float16/bfloat16: rounding "
            "the sum there before the noise is not covered by the "
            "sensitivity. Keep float32 variables (a mixed_float16 or "
            "mixed_bfloat16 policy), or train without query= (the "
            "optimizer's own noise is added in float32).")
      query_state = self.query.initial_state(variables)
      arguments.check_query_state(self, query_state)
      private.build_query(self.query, query_state, self.add_variable)
    private.build_seed()

  noise_variance = property(lambda self: self.run_recorder.noise_variance,
                            doc="Φ of the last logical step, (σC/B)².")

  def diagnostics(self):
    """The last step's diagnostics, name -> scalar (logged by ``fit``;
    names and meanings: ``core.diagnostics``)."""
    if not self.built:
      return {}
    return {name: v.value
            for name, v in self.run_recorder.diagnostics.items()}

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
    """The ``accounting.run.RunRecord`` of the run so far."""
    return (self.run_recorder.values() if self.built
            else run.RunRecord(0, 0, 0, 0))

  @property
  def accounting_ledger(self):
    """What ran, for the once-per-epoch accounting: the epochs and their
    physical batches (:class:`~tf_dpadambc.accounting.ledger.AccountingLedger`;
    a custom training loop calls its ``end_epoch()`` after each pass)."""
    return ledger_lib.attached(self)

  # ---------------------------------------------------------- the guard
  def apply(self, grads, trainable_variables=None):
    raise RuntimeError(
        _AGGREGATED_GRADIENTS_ERROR.format(name=self.__class__.__name__))

  # -------------------------------------------------- the private path
  # (Entry points: not converted by AutoGraph, as in keras/training.py.)
  @tf.autograph.experimental.do_not_convert
  def apply_private(self, clipped_sum, num_units, num_examples,
                    trainable_variables=None, clipped_square_sum=None):
    """Feeds one physical batch's Σ_u clip_C(g_u) (units clipped at
    :meth:`clip_spec`; a ``ClippedSum``, with Σ_u clip(g_u)² where JME needs
    it). At the k-th batch (else at once) the noise is drawn once and the
    weights are updated.

    Only a ``ClippedSum`` is taken: what ``private_gradient_sum``,
    ``clipping.materialized_clipped_sum`` and :meth:`apply_per_unit` return,
    or ``clipping.assume_clipped(sums)`` where the caller clipped each unit
    itself. A plain list of tensors is refused: raw gradients released as a
    clipped sum have no bounded sensitivity (a review: 7,286 times the bound,
    counted as private steps).

    The sum must be clipped at this step's bound, the one the noise is
    calibrated to (``clip_spec(variables).sensitivity``: C, ‖(C_k)‖₂, DP²'s
    C1 or C2 by phase). A sum that records a larger bound
    (``ClippedSum.sensitivity``) is refused (``ValueError``) when both are
    known when traced; where one is known only at run time (a spec kept
    across DP²'s phases in a compiled step) the sum is scaled by
    min(1, Δ/bound), so that every unit is within Δ (a review: a sum
    clipped at 100C moved the release by 141C, accounted at C).

    Returns the ``ClippedSum`` fed (scaled where it had to be)."""
    if self.privatizer.clips_records:
      raise TypeError(
          f"{self.name} privatizes with a DPQuery, which clips each unit "
          "itself: feed it per-unit gradients with apply_per_unit().")
    if not isinstance(clipped_sum, clipping.ClippedSum):
      raise TypeError(
          f"{self.name}.apply_private releases a clipped sum it cannot "
          f"check; got {type(clipped_sum).__name__}. Pass the ClippedSum of "
          "tf_dpadambc.private_gradient_sum (or "
          "clipping.materialized_clipped_sum), feed per-unit gradients to "
          "apply_per_unit() (which clips them), or, if you clipped every "
          "unit yourself, say so: clipping.assume_clipped(sums).")
    # Every op of the step waits for this batch's data: where the input
    # iterator ends inside a compiled step, nothing runs (Keras would still
    # advance `iterations`, counting a step that released nothing).
    with _after_inputs(clipped_sum, clipped_square_sum, num_units):
      if clipped_sum.square_grads is None and clipped_square_sum is not None:
        clipped_sum = clipped_sum._replace(
            square_grads=list(clipped_square_sum))
      clipped_sum = self._within_step_sensitivity(
          clipped_sum, self._step_sensitivity())
      self._feed(clipped_sum.grads, clipped_sum.square_grads, num_units,
                 num_examples, trainable_variables)
    return clipped_sum

  def _within_step_sensitivity(self, result, sensitivity):
    """``result`` (a ClippedSum) if its units are within ``sensitivity``, the
    bound this step's noise is calibrated to; raises if its recorded bound is
    larger and both are known when traced; else scaled in the data flow
    (``clipping.rescaled_to``). A sum that records no bound
    (``clipping.assume_clipped``) is the caller's statement that it is this
    one."""
    bound = clipping.recorded_sensitivity(result)
    if bound is None or sensitivity is None:
      return result
    known = clipping.static_scalar(sensitivity)
    if isinstance(bound, float) and known is not None:
      if not bound <= known:
        raise ValueError(
            f"{self.name} adds noise for a per-unit sensitivity of "
            f"{known:.6g} this step, and this ClippedSum was clipped to "
            f"{bound:.6g}: releasing it would not be private at the "
            "accounted ε. Compute the sum with "
            "optimizer.clip_spec(model.trainable_variables) in the same "
            "step, e.g. tf_dpadambc.private_gradient_sum(model, x, y, "
            "sample_weight, optimizer.clip_spec(model.trainable_variables))"
            " — the optimizer's bound can change between steps (DP²'s "
            "phases, adaptive clipping), so do not reuse a spec from an "
            "earlier step.")
      return result
    return clipping.rescaled_to(result, bound, sensitivity)

  @tf.autograph.experimental.do_not_convert
  def apply_per_unit(self, per_unit_grads, num_units, num_examples,
                     trainable_variables=None, unit_mask=None):
    """Feeds one physical batch's per-unit gradients g_u ([U, ...] each).

    Clips them with :meth:`clip_spec` and calls :meth:`apply_private`; with
    a DPQuery, accumulates Σ_u preprocess_record(g_u) and releases it.
    ``unit_mask`` ([U] bool) leaves out padding rows. Returns the
    ``ClippedSum`` (None with a query).

    Only ``per_example.PerUnitGradients`` are taken: what
    ``tf_dpadambc.keras.training.per_unit_gradients`` returns (each unit
    evaluated alone), or ``per_example.assume_per_unit(grads)`` where the
    caller vouches that row u depends on unit u alone. A plain list (e.g.
    the rows of ``tape.jacobian``, which mix examples wherever the model
    does) is refused.
    """
    if not isinstance(per_unit_grads, per_example.PerUnitGradients):
      raise TypeError(
          f"{self.name}.apply_per_unit clips per-unit gradients it cannot "
          f"check; got {type(per_unit_grads).__name__}. Compute them with "
          "tf_dpadambc.keras.training.per_unit_gradients(model, x, y, "
          "sample_weight) (each unit evaluated on its own examples), or, if "
          "row u of every tensor depends on unit u's examples alone, say so: "
          "tf_dpadambc.core.per_example.assume_per_unit(grads). Rows of a "
          "batched jacobian are not per-example when the model mixes "
          "examples (lag features, batch statistics).")
    variables = self._variables_of_step(trainable_variables)
    if not self.privatizer.clips_records:
      result = clipping.materialized_clipped_sum(
          [g if unit_mask is None else ghost.masked(g, unit_mask)
           for g in per_unit_grads], self.clip_spec(variables))
      self.apply_private(result, num_units, num_examples, variables)
      return result
    self._feed_sample(self.query.sample_state(
        self._private.query_state(), per_unit_grads, variables, unit_mask),
                      num_units, num_examples, variables)
    return None

  @tf.autograph.experimental.do_not_convert
  def apply_query_clipped(self, result, num_units, num_examples,
                          trainable_variables=None, unit_mask=None):
    """Feeds a DPQuery with a ``ClippedSum`` clipped at :meth:`query_clip_spec`:
    the same sample state as :meth:`apply_per_unit` gives, without per-unit
    gradients."""
    variables = self._variables_of_step(trainable_variables)
    query_state = self._private.query_state()
    # Clipped at the query's clip norm of this step, which its noise is
    # calibrated to (adaptive clipping moves it every step).
    result = self._within_step_sensitivity(
        result, self.query.clip_norm(query_state))
    self._feed_sample(self.query.sample_of_clipped_sum(
        query_state, result, variables, unit_mask),
                      num_units, num_examples, variables)

  def _feed_sample(self, sample, num_units, num_examples, variables):
    with _after_inputs(sample, num_units):  # as apply_private
      self._feed(sample, None, num_units, num_examples, variables)

  def _variables_of_step(self, trainable_variables):
    variables = list(self._trainable_variables if trainable_variables is None
                     else trainable_variables)
    if not self.built:
      self.build(variables)
      return variables
    try:
      self._check_variables_are_known(variables)  # Keras' own check
    except ValueError as e:
      # (A model whose layers create weights inside the train step: fit
      # builds the optimizer from the symbolic, inference-mode build.)
      raise ValueError(
          f"{self.name} was built for other trainable variables than this "
          f"step's ({e}). A layer that creates its weights only in training "
          "mode, or a change of trainable weights after the optimizer was "
          "built, does this: build every layer before fit (call the model "
          "on a batch with training=True), or compile with a new "
          "optimizer.") from e
    return variables

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
    else:
      # An empty batch (a generator can yield one) releases noise only:
      # divided by 1, not 0 (the quotient's privacy does not depend on it).
      num_units, num_examples = (tf.maximum(num_units, 1),
                                 tf.maximum(num_examples, 1))
    self.run_recorder.note_batch(num_examples)

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
    """One logical step, at most once per step index and seed."""
    privatizer_lib.release_once(
        self._private, tf.cast(self._iterations.value, tf.int64),
        self.privatizer.secret_stream,
        lambda: self._release_now(clipped_sum, clipped_square_sum, num_units,
                                  num_examples, variables))

  def _release_now(self, clipped_sum, clipped_square_sum, num_units,
                   num_examples, variables):
    # `variables` may be a subset of those built: update_step maps its
    # variable index to the release's position (StepContext.position).
    indices = [self._get_variable_index(v) for v in variables]
    self.privatizer.check_step_variables(indices,
                                         len(self._trainable_variables))
    ctx = privatizer_lib.StepContext(
        variables, {index: i for i, index in enumerate(indices)}, None,
        None, self.noise_multiplier, self._private)
    state_lib.keep_unsaved(self, "_step_context", ctx)
    sample, new_states = self._sampler()
    ctx.sample = _in_variable_dtypes(sample, variables)
    ctx.sensitivity = self._step_sensitivity()
    release = self._privatize(ctx, clipped_sum, clipped_square_sum,
                              num_units)
    self._private.commit_streams(new_states, variables)
    ctx.release = release._replace(
        noise_variance=release.noise_variance
        * self.privatizer.variance_factor(self._iterations))
    self.run_recorder.note_release(num_units, num_examples,
                                   ctx.release.noise_variance)
    self._on_private_step(ctx)
    self._private.tap(ctx.release.first)
    # Keras' own apply: weight decay, update_step per variable, iterations += 1.
    keras.optimizers.Optimizer.apply(self, ctx.release.first, variables)
    self.run_recorder.note_diagnostics(ctx.statistics)
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
    """For auditing (``tf_dpadambc.audit``): keeps each step's release ḡ_t
    (already private; the update is its post-processing) in unsaved
    variables shaped like ``variables``, read by :attr:`last_release`."""
    self._private.tap_releases(variables)

  @property
  def last_release(self):
    """The last step's release ḡ_t (NumPy arrays), after :meth:`tap_releases`."""
    return [t.numpy() for t in self._private.release_tap]

  # ------------------------------------------------------- accounting
  # The arithmetic is accounting/run.py's; these are its public names.
  @property
  def effective_noise_multiplier(self):
    """σ for accounting (add/remove or zero-out adjacency): σ/2 for units of
    several examples (their clipped mean moves by up to 2C), times
    ``traits.accounting_noise_factor``."""
    return run.effective_noise_multiplier(self)

  def dp_event(self, num_examples, batch_size=None, sampling=None,
               steps=None, extra_epoch_batches=0):
    """The dp_accounting DpEvent of the training this optimizer performed
    (arguments: :func:`tf_dpadambc.accounting.run.dp_event`)."""
    return run.dp_event(self, num_examples, batch_size, sampling, steps,
                        extra_epoch_batches)

  def accounted_noise_multiplier(self, num_examples):
    """The smallest σ the accounting uses for N examples (``accounting.run``)."""
    return run.accounted_noise_multiplier(self, num_examples)

  def logical_steps_per_epoch(self, num_examples):
    """Logical steps per pass over the data (``accounting.run``)."""
    return run.logical_steps_per_epoch(self, num_examples)

  def query_step_event(self):
    """One release of the DPQuery, as accounted (``accounting.run``)."""
    return run.query_step_event(self)

  # ----------------------------------------------------------- saving
  # Every format saves `variables` (Keras' through save_own_variables, TF's
  # through the object graph); no secret or un-noised state (state.py).
  def _saved_variables(self):
    """What every format saves: the tracked variables, nothing secret."""
    return list(self.variables)

  def save_own_variables(self, store):
    """Saves the optimizer state (Keras formats), which holds nothing secret:
    not the accumulated clipped sums, the seed or a noise stream's state."""
    state_lib.save_variables(self._saved_variables(), store)

  def load_own_variables(self, store):
    state_lib.load_variables(self, self._saved_variables(), store)

  # ---------------------------------------------------------- config
  def get_config(self):
    arguments.check_serializable(self)
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


DPOptimizer.__doc__ += "\n" + arguments.ARGS_DOC
