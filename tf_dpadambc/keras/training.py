"""The private Keras 3 train step and ``make_private``.

Keras 3's ``Model.train_step`` reduces the loss over the batch and gives the
optimizer one aggregated gradient, from which no per-example bound can be
recovered. ``make_private(model)`` installs a train step that

1. evaluates every unit (example or microbatch) on its own, inside
   ``tf.vectorized_map``: its forward pass, its loss and either the output
   gradients of its layers (ghost clipping, ``keras.ghost``) or its whole
   gradient (``core.per_example``);
2. forms Σ_u clip_C(g_u) from those per-unit values (``core.clipping``), so
   no unit adds more than C whatever the model does with the batch axis;
3. hands the clipped sum to the DP optimizer, which adds the noise once per
   logical step and updates the weights (``DPOptimizer.apply_private``);

all inside the one function Keras compiles (``jit_compile=True`` works).
Losses, metrics, sample weights and validation behave as in plain Keras.
"""
import dataclasses
import itertools
import logging
import math
import types
import weakref

import keras
import tensorflow as tf

from tf_dpadambc import queries
from tf_dpadambc.accounting import ledger
from tf_dpadambc.core import clipping
from tf_dpadambc.core import diagnostics as core_diagnostics
from tf_dpadambc.core import per_example
from tf_dpadambc.keras import _compat
from tf_dpadambc.keras import ghost
from tf_dpadambc.keras import replicas
from tf_dpadambc.keras import validation
from tf_dpadambc.keras.optimizers import base

_RECORD = "_tf_dpadambc_private"
_METHODS = ("auto", "ghost", "vectorized")
# The static loss scale under float16 compute (make_private(loss_scale=...)).
# A unit's loss is the mean over its own examples (one by default), not over
# the batch: its output gradients are O(1), where Keras' dynamic scaling
# starts at 2**15 for a batch mean. 2**10 (Keras' start per example of a
# batch of 32) keeps float16 gradients down to 2**-34 (instead of 2**-24)
# from flushing to zero and leaves 64x headroom below float16's maximum
# (65504) for gradients of magnitude 1; a unit that still overflows is zeroed
# alone (never the step).
DEFAULT_FLOAT16_LOSS_SCALE = 2.0 ** 10
_LOW_PRECISION = (tf.float16, tf.bfloat16)
_UNVERIFIED = "dp_unverified_steps"
# Every trace of the private step gets its own id (see _verify_stage).
_TRACE_IDS = itertools.count()


@dataclasses.dataclass
class ModelRecord:
  """What ``make_private`` keeps on a model, under one attribute.

  Attributes:
    clipping: the clipping method (``"auto"``, ``"ghost"``, ``"vectorized"``).
    loss_scale: the static loss scale, or None (automatic, see
      :func:`loss_scale`).
    plan: the :class:`~tf_dpadambc.keras.ghost.ClippingPlan` last traced.
    metrics: ``(dp_clipped_fraction, dp_nonfinite_examples,
      dp_unverified_steps)`` metrics of the train step.
    diagnostics: name → epoch mean of the optimizer's diagnostic of that
      name (``core.diagnostics.NAMES``).
    verified: int64 variable, the id of the last trace of the train step
      whose model passed :func:`examples_independent` (−1: none). Never
      saved: a restored model is checked again.
    private: True once ``make_private`` installed the train step.
    last_dp_optimizer: the DP optimizer last compiled into the model (its
      run composes with the next one's, even across a non-DP compile).
  """

  clipping: str = "auto"
  loss_scale: float = None
  plan: object = None
  metrics: tuple = ()
  diagnostics: dict = dataclasses.field(default_factory=dict)
  verified: object = None
  private: bool = False
  last_dp_optimizer: object = None


def _record(model):
  """The model's :class:`ModelRecord` (created, unsaved, on first use)."""
  record = model.__dict__.get(_RECORD)
  if not isinstance(record, ModelRecord):
    record = ModelRecord()
    # object.__setattr__: kept out of Keras' tracking and of saved models.
    object.__setattr__(model, _RECORD, record)
  return record


def _batch_size(x):
  first = next(t for t in tf.nest.flatten(x) if t is not None)
  return tf.shape(first)[0]


def _per_example_values(example_loss, y, y_pred):
  """The loss of every example: unreduced values, averaged over non-batch axes."""
  # Mixed precision: the loss in float32 (as Keras' Loss.__call__ does).
  y_pred = tf.nest.map_structure(
      lambda t: tf.cast(t, tf.float32) if t.dtype in _LOW_PRECISION else t,
      y_pred)
  values = example_loss(y, y_pred)
  rank = values.shape.rank
  if rank == 0:
    raise ValueError(
        "The loss returned a single (reduced) value for the whole batch; "
        "private training needs one value per example to clip each "
        "example's gradient. Use a Keras loss (string or keras.losses.Loss) "
        "or a function that returns per-example values without averaging "
        "over the batch.")
  if rank > 1:  # e.g. per-timestep losses: Keras averages them too
    values = tf.reduce_mean(values, axis=list(range(1, rank)))
  return values


def _per_example_weights(sample_weight, batch_size):
  """Sample weights as a [B] vector (one weight per example)."""
  if sample_weight is None:
    return tf.ones([batch_size], dtype=keras.backend.floatx())
  sample_weight = tf.convert_to_tensor(sample_weight)
  if sample_weight.shape.rank == 2 and sample_weight.shape[-1] == 1:
    sample_weight = tf.squeeze(sample_weight, axis=-1)
  if sample_weight.shape.rank != 1:
    raise ValueError(
        "Private training supports one sample weight per example (shape "
        f"[batch] or [batch, 1]); got shape {sample_weight.shape}. "
        "Per-timestep weights are not supported yet.")
  return sample_weight


