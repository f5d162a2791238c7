"""Refuse models whose training cannot be made private per example, and
callbacks that would act on the un-noised training logs."""
import contextlib
import functools
import inspect
import os
import sys
import threading

import keras
import numpy as np
import tensorflow as tf

from tf_dpadambc.core import graph
from tf_dpadambc.keras import _compat

# Layers that mix examples of a batch (their output for one example depends on
# the others) or update state from the data without noise.
_CROSS_EXAMPLE_LAYERS = (keras.layers.BatchNormalization,)


def check_model(model):
  """Raises ValueError for layers that break per-example sensitivity, and
  for preprocessing layers adapted on data (:func:`adapted_preprocessing`).

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
    adapted = adapted_preprocessing(layer)
    if adapted is not None:
      raise ValueError(adapted)


def adapted_preprocessing(layer):
  """The refusal of a preprocessing layer whose state ``adapt()`` computed
  from data (a message), or None.

  ``adapt()`` reads every raw example, without clipping or noise, and the
  statistics it computes (a mean and variance, bin boundaries, a vocabulary)
  are saved with the model, which the guarantee covers (a review: one
  outlier moved a saved Normalization mean by |x|/N at any σ). The same
  values passed to the constructor (public statistics) are allowed, and so
  is a layer never adapted (it fails when used). Keras 3 and tf_keras
  layers, by their attributes: ``Normalization`` (no ``mean`` given, and its
  ``adapt_mean``/``adapt_variance`` moved from 0/1), ``Discretization``
  (``num_bins`` given, and bin boundaries or a quantile summary computed),
  ``StringLookup``/``IntegerLookup``/``TextVectorization`` (no
  ``vocabulary`` given, and a vocabulary, token counts or document counts
  learned), ``FeatureSpace`` (by its preprocessors), and
  tf_keras' ``is_adapted``. Any other class with ``adapt`` is refused unless
  tf_keras says it was not adapted: what its adapt() writes is unknown.
  """
  if not callable(getattr(layer, "adapt", None)):
    return None
  # The values now, also when called while a train step is traced.
  with tf.init_scope():
    preprocessors = getattr(layer, "preprocessors", None)
    if hasattr(preprocessors, "values"):  # a FeatureSpace: adapts these
      for preprocessor in preprocessors.values():
        adapted = adapted_preprocessing(preprocessor)
        if adapted is not None:
          return adapted
      return None
    try:
      stats, argument, held = _adapt_state(layer)
    except Exception:  # pylint: disable=broad-except
      # Internals this release does not have: cannot tell, so refuse.
      stats, argument, held = _UNKNOWN, None, True
  if not held and getattr(layer, "is_adapted", None) is not True:
    return None
  name = type(layer).__name__
  fix = (f"pass them to the constructor ({name}({argument}))" if argument
         else "set them without adapt(), in a layer that takes them as "
         "constructor arguments")
  return (
      f"Layer '{layer.name}' ({name}) holds {stats}. adapt() reads every "
      "raw example without clipping or noise, and its statistics are saved "
      "with the model, so they would reveal individual training examples "
      "beyond the ε reported. Compute the statistics on public data (or "
      f"with a differentially private mechanism) and {fix}, or preprocess "
      "the data outside the model.")


def _adapt_state(layer):
  """(what adapt() computes, the constructor arguments that give it, whether
  the layer holds it), by the layer's attributes (Keras 3 and tf_keras)."""
  if hasattr(layer, "input_mean"):  # Normalization
    held = layer.input_mean is None and hasattr(layer, "adapt_mean") and (
        np.any(np.asarray(layer.adapt_mean.numpy()) != 0)
        or np.any(np.asarray(layer.adapt_variance.numpy()) != 1))
    return "a mean and variance" + _NOT_GIVEN, "mean=..., variance=...", held
  if hasattr(layer, "num_bins"):  # Discretization
    summary = getattr(layer, "summary", None)
    summary = summary.numpy() if hasattr(summary, "numpy") else summary
    held = layer.num_bins is not None and (
        len(list(layer.bin_boundaries or [])) > 0
        or (summary is not None and np.size(summary) > 0))
    return "bin boundaries" + _NOT_GIVEN, "bin_boundaries=[...]", held
  lookup = getattr(layer, "_lookup_layer", layer)  # TextVectorization's
  if hasattr(lookup, "_has_input_vocabulary"):  # StringLookup, IntegerLookup
    tables = [getattr(lookup, name, None) for name in (
        "lookup_table", "token_counts", "token_document_counts")]
    documents = getattr(lookup, "num_documents", None)
    held = not lookup._has_input_vocabulary and (  # pylint: disable=protected-access
        any(int(t.size().numpy()) > 0 for t in tables if t is not None)
        or (documents is not None and int(documents.numpy()) > 0))
    argument = "vocabulary=[...]" + (
        ", idf_weights=[...]" if lookup.output_mode == "tf_idf" else "")
    return "a vocabulary" + _NOT_GIVEN, argument, held
  # Unknown: tf_keras' PreprocessingLayer records adapt() (is_adapted);
  # otherwise what adapt() writes cannot be told apart from the rest.
  return _UNKNOWN, None, getattr(layer, "is_adapted", None) is not False


