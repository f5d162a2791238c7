"""tf_keras (Keras 2) adapters of the private optimizers.

Each class here is a ``tf_keras.optimizers.Optimizer`` that drives one of our
Keras 3 optimizers (:class:`tf_dpadambc.keras.optimizers.base.DPOptimizer`,
the *inner* optimizer): the inner optimizer holds every variable and every
formula (noise, moments, Φ, accounting); the adapter only turns tf_keras'
``minimize(loss, var_list, tape)`` into a clipped sum:

1. ``loss`` is the per-example loss vector [B] that tf_keras' ``train_step``
   passes when the compiled loss has ``reduction=NONE`` (a scalar is refused);
2. units: examples, or M microbatches (the mean loss of B/M examples each);
3. per-unit gradients by *per-unit evaluation*: each unit's loss is computed
   from that unit's examples alone (``tf.vectorized_map`` over units; where an
   op cannot be vectorized, ``tf.map_fn``), so its gradient depends on its
   own examples only, whatever the model does across a batch. ``fit`` with
   tf_keras' stock ``Model.train_step`` gets it automatically (x, y,
   sample_weight and the compiled loss are taken from the ``train_step``
   frame); custom train steps and loops call :meth:`minimize_per_unit`;
4. ``inner.apply_per_unit(per_unit_grads, units, B, var_list)``: clipped and
   summed by ``core.clipping.materialized_clipped_sum`` under the inner
   optimizer's ``clip_spec``, then ``apply_private``: noise N(0, σ²C²) once
   per logical step, ḡ = (Σ_u clip_C(g_u) + noise)/units, the update.

The jacobian of the batch's loss vector (TF-Privacy's method) is a set of
per-example gradients only if no layer mixes the examples of the batch (batch
statistics, another example's features, ...), which cannot be checked: it is
refused unless the optimizer is built with ``assume_examples_independent=True``
(an explicit opt-out that removes the privacy guarantee for models that mix).

``fit``'s per-unit evaluation is also checked every step against the losses
tf_keras recorded (in inference mode when the model draws random numbers): a
mismatch means the model mixes examples, so per-unit gradients are not the
gradients of the loss being trained. It is counted in a variable, which the
host reads after the step to raise (no assert op, which XLA would drop). It
does not gate the release: each unit is evaluated alone, so the step is
private either way, while a release gated on a check of the whole batch is
not (S·1[check] + N: one example flips the check).

Cost: per-unit evaluation runs one forward and backward pass per unit,
vectorized, O(B); the jacobian back-propagates through the whole batch once
per unit, O(U·B). TF-Privacy's tutorial CNN, batch 250, 2 CPU cores: 250
microbatches 0.27 s/step vectorized vs 9.7 s jacobian, 25 microbatches
0.085 s vs 0.80 s (``per_unit_plan`` says how a step was computed).

``apply_gradients`` raises: aggregated gradients were neither clipped per
example nor noised. Classes are generated from the Keras 3 classes (one per
class, same name and arguments); ``DPKerasSGDOptimizer``,
``DPKerasAdamOptimizer`` and ``DPKerasAdagradOptimizer`` take TF-Privacy's
constructor signature.
"""
import logging
import sys
import threading
import weakref

import keras
import tensorflow as tf
import tf_keras

from tf_dpadambc.core import clipping
from tf_dpadambc.core import ghost
from tf_dpadambc.core import graph
from tf_dpadambc.core import per_example
from tf_dpadambc.keras import optimizers as keras3_optimizers
from tf_dpadambc.keras import replicas
from tf_dpadambc.keras import training as keras3_training
from tf_dpadambc.keras import validation
from tf_dpadambc.keras.optimizers import base
from tf_dpadambc.tf_keras import _compat
from tf_dpadambc.tf_keras import guards

PACKAGE = "tf_dpadambc"

_AGGREGATED_GRADIENTS_ERROR = (
    "{name} received aggregated gradients through `apply_gradients`. Those "
    "gradients were not clipped per example nor noised, so applying them "
    "would train without differential privacy. Compile the model with a "
    "per-example loss and let `fit` call `minimize`:\n\n"
    "    loss = tf.keras.losses.CategoricalCrossentropy(\n"
    "        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)\n"
    "    model.compile(optimizer={name}(...), loss=loss)\n\n"
    "or, in a custom train step or loop, call `optimizer.minimize_per_unit("
    "loss_fn, (x, y), var_list)` with `loss_fn((x, y))` returning the "
    "per-example losses of a batch. "
    "(Mixed-precision loss scaling wraps the optimizer and calls "
    "`apply_gradients`: it is not supported.)")

_MIXED_PRECISION_ERROR = (
    "tf_dpadambc's tf_keras adapter does not support mixed precision "
    "({what}): tf_keras' LossScaleOptimizer scales the batch's aggregated "
    "loss and skips steps when it overflows (a decision on the data outside "
    "the clipping), and per-unit evaluation in float16/bfloat16 is not "
    "checked here. Build the model under tf_keras.mixed_precision."
    "set_global_policy('float32'), or use Keras 3 with "
    "tf_dpadambc.make_private, which supports mixed_float16 and "
    "mixed_bfloat16 (static loss scale, float32 clipping and noise).")

_SCALAR_LOSS_ERROR = (
    "{name}.minimize received a scalar loss: the loss was reduced over the "
    "batch, and per-example gradients cannot be recovered from it. As with "
    "TF-Privacy's DP optimizers, compile the model with a loss that is not "
    "reduced, e.g.\n\n"
    "    loss = tf.keras.losses.CategoricalCrossentropy(\n"
    "        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)\n")

_CROSS_EXAMPLE_ERROR = (
    "Layer '{layer}' ({cls}) normalizes with statistics of the whole batch "
    "and updates its moving statistics from the data without noise: the "
    "jacobian of the batch's losses is then not a per-example gradient, and "
    "one example's influence is not bounded by clipping. Differentially "
    "private training cannot use it; replace it with LayerNormalization or "
    "GroupNormalization (per-example normalizations).")

