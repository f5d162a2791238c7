"""tf_keras (Keras 2) adapters of the private optimizers.

Each class here is a ``tf_keras.optimizers.Optimizer`` that drives one of our
Keras 3 optimizers (:class:`tf_dpadambc.keras.optimizers.base.DPOptimizer`,
the *inner* optimizer): the inner optimizer holds every variable and every
formula (noise, moments, Φ, accounting); the adapter only turns tf_keras'
``minimize(loss, var_list, tape)`` into a clipped sum, as TF-Privacy's
``DPKeras*Optimizer`` do:

1. ``loss`` is the per-example loss vector [B] that tf_keras' ``train_step``
   passes when the compiled loss has ``reduction=NONE`` (a scalar is refused);
2. units: examples, or M microbatches (the mean loss of B/M examples each);
3. per-unit gradients: when ``fit`` runs the stock ``Model.train_step``
   (traced) with one per-example compiled loss and no stochastic layer,
   ``tf.vectorized_map`` over units of ``model(x_u, training=True)`` and that
   loss (x, y, sample_weight taken from the ``train_step`` frame), checked
   every step: if a unit's loss differs from the batch's, examples mix and
   the step fails before any update; in any other case the reference
   ``tape.jacobian(unit_losses, var_list)``;
4. ``inner.apply_per_unit(per_unit_grads, units, B, var_list)``: clipped and
   summed by ``core.clipping.materialized_clipped_sum`` under the inner
   optimizer's ``clip_spec``, then ``apply_private``: noise N(0, σ²C²) once
   per logical step, ḡ = (Σ_u clip_C(g_u) + noise)/units, the update.

Cost: the jacobian back-propagates through the whole batch once per unit,
O(U·B) work (as TF-Privacy's vectorized optimizers); the vectorized path runs
one forward and backward per unit, O(B). TF-Privacy's tutorial CNN, batch
250, 2 CPU cores: 250 microbatches 0.27 s/step vectorized vs 9.7 s jacobian,
25 microbatches 0.085 s vs 0.80 s (``per_unit_plan`` says which path a step
takes and why; ``vectorize = False`` forces the jacobian).

``apply_gradients`` raises: aggregated gradients were neither clipped per
example nor noised. Classes are generated from the Keras 3 classes (one per
class, same name and arguments); ``DPKerasSGDOptimizer``,
``DPKerasAdamOptimizer`` and ``DPKerasAdagradOptimizer`` take TF-Privacy's
constructor signature.
"""
import tensorflow as tf
import tf_keras

from tf_dpadambc.core import per_example
from tf_dpadambc.keras import optimizers as keras3_optimizers
from tf_dpadambc.keras.optimizers import base
from tf_dpadambc.tf_keras import _compat

PACKAGE = "tf_dpadambc"

_AGGREGATED_GRADIENTS_ERROR = (
    "{name} received aggregated gradients through `apply_gradients`. Those "
    "gradients were not clipped per example nor noised, so applying them "
    "would train without differential privacy. Compile the model with a "
    "per-example loss and let `fit` call `minimize`:\n\n"
    "    loss = tf.keras.losses.CategoricalCrossentropy(\n"
    "        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)\n"
    "    model.compile(optimizer={name}(...), loss=loss)\n\n"
    "or, in a custom loop, call `optimizer.minimize(per_example_losses, "
    "var_list, tape=tape)` with the loss vector recorded on `tape`. "
    "(Mixed-precision loss scaling wraps the optimizer and calls "
    "`apply_gradients`: it is not supported.)")

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
    "tf_dpadambc: the per-example forward passes did not reproduce the "
    "losses of the batch: a layer mixes the examples of the batch (e.g. it "
    "uses batch statistics), or draws random values Keras does not track. The "
    "per-example gradients of such a model are not bounded by clipping, so "
    "this step was refused before any update. Remove or fix that layer. If "
    "it does not mix examples (only untracked randomness), set "
    "optimizer.vectorize = False to use the jacobian path.")