_NOT_GIVEN = (" not given to its constructor: computed by adapt() (or set or "
              "loaded later, which cannot be told apart)")
_UNKNOWN = ("state that adapt() may have computed (tf_dpadambc cannot tell "
            "for this class)")


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


def _is_a(callback, name):
  """``callback`` is (a subclass of) Keras 3's or tf_keras' class ``name``
  (by name: this package does not import tf_keras)."""
  return any(cls.__name__ == name
             and cls.__module__.split(".")[0].endswith("keras")
             for cls in type(callback).__mro__)


def _acts_on(callback):
  """The training log ``callback`` acts on (stops, tunes or picks what is
  kept by), or None. Validation quantities (``val_…``, computed on data the
  model does not train on) and ``epsilon`` (data-independent) are fine.
  Keras 3's callbacks and tf_keras' alike (the tf_keras adapter checks its
  ``fit`` with this too)."""
  if _is_a(callback, "TerminateOnNaN"):
    return "loss"
  acts = _is_a(callback, "EarlyStopping") or _is_a(
      callback, "ReduceLROnPlateau") or (
          _is_a(callback, "ModelCheckpoint")
          and getattr(callback, "save_best_only", False))
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
  if _is_a(callbacks, "CallbackList"):
    callbacks = callbacks.callbacks
  # Keras flattens nested lists of callbacks: so do we.
  for callback in tf.nest.flatten(callbacks or []):
    monitor = _acts_on(callback)
    if monitor is None:
      continue
    name = type(callback).__name__
    if _is_a(callback, "TerminateOnNaN"):
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


# Hooks that run between private steps (the training logs are in hand).
_BETWEEN_STEPS = ("on_epoch_begin", "on_epoch_end", "on_batch_begin",
                  "on_batch_end", "on_train_batch_begin", "on_train_batch_end",
                  "on_test_begin", "on_test_end", "on_test_batch_begin",
                  "on_test_batch_end", "on_predict_begin", "on_predict_end",
                  "on_predict_batch_begin", "on_predict_batch_end")
# (watched ids, callback name, hook) of the user hook running, in any thread:
# a hook may write from a thread of its own (a review: 737 for a bound of 1).
_WRITE_GUARD = []
_WRITE_GUARD_LOCK = threading.Lock()
_VARIABLE_WRITES = ("assign", "assign_add", "assign_sub", "scatter_sub",
                    "scatter_add", "scatter_max", "scatter_min", "scatter_mul",
                    "scatter_div", "scatter_update", "batch_scatter_update",
                    "scatter_nd_sub", "scatter_nd_add", "scatter_nd_update",
                    "scatter_nd_max", "scatter_nd_min")
_WRITES_GUARDED = []