_MIXING_ERROR = (
    "tf_dpadambc: {count} training step(s) refused. Evaluated on each example "
    "(or microbatch) alone, the model did not give the losses it gave on the "
    "whole batch{mode}: a layer mixes the examples of a batch (batch "
    "statistics, features of other examples, ...), or draws random numbers "
    "in inference mode or outside tf.random/Keras layers. Per-example "
    "gradients are then not the gradients of the loss being trained. Those "
    "steps trained each example's loss evaluated alone (clipped and noised: "
    "privacy holds), a model other than the one written: remove or fix that "
    "layer. (A custom "
    "train step may call optimizer.minimize_per_unit(loss_fn, data, "
    "var_list), which trains each example's loss evaluated alone, without "
    "this comparison.)")

_JACOBIAN_ERROR = (
    "tf_dpadambc: {name}.minimize cannot evaluate each example alone here "
    "({why}). The only other way, the jacobian of the batch's loss vector "
    "(TF-Privacy's), yields per-example gradients only if no layer mixes the "
    "examples of a batch (batch statistics, another example's features, "
    "...): nothing checks that, and one example's influence would then not "
    "be bounded by clipping, so it is refused. Either\n"
    "  * train with model.fit and tf_keras' own train_step (no custom "
    "train_step, compute_loss or __call__ override; compiled loss with "
    "reduction=NONE), or\n"
    "  * in a custom train step or loop, call\n"
    "      optimizer.minimize_per_unit(loss_fn, (x, y), var_list)\n"
    "    with loss_fn((x, y)) returning the per-example losses of a batch: "
    "each example (or microbatch) is evaluated alone, exact for any model, "
    "or\n"
    "  * if you are certain that every example's loss depends on that "
    "example alone, build the optimizer with assume_examples_independent="
    "True. That removes the differential-privacy guarantee for any model "
    "that does mix examples.")

_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
_PENDING = threading.local()  # the batched pass a release checks first


def _handles(variable):
  """The resource handles of ``variable``: of each replica's component for
  a distributed one (a metric's sum under MirroredStrategy)."""
  found = []
  for part in (*getattr(variable, "values", ()), variable):
    try:
      found.append(part.handle)
    except (AttributeError, ValueError, RuntimeError):
      continue
  return found
# The ops of this adapter's own releases, per traced graph: their writes
# (the noised update) are not the batch's.
_OWN_UPDATES = weakref.WeakKeyDictionary()

_STATE_ERROR = (
    "tf_dpadambc: the model writes state (variables, hash tables, random "
    "generators, queues; or, evaluated in a loop, runs Python) during its "
    "forward pass ({ops}). Evaluated per example, the examples would share "
    "that state, and "
    "state written from the data between steps is released without noise: "
    "differentially private training cannot use such a layer (for batch "
    "normalization use LayerNormalization or GroupNormalization). Remove "
    "the write or the layer. (In minimize_per_unit's loss_fn, use a loss "
    "object, not model.compiled_loss: it updates metric variables.)")

_OUTSIDE_DATA_ERROR = (
    "tf_dpadambc: the loss evaluated on each example (or microbatch) alone "
    "reads data other than that unit's: {reads}. A unit's loss must be "
    "computed from the unit it is given and the model: one that reads the "
    "whole batch (the train step's x or y, a dataset, a tensor captured "
    "from outside) depends on the other examples, every unit then gets the "
    "batch's gradient, and clipping bounds no example's influence. In "
    "minimize_per_unit, compute the loss from loss_fn's argument only:\n\n"
    "    losses = self.optimizer.minimize_per_unit(\n"
    "        lambda batch: loss_object(batch[1], self(batch[0], "
    "training=True)),\n"
    "        (x, y), self.trainable_variables)\n\n"
    "and pass per-example tensors (sample weights, ...) in `data`. A tensor "
    "made eagerly outside loss_fn and captured (e.g. class weights from "
    "tf.constant outside it) cannot be told apart from captured data and is "
    "refused too: create it inside loss_fn (tf.constant(...) there is a "
    "constant of the step), or hold it in the model (a layer's attribute or "
    "a non-trainable variable).")

# Relative agreement required between per-unit losses and tf_keras' batched
# ones: per-example and batched kernels may round differently (equal on CPU;
# TF32 on GPUs rounds inputs to ~5e-4), while a layer mixing examples or
# drawing other random values moves them far more.
_AGREEMENT_TOL = 1e-3

# What the accounting, the callbacks and users read from the inner optimizer.
_FORWARDED = (
    "l2_norm_clip", "noise_multiplier", "num_microbatches",
    "accumulation_steps", "seed", "clipping", "noise", "sensitivity",
    "is_private", "is_correlated", "built", "noise_variance", "diagnostics",
    "steps_taken", "logical_batch_size", "dp_event", "expected_batch_size",
    "effective_noise_multiplier", "accounted_noise_multiplier",
    "accounting_reason", "logical_steps_per_epoch", "clip_spec",
    "exclude_from_weight_decay")


