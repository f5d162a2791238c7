"""Refuse models whose training cannot be made private per example, and
callbacks that would act on the un-noised training logs."""
import functools
import inspect

import keras
import tensorflow as tf

from tf_dpadambc.core import graph
from tf_dpadambc.keras import _compat

# Layers that mix examples of a batch (their output for one example depends on
# the others) or update state from the data without noise.
_CROSS_EXAMPLE_LAYERS = (keras.layers.BatchNormalization,)


def check_model(model):
  """Raises ValueError for layers that break per-example sensitivity.

  Mixed precision is supported (``make_private``: float32 variables, norms,
  clipping and noise; a static loss scale under float16).
  """
  for layer in _compat.flatten_layers(model):
    if isinstance(layer, _CROSS_EXAMPLE_LAYERS):
      raise ValueError(
          f"Layer '{layer.name}' ({layer.__class__.__name__}) normalizes with "
          "statistics of the whole batch and updates its moving statistics "
          "from the data without noise: one example's influence is not "
          "bounded by clipping, so differentially private training cannot "
          "use it. Replace it with keras.layers.GroupNormalization or "
          "keras.layers.LayerNormalization (per-example normalizations).")
    if getattr(layer, "stateful", False) is True:
      # Private training evaluates every unit statelessly: the state would
      # silently never carry over, and if it did, one batch's examples
      # would reach later steps (and the saved state) without noise.
      raise ValueError(
          f"Layer '{layer.name}' ({layer.__class__.__name__}) is stateful: "
          "it carries each batch's final state into the next batch, so one "
          "example would influence later steps and the saved state without "
          "clipping or noise. Private training evaluates each example on its "
          "own and cannot keep such state. Use stateful=False (pass the "
          "context as input features instead).")


def check_forward(model, inputs):
  """Raises ValueError if the model's forward pass writes state.

  Per-unit evaluation keeps examples apart only through values: a variable
  written in the forward pass carries one unit's data to the others (under
  ``tf.vectorized_map`` they share it) and into later steps, without noise.
  Traced on zeros shaped like one example of ``inputs``, in training and
  in inference mode: Keras variables assigned from the data (other than the
  random state of a SeedGenerator) in training mode, and raw ``tf.Variable``
  writes in either (any write op: Keras variables write no op inside a
  StatelessScope), are refused. Once per traced graph and input signature
  (the train step checks before the first-step check, the private gradient
  again).
  """
  key = (id(tf.compat.v1.get_default_graph()), tuple(
      (tuple(t.shape), t.dtype) for t in tf.nest.flatten(inputs)))
  if model.__dict__.get(_CHECKED_FORWARD) == key:
    return
  _check_forward(model, inputs)
  model.__dict__[_CHECKED_FORWARD] = key


_CHECKED_FORWARD = "_tf_dpadambc_checked_forward"
_DRAWS_RANDOM = "_tf_dpadambc_training_draws_random"


def deterministic_in_training(model):
  """True if :func:`check_forward` saw the model's training-mode forward
  pass draw no random numbers (so a batched and a per-unit evaluation in
  training mode must agree); False if it draws some, or was not checked."""
  return model.__dict__.get(_DRAWS_RANDOM) is False