def _guard_variable_writes():
  """Once per process: every write method of TensorFlow's resource variables
  (what Keras 3's and tf_keras' variables write through) first asks
  :func:`_refuse_write`, which acts only inside a guarded callback hook."""
  if _WRITES_GUARDED:
    return
  from tensorflow.python.ops import resource_variable_ops  # pylint: disable=g-import-not-at-top
  # Each class that defines a write itself (ResourceVariable overrides
  # BaseResourceVariable's).
  classes, stack = [], [resource_variable_ops.BaseResourceVariable]
  while stack:
    cls = stack.pop()
    classes.append(cls)
    stack.extend(cls.__subclasses__())
  for cls in classes:
    for name in _VARIABLE_WRITES:
      original = vars(cls).get(name)
      if original is None:
        continue

      def write(self, *args, _original=original, **kwargs):
        _refuse_write(self)
        return _original(self, *args, **kwargs)
      functools.update_wrapper(write, original)
      setattr(cls, name, write)
  _WRITES_GUARDED.append(True)


def _refuse_write(variable):
  if not _WRITE_GUARD:
    return
  guarded = _WRITE_GUARD[-1]
  if id(variable) not in guarded[0]:
    return
  watched, callback, hook = guarded
  if callback is None:
    raise ValueError(
        f"A metric wrote the variable '{variable.name}' of the model or its "
        "optimizer in the private step's logs, which are computed from the "
        "batch without noise: the next steps' gradients (and the saved weights) would "
        "read it without noise (a review: 8C for a bound of 2C). A metric "
        "must keep its state in variables of its own (add_variable), not "
        "in the model's.")
  raise ValueError(
      f"Callback {callback}.{hook} wrote the variable '{variable.name}' of "
      "the model or its optimizer during private training. Between steps a "
      "callback holds the training logs (loss, metrics), which are computed "
      "without noise: a value written from them into the model or the "
      "optimizer reaches the next steps' gradients, and the weights, "
      "without noise (a review: 9.1C for a bound of 2C). Change the model "
      "only through the private step: compute schedules inside the model "
      "from public values (the optimizer's iterations), or set them before "
      "fit. (The learning rate may be set, e.g. by LearningRateScheduler: "
      "from the epoch, not from the training logs.)")


@contextlib.contextmanager
def model_unwritten(model):
  """Within it (the private step's logs stage: metrics updated from the
  batch), the model's and its optimizer's variables may not be written:
  ``ValueError`` at the write, when traced (or run eagerly), before any step
  runs with it. Writes through Python's variable methods only: a
  ``tf.raw_ops`` write on a handle is not seen."""
  _guard_variable_writes()
  # The model's variables and its optimizer's, private state included (a
  # review: a metric wrote the batch's labels into the momentum, 982x, and
  # into a pending accumulation's un-noised sum, 2,455C).
  watched = _watched(model, learning_rate=True)
  with _WRITE_GUARD_LOCK:
    _WRITE_GUARD.append((watched, None, None))
  try:
    yield
  finally:
    with _WRITE_GUARD_LOCK:
      _WRITE_GUARD.pop()


def _watched(model, learning_rate=False):
  """ids of the tf.Variables behind the model's variables and its
  optimizer's (its unsaved private state included), but the learning rate
  (set by schedules between epochs) unless ``learning_rate``. Keras 3 or
  tf_keras (whose adapter wraps a Keras 3 optimizer)."""
  optimizer = getattr(model, "optimizer", None)
  variables = list(model.variables)
  rates = []
  for opt in (optimizer, getattr(optimizer, "keras_optimizer", None)):
    if opt is None:
      continue
    rates.append(getattr(opt, "_learning_rate", None))
    owned = getattr(opt, "variables", [])
    variables += list(owned() if callable(owned) else owned)
    private = opt.__dict__.get("_private") if hasattr(opt, "__dict__") else None
    if private is not None and hasattr(private, "all_variables"):
      variables += private.all_variables()
  if not learning_rate:
    variables = [v for v in variables if not any(v is r for r in rates)]
  ids = set()
  for v in variables:
    ids.add(id(v))
    inner = getattr(v, "_value", None)
    if isinstance(inner, tf.Variable):
      ids.add(id(inner))
  return ids