def _unit_losses(model, x, y, sample_weight, num_microbatches):
  """The pieces every clipping method shares: the parameters, the stateless
  forward pass, the per-example loss (None: evaluate the compiled loss per
  unit), ``unit_loss_fn(params, unit) -> (loss, y_pred)`` and the units."""
  validation.check_forward(model, x)
  non_trainable = [v.value for v in model.non_trainable_variables]
  params = [v.value for v in model.trainable_variables]
  sample_weight = _per_example_weights(sample_weight, _batch_size(x))
  example_loss = _compat.example_loss_fn(model)
  if len(tf.nest.flatten(y)) != 1:
    example_loss = None  # several outputs: evaluate the compiled loss per unit
  compiled_loss = _compat.compiled_loss(model)

  def forward(params, inputs):
    y_pred, _, losses = model.stateless_call(
        params, non_trainable, inputs, training=True, return_losses=True)
    return y_pred, losses

  def weighted_mean_loss(uy, y_pred, uw):
    if example_loss is None:
      # Keras' compiled loss also updates its per-output loss trackers: per
      # unit that is state written from the data (refused by the step's
      # check); the logs stage tracks the batch's losses instead.
      with _compat.without_loss_trackers(compiled_loss):
        return compiled_loss(uy, y_pred, uw)
    values = _per_example_values(example_loss, uy, y_pred)
    return tf.reduce_mean(tf.cast(uw, values.dtype) * values)

  def unit_loss_fn(params, unit):
    ux, uy, uw = unit
    y_pred, losses = forward(params, ux)
    loss = weighted_mean_loss(uy, y_pred, uw)
    if losses:
      # A unit whose weights are all 0 (e.g. Poisson padding) is absent:
      # not even its regularization term may enter the clipped sum.
      present = tf.reduce_any(tf.not_equal(uw, 0))
      loss += tf.cast(present, loss.dtype) * tf.add_n(
          [tf.cast(l, loss.dtype) for l in losses])
    return loss, y_pred

  units = per_example.split_microbatches((x, y, sample_weight),
                                         num_microbatches)
  return params, non_trainable, forward, example_loss, unit_loss_fn, units


# The entry points a user's tf.function may call are not converted by
# AutoGraph: the library's control flow is explicit, fit calls them
# unconverted (Keras' step is do_not_convert), and converting them took a
# fifth of the tracing of such a function.
@tf.autograph.experimental.do_not_convert
def per_unit_gradients(model, x, y, sample_weight, num_microbatches=None):
  """Every unit's gradient of a compiled Keras model's loss on one batch.

  Each unit (example or microbatch) is evaluated alone under
  ``tf.vectorized_map``, so examples cannot mix. Returns ``(grads,
  unit_losses [U], y_pred)`` with ``grads[j]`` shaped ``[U, *var_j.shape]``
  (what a DPQuery's ``preprocess_record`` takes, one unit at a time), a
  ``per_example.PerUnitGradients`` (what ``apply_per_unit`` takes; also
  when called eagerly, where the evaluation runs as a traced function,
  whose outputs are plain lists).
  """
  grads, losses, y_pred = _per_unit_gradients(model, x, y, sample_weight,
                                              num_microbatches)
  return per_example.PerUnitGradients(grads), losses, y_pred


@tf.autograph.experimental.do_not_convert
@validation.stateless_evaluation
def _per_unit_gradients(model, x, y, sample_weight, num_microbatches):
  params, _, _, _, unit_loss_fn, units = _unit_losses(
      model, x, y, sample_weight, num_microbatches)
  with per_example.sequential_units(_compat.has_recurrent_layers(model)), \
      per_example.loss_scale(loss_scale(model)):
    grads, losses, y_pred = per_example.per_unit_gradients(
        unit_loss_fn, params, units)
  return grads, losses, per_example.merge_microbatches(y_pred)


@tf.autograph.experimental.do_not_convert
@validation.stateless_evaluation
def private_gradient_sum(model, x, y, sample_weight, clip,
                         num_microbatches=None, method="auto"):
  """Σ_u clip_C(g_u) of a compiled Keras model's loss on one batch.

  ``clip`` is a clip norm C or a :class:`~tf_dpadambc.core.clipping.ClipSpec`
  (``optimizer.clip_spec(model.trainable_variables)`` gives the one a DP
  optimizer expects).

  Units are examples (``num_microbatches=None``) or M equal microbatches. A
  unit's loss is the mean over its examples of (sample weight × per-example
  loss) — the loss ``model.fit`` reports — plus any ``add_loss`` or
  regularization losses of that unit's forward pass. The loss's own
  ``reduction`` is not used.

  Every path evaluates each unit on its own (``tf.vectorized_map``, whose
  semantics are a loop over units), and computes a unit's clip factor from
  exactly the values its contribution is built from: one unit adds at most C
  to the sum whatever the model does with the batch axis. Stochastic layers
  (Dropout, GaussianNoise, ...) draw one set of random values per step,
  shared by the units of the batch.

  ``method``: ``"auto"`` (ghost norms with book-keeping where the model
  allows it, ``keras.ghost``; materialized per-unit gradients otherwise),
  ``"ghost"`` (raise ``ValueError`` where it is not possible) or
  ``"vectorized"``. The plan used is kept for :func:`clipping_plan`.

  Returns:
    ``(ClippedSum, unit_losses [U], y_pred)`` with ``y_pred`` the batch's
    predictions (each unit's own) in the original example order.
  """
  if method not in _METHODS:
    raise ValueError(f"clipping={method!r}: use one of {_METHODS}.")
  with per_example.sequential_units(_compat.has_recurrent_layers(model)), \
      per_example.loss_scale(loss_scale(model)):
    return _private_gradient_sum(model, x, y, sample_weight, clip,
                                 num_microbatches, method)