class TFKerasDPOptimizer(tf_keras.optimizers.Optimizer):
  """A tf_keras optimizer that drives one of our Keras 3 DP optimizers.

  Use the generated classes (``tf_dpadambc.tf_keras.DPAdamBC(...)``, same
  arguments as the Keras 3 class, plus ``assume_examples_independent``) or
  :meth:`wrap` an existing Keras 3 optimizer. The model must be compiled
  with a per-example loss (``reduction=NONE``): tf_keras' ``train_step``
  then passes the loss vector and its tape to :meth:`minimize`, which clips
  each unit's gradient (example, or microbatch with ``num_microbatches``)
  and hands the clipped sum to the inner optimizer. The noise, the update
  and the accounting are the inner optimizer's: ḡ = (Σ_u clip_C(g_u) +
  N(0, σ²C² I)) / U with U units (TF-Privacy's semantics: noise σC on the
  sum of clipped microbatch means, divided by the number of microbatches).

  Per-unit gradients come from per-unit evaluation (each unit's loss from
  its own examples alone, see :meth:`_per_unit_gradients`): by
  construction, one example moves only its own unit's gradient, which
  clipping bounds. ``fit`` with tf_keras' stock ``train_step`` (also with
  ``jit_compile=True``, ``run_eagerly=True``, dropout or other random
  layers) gets it automatically; custom train steps and loops call
  :meth:`minimize_per_unit`. :meth:`minimize` called any other way (a custom
  ``train_step``, a callable loss, ``vectorize = False``) would need the
  jacobian of the batch's loss vector, which is per-example only if the
  model never mixes examples: it raises ``ValueError`` unless the optimizer
  was built with ``assume_examples_independent=True``, an explicit opt-out
  that removes the privacy guarantee for models that do mix examples.

  ``fit``'s per-unit losses are compared every step with the losses tf_keras
  recorded on the batch (both in inference mode when the model draws random
  numbers). A mismatch (a layer mixes examples: lag features, batch
  centring, ...) is counted in :attr:`refused_steps` (the step's release is
  not gated on it: each unit was evaluated alone, so its clipped gradient is
  private either way, and a release gated on a check of the whole batch
  would not be); the host then raises
  ``RuntimeError`` (after that step's call of the train function, or at the
  end of its epoch; in eager mode at once). No assert op is involved: it
  works under XLA. A model that writes variables in its forward pass is
  refused (``ValueError``) when the step is traced.

  Models with batch normalization are refused at the first step: the
  adapter looks for the model that calls ``minimize`` on the Python stack
  (``self`` in ``Model.train_step``, or a local model that is compiled with
  this optimizer or owns the variables being trained) and checks its layers;
  inside a traced step it also refuses any fused batch normalization in
  training mode found in the graph of the loss.

  Not supported (they raise): ``apply_gradients`` (aggregated gradients),
  mixed-precision loss scaling (it calls ``apply_gradients``), and under
  several replicas (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``)
  a DPQuery, a public preconditioner or correlated noise. Under several
  replicas each replica clips its own units and the noise is drawn once per
  step for all of them (``keras.replicas.release``).

  The inner optimizer is :attr:`keras_optimizer`; its accounting is
  forwarded (``dp_event``, ``steps_taken``, ``logical_batch_size``,
  ``diagnostics()``, ...), so ``tf_dpadambc.optimizer_privacy_statement``
  and ``tf_dpadambc.tf_keras.PrivacyBudget`` work on this optimizer.
  """

  # The Keras 3 class the generated subclasses construct.
  keras3_class = None
  # False: the jacobian path (only with assume_examples_independent=True).
  vectorize = True

  def __init__(self, *args, assume_examples_independent=False, **kwargs):
    if self.keras3_class is None:
      raise TypeError(
          "TFKerasDPOptimizer is abstract: use one of the classes of "
          "tf_dpadambc.tf_keras (DPSGD, DPAdamBC, ...) or "
          "TFKerasDPOptimizer.wrap(keras3_optimizer).")
    self._init_from(self.keras3_class(*args, **kwargs),
                    assume_examples_independent)

  @classmethod
  def wrap(cls, optimizer, assume_examples_independent=False):
    """A tf_keras optimizer driving an existing Keras 3 ``DPOptimizer``."""
    if not isinstance(optimizer, base.DPOptimizer):
      raise TypeError(
          "wrap() needs a tf_dpadambc Keras 3 optimizer (DPSGD, DPAdamBC, "
          f"...); got {type(optimizer).__name__}.")
    if cls.keras3_class is not None and not isinstance(optimizer,
                                                       cls.keras3_class):
      raise TypeError(f"{cls.__name__} wraps {cls.keras3_class.__name__}; "
                      f"got {type(optimizer).__name__}.")
    self = cls.__new__(cls)
    self._init_from(optimizer, assume_examples_independent)  # pylint: disable=protected-access
    return self

  def _init_from(self, inner, assume_examples_independent=False):
    # The tf_keras base only gets a name: every hyper-parameter (weight
    # decay, EMA, gradient clipping) belongs to the inner optimizer.
    super().__init__(name=inner.name)
    # Not a checkpoint dependency: its accumulated clipped sums (gradient
    # accumulation) are not noised yet and must not be written to files.
    # The rest of its state is tracked through `_variables` (see build).
    self._inner = self._no_dependency(inner)
    if not isinstance(assume_examples_independent, bool):
      raise TypeError("assume_examples_independent must be True or False.")
    self.assume_examples_independent = assume_examples_independent
    self._plan = None
    self._check_mode = "training"
    self._reported_refusals = 0
    self._eager_cache = None
    if inner.built:
      self._track_inner_state()

  def _create_iteration_variable(self):
    pass  # the inner optimizer counts the (logical) steps

  @property
  def keras_optimizer(self):
    """The Keras 3 ``DPOptimizer`` that holds the state and the formulas."""
    return self._inner

  @property
  def iterations(self):
    """Logical private steps taken (noise releases): the inner counter."""
    return self._inner.iterations.value

  @property
  def learning_rate(self):
    lr = self._inner.learning_rate
    return getattr(lr, "value", lr)  # the tf.Variable behind a Keras 3 one

  @learning_rate.setter
  def learning_rate(self, value):
    self._inner.learning_rate = value

  # -------------------------------------------------------------- state
  def build(self, var_list):
    """Builds the inner optimizer's variables, outside any traced function
    (in the strategy's scope: see ``keras.replicas.build``)."""
    if self._inner.built:
      return
    replicas.build(self._inner, list(var_list))
    self._track_inner_state()

  def _track_inner_state(self):
    # Extended in place: tf_keras caches the list object it checkpoints.
    self._variables.extend(
        v.value for v in self._inner._saved_variables())  # pylint: disable=protected-access

  def save_own_variables(self, store):
    self._inner.save_own_variables(store)

  def load_own_variables(self, store):
    self._inner.load_own_variables(store)

  def finalize_variable_values(self, var_list):
    self._inner.finalize_variable_values(list(var_list))

  # ---------------------------------------------------------- the guard
  def apply_gradients(self, grads_and_vars, *args, **kwargs):
    if _called_by_loss_scale_optimizer():
      raise ValueError(_MIXED_PRECISION_ERROR.format(
          what="the optimizer is wrapped in a LossScaleOptimizer, as "
          "compile does under mixed_float16"))
    raise RuntimeError(
        _AGGREGATED_GRADIENTS_ERROR.format(name=type(self).__name__))

  def update_step(self, gradient, variable):
    raise RuntimeError(
        _AGGREGATED_GRADIENTS_ERROR.format(name=type(self).__name__))

  # -------------------------------------------------- the private path
  def minimize(self, loss, var_list, tape=None):
    """One private step from per-example losses.

    Exact (each unit evaluated alone) when tf_keras' stock
    ``Model.train_step`` calls it; called any other way it needs the
    jacobian of ``loss`` and raises ``ValueError`` unless the optimizer was
    built with ``assume_examples_independent=True`` (custom train steps:
    use :meth:`minimize_per_unit`).

    Args:
      loss: the per-example loss, a tensor [B] (or [B, ...], averaged over
        the other axes) recorded on ``tape``; or a callable returning it.
        A scalar is refused.
      var_list: the trainable variables (or a callable returning them).
      tape: the ``tf.GradientTape`` that recorded ``loss``.
    """
    name = type(self).__name__
    if not callable(loss) and tape is None:
      raise ValueError(f"{name}.minimize: `tape` is required when a Tensor "
                       "loss is passed.")
    tape = tape if tape is not None else tf.GradientTape()
    if callable(loss):
      with tape:
        if not callable(var_list):
          tape.watch(var_list)
        loss = loss()
    if callable(var_list):
      var_list = var_list()
    var_list = list(var_list)
    loss = tf.convert_to_tensor(loss)
    if loss.shape.rank == 0:
      raise ValueError(_SCALAR_LOSS_ERROR.format(name=name))
    self._check_model(var_list, loss)
    replicated = self._replicated()
    self.build(var_list)

    with tape:  # the reduction to units must be on the tape too
      examples = _example_losses(loss)
      unit_losses = self._unit_losses(examples)
    per_unit, keep = self._per_unit_gradients(loss, tape, unit_losses,
                                              var_list)
    num_units = tf.shape(unit_losses)[0]
    # The verdict (keep) does not gate the release: a sum released only
    # where a check on the whole batch passes is S·1[check] + N, and one
    # example can flip the check (a review: ‖S‖ = 6.4C for a bound of 2C).
    # Each unit was evaluated alone: its clipped gradient is private either
    # way; a mismatch is reported by the host (refused_steps).
    self._apply_per_unit(per_unit, num_units, tf.shape(examples)[0],
                         var_list, None, replicated)
    if keep is not None and tf.executing_eagerly():
      self._raise_if_refused()

  def minimize_per_unit(self, loss_fn, data, var_list):
    """One private step, each unit's loss evaluated on its examples alone.

    For custom train steps and loops (``minimize`` with a tape is refused
    there): ::

        def train_step(self, data):
          x, y = data
          losses = self.optimizer.minimize_per_unit(
              lambda batch: loss_object(batch[1], self(batch[0],
                                                       training=True)),
              (x, y), self.trainable_variables)
          return {"loss": tf.reduce_mean(losses)}

    ``loss_fn(batch)`` returns the losses of ``batch``, a structure like
    ``data`` (tensors with the batch on axis 0, None kept): per example
    ([b] or [b, ...]) or their mean; a unit's loss is the mean of what it
    returns. Use a loss object, not ``compiled_loss`` (which updates metric
    variables: refused). It is called on each unit (one example, or one
    microbatch of B/M examples) alone, vectorized over units
    (``tf.map_fn`` where TensorFlow cannot vectorize an op), in a
    ``tf.function`` when called eagerly: each unit's gradient depends on its
    own examples only, whatever the model does across a batch, so clipping
    bounds every example's influence. Random layers draw their values
    independently of the data: still exact. A model that writes variables
    in its forward pass is refused (``ValueError``), and so is a ``loss_fn``
    that reads anything but its argument and the model (the outer batch, a
    tensor captured from eager that the model does not hold: see
    :meth:`_map_units`).

    Returns the [U] unit losses (means over each unit's examples).
    """
    if callable(var_list):
      var_list = var_list()
    var_list = list(var_list)
    self._check_model(var_list, None)
    replicated = self._replicated()
    self.build(var_list)
    model = _compat.calling_model(self, var_list)
    num_microbatches = self._inner.num_microbatches
    first = tf.nest.flatten(data)[0]
    num_examples = tf.shape(first)[0]

    def compute(batch):
      grads, losses, _, how = self._map_units(
          lambda unit: tf.reduce_mean(loss_fn(unit)), var_list, batch,
          num_microbatches, model)
      self._plan = f"{how} (minimize_per_unit)"
      return grads, losses

    if tf.executing_eagerly():
      compute = self._eager_function(
          ("minimize_per_unit", loss_fn, num_microbatches, *var_list),
          compute)
    grads, losses = compute(data)
    self._apply_per_unit(grads, tf.shape(losses)[0], num_examples, var_list,
                         None, replicated)
    return losses

  def _replicated(self):
    """True under several synchronous replicas; refuses the strategies and
    options whose noise could not be added once (as Keras 3's step does)."""
    return keras3_training._check_strategy(  # pylint: disable=protected-access
        tf.distribute.get_strategy(), self._inner)

  def _apply_per_unit(self, per_unit, num_units, num_examples, var_list,
                      unit_mask, replicated):
    """Clips and sums this replica's units; one private release per step:
    here (one replica), or of all replicas' sums (``keras.replicas.release``:
    global Σ clip_C(g_u), noise σC drawn once, divided by the global count)."""
    self._check_batched_writes()
    trace = None if tf.executing_eagerly() else (
        tf.compat.v1.get_default_graph())
    start = 0 if trace is None else len(trace.get_operations())
    try:
      self._release_per_unit(per_unit, num_units, num_examples, var_list,
                             unit_mask, replicated)
    finally:
      if trace is not None:  # this release's writes (noised): not the data's
        _OWN_UPDATES.setdefault(trace, set()).update(
            op.name for op in trace.get_operations()[start:])

  def _release_per_unit(self, per_unit, num_units, num_examples, var_list,
                        unit_mask, replicated):
    if not replicated:
      # Every caller's rows are per unit: evaluated alone (_map_units), or
      # the jacobian of an optimizer built with assume_examples_independent.
      self._inner.apply_per_unit(per_example.assume_per_unit(per_unit),
                                 num_units, num_examples, var_list,
                                 unit_mask=unit_mask)
      return
    result = clipping.materialized_clipped_sum(
        [g if unit_mask is None else ghost.masked(g, unit_mask)
         for g in per_unit], self._inner.clip_spec(var_list))
    replicas.release(self._inner, result, num_units, num_examples, var_list)

  def _unit_losses(self, examples):
    """[B] per-example losses -> [U] unit losses (microbatch means)."""
    m = self._inner.num_microbatches
    if m is not None and examples.shape[0] is None:
      # fit's batch size is not static; the last batch may be partial. (Not
      # a privacy check: the reshape into units fails on such a batch
      # anyway; this says why.)
      check = tf.debugging.assert_equal(
          tf.shape(examples)[0] % m, 0, message=(
              f"num_microbatches={m} does not divide this batch's size: use "
              "batch sizes that are multiples of num_microbatches and drop "
              "the last partial batch (e.g. N a multiple of batch_size, or "
              "tf.data's batch(..., drop_remainder=True))."))
      # Before any reshape of the batch (here or in the per-unit path).
      with tf.control_dependencies([check]):
        examples = tf.identity(examples)
    return tf.reduce_mean(per_example.split_microbatches(examples, m), axis=1)

  # ------------------------------------------------ per-unit gradients
  @property
  def per_unit_plan(self):
    """How the last traced step computed per-unit gradients: each unit
    evaluated alone, "vectorized" (or "vectorized, some ops looped", "loop"
    where TensorFlow cannot vectorize an op; ", checked in inference mode"
    for a model that draws random numbers; " (minimize_per_unit)"), or
    "jacobian: " and why per-unit evaluation was not possible (only with
    ``assume_examples_independent=True``)."""
    return self._plan

  @property
  def vectorized_steps(self):
    """Physical ``fit`` steps whose per-unit gradients came from per-unit
    evaluation (vectorized or looped) of the stock ``train_step``."""
    counter = getattr(self, "_vectorized_steps", None)
    return 0 if counter is None else int(counter.numpy())

  @property
  def refused_steps(self):
    """Physical steps whose per-unit check failed (a diagnostic: their
    releases were private, per-unit evaluated)."""
    counter = getattr(self, "_refused_steps", None)
    return 0 if counter is None else int(counter.numpy())

  def _raise_if_refused(self):
    """Raises (on the host) if steps were refused since the last report."""
    count = self.refused_steps
    if count > self._reported_refusals:
      self._reported_refusals = count
      mode = (" (compared in inference mode, training=False, as the model "
              "draws random numbers)" if self._check_mode == "inference"
              else "")
      raise RuntimeError(_MIXING_ERROR.format(count=count, mode=mode))

  def _per_unit_gradients(self, loss, tape, unit_losses, var_list):
    """``([U, ...] gradients, keep)`` of ``unit_losses`` w.r.t. ``var_list``.

    Per-unit evaluation, for ``minimize`` called by tf_keras' stock
    ``Model.train_step`` (traced or eager) with a compiled loss of
    ``reduction=NONE``: each unit's loss is ``loss(y_u, model(x_u,
    training=True), sample_weight_u)`` of its own examples, evaluated alone
    by :meth:`_map_units`, and its gradient taken there. One example then
    changes only its own unit's gradient: clipping bounds its influence, by
    construction. ``keep`` (a scalar bool tensor) says whether those losses
    match the ones tf_keras recorded on the whole batch, ``unit_losses``
    (for a model that draws random numbers, whose per-unit draws differ from
    the batch's: both in inference mode); if not, examples mix and the
    gradients are not those of the trained loss (reported, not gated).

    Otherwise (custom ``train_step``, callable loss, ``compute_loss``
    override, ``vectorize = False``, ...) the jacobian of ``unit_losses``
    (``keep`` None), only with ``assume_examples_independent=True``: else
    ``ValueError``.
    """
    fast, why = self._stock_step_per_unit(loss, tape, unit_losses, var_list)
    if fast is not None:
      return fast
    if not self.assume_examples_independent:
      raise ValueError(_JACOBIAN_ERROR.format(name=type(self).__name__,
                                              why=why))
    self._plan = f"jacobian: {why} (assume_examples_independent=True)"
    return tape.jacobian(
        unit_losses, var_list, experimental_use_pfor=True,
        unconnected_gradients=tf.UnconnectedGradients.ZERO), None

  def _stock_step_per_unit(self, loss, tape, unit_losses, var_list):
    """``((grads, keep), None)`` by per-unit evaluation of the stock
    ``train_step``'s batch, or ``(None, why not)``."""
    if not self.vectorize:
      return None, "vectorize=False"
    step, why = _compat.stock_train_step(self, loss, tape)
    loss_fn = None
    if step is not None:
      loss_fn, why = _compat.compiled_loss_fn(step.model, step.y,
                                              step.sample_weight)
    if loss_fn is not None and {id(v) for v in var_list} != {
        id(v) for v in step.model.trainable_variables}:
      loss_fn, why = None, "var_list is not the model's trainable variables"
    if loss_fn is None:
      return None, why

    model = step.model
    data = {"x": step.x, "y": step.y}
    if step.sample_weight is not None:
      data["sample_weight"] = step.sample_weight
    num_microbatches = self._inner.num_microbatches
    self._count_steps()

    def unit_mean(batch, y_pred):
      value = loss_fn(batch["y"], y_pred, batch.get("sample_weight"))
      return tf.reduce_mean(_example_losses(value))

    def compute(data, recorded):
      grads, losses, ops, how = self._map_units(
          lambda unit: unit_mean(unit, model(unit["x"], training=True)),
          var_list, data, num_microbatches, model)
      if _compat.draws_random(ops):
        # Per-unit draws differ from the batch's: compare without them.
        self._check_mode = "inference"
        _, alone, _, _ = self._map_units(
            lambda unit: unit_mean(unit, model(unit["x"], training=False)),
            None, data, num_microbatches, model)
        batch_pred = model(data["x"], training=False)
        value = loss_fn(data["y"], batch_pred, data.get("sample_weight"))
        together = tf.reduce_mean(per_example.split_microbatches(
            _example_losses(value), num_microbatches), axis=1)
        how += ", checked in inference mode"
      else:
        self._check_mode = "training"
        alone, together = losses, recorded
      keep = clipping.losses_agree(tf.cast(together, tf.float32),
                                   tf.cast(alone, tf.float32),
                                   rtol=_AGREEMENT_TOL)
      self._refused_steps.assign_add(tf.cast(~keep, tf.int64))
      self._vectorized_steps.assign_add(1)
      self._plan = how
      return grads, keep

    with tf.control_dependencies([unit_losses]):  # divisibility checked
      data = tf.nest.map_structure(
          lambda t: t if t is None else tf.identity(t), data)
    if tf.executing_eagerly():
      compute = self._eager_function(
          ("fit", model, model.compiled_loss, num_microbatches, *var_list),
          compute)
    else:
      _compat.install_host_check(model, self._raise_if_refused)
    grads, keep = compute(data, tf.stop_gradient(unit_losses))
    return (grads, keep), None

  def _map_units(self, unit_loss, var_list, data, num_microbatches, model):
    """Evaluates ``unit_loss(unit)`` on each unit of ``data`` alone (and its
    gradient w.r.t. ``var_list`` unless None).

    ``data`` (a structure of [B, ...] tensors, None leaves kept) is split
    into units of one example, or ``num_microbatches`` microbatches.
    ``tf.vectorized_map`` over units (strict, then with TensorFlow's per-op
    loops where every shape is static), else ``tf.map_fn``: in every case each unit is computed from its
    own slice of ``data`` only. A model that writes variables in the
    evaluated code would share that state across units: ``ValueError``.

    That holds only if ``unit_loss`` reads its unit and nothing else that
    depends on the data: a loss that closes over the outer batch (a custom
    train step's ``x``) gives every unit the batch's gradient. So every
    tensor the traced unit function takes from outside itself must come
    from constants and the model alone (``graph.outside_data``: followed
    through captures, calls and branches): its variables and tables, and
    the eager tensors its layers hold (normalization statistics, lookup
    defaults). A tensor derived from ``data``, an input of the enclosing
    function (a train step's batch), an iterator's element, a stateful op's
    output, or another tensor captured from eager (the batch of an eager
    loop, or a constant made outside: they cannot be told apart) is refused
    (``ValueError``) before any update. Under ``tf.vectorized_map`` the unit
    function is traced in the enclosing graph (or, under XLA, a function
    capturing from it), under ``tf.map_fn`` in a loop body capturing from
    it: checked at the end of each trace, while its captures are recorded.
    NumPy arrays closed over become constants of the trace: not found.

    Returns ``(grads or None, losses [U] float32, ops, how)``; ``ops`` are
    the ops of the unit function as traced (to look for random draws).
    """
    leaves = tf.nest.flatten(data)
    present = [i for i, t in enumerate(leaves) if t is not None]
    units = [per_example.split_microbatches(leaves[i], num_microbatches)
             for i in present]
    recorded, reads = [], []
    # Constants the model holds as eager tensors (normalization statistics,
    # lookup defaults) are read from outside too; anything else captured
    # from eager might be data (the batch of an eager loop).
    held = _held_tensors(model)

    unit_inputs = []  # every trace's unit tensors (for state_writes)

    def alone(unit_leaves):
      unit_inputs.extend(unit_leaves)
      unit = [None] * len(leaves)
      for i, t in zip(present, unit_leaves):
        unit[i] = t
      unit = tf.nest.pack_sequence_as(data, unit)
      trace = tf.compat.v1.get_default_graph()
      start = len(trace.get_operations())
      if var_list is None:
        loss, grads = unit_loss(unit), []
      else:
        with tf.GradientTape() as tape:
          tape.watch(var_list)
          loss = unit_loss(unit)
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(
            loss, var_list,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)]
      everything = trace.get_operations()
      ops = everything[start:]
      recorded.extend(ops)
      # While the trace is open: its captures say what came from outside.
      reads.extend(_inspect(graph.outside_data)(
          ops, unit_leaves, [leaves[i] for i in present], held))
      # And what the step wrote from the batch before, where units read it.
      reads.extend(f"{write} writes the batch into a variable the loss reads"
                   for write in _inspect(graph.written_from_data)(
                       ops, graph.ops_before(trace, start),
                       [leaves[i] for i in present], held,
                       trained=[v.handle for v in var_list or []
                                if hasattr(v, "handle")]))
      return grads, tf.cast(loss, tf.float32)

    signature = ([tf.TensorSpec(v.shape, v.dtype.base_dtype)
                  for v in var_list or []], tf.TensorSpec([], tf.float32))
    def looped_ops_if_static():
      # TensorFlow's per-op while-loop fallback stacks each unit's result of
      # an op it cannot vectorize: under XLA a result whose shape is not
      # static took the LAST unit's shape for every unit (tf.boolean_mask:
      # a review released 8C between neighbours, with no error). Only where
      # every op of the unit's trace has a static shape; else looped whole.
      start = len(recorded)
      result = tf.vectorized_map(alone, units, fallback_to_while_loop=True,
                                 warn=False)
      # (and no function call, branch or loop, whose ops this trace does
      # not hold: a boolean_mask in a nested function passed unseen, 4.4C)
      dynamic = [op.name for op in recorded[start:]
                 if any(not out.shape.is_fully_defined() for out in op.outputs)
                 or any(attr.HasField("func") or (
                     attr.HasField("list") and attr.list.func)
                        for attr in op.node_def.attr.values())]
      if dynamic:
        raise ValueError(f"shapes not static under the fallback: {dynamic[:3]}")
      return result

    attempts = (
        ("vectorized", lambda: tf.vectorized_map(
            alone, units, fallback_to_while_loop=False)),
        ("vectorized, some ops looped", looped_ops_if_static),
        ("loop", lambda: tf.map_fn(alone, units,
                                   fn_output_signature=signature)))
    errors = []
    for how, attempt in attempts:
      try:
        with _QuietVectorization(how != "loop"):
          grads, losses = attempt()
      except Exception as error:  # pylint: disable=broad-except
        # No vectorization rule for an op (or a pfor bug): the next way.
        errors.append(f"{how}: {type(error).__name__}: {error}")
        continue
      writes = _compat.state_writes(recorded, model, unit_inputs)
      if how != "vectorized":  # units one after another: no Python state
        writes += graph.python_calls(recorded)
      if writes:  # (first: a model that writes state says so)
        raise ValueError(_STATE_ERROR.format(ops=", ".join(writes[:5])))
      if reads:
        raise ValueError(_OUTSIDE_DATA_ERROR.format(
            reads="; ".join(sorted(set(reads))[:3])))
      return (None if var_list is None else grads), losses, recorded, how
    if reads:  # (the more basic refusal, whether or not a way worked)
      raise ValueError(_OUTSIDE_DATA_ERROR.format(
          reads="; ".join(sorted(set(reads))[:3])))
    raise ValueError(
        "tf_dpadambc: the model cannot be evaluated one unit at a time "
        "(tf.vectorized_map and tf.map_fn both failed):\n"
        + "\n".join(errors))

  def _eager_function(self, key, compute):
    """``compute`` as a ``tf.function`` reused while ``key`` is the same (in
    eager mode the per-unit evaluation still needs a graph: to vectorize
    and to inspect the ops it runs)."""
    cached = self._eager_cache
    if cached is not None and len(cached[0]) == len(key) and all(
        a is b or isinstance(a, (int, str)) and a == b
        for a, b in zip(cached[0], key)):
      return cached[1]
    function = tf.function(compute, reduce_retracing=True)
    self._eager_cache = (key, function)  # holds key: its ids stay unique
    return function

  def _count_steps(self):
    if getattr(self, "_vectorized_steps", None) is None:
      with tf.init_scope():
        # Not checkpoint dependencies: diagnostics.
        self._vectorized_steps = self._no_dependency(tf.Variable(
            0, dtype=tf.int64, trainable=False, name="vectorized_steps"))
        self._refused_steps = self._no_dependency(tf.Variable(
            0, dtype=tf.int64, trainable=False, name="refused_steps"))

  def _check_model(self, var_list, loss):
    model = _compat.calling_model(self, var_list)
    if model is not None:
      guards.on_step(model, self)  # fit's callbacks, data and accounting
      # What the trace wrote before this point (the batched forward pass and
      # the loss) is checked before the release, after the per-unit checks
      # (whose errors say more).
      _PENDING.check = (model, None if tf.executing_eagerly() else
                        len(tf.compat.v1.get_default_graph().get_operations()))
      for layer in _compat.all_layers(model):
        policy = getattr(layer, "dtype_policy", None)
        if policy is not None and getattr(policy, "compute_dtype", None) != (
            getattr(policy, "variable_dtype", None)):
          raise ValueError(_MIXED_PRECISION_ERROR.format(
              what=f"layer '{layer.name}' uses the policy '{policy.name}'"))
        if isinstance(layer, _compat.CROSS_EXAMPLE_LAYERS):
          raise ValueError(_CROSS_EXAMPLE_ERROR.format(
              layer=layer.name, cls=type(layer).__name__))
        # Statistics adapt() computed from the raw data, saved with the model.
        adapted = validation.adapted_preprocessing(layer)
        if adapted is not None:
          raise ValueError(adapted)
    op = None if loss is None else _compat.traced_batch_norm(loss)
    if op is not None:
      raise ValueError(_CROSS_EXAMPLE_ERROR.format(
          layer=op, cls="a batch normalization op in training mode"))

  def _check_batched_writes(self):
    """Refuses a step whose trace, before the per-unit evaluation, wrote a
    value computed from the batch into the model's or the optimizer's
    variables: a layer writing only in the batched forward pass (a review:
    ``junk.assign(batch mean · B)`` when ``x.shape[0] != 1``, 691C, never
    seen by the per-unit trace). Writes made by this adapter's own earlier
    releases in the same trace are left out (they are noised)."""
    model, count = getattr(_PENDING, "check", None) or (None, None)
    _PENDING.check = None  # (per thread: tf.distribute traces each replica
    # in a thread of its own)
    if model is None or count is None or tf.executing_eagerly():
      return
    trace = tf.compat.v1.get_default_graph()
    own = _OWN_UPDATES.get(trace, set())
    before = [op for op in graph.ops_before(trace, count)
              if not (op.graph is trace and op.name in own)]
    # Every variable but the metrics' (whose state the logs keep): a write
    # relayed through a variable the model does not track reaches it too.
    own = [getattr(self, "_vectorized_steps", None),
           getattr(self, "_refused_steps", None)]  # the check's counters
    excluded = [h for m in model.metrics for v in m.variables
                for h in _handles(v)]
    excluded += [h for v in own if v is not None for h in _handles(v)]
    writes = graph.written_from_data(
        [], before, [], _held_tensors(model), exclude=excluded)
    # A function called by the batched pass (a nested tf.function) may not
    # write state at all: its writes are not among the trace's own ops.
    writes += graph.state_effects(
        [op for op in before if op.type in _CALL_OPS],
        allowed=lambda op: False)
    if writes:
      raise ValueError(
          "tf_dpadambc: the training step wrote a value computed from the "
          "batch into the model's (or the optimizer's) variables before the "
          f"private step ({', '.join(writes[:3])}). The whole batch's data "
          "would reach every later step, and the saved weights, without "
          "noise. Keep a layer's state out of the batch: compute it inside "
          "the private step, or from public values.")

  # ---------------------------------------------------------- config
  def get_config(self):
    config = self._inner.get_config()
    if self.assume_examples_independent:
      config["assume_examples_independent"] = True
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    del custom_objects  # the inner class deserializes schedules itself
    if cls.keras3_class is None:
      raise TypeError("from_config needs a concrete class.")
    config = dict(config)
    assume = config.pop("assume_examples_independent", False)
    return cls.wrap(cls.keras3_class.from_config(config),
                    assume_examples_independent=assume)


