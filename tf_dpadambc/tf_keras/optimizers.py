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
3. per-unit gradients ``tape.jacobian(unit_losses, var_list)`` (vectorized
   with pfor);
4. ``inner.apply_per_unit(per_unit_grads, units, B, var_list)``: clipped and
   summed by ``core.clipping.materialized_clipped_sum`` under the inner
   optimizer's ``clip_spec``, then ``apply_private``: noise N(0, σ²C²) once
   per logical step, ḡ = (Σ_u clip_C(g_u) + noise)/units, the update.

Cost: the jacobian of a batched loss back-propagates through the whole batch
once per unit, O(U·B) work (as TF-Privacy's vectorized optimizers): fine for
small models or few microbatches; the Keras 3 path (``make_private``) clips
per example in O(B).

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

  Models with batch normalization are refused at the first step: the
  adapter looks for the model that calls ``minimize`` on the Python stack
  (``self`` in ``Model.train_step``, or a local model that is compiled with
  this optimizer or owns the variables being trained) and checks its layers;
  inside a traced step it also refuses any fused batch normalization in
  training mode found in the graph of the loss. Limits: a layer that mixes
  examples in another way (a custom layer normalizing over the batch axis,
  attention across examples) is not detected, and a model that is not
  reachable from the caller's frames is not checked. Each unit's jacobian
  row is its gradient only if its loss depends on its own examples alone.

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
      examples = tf.reshape(loss, [tf.shape(loss)[0], -1])
      examples = tf.reduce_mean(examples, axis=1)
      unit_losses = self._unit_losses(examples)
    per_unit = tape.jacobian(
        unit_losses, var_list, experimental_use_pfor=True,
        unconnected_gradients=tf.UnconnectedGradients.ZERO)
    # Clipped with the inner clip_spec (or fed to its DPQuery), then noised.
    self._inner.apply_per_unit(per_unit, tf.shape(unit_losses)[0],
                               tf.shape(examples)[0], var_list)

  def _unit_losses(self, examples):
    """[B] per-example losses -> [U] unit losses (microbatch means)."""
    m = self._inner.num_microbatches
    if m is not None and examples.shape[0] is None:
      # fit's batch size is not static; the last batch may be partial.
      tf.debugging.assert_equal(
          tf.shape(examples)[0] % m, 0, message=(
              f"num_microbatches={m} does not divide this batch's size: use "
              "batch sizes that are multiples of num_microbatches and drop "
              "the last partial batch (e.g. N a multiple of batch_size, or "
              "tf.data's batch(..., drop_remainder=True))."))
    return tf.reduce_mean(per_example.split_microbatches(examples, m), axis=1)

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