def _private_gradient_sum(model, x, y, sample_weight, clip, num_microbatches,
                          method):
  (params, non_trainable, forward, example_loss, unit_loss_fn,
   units) = _unit_losses(model, x, y, sample_weight, num_microbatches)

  def unit_loss(uy, y_pred, uw):
    values = _per_example_values(example_loss, uy, y_pred)
    return tf.reduce_mean(tf.cast(uw, values.dtype) * values)

  probe = tf.nest.map_structure(lambda t: t[:1], x)
  _, extra_losses = forward(params, probe)
  spec = clipping.as_spec(clip)
  reason = None
  if example_loss is None:
    reason = "the model has several outputs or losses"
  elif extra_losses:
    reason = "the model adds losses (regularizers or add_loss)"
  elif _compat.has_recurrent_layers(model) and (
      ghost.unsupported_recurrent_layers(model)):
    # LSTM, GRU, SimpleRNN with a ghost rule vectorize (rules.recurrent).
    names = [l.name for l in ghost.unsupported_recurrent_layers(model)]
    reason = (f"recurrent layers {names} (no ghost rule for their "
              "configuration) are evaluated per unit in a loop")
  elif method != "vectorized":
    try:
      result, unit_losses, y_pred, plan = ghost.clipped_sum(
          model, params, non_trainable, units, unit_loss, spec)
    except ghost.Unsupported as e:
      reason = str(e)
    else:
      _record_plan(model, plan)
      return result, unit_losses, per_example.merge_microbatches(y_pred)
  if method == "ghost":
    raise ValueError(f"clipping='ghost' is not possible: {reason}. Use "
                     "clipping='auto' or 'vectorized'.")
  if reason is None:
    reason = "clipping='vectorized' was chosen"
  _record_plan(model, ghost.ClippingPlan(fallback=reason))
  result, unit_losses, y_pred = clipping.clipped_gradient_sum(
      unit_loss_fn, params, units, spec)
  return result, unit_losses, per_example.merge_microbatches(y_pred)


def _computes_in(model, dtype):
  return any(layer.dtype_policy.compute_dtype == dtype
             for layer in _compat.flatten_layers(model))


def loss_scale(model):
  """The static loss scale of the model's private train step.

  ``make_private(model, loss_scale=...)``'s value; by default
  :data:`DEFAULT_FLOAT16_LOSS_SCALE` where a layer computes in float16
  (``mixed_float16``), else 1 (bfloat16 has float32's range). Each unit's
  backward pass runs on S·loss_u and its gradient is divided by S in float32
  before any norm (``core.per_example.loss_scale``): S never changes the clip
  bound or the noise.
  """
  scale = _record(model).loss_scale
  if scale is not None:
    return scale
  return DEFAULT_FLOAT16_LOSS_SCALE if _computes_in(model, "float16") else 1.0


def _check_loss_scale(value):
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      value >= 1 and math.frexp(value)[0] == 0.5) or math.isinf(value):
    raise ValueError(
        f"loss_scale={value!r}: use None (automatic) or a power of two ≥ 1, "
        "a Python number (static: it is fixed when the step is traced, never "
        "adapted to the data).")
  return float(value)


@tf.autograph.experimental.do_not_convert
@validation.stateless_evaluation
def examples_independent(model, x, num_microbatches=None, rtol=1e-3, y=None):
  """True if the batched forward pass gives each unit the predictions (and,
  with ``y``, the per-example loss values) it gets alone: in training mode
  where that draws no random numbers (``validation.deterministic_in_
  training``: a layer that mixes examples only in training is caught),
  else in inference mode, so that randomness does not differ.

  Privacy does not rest on this (every private path evaluates units alone);
  it says whether per-unit evaluation trains the model the user wrote. A
  model whose layers mix examples of a batch (statistics over axis 0, a lag
  across rows, attention over the batch), or a loss that does (values
  centred over the batch), fails it. Tolerance: ``rtol`` of each value plus
  ``rtol`` of the output's mean magnitude (float32 sums ordered differently
  in a batch), plus 1e-6; at least 1e-2 where a layer computes in float16
  and 3e-2 in bfloat16 (a few units of their last place: the batched and
  per-unit passes round differently).
  """
  if _computes_in(model, "bfloat16"):
    rtol = max(rtol, 3e-2)
  elif _computes_in(model, "float16"):
    rtol = max(rtol, 1e-2)
  non_trainable = [v.value for v in model.non_trainable_variables]
  params = [v.value for v in model.trainable_variables]
  example_loss = None if y is None else _compat.example_loss_fn(model)
  if example_loss is not None and len(tf.nest.flatten(y)) != 1:
    example_loss = None

  training = validation.deterministic_in_training(model)

  def predict(inputs):
    return model.stateless_call(params, non_trainable, inputs,
                                training=training)[0]

  def predict_unit(unit):
    ux, uy = unit
    y_pred = predict(ux)
    if example_loss is None:
      return y_pred
    return y_pred, _per_example_values(example_loss, uy, y_pred)
  batched = predict(x)
  if example_loss is not None:
    batched = batched, _per_example_values(example_loss, y, batched)
  with per_example.sequential_units(_compat.has_recurrent_layers(model)):
    alone = per_example.merge_microbatches(per_example.map_units(
        predict_unit, per_example.split_microbatches(
            (x, tf.zeros([_batch_size(x)]) if y is None else y),
            num_microbatches)))

  def agree(b, a):
    if b.shape.is_fully_defined() and a.shape.is_fully_defined() and (
        b.shape != a.shape):
      return tf.constant(False)
    b, a = tf.cast(b, tf.float32), tf.cast(a, tf.float32)
    scale = tf.reduce_mean(tf.abs(tf.where(tf.math.is_finite(a), a, 0.)))
    close = tf.abs(b - a) <= rtol * (tf.abs(a) + scale) + 1e-6
    both_nonfinite = ~tf.math.is_finite(b) & ~tf.math.is_finite(a)
    return tf.reduce_all(close | both_nonfinite)
  return tf.reduce_all(tf.stack([agree(b, a) for b, a in zip(
      tf.nest.flatten(batched), tf.nest.flatten(alone))]))