class _QuietVectorization(logging.Filter):
  """Drops TensorFlow's log records while a vectorization is attempted: a
  failed attempt logs every op pfor could not convert, as errors, though
  the next way (a loop) then works. A total failure raises with the errors.
  """

  def __init__(self, active):
    super().__init__()
    self.active = active

  def filter(self, record):
    return False

  def __enter__(self):
    if self.active:
      tf.get_logger().addFilter(self)
    return self

  def __exit__(self, *exc):
    tf.get_logger().removeFilter(self)


def _held_tensors(model):
  """The eager tensors held by ``model``'s layers (``graph.held_eager_
  tensors``): model state, like its variables. None model: none."""
  return graph.held_eager_tensors(
      _compat.all_layers(model) if model is not None else [],
      _NOT_MODEL_STATE)


# Graph inspection, plain Python: not for autograph (which converts what
# the traced unit function calls).
_inspect = tf.autograph.experimental.do_not_convert
# Held by a model without being its state, or walked already (layers).
# (A traced function's captures are not the model's: they could be data.)
_NOT_MODEL_STATE = (tf.Variable, tf_keras.layers.Layer,
                    tf_keras.optimizers.Optimizer, tf_keras.metrics.Metric,
                    keras.layers.Layer, keras.optimizers.Optimizer,
                    keras.metrics.Metric, tf.types.experimental.GenericFunction,
                    tf.types.experimental.ConcreteFunction, tf.data.Dataset)


