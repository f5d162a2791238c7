"""The Keras 3 shell shared by every private optimizer.

A :class:`DPOptimizer` owns the privacy mechanism — clip norm C, noise
multiplier σ, microbatching, gradient accumulation, the secret noise seed —
and turns clipped sums into one private mean gradient per logical step
(``core.noise.gaussian_release``). Subclasses only say how that private mean
moves the weights (``build`` + ``update_step``, as in any Keras optimizer).

It takes its input through :meth:`DPOptimizer.apply_private`, called by the
train step that :func:`tf_dpadambc.make_private` installs. The ordinary Keras
entry points (``apply``, ``apply_gradients``) receive gradients that were
neither clipped per example nor noised, so they raise.
"""
import collections
import contextlib
import numbers
import warnings

import keras
import tensorflow as tf

from tf_dpadambc import mechanisms
from tf_dpadambc import queries
from tf_dpadambc._checks import check_count  # noqa: F401 (re-exported)
from tf_dpadambc._checks import check_decay  # noqa: F401 (re-exported)
from tf_dpadambc._checks import check_positive
from tf_dpadambc.accounting import cyclic
from tf_dpadambc.accounting import events
from tf_dpadambc.accounting import ledger as ledger_lib
from tf_dpadambc.core import clipping
from tf_dpadambc.core import diagnostics
from tf_dpadambc.core import ghost
from tf_dpadambc.core import noise as core_noise

PACKAGE = "tf_dpadambc"

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


def register(args_doc):
  """Class decorator: append the shared ``Args`` text, register for saving."""
  def decorate(cls):
    cls.__doc__ += args_doc
    return keras.saving.register_keras_serializable(package=PACKAGE)(cls)
  return decorate


Release = collections.namedtuple("Release",
                                 ["first", "second", "noise_variance"])
Release.__doc__ = """What one logical step's privatization hands to the update.

first: the private mean gradient ḡ, one tensor per variable (what Keras'
  ``update_step`` receives).
second: None, or a separately released second-moment input per variable
  (independent / joint moment estimation).
noise_variance: per-coordinate variance of the noise in ``first``.
"""


def _after_inputs(*inputs):
  """Control dependencies on the graph tensors among ``inputs`` (nests):
  the ops created under it run only once the batch's data exists."""
  tensors = [t for t in tf.nest.flatten(inputs)
             if tf.is_tensor(t) and not isinstance(t, tf.Variable)
             and hasattr(t, "graph") and not tf.executing_eagerly()]
  return tf.control_dependencies(tensors)


def check_clip(value):
  """A clip norm C > 0, or a list of per-variable bounds C_k > 0."""
  if isinstance(value, (list, tuple)):
    if not value:
      raise ValueError("l2_norm_clip: an empty list of per-layer clip norms.")
    return [check_positive(f"l2_norm_clip[{i}]", c) for i, c in enumerate(value)]
  return check_positive("l2_norm_clip", value)