def _library_roots():
  """The directories of Keras 3, tf_keras (when loaded), TensorFlow and this
  package: code there is theirs."""
  # (tf_keras by its module, if loaded: this package does not import it)
  names = ("keras", "tensorflow", "tf_dpadambc", "tf" + "_keras")
  roots = []
  for name in names:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path:
      roots.append(os.path.dirname(os.path.realpath(path)) + os.sep)
  return tuple(roots)


def _library_code(function, roots):
  """True if ``function``'s code lives in ``roots`` (not a user's: found by
  its file, not by a module name a class can claim)."""
  function = getattr(function, "__func__", function)
  code = getattr(function, "__code__", None)
  return code is not None and os.path.realpath(
      code.co_filename).startswith(roots)


def _user_hooks(callbacks):
  """(callback, hook) for every between-steps hook among ``callbacks`` whose
  code is a user's: a custom class's, or a function set on an instance (a
  ``LambdaCallback``'s)."""
  if _is_a(callbacks, "CallbackList"):
    callbacks = callbacks.callbacks
  roots = _library_roots()
  hooks = []
  for callback in tf.nest.flatten(callbacks or []):
    for hook in _BETWEEN_STEPS:
      method = getattr(callback, hook, None)
      if method is None or getattr(method, _WATCHING, False):
        continue
      if not _library_code(method, roots):
        hooks.append((callback, hook))
  return hooks


_WATCHING = "_tf_dpadambc_watching"


def watch_callbacks(model, callbacks):
  """Wraps the between-steps hooks whose code is a user's among
  ``callbacks`` (see :func:`callbacks_write_nothing`); returns a function
  that unwraps them."""
  hooks = _user_hooks(callbacks)
  if not hooks:
    return lambda: None
  _guard_variable_writes()
  watched = _watched(model)
  wrapped = []
  for callback, hook in hooks:
    method = getattr(callback, hook)

    def guarded(*args, _method=method, _hook=hook, _name=type(
        callback).__name__, **kwargs):
      with _WRITE_GUARD_LOCK:
        _WRITE_GUARD.append((watched, _name, _hook))
      try:
        return _method(*args, **kwargs)
      finally:
        with _WRITE_GUARD_LOCK:
          _WRITE_GUARD.pop()
    setattr(guarded, _WATCHING, True)
    # An instance's own hook (set in __init__) is put back as it was.
    wrapped.append((callback, hook, vars(callback).get(hook)))
    setattr(callback, hook, guarded)

  def unwrap():
    for callback, hook, own in wrapped:
      if own is not None:
        setattr(callback, hook, own)
      elif hook in vars(callback):
        delattr(callback, hook)
  return unwrap


@contextlib.contextmanager
def callbacks_write_nothing(model, callbacks):
  """Within it, a user callback's hooks that run between private steps
  (``_BETWEEN_STEPS``) may not write the model's or its optimizer's
  variables (learning rate aside): ``ValueError`` at the write, before the
  next step reads it. Keras' own callbacks are checked by class
  (:func:`check_callbacks`); a custom one cannot be read, so what it does
  is watched: the training logs it is given are not private, and a value
  written from them into the model would train the next steps on them
  without noise."""
  unwrap = watch_callbacks(model, callbacks)
  try:
    yield
  finally:
    unwrap()


def refuse_log_driven_callbacks(model):
  """Wraps ``model.fit`` so that :func:`check_callbacks` (and
  :func:`check_optimizer_is_traced`) run first, and custom callbacks are
  watched (:func:`callbacks_write_nothing`)."""
  fit = model.fit
  signature = inspect.signature(type(model).fit)

  def fit_with_checked_callbacks(*args, **kwargs):
    check_optimizer_is_traced(model)
    callbacks = signature.bind(model, *args, **kwargs).arguments.get(
        "callbacks")
    check_callbacks(callbacks)
    with callbacks_write_nothing(model, callbacks):
      return fit(*args, **kwargs)
  fit_with_checked_callbacks.__doc__ = fit.__doc__
  object.__setattr__(model, "fit", fit_with_checked_callbacks)
