"""Every use of a private Keras 3 attribute, in one place.

The private train step needs four things Keras 3 does not expose publicly:
the compiled loss (to evaluate it on one unit at a time), the loss tracker
(so that ``loss`` in the logs means what it means in plain Keras), the
random-seed generators of stochastic layers (to detect them, and to advance
them after each step) and the variables each layer owns directly (ghost
clipping records them per layer). Ghost clipping also relies on every
variable read inside a ``keras.StatelessScope`` going through the scope's
``get_current_value``. ``tests/test_training.py`` fails loudly if a Keras release
renames any of them. (Poisson batches also set the Keras mask of the
predictions, ``keras.src.backend.common.masking``; tests/test_poisson.py.
The train step's state is built before its first trace with Keras'
``_symbolic_build``; tests/test_training.py checks that the step traces once.)
"""
import keras
from keras.src.backend.common import masking
import tensorflow as tf


def compiled_loss(model):
  """The callable ``(y_true, y_pred, sample_weight) -> scalar`` built by compile()."""
  loss = getattr(model, "_compile_loss", None)
  if loss is None:
    raise ValueError(
        "The model was compiled without a loss. The private train step needs "
        "`model.compile(loss=...)`: the loss is evaluated on each example to "
        "clip its gradient.")
  return loss


def without_loss_trackers(loss):
  """A scope in which Keras' compiled loss computes without touching its
  per-output loss trackers: their values read as zeros (no read of the
  variables, which the logs write from the batch) and their updates are
  captured and dropped (a StatelessScope)."""
  trackers = list(getattr(loss, "variables", None) or [])
  return keras.StatelessScope(state_mapping=[
      (v, tf.zeros(v.shape, v.dtype)) for v in trackers])


def example_loss_fn(model):
  """``(y_true, y_pred) -> per-example values`` for a single-output model
  compiled with a single loss, or ``None`` (several outputs or losses).

  Uses the public ``model.loss`` (what was passed to compile): a Loss object's
  unreduced ``call`` or a loss function. Sample weights and the reduction are
  applied by the private train step itself.
  """
  loss = model.loss
  if isinstance(loss, (list, tuple)) and len(loss) == 1:
    loss = loss[0]
  if loss is None or isinstance(loss, (dict, list, tuple)):
    return None
  loss = keras.losses.get(loss)
  if isinstance(loss, keras.losses.Loss):
    return loss.call
  return loss


def loss_tracker(model):
  """The Mean metric behind ``logs['loss']``."""
  return model._loss_tracker  # pylint: disable=protected-access


def flatten_layers(model):
  """All layers of the model, recursively, including the model itself."""
  return list(model._flatten_layers(include_self=True, recursive=True))  # pylint: disable=protected-access


def own_trainable_variables(layer):
  """The trainable variables a layer created itself (not its sublayers')."""
  return [v for v in layer._trainable_variables if v.trainable]  # pylint: disable=protected-access


def has_recurrent_layers(model):
  """True if the model has a Keras recurrent layer (LSTM, GRU, RNN, ...)."""
  return any(isinstance(layer, keras.layers.RNN)
             for layer in flatten_layers(model))


def seed_generators(model):
  """The ``keras.random.SeedGenerator`` objects of the model's layers."""
  return [sg for layer in flatten_layers(model)
          for sg in getattr(layer, "_seed_generators", [])]  # pylint: disable=protected-access


def reset_metrics_too(model, metrics):
  """Makes ``model.reset_metrics()`` (called by fit at each epoch) reset ``metrics``.

  The metrics stay out of ``model.metrics`` so that evaluate() and the
  validation logs do not report training-only quantities.
  """
  reset = model.reset_metrics

  def reset_metrics():
    reset()
    for metric in metrics:
      metric.reset_state()
  object.__setattr__(model, "reset_metrics", reset_metrics)


def mask_rows(outputs, keep):
  """Marks the rows where ``keep`` [B] is False as masked (Keras mask, ANDed
  with any mask already there), so that metrics compiled with ``metrics=``
  — which Keras does not weight — skip them (MeanMetricWrapper honours it)."""
  def mark(t):
    old = masking.get_keras_mask(t)
    if old is None:
      masking.set_keras_mask(t, keep)
    else:
      old = tf.cast(old, tf.bool)
      masking.set_keras_mask(t, tf.logical_and(old, tf.reshape(
          keep, [-1] + [1] * (old.shape.rank - 1))))
  for t in tf.nest.flatten(outputs):
    mark(t)


def build_before_first_trace(model, iterator):
  """Creates the model's, the compiled metrics' and loss' and the optimizer's
  variables from the batch spec of ``iterator``, before the train step is
  first traced.

  Without a distribution strategy Keras defers that build to the first trace
  of the train function; a ``tf.function`` whose first trace creates
  variables traces a second time (the first only lifts the initializers out),
  so every ``fit`` traced the private step twice. Keras runs the same symbolic
  build itself under a strategy. Where the batch spec is unknown
  (``train_on_batch``) or the model cannot be built symbolically, the step
  builds its state while tracing, as before: a second trace, nothing else.
  """
  build = getattr(model, "_symbolic_build", None)
  spec = getattr(iterator, "element_spec", None)
  leaves = tf.nest.flatten(spec)
  if build is None or not leaves or not all(
      type(s) is tf.TensorSpec for s in leaves):  # pylint: disable=unidiomatic-typecheck
    return
  batch = tf.nest.map_structure(
      lambda s: keras.KerasTensor(s.shape, s.dtype.name), spec)
  optimizer = getattr(model, "optimizer", None)
  unbuilt = optimizer is not None and not optimizer.built
  try:
    with model.distribute_strategy.scope():
      build(data_batch=batch)
  except Exception:  # pylint: disable=broad-except
    if unbuilt and optimizer.built:
      raise  # the optimizer's own refusal (invalid arguments): as in a trace
    # The model or its metrics could not be built symbolically: the trace
    # builds them with the real tensors (and raises there if they cannot run).