def _example_losses(loss):
  """[B] or [B, ...] per-example losses -> [B] (mean over the other axes)."""
  return tf.reduce_mean(tf.reshape(loss, [tf.shape(loss)[0], -1]), axis=1)


def _forward(name):
  def get(self):
    return getattr(self._inner, name)  # pylint: disable=protected-access
  return property(get, doc=f"The inner optimizer's ``{name}``.")


for _name in _FORWARDED:
  setattr(TFKerasDPOptimizer, _name, _forward(_name))


def _register(cls):
  return tf_keras.saving.register_keras_serializable(package=PACKAGE)(cls)


def adapter_class(keras3_class):
  """The tf_keras class driving ``keras3_class`` (same name and arguments)."""
  name = keras3_class.__name__
  doc = (f"tf_keras adapter of :class:`tf_dpadambc.{name}` (same arguments; "
         "see :class:`TFKerasDPOptimizer` for how it is driven).\n\n"
         f"{name}: {(keras3_class.__doc__ or '').strip()}")
  return _register(type(name, (TFKerasDPOptimizer,), {
      "keras3_class": keras3_class, "__doc__": doc,
      "__module__": __name__}))


_CLASSES = {name: adapter_class(getattr(keras3_optimizers, name))
            for name in keras3_optimizers.__all__ if name != "DPOptimizer"}