def _record_plan(model, plan):
  """Keeps the plan for clipping_plan(); logs fallbacks when the plan changes."""
  record = _record(model)
  previous, record.plan = record.plan, plan
  if previous is not None and str(previous) == str(plan):
    return
  if plan.fallback and not plan.fallback.endswith("was chosen"):
    logging.getLogger(__name__).warning(
        "Model '%s': no ghost clipping, because %s; clipping uses vectorized "
        "per-unit gradients of the whole model (correct, slower).",
        model.name, plan.fallback)
  elif plan.per_layer_fallbacks:
    logging.getLogger(__name__).warning(
        "Model '%s': no ghost-norm rule for %s; those layers use vectorized "
        "per-unit gradients of their own weights (tf_dpadambc."
        "register_ghost_rule adds a rule).", model.name,
        ", ".join(f"'{e.layer}' ({e.kind})" for e in plan.per_layer_fallbacks))


def clipping_plan(model, x=None, y=None, sample_weight=None):
  """How the private train step clips: a :class:`~tf_dpadambc.keras.ghost.ClippingPlan`.

  With a batch ``x, y``, traces the step's clipping on it (no weights
  change) and returns that plan. Without data, the plan of the last traced
  train step, or before the first one the plan traced on inputs of the
  model's input shapes (zeros; the loss then does not matter). ``print(plan)``
  lists, per layer with weights, the method: ghost norm, materialized per
  unit, row sums (Embedding), or per-layer vectorized gradients; or why the
  whole model uses vectorized per-unit gradients.
  """
  if x is not None:
    optimizer = model.optimizer
    if not isinstance(optimizer, base.DPOptimizer):
      raise TypeError("clipping_plan(model, x, y) needs a model compiled with "
                      "a tf_dpadambc optimizer.")
    if not optimizer.built:
      optimizer.build(model.trainable_variables)
    tf.function(lambda: private_gradient_sum(
        model, x, y, sample_weight,
        optimizer.clip_spec(model.trainable_variables),
        optimizer.num_microbatches,
        _record(model).clipping), autograph=False).get_concrete_function()
  elif _record(model).plan is None:
    tf.function(lambda: _plan_without_data(model),
                autograph=False).get_concrete_function()
  return _record(model).plan


def _plan_without_data(model):
  """Records the plan of a batch of zeros shaped like the model's inputs,
  with the sum of the outputs as every unit's loss (the plan depends on the
  layers and shapes, not on the loss)."""
  if not model.inputs:
    raise ValueError("clipping_plan(model) without data needs a model with "
                     "known inputs (built with keras.Input); pass a batch: "
                     "clipping_plan(model, x, y).")
  x = [tf.zeros([2] + [1 if d is None else d for d in t.shape[1:]], t.dtype)
       for t in model.inputs]
  x = x[0] if len(x) == 1 else x
  method = _record(model).clipping
  non_trainable = [v.value for v in model.non_trainable_variables]
  params = [v.value for v in model.trainable_variables]
  _, _, losses = model.stateless_call(params, non_trainable, x,
                                      training=True, return_losses=True)
  if method == "vectorized":
    reason = "clipping='vectorized' was chosen"
  elif len(model.outputs) != 1:
    reason = "the model has several outputs or losses"
  elif losses:
    reason = "the model adds losses (regularizers or add_loss)"
  else:
    units = per_example.split_microbatches(
        (x, tf.zeros([2]), tf.ones([2])), None)
    try:
      _record_plan(model, ghost.clipped_sum(
          model, params, non_trainable, units,
          lambda uy, y_pred, uw: tf.reduce_sum(y_pred),
          clipping.ClipSpec(1.0))[3])
      return
    except ghost.Unsupported as e:
      reason = str(e)
  _record_plan(model, ghost.ClippingPlan(fallback=reason))


def _advance_seed_generators(model):
  # The per-unit forward passes ran statelessly; move every stochastic layer
  # to fresh randomness for the next step.
  for sg in _compat.seed_generators(model):
    sg.next()


_MADE_WITH_XLA = "_tf_dpadambc_made_with_xla"