def _check_forward(model, inputs):
  seeds = {id(sg.state) for sg in _compat.seed_generators(model)}
  assigned = []

  def trace(probe, training):
    params = [tf.zeros(v.shape, v.dtype) for v in model.trainable_variables]
    state = [tf.zeros(v.shape, v.dtype)
             for v in model.non_trainable_variables]
    _, updated = model.stateless_call(params, state, probe, training=training)
    if training:  # (inference-mode Keras writes are discarded, as here)
      assigned.extend(v.path for v, new, old in zip(
          model.non_trainable_variables, updated, state)
                      if new is not old and id(v) not in seeds)
    return 0

  spec = tf.nest.map_structure(
      lambda t: tf.TensorSpec([1] + list(t.shape[1:]), t.dtype), inputs)
  writes, reads = [], []
  # Both modes: the train step also runs the model in inference mode (its
  # first-step check), and a raw write there would persist.
  for training in (True, False):
    traced = tf.function(lambda p, t=training: trace(p, t), autograph=False
                         ).get_concrete_function(spec).graph
    writes += graph.state_effects(traced.get_operations())
    reads += graph.foreign_reads(traced.get_operations(), own_handles(model))
    if training:
      model.__dict__[_DRAWS_RANDOM] = graph.draws_random(
          traced.get_operations())
  if assigned or writes:
    what = (f"assigns {assigned}" if assigned
            else f"writes state ({', '.join(writes[:3])})")
    raise ValueError(
        f"The forward pass of model '{model.name}' {what} in training mode. "
        "State written from the data (a variable, a hash table, a random "
        "generator's position, a queue, a summary, Python) is not bounded by "
        "per-example clipping and leaks into other examples and later steps "
        "without noise (like BatchNormalization's moving statistics). "
        "Private training refuses "
        "it: compute the value from the example itself, or keep the state "
        "out of the training forward pass (update it only when "
        "training=False).")
  if reads:
    raise ValueError(_FOREIGN_READS.format(model=model.name,
                                           ops=", ".join(reads[:3])))


_TRACED = {}  # stateless_evaluation's functions, as tf.functions (eager)

_FOREIGN_READS = (
    "The forward pass of model '{model}' reads variables that are not the "
    "model's ({ops}). Its output may depend on its weights and its input "
    "only: a variable written elsewhere from the data (a metric's state, "
    "updated from the un-noised batch) would carry it into the gradients "
    "without noise. Make the value a weight of the model (add_weight) or a "
    "constant.")


def own_handles(model):
  """The resource handles of the model's variables, and of Keras' global
  SeedGenerator (randomness, not data)."""
  variables = list(model.variables)
  seed = keras.src.backend.common.global_state.get_global_attribute(
      "global_seed_generator")
  if seed is not None:
    variables.append(seed.state)
  handles = []
  for v in variables:
    value = getattr(v, "value", v)
    handle = getattr(value, "handle", None)
    if handle is not None:
      handles.append(handle)
  return handles


def stateless_evaluation(function):
  """Refuses, when traced, any op ``function`` adds to the step's graph that
  could carry data between units or into later steps
  (``graph.state_effects``: a write to a variable, a hash table or a random
  generator, a queue, a summary, Python).

  :func:`check_forward` traces the model on its own, and a layer can tell
  that trace from the step's (its name scope, its batch size): this looks
  at the ops the step itself runs, the forward passes outside per-unit
  evaluation included (a review: a layer that skipped a random generator by
  an amount read from the first example, only outside the per-unit loop,
  moved the release by 3.2C)."""
  @functools.wraps(function)
  def wrapped(*args, **kwargs):
    if tf.executing_eagerly():
      # run_eagerly=True: still traced, so that the ops are checked (an
      # eager forward pass escaped the check, and a layer can tell eager
      # from traced execution: a review, 5C).
      if wrapped not in _TRACED:
        _TRACED[wrapped] = tf.function(wrapped, autograph=False)
      return _TRACED[wrapped](*args, **kwargs)
    traced = tf.compat.v1.get_default_graph()
    start = len(traced.get_operations())
    result = function(*args, **kwargs)
    added = traced.get_operations()[start:]
    effects = graph.state_effects(added)
    if effects:
      raise ValueError(
          "The private step would run ops that keep state between examples "
          f"or steps ({', '.join(effects[:3])}): a variable, hash table or "
          "random generator written from the data, a queue, a summary or "
          "Python carries one example's data to the others and into later "
          "steps without noise. Private training refuses them: remove them "
          "from the model's forward pass and loss.")
    reads = graph.foreign_reads(added, own_handles(args[0]))
    if reads:
      raise ValueError(_FOREIGN_READS.format(model=args[0].name,
                                             ops=", ".join(reads[:3])))
    return result
  return wrapped