class DPOptimizer(keras.optimizers.Optimizer):
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
      For the variants that release the plain clipped sum (not IME, JME,
      scale-then-privatize, DP², public preconditioners); needs per-unit
      gradients (clipping="vectorized" speed).
    expected_batch_size: ``None`` (fixed-size batches) or B ≥ 1: every batch
      is a Poisson sample of expected size B (each example independently
      with probability q = B/N; ``tf_dpadambc.data.poisson_batches``). The
      mean then divides by B, never by the realized batch size (which is
      not private; as Opacus), Φ = (σC/B)², and ``dp_event`` accounts
      Poisson sampling with q = B/N — only. Not with ``num_microbatches``,
      gradient accumulation, correlated noise, a DPQuery or IME.
    learning_rate, **kwargs: as for ``keras.optimizers.Optimizer``
      (``weight_decay`` gives decoupled weight decay, at no privacy cost).

  The private mean of a logical step with B units is
  ḡ = (Σ_u clip_C(g_u) + N(0, σ²C² I)) / B, per-coordinate noise variance
  Φ = (σC/B)² (normalised by the number of units actually in the step, or
  by ``expected_batch_size``);
  with correlated noise Var_t = (σC/B)²·sens(C)²·‖row_t(C⁻¹)‖².
  """

  # Names of the diagnostics (core.diagnostics.summarize) a class reports.
  DIAGNOSTICS = ()

  def __init__(self, l2_norm_clip=None, noise_multiplier=None,
               learning_rate=0.001, num_microbatches=None,
               gradient_accumulation_steps=None, seed=None,
               clipping="standard", automatic_gamma=0.01, noise=None,
               query=None, expected_batch_size=None, name=None, **kwargs):
    # Validate before Keras' __init__ so that bad input fails first; Keras
    # requires super().__init__() before any attribute is set.
    if query is not None:
      self._check_query_use(l2_norm_clip, noise_multiplier, noise, clipping,
                            gradient_accumulation_steps)
      query = queries.QueryRelease(query)
    elif l2_norm_clip is None or noise_multiplier is None:
      raise TypeError(
          f"{self.__class__.__name__} needs l2_norm_clip and "
          "noise_multiplier (or a TF-Privacy DPQuery as query=...).")
    else:
      l2_norm_clip = check_clip(l2_norm_clip)
      noise_multiplier = check_positive("noise_multiplier", noise_multiplier,
                                        allow_zero=True)
    if clipping not in ("standard", "automatic"):
      raise ValueError('clipping must be "standard" or "automatic"; got '
                       f"{clipping!r}.")
    automatic_gamma = check_positive("automatic_gamma", automatic_gamma)
    num_microbatches = check_count("num_microbatches", num_microbatches)
    accumulation_steps = check_count(
        "gradient_accumulation_steps", gradient_accumulation_steps) or 1
    if kwargs.get("loss_scale_factor") is not None:
      raise ValueError(
          "loss_scale_factor is not supported by DP optimizers: the private "
          "train step scales each unit's loss itself under mixed_float16 "
          "(static, divided out before clipping: "
          "tf_dpadambc.make_private(model, loss_scale=...)).")
    mechanism = mechanisms.deserialize(noise)
    if (mechanism.l2_norm_clip is not None
        or mechanism.noise_multiplier is not None):
      raise ValueError(
          "The noise mechanism passed to an optimizer takes l2_norm_clip and "
          "noise_multiplier from the optimizer; build it without them (they "
          "are for its use as a TF-Privacy DPQuery).")
    if seed is not None and (isinstance(seed, bool)
                             or not isinstance(seed, numbers.Integral)):
      raise ValueError(f"seed must be None or an integer; got {seed!r}.")
    expected_batch_size = self._check_poisson_use(
        expected_batch_size, num_microbatches, accumulation_steps, mechanism,
        query)
    super().__init__(learning_rate=learning_rate,
                     name=name or self.__class__.__name__, **kwargs)
    self.l2_norm_clip = l2_norm_clip
    self.clipping = clipping
    self.automatic_gamma = automatic_gamma
    self.noise_multiplier = noise_multiplier
    self.num_microbatches = num_microbatches
    self.accumulation_steps = accumulation_steps
    self.seed = seed
    self.noise = mechanism
    self.query = query
    self.expected_batch_size = expected_batch_size
    # Secret: a plain attribute that no tracking sees (see _keep_unsaved).
    self._keep_unsaved("_seed_pair", core_noise.random_seed() if seed is None
                       else [int(seed) % (2**62), 0x5EED])
    self._keep_unsaved("_step_traced", False)
    if query is not None and tf.compat.v1.get_seed(None)[0] is not None:
      warnings.warn(
          "The DPQuery draws its noise from TensorFlow's global random "
          "generator, and a global seed is set (tf.random.set_seed or "
          "keras.utils.set_random_seed): whoever knows that seed can "
          "reproduce and remove the noise. Do not set a global seed in "
          "private training runs.", UserWarning, stacklevel=2)
    if self.noise_multiplier == 0:
      warnings.warn(
          f"{self.__class__.__name__} with noise_multiplier=0 adds no noise: "
          "training is NOT differentially private (gradients are still "
          "clipped). Use it only for debugging.", UserWarning, stacklevel=2)

  def _check_query_use(self, l2_norm_clip, noise_multiplier, noise,
                       clipping_mode, accumulation):
    """A DPQuery replaces the Gaussian mechanism of DPOptimizer._privatize;
    refuse the settings and classes it cannot serve soundly."""
    name = self.__class__.__name__
    if l2_norm_clip is not None or noise_multiplier is not None:
      raise ValueError(
          f"{name}: pass either query= or l2_norm_clip/noise_multiplier; the "
          "query does its own clipping and noise.")
    if noise is not None:
      raise ValueError(f"{name}: query= and noise= are exclusive (the query "
                       "is the noise mechanism).")
    if clipping_mode != "standard":
      raise ValueError(f"{name}: clipping={clipping_mode!r} with a query; the "
                       "query's preprocess_record does the clipping.")
    if accumulation not in (None, 1):
      raise ValueError(
          f"{name}: gradient_accumulation_steps with a query is not "
          "supported (the query's sample state would have to persist across "
          "physical batches); use a larger batch.")
    cls = type(self)
    own = [m for m in ("_privatize", "clip_spec", "_step_sensitivity")
           if getattr(cls, m) is not getattr(DPOptimizer, m)]
    if own or cls._uses_square_sum:
      how = ", ".join(own) or "sums of squares"
      raise ValueError(
          f"{name} privatizes its own way ({how}), so a DPQuery cannot stand "
          "in for its mechanism. "
          "Queries work with the variants that release the plain clipped "
          "sum: DPSGD, DPAdam, DPAdamBC, DPRMSProp(BC), DPAdagrad(BC), ...")

  def _check_poisson_use(self, expected_batch_size, num_microbatches,
                         accumulation_steps, mechanism, query):
    """B for Poisson-sampled batches (or None); refuses what would make the
    normalisation by B or the accounting with q = B/N unsound."""
    expected_batch_size = check_count("expected_batch_size",
                                      expected_batch_size)
    if expected_batch_size is None:
      return None
    name = self.__class__.__name__
    refused = [
        (num_microbatches is not None, "num_microbatches (microbatches of "
         "a random-size batch have no fixed size or sensitivity)"),
        (accumulation_steps > 1, "gradient_accumulation_steps (k Poisson "
         "batches together are not one Poisson sample of rate kB/N: an "
         "example can be in several); use a larger expected_batch_size"),
        (not isinstance(mechanism, mechanisms.IndependentNoise)
         and not mechanism.supports_cyclic_poisson,
         "correlated (DP-MF) noise of a strategy that is not banded (no ε "
         "is known for it with Poisson sampling; a banded one takes cyclic "
         "Poisson batches, data.cyclic_poisson_batches)"),
        (query is not None, "a DPQuery (it normalises by the realized "
         "number of units)"),
        (self._poisson_unsupported is not None, self._poisson_unsupported)]
    for bad, why in refused:
      if bad:
        raise ValueError(f"{name}: expected_batch_size (Poisson-sampled "
                         f"batches) is not supported with {why}.")
    return expected_batch_size

  # Why a class cannot take Poisson batches (expected_batch_size), if so.
  _poisson_unsupported = None

  # Bias correction subtracts Φ: it needs the noise variance of each release.
  _needs_noise_variance = False

  @property
  def is_private(self):
    """False when no noise is added (noise_multiplier == 0) or the class is a
    non-private research baseline."""
    if self.query is not None:
      return self.query.is_private and not self._not_private_reason
    return self.noise_multiplier > 0 and not self._not_private_reason

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
    if not self.built:
      self.build(list(trainable_variables))
    return self._clip_spec_for(self.l2_norm_clip)._replace(
        square_sum=self._uses_square_sum)

  # ---------------------------------------------------------------- state
  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    def scalar(name, dtype="int64"):
      return self.add_variable((), initializer="zeros", dtype=dtype, name=name)
    # What the accounting needs: the largest logical batch seen, in examples
    # and in clipped units (partial last batches are smaller).
    self._max_batch_examples = scalar("dp_max_batch_examples")
    self._max_batch_units = scalar("dp_max_batch_units")
    self._noise_variance = scalar("dp_noise_variance", "float32")
    self._max_physical_examples = scalar("dp_max_physical_examples")
    # Examples in all physical batches: more than (passes) x N means the
    # recorded epochs were not passes over the data (accounting.ledger).
    self._examples_seen = scalar("dp_examples_seen")
    # What ran, for the once-per-epoch accounting: epochs and their batches
    # (accounting.ledger), saved and restored with the optimizer.
    self._ledger_variable = self.add_variable(
        (ledger_lib.STATE_SIZE,), dtype="int64", name="dp_accounting_ledger",
        initializer=keras.initializers.Constant(
            self.accounting_ledger.initial_values()))
    self._diagnostics = {name: scalar(name, "float32")
                         for name in self.DIAGNOSTICS}
    if isinstance(self.l2_norm_clip, list) and (
        len(self.l2_norm_clip) != len(variables)):
      raise ValueError(
          f"{len(self.l2_norm_clip)} per-layer clip norms for "
          f"{len(variables)} trainable variables: give one per variable.")
    # Secret or un-noised state lives in unsaved variables (_unsaved_variable):
    # none of it is in `variables`, in Keras' tracker or in TF's object
    # graph, so no format writes it — .keras, .weights.h5, tf.train.Checkpoint,
    # SavedModel, model.export, pickling — by construction, not per format.
    if self.accumulation_steps > 1:
      # The clipped sums of the pending logical step, not noised yet.
      self._keep_unsaved("_accumulated_sums", [
          self._unsaved_variable(v.shape, "dp_clipped_sum", v.dtype, like=v)
          for v in variables])
      self._keep_unsaved("_accumulated_squares", [
          self._unsaved_variable(v.shape, "dp_clipped_square_sum", v.dtype,
                                 like=v)
          for v in variables] if self._uses_square_sum else [])
      for name in ("accumulated_units", "accumulated_examples",
                   "physical_step"):  # physical batches of the pending step
        self._keep_unsaved(f"_{name}", self._unsaved_variable((), f"dp_{name}"))
      # Public: physical batches fed so far. Saved, and mirrored by an
      # unsaved copy, so that a step sees when a restore (in this process
      # too) moved it and restarts the pending logical step.
      self._physical_batches = scalar("dp_physical_batches")
      self._keep_unsaved("_live_physical_batches",
                         self._unsaved_variable((), "dp_live_physical_batches"))
    # The noise mechanism's streaming state, per release stream and variable
    # (correlated noise: past noise, as secret as the seed).
    self._keep_unsaved("_noise_state", {
        stream: [None if shape is None else self._unsaved_variable(
            shape, f"dp_noise_state_{stream}_{i}", "float32")
                 for i, shape in enumerate(
                     self.noise.state_shape(v.shape) for v in variables)]
        for stream in self._noise_streams})

    if self.query is not None:
      self._build_query_state(variables)
    else:
      self._query_variables = []

    # The secret seed, in a variable so that a step can renew it. Each
    # process draws its own OS seed; under several workers every replicated
    # release first agrees on worker 0's (keras.replicas.release), so all
    # workers draw the same once-global noise.
    self._keep_unsaved("_seed_variable", self._unsaved_variable(
        (2,), "dp_noise_seed", "int64",
        keras.initializers.Constant(self._seed_pair)))
    # The first step whose noise the current seed has not drawn yet; for
    # correlated noise (and a DPQuery with secret state) also the position of
    # the noise stream, which a step must continue (see _release).
    self._keep_unsaved("_next_noise_step",
                       self._unsaved_variable((), "dp_next_noise_step"))

  def _keep_unsaved(self, name, value):
    """Sets an attribute that no serialization sees.

    ``object.__setattr__`` bypasses Keras' tracker (``variables``, which the
    Keras formats save) and TF's attribute tracking (the object graph that
    tf.train.Checkpoint and SavedModel save).
    """
    object.__setattr__(self, name, value)

  def _unsaved_variable(self, shape, name, dtype="int64", initializer="zeros",
                        like=None):
    """A variable created like ``add_variable`` but tracked by nobody (keep it
    with :meth:`_keep_unsaved`): for state that is secret or not noised."""
    colocate = contextlib.nullcontext()
    if like is not None:  # as add_variable_from_reference, for tf.distribute
      colocate = self._distribution_strategy.extended.colocate_vars_with(
          like.value if isinstance(like, keras.Variable) else like)
      prefix = getattr(like, "path", None) or str(like.name).replace(":", "_")
      name = prefix.replace("/", "_") + "_" + name
    # Eagerly, also where build runs in a trace: a step reads these at trace
    # time (_check_stream_continues).
    with tf.init_scope(), colocate, keras.name_scope(self.name, caller=self):
      return keras.Variable(initializer=keras.initializers.get(initializer),
                            shape=shape, dtype=dtype, trainable=False,
                            name=name)

  @property
  def _has_secret_stream(self):
    """True when each step's noise continues a secret state (DP-MF's past
    noise, a DPQuery's state that is not known to be public): such a run
    cannot resume from any saved file."""
    return self.is_correlated or (self.query is not None
                                  and not self.query.public_state)

  def _build_query_state(self, variables):
    """One variable per tensor of the query's global state, so that the
    compiled step reads and advances it (adaptive clipping under fit)."""
    state = self.query.initial_state(variables)
    if self._needs_noise_variance and self.query.noise_stddev(state) is None:
      raise ValueError(
          f"{self.__class__.__name__} subtracts the noise variance Φ, but "
          f"the noise std of {type(self.query.query).__name__} is not known "
          "to tf_dpadambc. Use a Gaussian sum query (GaussianSumQuery, "
          "QuantileAdaptiveClipSumQuery, NormalizedQuery) or a variant "
          "without bias correction (DPAdam, DPSGD).")
    if not self.query.is_private:
      warnings.warn(
          f"{self.name}: the DPQuery {type(self.query.query).__name__} adds "
          "no noise (its DpEvent says so): training is NOT differentially "
          "private.", UserWarning, stacklevel=3)
    self._keep_unsaved("_query_structure", state)
    with tf.init_scope():  # the state's values, also when built in a trace
      values = [tf.convert_to_tensor(t).numpy()
                for t in tf.nest.flatten(state)]
    # Saved only where the state is known to be public (Gaussian sum queries,
    # adaptive clipping: post-processing of released values). Otherwise it
    # may hold noise seeds, past noise or un-noised sums (tree aggregation's
    # buffers and cumulative sums, DP-MF's stream): kept out of every file.
    secret = not self.query.public_state
    if secret:
      self._keep_unsaved("_query_variables", [])
    else:
      self._query_variables = []
    for i, (value, shape) in enumerate(zip(values, self.query.state_shapes)):
      name = f"dp_query_state_{i}"
      if not shape.is_fully_defined():  # tree buffers grow: a plain variable
        with tf.init_scope():
          variable = tf.Variable(value, shape=shape, trainable=False,
                                 name=name)
      elif secret:
        variable = self._unsaved_variable(
            value.shape, name, value.dtype.name,
            keras.initializers.Constant(value))
      else:
        variable = self.add_variable(
            value.shape, dtype=value.dtype.name, name=name,
            initializer=keras.initializers.Constant(value))
      self._query_variables.append(variable)

  def _query_state(self):
    return tf.nest.pack_sequence_as(
        self._query_structure,
        [tf.convert_to_tensor(v) for v in self._query_variables])

  def query_step_event(self):
    """The DpEvent of one release of the DPQuery, as accounted: Gaussian
    multipliers halved where units hold several examples (sensitivity 2×).
    Raises ``queries.NotAccountable`` where no ε can be trusted."""
    if not self.built:
      raise ValueError("The query's DpEvent is known after the first step.")
    return self.query.step_event(
        self._query_state(),
        divisor=2 if self._units_hold_several_examples() else 1)

  def query_metrics(self):
    """The DPQuery's metrics now (e.g. ``clip``, the adaptive clip norm)."""
    if self.query is None or not self.built:
      return {}
    return self.query.metrics(self._query_state())

  # The noise streams of a step's releases: 0 for ḡ (1: IME's ḡ², 2: JME's).
  _noise_streams = (0,)

  @property
  def noise_variance(self):
    """Φ of the last logical step: (σC/B)², per coordinate of ḡ."""
    return self._noise_variance

  # Joint moment estimation needs Σ clip(g_u)² from the train step.
  _uses_square_sum = False

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
    # Every op of the step waits for this batch's data: where the input
    # iterator ends inside a compiled step (an empty dataset, the end of an
    # epoch of unknown size), nothing runs. Keras would otherwise still
    # advance `iterations` (ops independent of the data run anyway), and a
    # step that released nothing would be counted.
    with _after_inputs(clipped_sum, clipped_square_sum, num_units):
      self._apply_private(clipped_sum, num_units, num_examples,
                          trainable_variables, clipped_square_sum)

  def _apply_private(self, clipped_sum, num_units, num_examples,
                     trainable_variables=None, clipped_square_sum=None):
    if self.query is not None:
      raise TypeError(
          f"{self.name} privatizes with a DPQuery, which clips each unit "
          "itself: feed it per-unit gradients with apply_per_unit().")
    if isinstance(clipped_sum, clipping.ClippedSum):
      clipped_sum, clipped_square_sum = (clipped_sum.grads,
                                         clipped_sum.square_grads)
    trainable_variables = self._variables_of_step(trainable_variables)
    if self._uses_square_sum and clipped_square_sum is None:
      raise ValueError(
          f"{self.__class__.__name__} needs the sum of squared clipped "
          "gradients: clip with `optimizer.clip_spec(...)` (the train step "
          "of make_private does).")
    squares = list(clipped_square_sum) if self._uses_square_sum else None
    num_units = tf.cast(num_units, tf.int64)
    num_examples = tf.cast(num_examples, tf.int64)
    if self.expected_batch_size is not None:
      # Poisson batches: the realized size is not private, so the mean
      # divides by the expected size B (Φ = (σC/B)²) and the accounting
      # records B (Abadi et al. 2016; Opacus normalises the same way).
      num_units = num_examples = tf.constant(self.expected_batch_size,
                                             tf.int64)
    self._note_physical_batch(num_examples)
    if self.accumulation_steps == 1:
      self._release(clipped_sum, squares, num_units, num_examples,
                    trainable_variables)
      return

    # A restore moved the saved batch count away from this process's: the
    # pending sums are from another timeline (or were dropped with the
    # file), so the logical step starts afresh (see _restart_after_restore).
    restored = tf.not_equal(self._physical_batches, self._live_physical_batches)
    for acc in self._accumulation_state():
      acc.assign(tf.where(restored, tf.zeros_like(acc), acc))
    batches = self._physical_batches.assign_add(1)
    self._live_physical_batches.assign(batches)
    for acc, s in zip(self._accumulated_sums + self._accumulated_squares,
                      list(clipped_sum) + (squares or [])):
      acc.assign_add(s)
    units = self._accumulated_units.assign_add(num_units)
    examples = self._accumulated_examples.assign_add(num_examples)
    step = self._physical_step.assign_add(1)

    def release():
      self._release([acc.value for acc in self._accumulated_sums],
                    ([acc.value for acc in self._accumulated_squares]
                     if self._uses_square_sum else None),
                    units, examples, trainable_variables)
      for acc in self._accumulation_state():
        acc.assign(tf.zeros_like(acc))
      return tf.constant(True)

    tf.cond(step >= self.accumulation_steps, release,
            lambda: tf.constant(False))

  def _variables_of_step(self, trainable_variables):
    if trainable_variables is None:
      trainable_variables = self._trainable_variables
    trainable_variables = list(trainable_variables)
    if not self.built:
      self.build(trainable_variables)
    return trainable_variables

  def apply_per_unit(self, per_unit_grads, num_units, num_examples,
                     trainable_variables=None, unit_mask=None):
    """Feeds one physical batch's per-unit gradients g_u ([U, ...] each).

    Clips them with :meth:`clip_spec` and calls :meth:`apply_private`; with
    a DPQuery, accumulates Σ_u preprocess_record(g_u) and releases it.
    ``unit_mask`` ([U] bool) leaves out padding rows. Returns the
    ``ClippedSum`` (None with a query).
    """
    variables = self._variables_of_step(trainable_variables)
    if self.query is None:
      result = clipping.materialized_clipped_sum(
          [g if unit_mask is None else ghost.masked(g, unit_mask)
           for g in per_unit_grads],
          self.clip_spec(variables))
      self.apply_private(result, num_units, num_examples, variables)
      return result
    sample = self.query.sample_state(self._query_state(), per_unit_grads,
                                     variables, unit_mask)
    self._release_sample(sample, num_units, num_examples, variables)
    return None

  def query_clip_spec(self, trainable_variables):
    """The ClipSpec of this step for a DPQuery that clips by L2 norm (so the
    train step can use ghost clipping), or None."""
    self._variables_of_step(trainable_variables)
    clip = self.query.clip_norm(self._query_state())
    return None if clip is None else clipping.ClipSpec(clip)

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
        self._query_state(), result.grads, norms, variables, mask)
    self._release_sample(sample, num_units, num_examples, variables)

  def _note_physical_batch(self, num_examples):
    self._max_physical_examples.assign(
        tf.maximum(self._max_physical_examples, num_examples))
    self._examples_seen.assign_add(num_examples)

  def _release_sample(self, sample, num_units, num_examples, variables):
    with _after_inputs(sample, num_units):  # as apply_private
      num_examples = tf.cast(num_examples, tf.int64)
      self._note_physical_batch(num_examples)
      self._release(sample, None, tf.cast(num_units, tf.int64),
                    num_examples, variables)

  def _release(self, clipped_sum, clipped_square_sum, num_units,
               num_examples, variables):
    """One logical step: noise once, normalise by B, update the weights.

    Never draws the noise of a step index twice with one seed, and refuses a
    secret noise stream (DP-MF) that does not continue where it stopped.
    """
    self._keep_unsaved("_step_traced", True)  # see _restart_after_restore
    step = tf.cast(self._iterations.value, tf.int64)
    args = (clipped_sum, clipped_square_sum, num_units, num_examples,
            variables)
    if not self._has_secret_stream:
      # A step index the current seed has drawn before: a restore rolled the
      # step counter back in this process (unseen by load_own_variables,
      # e.g. tf.train.Checkpoint.restore). Two releases with the same noise
      # would let their difference cancel it, so go on with a fresh secret
      # seed derived from the current one (in the compiled step: no OS).
      seed = self._seed_variable
      seed.assign(tf.where(
          step < self._next_noise_step.value,
          tf.random.experimental.stateless_split(seed.value, 2)[1],
          seed.value))
      self._next_noise_step.assign(step + 1)
      self._release_now(*args)
      return
    self._check_stream_continues()  # eagerly, when the step is traced
    # The same check inside the step, for a restore into an optimizer whose
    # step is compiled already. It raises where the step is not compiled by
    # XLA; XLA drops asserts, and there the step is skipped: no noise, no
    # update, the step counter does not move (nothing is released).
    continues = tf.equal(step, self._next_noise_step.value)
    checks = tf.debugging.Assert(continues, [
        "A noise stream cannot resume mid-stream: step", step,
        "but the stream is at", self._next_noise_step.value])

    def release():
      self._next_noise_step.assign(step + 1)
      self._release_now(*args)
      return tf.constant(True)

    with tf.control_dependencies([checks] if checks is not None else []):
      tf.cond(continues, release, lambda: tf.constant(False))

  def _check_stream_continues(self):
    with tf.init_scope():
      step = int(self._iterations.numpy())
      position = int(self._next_noise_step.numpy())
    if step != position:
      raise ValueError(self._stream_error(step, position))

  def _stream_error(self, step, position):
    what = ("correlated (DP-MF) noise" if self.is_correlated else
            f"DPQuery {type(self.query.query).__name__}")
    return (
        f"{self.name}: its {what} cannot resume mid-stream. Its step counter "
        f"says {step} steps were taken (restored from a file), but its noise "
        f"stream is at step {position}. Each step's noise continues a secret "
        "state (past noise, and with a Dense strategy the seed) that no file "
        "holds, so a restored run cannot continue the mechanism its ε was "
        "computed for. Finish the run in one process (its checkpoints still "
        "restore the weights, e.g. for inference), or train on with a new "
        "optimizer: a new run, whose ε composes with this run's.")

  def _release_now(self, clipped_sum, clipped_square_sum, num_units,
                   num_examples, variables):
    # Releases are ordered like `variables`, which may be a subset of the
    # variables the optimizer was built with: update_step maps its variable
    # index to the release's position (see _position).
    if self.is_correlated and [self._get_variable_index(v) for v in
                               variables] != list(range(
                                   len(self._trainable_variables))):
      raise ValueError(
          "Correlated (DP-MF) noise streams every variable's noise from its "
          "past draws, so every step must update all the variables the "
          f"optimizer was built with, in order ({len(variables)} of "
          f"{len(self._trainable_variables)} given). Freeze layers before "
          "the first step, or use a new optimizer after freezing.")
    object.__setattr__(self, "_step_variables", variables)
    object.__setattr__(self, "_step_positions", {
        self._get_variable_index(v): i for i, v in enumerate(variables)})
    sample, new_states = self._sampler()
    release = self._privatize(clipped_sum, clipped_square_sum, num_units,
                              sample)
    for stream, states in new_states.items():
      for variable, state in zip(self._stream_state(stream), states or []):
        variable.assign(state)
    release = release._replace(
        noise_variance=release.noise_variance
        * self.noise.variance_factor(self._iterations))
    self._noise_variance.assign(release.noise_variance)
    self._max_batch_units.assign(tf.maximum(self._max_batch_units, num_units))
    self._max_batch_examples.assign(
        tf.maximum(self._max_batch_examples, num_examples))
    self._on_private_step(release)
    for tap, value in zip(getattr(self, "_release_tap", None) or [],
                          release.first):
      tap.assign(tf.cast(value, tap.dtype))
    # update_step reads the step's release and reports statistics; both live
    # only while this (traced) call runs.
    # (object.__setattr__: plain Python state, kept out of Keras' tracking.)
    object.__setattr__(self, "_step_release", release)
    object.__setattr__(self, "_step_statistics", [])
    # Keras' own apply: weight decay, update_step per variable, iterations += 1.
    keras.optimizers.Optimizer.apply(self, release.first, variables)
    if self._step_statistics:
      for name, value in diagnostics.summarize(self._step_statistics).items():
        if name in self._diagnostics:
          self._diagnostics[name].assign(value)
    object.__setattr__(self, "_step_release", None)

  # Under a tf.distribute strategy the private release runs once, in the
  # cross-replica context (keras.training merges the replicas' clipped sums
  # first). Keras' TF optimizer assumes a replica context there (its
  # maybe_merge_call and gradient all-reduce); in cross-replica context the
  # gradients are already global, so update the mirrored variables directly.
  def _backend_update_step(self, grads, trainable_variables, learning_rate):
    if tf.distribute.get_replica_context() is not None:
      return super()._backend_update_step(grads, trainable_variables,
                                          learning_rate)
    variables = [v.value if isinstance(v, keras.Variable) else v
                 for v in trainable_variables]
    return self._distributed_tf_update_step(
        tf.distribute.get_strategy(), list(zip(grads, variables)),
        learning_rate)

  def _apply_weight_decay(self, variables):
    if (self.weight_decay is None
        or tf.distribute.get_replica_context() is not None):
      return super()._apply_weight_decay(variables)
    def decay(v):
      v.assign_sub(v * tf.cast(self.weight_decay, v.dtype)
                   * tf.cast(self.learning_rate, v.dtype))
    for variable in variables:
      if self._use_weight_decay(variable):
        tf.distribute.get_strategy().extended.update(
            variable.value if isinstance(variable, keras.Variable)
            else variable, decay, group=False)

  def _sampler(self):
    """The step's ``sample(templates, stddev, stream)`` (core.noise) from the
    noise mechanism, and the dict its new streaming states go to."""
    new_states = {}
    step = self._iterations

    def sample(templates, stddev, stream=0):
      def seed_of(j):  # stream 0 draws exactly the independent noise's z
        return core_noise.stream_seed(
            core_noise.step_seed(self._seed(), j), stream)
      variables = self._stream_state(stream)
      state = [v.value for v in variables if v is not None] or None
      out, new_states[stream] = self.noise.sample(templates, stddev, seed_of,
                                                  step, state)
      return out
    return sample, new_states

  def _seed(self):
    """The secret seed pair: an unsaved variable once built."""
    if getattr(self, "_seed_variable", None) is not None:
      return self._seed_variable.value
    return self._seed_pair

  def _stream_state(self, stream):
    """The state variables of one release stream, in the step's order."""
    if stream not in self._noise_state:
      raise ValueError(f"{self.__class__.__name__} draws noise stream "
                       f"{stream} but declares {self._noise_streams}.")
    states = self._noise_state[stream]
    return [v for v in (states[self._get_variable_index(x)]
                        for x in self._step_variables) if v is not None]

  def _privatize(self, clipped_sum, clipped_square_sum, num_units, sample):
    """The Gaussian mechanism on the clipped sum (DP-SGD's release).

    Noise std σ·Δ with Δ the clipping's sensitivity (C or ‖(C_k)‖₂), drawn by
    the noise mechanism's ``sample`` (independent or correlated). Variants
    that release more (IME, JME) or in another geometry (scale-then-
    privatize) override this.
    """
    del clipped_square_sum
    if self.query is not None:
      return self._query_release(clipped_sum, num_units)
    noisy_mean, noise_variance = core_noise.gaussian_release(
        clipped_sum, self._step_sensitivity(), self.noise_multiplier,
        num_units, sample)
    return Release(noisy_mean, None, noise_variance)

  def _query_release(self, sample_state, num_units):
    """The DPQuery's release; its new global state goes to the variables."""
    mean, new_state, phi = self.query.release(sample_state,
                                              self._query_state(), num_units)
    for variable, leaf in zip(self._query_variables,
                              tf.nest.flatten(new_state)):
      variable.assign(tf.cast(leaf, variable.dtype))
    if phi is None:  # unknown noise std: Φ only feeds diagnostics here
      phi = tf.constant(float("nan"), tf.float32)
    return Release(mean, None, phi)

  def _step_sensitivity(self):
    """Δ of this step's clipped sum (a step-dependent tensor for DP²)."""
    return self.sensitivity

  def tap_releases(self, variables):
    """For auditing (``tf_dpadambc.audit``): keeps each step's release ḡ_t —
    the noisy gradient the update is computed from, already private — in
    unsaved variables shaped like ``variables`` (the model's trainable
    variables, in order); :attr:`last_release` reads them. A white-box
    auditor that sees every release is the strongest adversary the ε claim
    covers (the update is post-processing of the release)."""
    self._keep_unsaved("_release_tap", [
        self._unsaved_variable(v.shape, f"audit_release_{i}", "float32")
        for i, v in enumerate(variables)])

  @property
  def last_release(self):
    """The last step's release ḡ_t (NumPy arrays), after :meth:`tap_releases`."""
    return [t.numpy() for t in self._release_tap]

  def _on_private_step(self, release):
    """Hook for per-step (not per-variable) state, before ``update_step``."""
    del release  # (a body AutoGraph can convert)

  def _position(self, index):
    """Position in this step's release of the variable of optimizer index i."""
    return self._step_positions[index]

  def _report(self, statistics):
    """Called by ``update_step`` with core.diagnostics.moment_statistics."""
    self._step_statistics.append(statistics)

  # ------------------------------------------------------- accounting
  @property
  def effective_noise_multiplier(self):
    """σ for accounting under add/remove-one-example adjacency.

    A unit of one example has sensitivity C; a microbatch of several examples
    changes by up to 2C when one example is added or removed (its clipped mean
    can flip direction), which halves the effective σ — as TF-Privacy's
    ``used_microbatching=True``. Conservatively σ/2 whenever microbatching is
    configured and no step has shown that units hold one example.
    """
    if self.query is not None:
      raise ValueError("With a DPQuery the accounting follows the query's "
                       "DpEvent: use dp_event().")
    sigma = self.noise_multiplier * self._accounting_noise_factor
    return sigma / 2 if self._units_hold_several_examples() else sigma

  def _units_hold_several_examples(self):
    units = int(self._max_batch_units.numpy()) if self.built else 0
    if units:
      return int(self._max_batch_examples.numpy()) > units
    return self.num_microbatches is not None

  # Ratio of the σ the accounting may use to the configured σ (< 1 where a
  # release has more sensitivity than its noise pays for, e.g. JME).
  _accounting_noise_factor = 1.0

  # Set by research baselines that apply un-noised statistics.
  _not_private_reason = None

  # Why the accounted σ is below σ, where a subclass knows better than the
  # statement's default (microbatches, accumulation across epochs).
  accounting_reason = None

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
    return int(self._max_batch_examples.numpy()) if self.built else 0

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
      object.__setattr__(self, "_tf_dpadambc_ledger", ledger)
    return ledger

  def _run_structure(self, extra_epoch_batches=0, num_examples=None):
    """The ledger's RunStructure, or None before the first step. With N,
    an epoch longer than one pass over N examples (ceil(N / b) physical
    batches) is not taken for one pass."""
    if not self.built or not (self.steps_taken or extra_epoch_batches):
      return None
    physical = int(self._max_physical_examples.numpy())
    longest = (events.batches_per_epoch(num_examples, physical)
               if num_examples and physical else None)
    structure = self.accounting_ledger.structure(extra_epoch_batches, longest)
    if num_examples and int(self._examples_seen.numpy()) > num_examples * (
        structure.passes + structure.unknown_batches):
      # More examples went through than the recorded passes hold (a
      # repeated dataset cut into epochs by steps_per_epoch): the epochs
      # were not passes over the data.
      structure = self.accounting_ledger.structure(extra_epoch_batches,
                                                   conservative=True)
    return structure

  def dp_event(self, num_examples, batch_size=None, sampling="poisson",
               steps=None, extra_epoch_batches=0):
    """The dp_accounting DpEvent of the training this optimizer performed.

    Args:
      num_examples: size N of the training set.
      batch_size: expected logical batch size; defaults to the largest seen
        (``expected_batch_size`` for Poisson batches).
      sampling: ``"poisson"`` (each example in each step independently with
        probability B/N: what the ε from ``compute_epsilon`` assumes; it
        holds for batches from ``data.poisson_batches`` with
        ``expected_batch_size``) or ``"shuffle"`` (each example once per
        epoch, no amplification). With
        correlated noise: ``"cyclic"`` (fixed batch order every epoch),
        ``"shuffle"`` or ``"cyclic_poisson"`` (amplified BandMF, expected
        batch size B); see ``CorrelatedNoise.accounting_event``.
      steps: ``None`` (default): the run as it happened — the steps taken
        and, once per epoch, the epochs :attr:`accounting_ledger` recorded
        with their real numbers of batches (a logical step whose batches
        span two epochs can hold an example twice: σ/2 for that step).
        Another number of logical steps plans a run (as
        ``compute_epsilon``): epochs of the fewest batches seen, ceil(N/b)
        before any.
      extra_epoch_batches: also account one more epoch of this many physical
        batches after the run (``PrivacyBudget``'s look-ahead).
    """
    if self._not_private_reason:
      raise ValueError(
          f"{self.__class__.__name__} has no ε: {self._not_private_reason}")
    poisson = "cyclic_poisson" if self.is_correlated else "poisson"
    if self.expected_batch_size is not None and sampling == "poisson":
      sampling = poisson  # the default: the run's own (banded MF: cyclic)
    if self.expected_batch_size is not None and (
        sampling != poisson
        or batch_size not in (None, self.expected_batch_size)):
      raise ValueError(
          f"{self.__class__.__name__} takes Poisson-sampled batches "
          f"(expected_batch_size={self.expected_batch_size}): only "
          f"sampling={poisson!r} with that batch size describes them (an "
          "example can be in several steps of an epoch, so the once-per-"
          f"epoch accounting does not hold); got sampling={sampling!r}, "
          f"batch_size={batch_size!r}.")
    batch_size = batch_size or self.logical_batch_size
    if not batch_size:
      raise ValueError("No private step was taken yet: pass batch_size.")
    planned = steps is not None and steps != self.steps_taken
    groups = None
    if sampling == "cyclic_poisson" and self.is_correlated and not planned:
      # The run's amplified ε only if its ledger verified the sampler.
      groups = cyclic.verified_groups(self, num_examples, batch_size)
    once_per_epoch = sampling in ("shuffle", "cyclic") and not planned
    structure = (self._run_structure(extra_epoch_batches, num_examples)
                 if once_per_epoch else None)
    if structure is None:  # Poisson (steps are all that count), or a plan
      steps = ((self.steps_taken if steps is None else steps)
               + extra_epoch_batches // self.accumulation_steps)
      if self.query is not None:
        return events.sampled_event(
            self.query_step_event(), num_examples, batch_size, steps,
            {"cyclic": "shuffle"}.get(sampling, sampling),
            self.logical_steps_per_epoch(num_examples))
      return self.noise.accounting_event(
          self._planned_noise_multiplier(num_examples) if planned
          else self.accounted_noise_multiplier(num_examples),
          steps, sampling, batch_size, num_examples,
          self.logical_steps_per_epoch(num_examples),
          **({"groups": groups} if groups else {}))
    if self.query is not None:  # no accumulation: one use per epoch
      return events.composed(self.query_step_event(),
                             structure.participations)
    if not self.is_correlated:
      return events.shuffled_gaussian_event(self.effective_noise_multiplier,
                                            structure.releases)
    return self.noise.accounting_event(
        self.effective_noise_multiplier / structure.max_multiplicity,
        structure.steps, sampling, batch_size, num_examples,
        structure.accounting_steps_per_epoch())

  def accounted_noise_multiplier(self, num_examples):
    """The smallest σ the accounting uses for a training set of N examples.

    :attr:`effective_noise_multiplier`, divided by the most epochs one
    logical step of the run touched (recorded by :attr:`accounting_ledger`):
    with gradient accumulation a logical step can hold the same example once
    per epoch it spans (m times the per-unit sensitivity; compounding with
    microbatching's 2C). Before the first step, the most a step could touch
    with epochs of ceil(N / b) physical batches.
    """
    structure = self._run_structure(num_examples=num_examples)
    if structure is None:
      return (self.effective_noise_multiplier
              / self._epochs_per_logical_step(num_examples))
    return self.effective_noise_multiplier / structure.max_multiplicity

  def _planned_noise_multiplier(self, num_examples):
    """σ for a planned run: the worst a logical step could touch."""
    structure = self._run_structure(num_examples=num_examples)
    touched = self._epochs_per_logical_step(num_examples)
    if structure is not None:
      touched = max(touched, structure.max_multiplicity)
    return self.effective_noise_multiplier / touched

  def _epochs_per_logical_step(self, num_examples):
    """m: the most epochs a window of k consecutive physical batches (a
    logical step; windows start at multiples of k) can intersect, with P
    batches per epoch (the fewest seen in an epoch, else ceil(N / b)): 1 if
    k divides P, k/P if P divides k, else ceil((k − 1)/P) + 1 (a window
    starting at an epoch's last batch)."""
    k = self.accumulation_steps
    physical = (int(self._max_physical_examples.numpy()) if self.built
                else 0)
    if k == 1 or not physical:
      return 1
    p = events.batches_per_epoch(num_examples, physical)
    structure = self._run_structure(num_examples=num_examples)
    if structure is not None and structure.min_epoch_batches:
      p = min(p, structure.min_epoch_batches)
    if p % k == 0:
      return 1
    if k % p == 0:
      return k // p
    return -(-(k - 1) // p) + 1

  def logical_steps_per_epoch(self, num_examples):
    """Logical steps per pass over the data: the fewest the run's epochs
    held (all but the last), else ceil(N / b) / k, b physical."""
    structure = self._run_structure(num_examples=num_examples)
    if structure is not None and structure.logical_steps_per_epoch():
      return structure.logical_steps_per_epoch()
    physical = (int(self._max_physical_examples.numpy()) if self.built
                else 0)
    if not physical:
      return None
    return (events.batches_per_epoch(num_examples, physical)
            / self.accumulation_steps)

  # ----------------------------------------------------------- saving
  # Every format saves `variables` (the Keras formats through
  # save_own_variables, TF's through the object graph), and the secret or
  # un-noised state is in none of them (see build). On restore:
  # * a pending accumulation step restarts: its sums were not saved, and the
  #   physical batches dropped with them were never released (no noise was
  #   drawn for them), so nothing was spent on them and the accounting, which
  #   counts releases, does not under-count;
  # * the seed is new: drawn from the OS by a new optimizer (and, for a
  #   restore into this one, by load_own_variables, or derived in the step
  #   when the step counter went back, see _release);
  # * a secret noise stream (DP-MF) cannot be continued: training refuses
  #   until it is back where it stopped (see _stream_error).
  def _accumulation_state(self):
    if not self.built or self.accumulation_steps == 1:
      return []
    return list(self._accumulated_sums) + list(self._accumulated_squares) + [
        self._accumulated_units, self._accumulated_examples,
        self._physical_step]

  def _saved_variables(self):
    """What every format saves: the tracked variables, nothing secret."""
    return list(self.variables)

  def save_own_variables(self, store):
    """Saves the optimizer state (Keras formats), which holds nothing secret:
    not the accumulated clipped sums (not noised yet), not the seed, not a
    noise stream's state (see build)."""
    for i, variable in enumerate(self._saved_variables()):
      store[str(i)] = variable.numpy()

  def load_own_variables(self, store):
    variables = self._saved_variables()
    if len(store.keys()) == self._unbuilt_variable_count < len(variables):
      # Saved before the first step (e.g. model.save right after compile):
      # only the step counter and learning rate; the rest starts fresh.
      variables = variables[:self._unbuilt_variable_count]
    elif len(store.keys()) != len(variables):
      raise ValueError(
          f"Cannot restore {self.name}: the file holds {len(store.keys())} "
          f"variables, this optimizer has {len(variables)}"
          + ("" if self.built else " (build it first: "
             "optimizer.build(model.trainable_variables))") + ".")
    for i, variable in enumerate(variables):
      variable.assign(store[str(i)])
    self._restart_after_restore()

  @property
  def _unbuilt_variable_count(self):
    """Variables an optimizer has before build: the step counter and, unless
    it is a schedule, the learning rate."""
    return 1 + isinstance(self._learning_rate, keras.Variable)

  def _restart_after_restore(self):
    """After a restore into this (live) optimizer: the pending logical step
    restarts and the seed is new, as in a new optimizer."""
    if not self.built:
      return  # nothing drawn, nothing pending: build starts afresh
    for variable in self._accumulation_state():
      variable.assign(tf.zeros_like(variable))
    if self.accumulation_steps > 1:
      self._live_physical_batches.assign(self._physical_batches)
    if self._has_secret_stream:
      step, position = (int(self._iterations.numpy()),
                        int(self._next_noise_step.numpy()))
      if step != position and self._step_traced:
        # The compiled step could only skip (under XLA), not explain.
        raise ValueError(self._stream_error(step, position))
      return  # not traced yet: the first step refuses (or it continues)
    if self.seed is None:
      self._keep_unsaved("_seed_pair", core_noise.random_seed())
      self._seed_variable.assign(self._seed_pair)
      self._next_noise_step.assign(0)  # the new seed has drawn nothing

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