def _dp_train_step(self, data):
  """The train step ``make_private`` installs (``self`` is the model).

  Named stages: the plan (:func:`_plan_stage`: optimizer, strategy, batch
  kind), the optimizer's public work (``before_step``), the first-step
  verification (:func:`_verify_stage`), the private gradient — clipped sum
  by ghost norms or per-unit gradients, then the release
  (:func:`_private_stage`) — and the logs (:func:`_logs_stage`).
  """
  x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  optimizer, replicated = _plan_stage(self, sample_weight)
  # (and the setting the train function was made with: jit_compile set
  # to False after make_train_function left an XLA function; a review)
  queries.check_not_under_xla(
      getattr(optimizer, "query", None),
      bool(getattr(self, "jit_compile", False))
      or bool(self.__dict__.get(_MADE_WITH_XLA, False)))
  optimizer.before_step(self)  # public work only (e.g. AdaDPS' refresh)
  validation.check_model(self)
  validation.check_forward(self, x)  # before any evaluation of the model
  batch_size = _batch_size(x)
  with per_example.quiet_failed_conversions():
    consistent = _verify_stage(self, optimizer, x, y)
    result, unit_losses, y_pred = _private_stage(
        self, optimizer, x, y, sample_weight, batch_size, consistent,
        replicated)
  _advance_seed_generators(self)
  # The metrics see the batch without noise: they may write their own state,
  # not the model's (a review: a metric writing a batch statistic into a
  # model variable read by the next steps, 8C for a bound of 2C).
  with validation.model_unwritten(self):
    return _logs_stage(self, optimizer, x, y, y_pred, sample_weight,
                       batch_size, result, unit_losses, consistent)


def _plan_stage(model, sample_weight):
  """The DP optimizer, and whether the step runs on several replicas;
  refuses optimizers, strategies and batches the step cannot serve."""
  optimizer = model.optimizer
  # (At trace time; a weak reference: Keras' saving walks the model's
  # attributes, and would save the optimizer under this name.)
  model.__dict__[validation.TRACED_OPTIMIZER] = weakref.ref(optimizer)
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    raise TypeError(
        "This model was made private with tf_dpadambc.make_private, but its "
        "optimizer is a LossScaleOptimizer: its dynamic loss scale skips "
        "steps depending on the data, which private training must not do. "
        "Compile with the DP optimizer itself; under mixed_float16 the "
        "private step applies a static loss scale "
        "(make_private(loss_scale=...)).")
  if not isinstance(optimizer, base.DPOptimizer):
    raise TypeError(
        "This model was made private with tf_dpadambc.make_private, but it is "
        f"compiled with {optimizer.__class__.__name__}, which is not a "
        "differentially private optimizer. Compile it with one of "
        "tf_dpadambc's optimizers (DPSGD, DPAdam, DPAdamBC, ...).")
  replicated = _check_strategy(model.distribute_strategy, optimizer)
  if optimizer.expected_batch_size is not None and sample_weight is None:
    raise ValueError(
        f"{optimizer.name} has expected_batch_size="
        f"{optimizer.expected_batch_size}: its batches must be Poisson "
        "samples, padded, with weight 0 on the padding. These batches have "
        "no sample weights: fit on tf_dpadambc.data.poisson_batches(x, y, "
        "expected_batch_size=...) (without batch_size), or drop "
        "expected_batch_size for fixed-size batches (shuffle accounting).")
  # fit checked its dataset before this trace; train_on_batch declares.
  ledger.require_poisson_dataset(optimizer)
  return optimizer, replicated


def _verify_stage(model, optimizer, x, y):
  """Is the model the user wrote (batched) the model that per-unit
  evaluation trains? If not, fit raises after the step (whose release is
  private either way: it is not gated on this verdict, see :func:`_flagged`).

  Checked on the first run of every trace of the step, and on every step
  until a check passes: a new compile, new input shapes (a model may mix
  examples only at some batch size), a restored or re-used optimizer (its
  ``iterations`` says nothing of this model), a second ``fit`` after a
  refusal, and each step of a ``steps_per_execution`` loop whose first step
  failed. The trace's id is a constant of its graph; ``record.verified``
  holds the last id that passed (only one: traces that alternate, such as
  an epoch's last partial batch, are checked again at each switch)."""
  record = _record(model)
  trace = tf.constant(next(_TRACE_IDS), tf.int64)
  unchecked = tf.not_equal(record.verified, trace)
  consistent = tf.cond(
      unchecked,
      lambda: examples_independent(model, x, optimizer.num_microbatches,
                                   y=y),
      lambda: tf.constant(True))
  record.verified.assign(tf.where(unchecked & consistent, trace,
                                  tf.convert_to_tensor(record.verified)))
  return consistent


def _private_stage(model, optimizer, x, y, sample_weight, batch_size,
                   consistent, replicated):
  """Σ_u clip(g_u) (ghost norms or per-unit gradients), zeroed unless
  ``consistent``, released by the optimizer: ``(ClippedSum or None,
  unit_losses, y_pred)``. A privatizer that clips records itself (a DPQuery)
  gets them through :func:`_query_step`."""
  if optimizer.privatizer.clips_records:
    return _query_step(model, optimizer, x, y, sample_weight, batch_size,
                       consistent)
  result, unit_losses, y_pred = private_gradient_sum(
      model, x, y, sample_weight,
      optimizer.clip_spec(model.trainable_variables),
      optimizer.num_microbatches, _record(model).clipping)
  result = _flagged(consistent, result)
  num_units = tf.shape(unit_losses)[0]
  if replicated:
    replicas.release(optimizer, result, num_units, batch_size,
                     model.trainable_variables)
  else:
    optimizer.apply_private(result, num_units, batch_size,
                            model.trainable_variables)
  return result, unit_losses, y_pred