def _acts_on(callback):
  """The training log ``callback`` acts on (stops, tunes or picks what is
  kept by), or None. Validation quantities (``val_…``, computed on data the
  model does not train on) and ``epsilon`` (data-independent) are fine."""
  if isinstance(callback, keras.callbacks.TerminateOnNaN):
    return "loss"
  acts = isinstance(callback, (keras.callbacks.EarlyStopping,
                               keras.callbacks.ReduceLROnPlateau)) or (
                                   isinstance(callback,
                                              keras.callbacks.ModelCheckpoint)
                                   and callback.save_best_only)
  monitor = getattr(callback, "monitor", None)
  if not acts or not isinstance(monitor, str):
    return None
  return None if monitor.startswith("val_") or monitor == "epsilon" else (
      monitor)


def check_callbacks(callbacks):
  """Raises ValueError for Keras callbacks driven by the training logs.

  The loss and metrics ``fit`` logs are computed without noise. A callback
  that stops training, changes the learning rate or chooses the checkpoint
  to keep from them feeds that un-noised information into the weights and
  the saved state (a review: with ``TerminateOnNaN`` and one NaN example, or
  ``EarlyStopping(monitor="loss")`` and one outlier, the saved step count
  told a dataset from its neighbour at any σ). Custom callbacks cannot be
  checked; the README says the same of them.
  """
  if isinstance(callbacks, keras.callbacks.CallbackList):
    callbacks = callbacks.callbacks
  # Keras flattens nested lists of callbacks: so do we.
  for callback in tf.nest.flatten(callbacks or []):
    monitor = _acts_on(callback)
    if monitor is None:
      continue
    name = type(callback).__name__
    if isinstance(callback, keras.callbacks.TerminateOnNaN):
      raise ValueError(
          "TerminateOnNaN stops training when the training loss is not "
          "finite, which one example can cause; the loss is computed without "
          "noise, so when training stops would reveal that example beyond the "
          "ε reported. Remove it: a unit whose gradient is not finite is "
          "already zeroed (counted in dp_nonfinite_examples).")
    raise ValueError(
        f"{name}(monitor={monitor!r}) acts on a training quantity, computed "
        "without noise: when it stops training, changes the learning rate or "
        "picks the checkpoint to keep, it releases information about "
        "individual training examples that the ε reported does not cover. "
        "Monitor a validation quantity instead (monitor='val_loss' with "
        "validation_data held out from the training data), or remove it.")


TRACED_OPTIMIZER = "_tf_dpadambc_traced_optimizer"


def check_optimizer_is_traced(model):
  """Raises ValueError if ``model.optimizer`` was replaced (assigned, not
  compiled) after the train step was traced: the step would go on with the
  optimizer it was traced with, while the accounting and the callbacks read
  ``model.optimizer`` (a review: ε 0 reported for a model that kept
  training)."""
  traced = model.__dict__.get(TRACED_OPTIMIZER)
  traced = traced() if traced is not None else None
  if (traced is not None and getattr(model, "train_function", None)
      is not None and traced is not getattr(model, "optimizer", None)):
    raise ValueError(
        f"model.optimizer of '{model.name}' was replaced after its private "
        f"train step was traced with {traced.name}: the step would keep "
        "training with that one, while the accounting reads "
        "model.optimizer. Compile again with the new optimizer "
        "(model.compile(optimizer=...)); its ε then includes the earlier "
        "run.")


def refuse_log_driven_callbacks(model):
  """Wraps ``model.fit`` so that :func:`check_callbacks` (and
  :func:`check_optimizer_is_traced`) run first."""
  fit = model.fit
  signature = inspect.signature(type(model).fit)

  def fit_with_checked_callbacks(*args, **kwargs):
    check_optimizer_is_traced(model)
    check_callbacks(signature.bind(model, *args, **kwargs).arguments.get(
        "callbacks"))
    return fit(*args, **kwargs)
  fit_with_checked_callbacks.__doc__ = fit.__doc__
  object.__setattr__(model, "fit", fit_with_checked_callbacks)