globals().update(_CLASSES)


# ------------------------------------------------- TF-Privacy's names
def _tf_privacy_class(name, keras3_name, positional):
  """``name`` with TF-Privacy's signature, driving ``keras3_name``.

  TF-Privacy's ``DPKeras*Optimizer(l2_norm_clip, noise_multiplier,
  num_microbatches=None, gradient_accumulation_steps=1, *args, **kwargs)``
  passes ``*args`` on to the Keras 2 optimizer: ``positional`` names them.
  """
  parent = _CLASSES[keras3_name]

  def __init__(self, l2_norm_clip, noise_multiplier, num_microbatches=None,
               gradient_accumulation_steps=1, *args, **kwargs):
    if len(args) > len(positional):
      raise TypeError(f"{name} takes at most {len(positional)} positional "
                      f"optimizer arguments ({', '.join(positional)}).")
    for key, value in zip(positional, args):
      if key in kwargs:
        raise TypeError(f"{name} got multiple values for argument {key!r}.")
      kwargs[key] = value
    if kwargs.pop("amsgrad", False):
      raise ValueError(f"{name}: amsgrad=True is not supported.")
    assume = kwargs.pop("assume_examples_independent", False)
    self._init_from(parent.keras3_class(
        l2_norm_clip, noise_multiplier, num_microbatches=num_microbatches,
        gradient_accumulation_steps=gradient_accumulation_steps, **kwargs),
                    assume)

  doc = (f"TF-Privacy's ``{name}`` signature, driving our ``{keras3_name}``."
         "\n\n    " + name + "(l2_norm_clip, noise_multiplier, "
         "num_microbatches=None, gradient_accumulation_steps=1, "
         + ", ".join(positional) + ", ...)\n\n"
         "Same semantics as TF-Privacy's: noise of std σC on the sum of the "
         "clipped microbatch (or example) gradients, divided by the number of "
         "microbatches. Two differences: with gradient_accumulation_steps = "
         "k the noise is drawn once per logical step of k batches (TF-"
         "Privacy draws it for every batch and averages: √k times more noise "
         "for the same accounting), and microbatches of several examples are "
         "accounted with sensitivity 2C "
         "(TF-Privacy's statement with used_microbatching=True).")
  return _register(type(name, (parent,), {
      "__init__": __init__, "__doc__": doc, "__module__": __name__}))