def _logs_stage(model, optimizer, x, y, y_pred, sample_weight, batch_size,
                result, unit_losses, consistent):
  """The step's logs: the loss over the real examples, the clipping counts,
  the optimizer's diagnostics, the query's metrics."""
  loss, loss_weight = tf.reduce_mean(unit_losses), batch_size
  counted = tf.shape(unit_losses)[0]
  if optimizer.expected_batch_size is not None:
    # The padding (weight 0) is no example: do not count it.
    real = tf.not_equal(_per_example_weights(sample_weight, batch_size), 0)
    counted = tf.reduce_sum(tf.cast(real, tf.int32))
    loss = tf.reduce_sum(unit_losses) / tf.cast(tf.maximum(counted, 1),
                                                unit_losses.dtype)
    loss_weight = counted
    _compat.mask_rows(y_pred, real)  # metrics= are not weighted by Keras
  _compat.loss_tracker(model).update_state(loss, sample_weight=loss_weight)
  if y is not None and (len(tf.nest.flatten(y)) != 1
                        or _compat.example_loss_fn(model) is None):
    # Per-output losses (a_loss, b_loss): Keras' compiled loss logs them as
    # it computes them, here from the units' own predictions (per unit it
    # runs without its trackers, _unit_losses).
    _compat.compiled_loss(model)(y, y_pred, sample_weight)
  record = _record(model)
  clipped_fraction, nonfinite, unverified = record.metrics
  if result is not None:  # (a DPQuery clips internally: no such counts)
    clipped_fraction.update_state(
        tf.cast(result.num_clipped, tf.float32)
        / tf.maximum(tf.cast(counted, tf.float32), 1.0),
        sample_weight=tf.cast(counted, tf.float32))
    nonfinite.update_state(tf.cast(result.num_nonfinite, tf.float32))
  unverified.update_state(tf.cast(
      ~consistent if result is None else result.mismatch, tf.float32))
  for name, value in optimizer.diagnostics().items():
    record.diagnostics[name].update_state(value)
  logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
  if result is not None:
    logs.update({m.name: m.result() for m in (clipped_fraction, nonfinite)})
  logs.update({name: record.diagnostics[name].result()
               for name in optimizer.diagnostics()})
  logs[_UNVERIFIED] = unverified.result()
  logs.update({f"dp_query_{name}": value
               for name, value in optimizer.query_metrics().items()})
  return logs


_STRATEGIES = ("MirroredStrategy", "MultiWorkerMirroredStrategy",
               "CollectiveAllReduceStrategy", "_DefaultDistributionStrategy",
               "OneDeviceStrategy")


def _check_strategy(strategy, optimizer):
  """True if the step runs on several synchronous replicas; refuses the
  strategies and combinations whose noise could not be added once."""
  kinds = {c.__name__ for c in type(strategy).__mro__}
  if not kinds & set(_STRATEGIES):
    raise NotImplementedError(
        f"Private training under {type(strategy).__name__} is not "
        "supported: tf_dpadambc adds the noise once per step across "
        "synchronous replicas (MirroredStrategy, MultiWorkerMirroredStrategy). "
        "Asynchronous or TPU strategies would need their own mechanism.")
  if strategy.num_replicas_in_sync == 1:
    return False
  refusal = optimizer.replica_refusal()
  if refusal:
    raise NotImplementedError(
        f"{optimizer.name} with {refusal} is not supported under "
        f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} "
        "replicas yet: train on one device (no strategy scope).")
  return True


def _flagged(consistent, result):
  """The clipped sum, marked as a mismatch where ``consistent`` is False.

  Not zeroed: the check compares the batched model with per-unit
  evaluation on the whole batch, so a release gated on it would be
  S·1[check] + N, and a model that mixes examples only when one of them is
  present flips it (a review: ‖S‖ = 6.4C for a bound of 2C). The sum is
  built from each unit evaluated alone (exact by construction, what it
  reads checked when traced), so it is private whatever the verdict; the
  verdict is a diagnostic the host raises on."""
  return result._replace(mismatch=result.mismatch | ~consistent)


def _query_step(model, optimizer, x, y, sample_weight, batch_size,
                consistent):
  """A step privatized by the optimizer's DPQuery.

  Queries that clip by L2 norm (Gaussian sum, adaptive clipping, normalized)
  take the usual clipped sum (ghost clipping where possible) and the per-unit
  norms; any other query gets per-unit gradients for its own
  ``preprocess_record`` (also with clipping="vectorized"). Units with a
  non-finite gradient, or whose examples all have weight 0 (padding), are
  not records (adaptive clipping would count them as unclipped).
  """
  weights = per_example.split_microbatches(
      _per_example_weights(sample_weight, batch_size),
      optimizer.num_microbatches)
  present = tf.reduce_any(tf.not_equal(weights, 0), axis=1)
  method = _record(model).clipping
  spec = (optimizer.query_clip_spec(model.trainable_variables)
          if method != "vectorized" else None)
  if spec is not None:
    result, unit_losses, y_pred = private_gradient_sum(
        model, x, y, sample_weight, spec, optimizer.num_microbatches, method)
    result = _flagged(consistent, result)
    optimizer.apply_query_clipped(result, tf.shape(unit_losses)[0],
                                  batch_size, model.trainable_variables,
                                  unit_mask=present)
    return result, unit_losses, y_pred
  grads, unit_losses, y_pred = per_unit_gradients(
      model, x, y, sample_weight, optimizer.num_microbatches)
  finite = tf.reduce_all(tf.stack([
      tf.reduce_all(tf.math.is_finite(tf.reshape(g, [tf.shape(g)[0], -1])),
                    axis=1) for g in grads]), axis=0)
  # (the records of the other units are zeroed after preprocessing)
  optimizer.apply_per_unit(grads, tf.shape(unit_losses)[0], batch_size,
                           model.trainable_variables,
                           unit_mask=finite & present)
  return None, unit_losses, y_pred