# Relative agreement required between the vectorized path's unit losses and
# tf_keras' batched ones: per-example and batched kernels may round
# differently (equal on CPU; TF32 on GPUs rounds inputs to ~5e-4), while a
# layer mixing examples or drawing other random values moves them far more.
_AGREEMENT_TOL = 1e-3

# What the accounting, the callbacks and users read from the inner optimizer.
_FORWARDED = (
    "l2_norm_clip", "noise_multiplier", "num_microbatches",
    "accumulation_steps", "seed", "clipping", "noise", "sensitivity",
    "is_private", "is_correlated", "built", "noise_variance", "diagnostics",
    "steps_taken", "logical_batch_size", "dp_event",
    "effective_noise_multiplier", "accounted_noise_multiplier",
    "accounting_reason", "logical_steps_per_epoch", "clip_spec",
    "exclude_from_weight_decay")


class TFKerasDPOptimizer(tf_keras.optimizers.Optimizer):
  """A tf_keras optimizer that drives one of our Keras 3 DP optimizers.

  Use the generated classes (``tf_dpadambc.tf_keras.DPAdamBC(...)``, same
  arguments as the Keras 3 class) or :meth:`wrap` an existing Keras 3
  optimizer. The model must be compiled with a per-example loss
  (``reduction=NONE``): tf_keras' ``train_step`` then passes the loss vector
  and its tape to :meth:`minimize`, which clips each unit's gradient
  (example, or microbatch with ``num_microbatches``) and hands the clipped sum
  to the inner optimizer. The noise, the update and the accounting are the
  inner optimizer's: ḡ = (Σ_u clip_C(g_u) + N(0, σ²C² I)) / U with U units
  (TF-Privacy's semantics: noise σC on the sum of clipped microbatch means,
  divided by the number of microbatches).

  Per-unit gradients come from ``tf.vectorized_map`` over units when the
  stock ``train_step`` calls ``minimize`` (see :meth:`_per_unit_gradients`),
  else from the jacobian of the batch's unit losses.

  Models with batch normalization are refused at the first step: the
  adapter looks for the model that calls ``minimize`` on the Python stack
  (``self`` in ``Model.train_step``, or a local model that is compiled with
  this optimizer or owns the variables being trained) and checks its layers;
  inside a traced step it also refuses any fused batch normalization in
  training mode found in the graph of the loss. Limits: a layer that mixes
  examples in another way (a custom layer normalizing over the batch axis,
  attention across examples) is not detected, and a model that is not
  reachable from the caller's frames is not checked. On the fast path such
  mixing is caught every step (the per-example losses differ from the
  batch's) and the step fails before any update; on the jacobian path each
  unit's jacobian row is its gradient only if its loss depends on its own
  examples alone.

  Not supported (they raise): ``apply_gradients`` (aggregated gradients),
  mixed-precision loss scaling (it calls ``apply_gradients``), and
  ``tf.distribute`` with more than one replica.

  The inner optimizer is :attr:`keras_optimizer`; its accounting is
  forwarded (``dp_event``, ``steps_taken``, ``logical_batch_size``,
  ``diagnostics()``, ...), so ``tf_dpadambc.optimizer_privacy_statement``
  and ``tf_dpadambc.tf_keras.PrivacyBudget`` work on this optimizer.
  """

  # The Keras 3 class the generated subclasses construct.
  keras3_class = None
  # False: always the reference jacobian path (set on an instance to compare).
  vectorize = True

  def __init__(self, *args, **kwargs):
    if self.keras3_class is None:
      raise TypeError(
          "TFKerasDPOptimizer is abstract: use one of the classes of "
          "tf_dpadambc.tf_keras (DPSGD, DPAdamBC, ...) or "
          "TFKerasDPOptimizer.wrap(keras3_optimizer).")
    self._init_from(self.keras3_class(*args, **kwargs))

  @classmethod
  def wrap(cls, optimizer):
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
    self._init_from(optimizer)  # pylint: disable=protected-access
    return self

  def _init_from(self, inner):
    # The tf_keras base only gets a name: every hyper-parameter (weight
    # decay, EMA, gradient clipping) belongs to the inner optimizer.
    super().__init__(name=inner.name)
    # Not a checkpoint dependency: its accumulated clipped sums (gradient
    # accumulation) are not noised yet and must not be written to files.
    # The rest of its state is tracked through `_variables` (see build).
    self._inner = self._no_dependency(inner)
    self._plan = None
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
    """Builds the inner optimizer's variables, outside any traced function."""
    if self._inner.built:
      return
    with tf.init_scope():
      self._inner.build(list(var_list))
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
    raise RuntimeError(
        _AGGREGATED_GRADIENTS_ERROR.format(name=type(self).__name__))

  def update_step(self, gradient, variable):
    raise RuntimeError(
        _AGGREGATED_GRADIENTS_ERROR.format(name=type(self).__name__))

  # -------------------------------------------------- the private path
  def minimize(self, loss, var_list, tape=None):
    """One private step from per-example losses.

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
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
      # Each replica would add its own noise and divide by its own batch.
      raise NotImplementedError(
          f"Private training under a tf.distribute strategy with {replicas} "
          "replicas is not supported: train on one device.")
    self.build(var_list)

    with tape:  # the reduction to units must be on the tape too
      examples = _example_losses(loss)
      unit_losses = self._unit_losses(examples)
    per_unit = self._per_unit_gradients(loss, tape, unit_losses, var_list)
    # Clipped with the inner clip_spec (or fed to its DPQuery), then noised.
    self._inner.apply_per_unit(per_unit, tf.shape(unit_losses)[0],
                               tf.shape(examples)[0], var_list)

  def _unit_losses(self, examples):
    """[B] per-example losses -> [U] unit losses (microbatch means)."""
    m = self._inner.num_microbatches
    if m is not None and examples.shape[0] is None:
      # fit's batch size is not static; the last batch may be partial.
      check = tf.debugging.assert_equal(
          tf.shape(examples)[0] % m, 0, message=(
              f"num_microbatches={m} does not divide this batch's size: use "
              "batch sizes that are multiples of num_microbatches and drop "
              "the last partial batch (e.g. N a multiple of batch_size, or "
              "tf.data's batch(..., drop_remainder=True))."))
      # Before any reshape of the batch (here or in the vectorized path).
      with tf.control_dependencies([check]):
        examples = tf.identity(examples)
    return tf.reduce_mean(per_example.split_microbatches(examples, m), axis=1)

  # ------------------------------------------------ per-unit gradients
  @property
  def per_unit_plan(self):
    """How the last traced step computes per-unit gradients: "vectorized"
    (checked every step, see :meth:`_per_unit_gradients`) or "jacobian: "
    and why the vectorized path does not apply."""
    return self._plan

  @property
  def vectorized_steps(self):
    """Physical steps whose per-unit gradients came from the vectorized path
    (the others used the jacobian)."""
    counter = getattr(self, "_vectorized_steps", None)
    return 0 if counter is None else int(counter.numpy())

  def _per_unit_gradients(self, loss, tape, unit_losses, var_list):
    """[U, ...] gradients of ``unit_losses`` w.r.t. ``var_list``.

    Reference: ``tape.jacobian`` of the batch's unit losses (any caller; it
    back-propagates through the whole batch once per unit). Fast path, for a
    traced stock ``Model.train_step`` with one per-example compiled loss and
    no stochastic layer: ``tf.vectorized_map`` over units of
    ``model(x_u, training=True)`` and the compiled loss (forward and backward
    of one unit each). Each unit's gradient then depends on its own examples
    only, and is used only if that function is the one tf_keras recorded:
    its unit losses must match ``unit_losses`` (all units, this step).
    Otherwise a layer mixes examples (or draws untracked randomness): the
    jacobian rows would not be per-example gradients either, so the step
    fails with an error before any update.
    """
    def jacobian():
      return tape.jacobian(
          unit_losses, var_list, experimental_use_pfor=True,
          unconnected_gradients=tf.UnconnectedGradients.ZERO)

    fast, self._plan = self._vectorized(loss, tape, unit_losses, var_list)
    if fast is None:
      return jacobian()
    grads, losses = fast
    agree = tf.reduce_all(tf.abs(losses - unit_losses) <= _AGREEMENT_TOL * (
        1.0 + tf.abs(unit_losses)))

    checked = tf.debugging.Assert(agree, [_MIXING_ERROR])
    with tf.control_dependencies([checked,
                                  self._vectorized_steps.assign_add(1)]):
      return [tf.identity(g) for g in grads]

  def _vectorized(self, loss, tape, unit_losses, var_list):
    """``((grads, unit losses), "vectorized")`` or ``(None, "jacobian: why")``.
    """
    if not self.vectorize:
      return None, "jacobian: vectorize=False"
    if tf.executing_eagerly():
      return None, "jacobian: eager step (run_eagerly=True)"
    step, why = _compat.stock_train_step(self, loss, tape)
    loss_fn = None
    if step is not None:
      loss_fn, why = _compat.single_loss(step.model, step.y,
                                         step.sample_weight)
    if loss_fn is not None and {id(v) for v in var_list} != {
        id(v) for v in step.model.trainable_variables}:
      loss_fn, why = None, "var_list is not the model's trainable variables"
    if loss_fn is not None:
      layer = _compat.stochastic_layer(step.model)
      if layer is not None:
        # Per-unit calls would draw other masks than the recorded batch: the
        # check would fail every step (and cost both paths).
        loss_fn, why = None, f"stochastic layer '{layer.name}'"
    if loss_fn is None:
      return None, f"jacobian: {why}"

    data = {"x": step.x, "y": step.y}
    if step.sample_weight is not None:
      data["sample_weight"] = step.sample_weight
    with tf.control_dependencies([unit_losses]):  # divisibility checked
      data = tf.nest.map_structure(tf.identity, data)
    units = per_example.split_microbatches(data, self._inner.num_microbatches)
    model = step.model

    def unit_loss(params, unit):
      del params  # the model reads its variables, watched by the tape
      y_pred = model(unit["x"], training=True)
      value = loss_fn(unit["y"], y_pred, unit.get("sample_weight"))
      return tf.reduce_mean(_example_losses(value)), ()

    self._count_steps()
    try:
      grads, losses, _ = per_example.per_unit_gradients(unit_loss, var_list,
                                                        units)
    except Exception as error:  # pylint: disable=broad-except
      # Not vectorizable (an op without a pfor rule, ...): the reference.
      return None, f"jacobian: not vectorizable ({type(error).__name__})"
    return (grads, tf.cast(losses, unit_losses.dtype)), "vectorized"

  def _count_steps(self):
    if getattr(self, "_vectorized_steps", None) is None:
      with tf.init_scope():
        # Not a checkpoint dependency: a diagnostic.
        self._vectorized_steps = self._no_dependency(tf.Variable(
            0, dtype=tf.int64, trainable=False, name="vectorized_steps"))

  def _check_model(self, var_list, loss):
    model = _compat.calling_model(self, var_list)
    if model is not None:
      for layer in _compat.all_layers(model):
        if isinstance(layer, _compat.CROSS_EXAMPLE_LAYERS):
          raise ValueError(_CROSS_EXAMPLE_ERROR.format(
              layer=layer.name, cls=type(layer).__name__))
    op = _compat.traced_batch_norm(loss)
    if op is not None:
      raise ValueError(_CROSS_EXAMPLE_ERROR.format(
          layer=op, cls="a batch normalization op in training mode"))

  # ---------------------------------------------------------- config
  def get_config(self):
    return self._inner.get_config()

  @classmethod
  def from_config(cls, config, custom_objects=None):
    del custom_objects  # the inner class deserializes schedules itself
    if cls.keras3_class is None:
      raise TypeError("from_config needs a concrete class.")
    return cls.wrap(cls.keras3_class.from_config(dict(config)))


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
    self._init_from(parent.keras3_class(
        l2_norm_clip, noise_multiplier, num_microbatches=num_microbatches,
        gradient_accumulation_steps=gradient_accumulation_steps, **kwargs))

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
         "accounted with sensitivity 2C under add/remove adjacency "
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