DPKerasSGDOptimizer = _tf_privacy_class(
    "DPKerasSGDOptimizer", "DPSGD", ("learning_rate", "momentum", "nesterov"))
DPKerasAdamOptimizer = _tf_privacy_class(
    "DPKerasAdamOptimizer", "DPAdam",
    ("learning_rate", "beta_1", "beta_2", "epsilon", "amsgrad"))
DPKerasAdagradOptimizer = _tf_privacy_class(
    "DPKerasAdagradOptimizer", "DPAdagrad",
    ("learning_rate", "initial_accumulator_value", "epsilon"))
# TF-Privacy's vectorized classes compute the same thing; ours always vectorize.
VectorizedDPKerasSGDOptimizer = DPKerasSGDOptimizer
VectorizedDPKerasAdamOptimizer = DPKerasAdamOptimizer
VectorizedDPKerasAdagradOptimizer = DPKerasAdagradOptimizer

TF_PRIVACY_NAMES = [
    "DPKerasSGDOptimizer", "DPKerasAdamOptimizer", "DPKerasAdagradOptimizer",
    "VectorizedDPKerasSGDOptimizer", "VectorizedDPKerasAdamOptimizer",
    "VectorizedDPKerasAdagradOptimizer"]
__all__ = (["TFKerasDPOptimizer", "adapter_class"] + sorted(_CLASSES)
           + TF_PRIVACY_NAMES)


def _called_by_loss_scale_optimizer():
  """True if a tf_keras LossScaleOptimizer is on the Python stack."""
  frame = sys._getframe(1)  # pylint: disable=protected-access
  wrapper = tf_keras.mixed_precision.LossScaleOptimizer
  while frame is not None:
    if isinstance(frame.f_locals.get("self"), wrapper):
      return True
    frame = frame.f_back
  return False