def _checked_train_function(model):
  """Wraps ``make_train_function`` so that an unverified step raises on the host.

  Such a step trained each example evaluated alone (private, but not the
  model written); here, right after it, training stops with an explanation.
  """
  make = model.make_train_function

  def make_train_function(force=False):
    if model.distribute_strategy.num_replicas_in_sync > 1 and model.jit_compile:
      # The replicas' clipped sums meet in one cross-replica release, which
      # XLA cannot compile across devices.
      logging.getLogger(__name__).warning(
          "Model '%s': private training on %d replicas compiles the train "
          "step without XLA (jit_compile=False).", model.name,
          model.distribute_strategy.num_replicas_in_sync)
      model.jit_compile = False
    if force or getattr(model, "train_function", None) is None:
      # What this train function is compiled with (a cached one keeps it).
      object.__setattr__(model, _MADE_WITH_XLA, bool(model.jit_compile))
    make(force)
    function = model.train_function
    if getattr(function, "_tf_dpadambc_checked", False):
      return function

    def checked(*args, **kwargs):
      if not checked.state_built:
        _compat.build_before_first_trace(model, args[0] if args else None)
        checked.state_built = True
      try:
        logs = function(*args, **kwargs)
      except Exception:
        if not checked.ran:
          # Refused while tracing (the model, the optimizer or the data):
          # the next call makes a new function instead of retracing this
          # one, whose aborted trace may have created variables.
          model.train_function = None
        raise
      checked.ran = True
      if float(logs.pop(_UNVERIFIED, 0.0)):
        raise RuntimeError(
            "The model's output or loss for an example depends on the other "
            "examples of its batch (checked on the first step of each traced "
            "train step: the batched forward pass did not reproduce each "
            "example's own output and loss). A layer, a Lambda or the loss "
            "mixes examples (statistics, shifts, lags or attention over axis "
            "0), or draws "
            "randomness Keras does not "
            "track (tf.random instead of keras.random with a SeedGenerator) "
            "in inference mode. Private training evaluates each example on "
            "its own, which trains a different model (that step did: its "
            "update was clipped and noised per example as usual, so privacy "
            "holds). Make every layer act on each example separately "
            "(e.g. LayerNormalization instead of statistics over the batch).")
      if not float(logs.get("dp_nonfinite_examples", 1.0)):
        del logs["dp_nonfinite_examples"]  # shown only when non-zero
      return logs
    checked._tf_dpadambc_checked = True  # pylint: disable=protected-access
    checked.state_built = False
    checked.ran = False
    model.train_function = checked
    return checked
  object.__setattr__(model, "make_train_function", make_train_function)


def _without_loss_scale_optimizer(model):
  """Replaces a Keras ``LossScaleOptimizer`` around a DP optimizer by the DP
  optimizer itself (logging a warning): its dynamic loss scale skips a step,
  and lowers the scale, when the batch's gradients overflow — a decision
  taken on the data outside the clipping, which private training must never
  make. The private step applies its own static scale instead."""
  optimizer = getattr(model, "optimizer", None)
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and isinstance(
      optimizer.inner_optimizer, base.DPOptimizer):
    logging.getLogger(__name__).warning(
        "Model '%s': the DP optimizer was wrapped in a LossScaleOptimizer; "
        "private training uses the DP optimizer itself with a static loss "
        "scale (make_private(loss_scale=...)): a dynamic scale skips steps "
        "depending on the data.", model.name)
    model.optimizer = optimizer.inner_optimizer


def _continue_accounting(model, before, optimizer):
  """A model compiled again with a new DP optimizer carries the releases of
  the DP optimizer it was last trained with in its weights, whatever was
  compiled in between: the new ledger composes that run (a review:
  recompiled after 3 epochs and fit 1 more, ε 4.73 reported for a model of
  10.73; the same with a non-DP compile in between)."""
  new = ledger.ledger_of(optimizer)
  if new is None:
    return
  record = _record(model)
  previous = (before if ledger.ledger_of(before) is not None
              else record.last_dp_optimizer)  # (before: e.g. a loaded one)
  record.last_dp_optimizer = optimizer
  if previous is None or previous is optimizer:
    return
  new.follow_run(getattr(previous, "keras_optimizer", previous))
  if new.prior_run is not None:
    logging.getLogger(__name__).warning(
        "%s continues the training of %s on this model: its ε includes "
        "that run's releases (they are in the weights).", optimizer.name,
        new.prior_run.name)


def _compile_without_loss_scaling(model):
  """``compile`` that never wraps the DP optimizer in a LossScaleOptimizer
  (Keras does so under ``mixed_float16`` unless ``auto_scale_loss=False``)."""
  compile_ = model.compile
  if getattr(compile_, "_tf_dpadambc_checked", False):
    return

  def compile(*args, **kwargs):  # pylint: disable=redefined-builtin
    kwargs.setdefault("auto_scale_loss", False)
    before = getattr(model, "optimizer", None)
    compile_(*args, **kwargs)
    _without_loss_scale_optimizer(model)
    _continue_accounting(model, before, getattr(model, "optimizer", None))
  compile._tf_dpadambc_checked = True  # pylint: disable=protected-access
  compile.__doc__ = compile_.__doc__
  object.__setattr__(model, "compile", compile)


def declared_train_on_batch(model):
  """Wraps ``model.train_on_batch``: a Poisson optimizer trains on batches
  that ``fit`` never checks only after ``tf_dpadambc.register_dataset``
  (``accounting.ledger.require_poisson_dataset``; the step traced by an
  earlier fit is reused, so the trace-time check alone would not run)."""
  train_on_batch = model.train_on_batch
  if getattr(train_on_batch, "_tf_dpadambc_checked", False):
    return

  def checked(*args, **kwargs):
    ledger.require_poisson_dataset(getattr(model, "optimizer", None))
    return train_on_batch(*args, **kwargs)
  checked._tf_dpadambc_checked = True  # pylint: disable=protected-access
  checked.__doc__ = train_on_batch.__doc__
  object.__setattr__(model, "train_on_batch", checked)


def check_overrides(model):
  """Raises ValueError if the model's class overrides ``train_step`` or
  ``compute_loss``: the private step replaces the first and evaluates the
  compiled loss on each unit instead of the second, so the user's code
  would silently not run (a review: a custom loss ignored without a word;
  KerasHub's contrastive and detection tasks override compute_loss)."""
  for name in ("train_step", "compute_loss"):
    if getattr(type(model), name) is not getattr(keras.Model, name):
      raise ValueError(
          f"{type(model).__name__}.{name} is overridden, and private "
          f"training would not run it: its step clips the gradient of the "
          f"compiled loss (compile(loss=...)) of each example evaluated "
          f"alone. Express the loss as a per-example compiled loss (a "
          f"function or keras.losses.Loss of (y_true, y_pred); per-example "
          f"penalties from the model go through layer.add_loss), and remove "
          f"the {name} override.")


def make_private(model, clipping="auto", loss_scale=None):
  """Gives a Keras 3 model a differentially private train step; returns it.

      model = tf_dpadambc.make_private(model)
      model.compile(optimizer=tf_dpadambc.DPAdamBC(l2_norm_clip=1.0,
                                                   noise_multiplier=1.1),
                    loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"])
      model.fit(x, y, batch_size=256, epochs=5)

  Every training step then clips each example's (or microbatch's) gradient
  and adds noise once per logical step, through the compiled DP optimizer.
  ``fit`` logs more metrics: ``dp_clipped_fraction`` (units whose norm
  exceeded C), ``dp_nonfinite_examples`` (units with a non-finite gradient,
  whose contribution was zeroed, summed over the epoch; logged only when
  non-zero) and, for adaptive
  optimizers, the epoch means of their diagnostics: ``dp_v_over_phi`` (mean
  v̂/Φ; ≈ 1 means the second moment is mostly DP noise),
  ``dp_clamped_fraction`` (bias correction: coordinates at the floor γ') and
  ``dp_negative_v_fraction`` (IME/JME: coordinates with v̂ < 0).

  ``clipping`` says how per-unit norms and the clipped sum are computed:
  ``"auto"`` (default) uses ghost norms with book-keeping (one forward and
  one backward pass, no per-example gradients; ``keras.ghost``) when the
  model allows it, with per-layer vectorized gradients for layers without a
  ghost rule, and otherwise vectorized per-unit gradients of the whole model,
  logging a warning that says why; ``"ghost"`` raises instead of falling
  back; ``"vectorized"`` always uses vectorized per-unit gradients.
  :func:`clipping_plan` shows the plan, per layer.

  Mixed precision (``mixed_float16``, ``mixed_bfloat16``, or per-layer
  dtype policies): variables, norms, clipping, noise and the update stay in
  float32 (norms of ghost clipping in float64). Under float16 compute each
  unit's backward pass runs on S·loss_u with a static power of two S
  (``loss_scale``; default 2**10 for float16, 1 otherwise), divided out
  exactly in float32 before any norm, so S never touches C or the noise σC.
  A unit whose scaled gradient overflows is zeroed alone (counted in
  ``dp_nonfinite_examples``); no step is ever skipped or rescaled depending
  on the data. Keras' ``LossScaleOptimizer`` (dynamic scaling) is not used:
  ``compile`` does not wrap the DP optimizer in one.

  Call it again after ``keras.models.load_model``: the train step is not
  saved with the model. Raises ``ValueError`` for layers that mix examples
  (BatchNormalization), and for a model class that overrides ``train_step``
  or ``compute_loss`` (:func:`check_overrides`: they would not run).
  """
  if not isinstance(model, keras.Model):
    raise TypeError(f"make_private expects a keras.Model; got {type(model)}.")
  if keras.backend.backend() != "tensorflow":
    raise ValueError("tf_dpadambc requires the TensorFlow backend of Keras 3 "
                     "(KERAS_BACKEND=tensorflow).")
  validation.check_model(model)
  check_overrides(model)
  if clipping not in _METHODS:
    raise ValueError(f"clipping={clipping!r}: use one of {_METHODS}.")
  record = _record(model)
  record.clipping, record.loss_scale = clipping, _check_loss_scale(loss_scale)
  _compile_without_loss_scaling(model)
  _without_loss_scale_optimizer(model)
  if not record.private:
    record.metrics = (keras.metrics.Mean(name="dp_clipped_fraction"),
                      keras.metrics.Sum(name="dp_nonfinite_examples"),
                      keras.metrics.Sum(name=_UNVERIFIED))
    # Epoch means of the optimizer's per-step diagnostics.
    record.diagnostics = {name: keras.metrics.Mean(name=name)
                          for name in core_diagnostics.NAMES}
    # Outside every tracker (the record is), so never saved or restored.
    record.verified = keras.Variable(
        -1, dtype="int64", trainable=False, name="dp_verified_trace",
        aggregation="only_first_replica")
    _compat.reset_metrics_too(
        model, record.metrics + tuple(record.diagnostics.values()))
    _checked_train_function(model)
    replicas.refuse_fit_across_workers(model)
    validation.refuse_log_driven_callbacks(model)
    declared_train_on_batch(model)
    ledger.track_fit(model)  # epochs and their batches, for the accounting
    record.private = True
  object.__setattr__(model, "train_step",
                     types.MethodType(_dp_train_step, model))
  model.train_function = None  # drop a step traced before make_private
  return model


def is_private(model):
  """True if ``make_private`` was applied to this model."""
  record = model.__dict__.get(_RECORD)
  return isinstance(record, ModelRecord) and record.private
