"""The tf_keras adapter's checks around ``fit`` and ``compile``.

Keras 3 models get them from ``make_private``'s wrappers; a tf_keras model is
compiled with an adapter optimizer and trained with tf_keras' own ``fit``,
so the adapter installs them when its step is first traced for the model
(inside that ``fit``). A review found each one missing on tf_keras:

- callbacks acting on the un-noised training logs (``TerminateOnNaN`` with one
  NaN example: 3 steps against 40, telling neighbours apart at any σ);
- Poisson accounting of fixed-size batches (ε 4.04 reported for 12.30), or of
  batches sampled from fewer examples than accounted (3.18 for 5.88);
- compiling a new DP optimizer: its ε left out the earlier run (4.73
  reported for 10.73);
- assigning ``model.optimizer`` after the step was traced: the step kept the
  old optimizer, the statement read the new one (ε 0 reported for 10.73);
- epochs taken for passes over the data whatever the data (an infinite
  ``take(N/2).repeat()`` dataset with ``steps_per_epoch``: ε 9.01 reported
  for 13.78): the fit's data is classified as Keras 3's is
  (``accounting.ledger.fit_data``), and the privacy callbacks record its
  epochs as passes only where they are.
"""
import inspect
import sys
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable_base  # pylint: disable=g-direct-tensorflow-import
import tf_keras

from tf_dpadambc import queries
from tf_dpadambc.accounting import ledger
from tf_dpadambc.keras import training
from tf_dpadambc.keras import validation

_GUARDED = "_tf_dpadambc_fit_guarded"
# Frames searched for the running fit, from the top of each thread's stack.
_MAX_FRAMES = 200
_FIT_SIGNATURE = inspect.signature(tf_keras.Model.fit)


def on_step(model, optimizer):
  """Checks ``model``'s running ``fit`` and wires the accounting; called by
  the adapter each time it traces (or eagerly runs) a step for ``model``.

  Raises ``ValueError`` before the step releases anything: for callbacks
  driven by the training logs, and for data the optimizer's Poisson
  accounting does not hold for. The first call also wraps ``model.fit``,
  which checks the same (and a replaced ``model.optimizer``) before every
  later ``fit``, whose step is not traced again.
  """
  if not isinstance(model, tf_keras.Model):
    return  # a Keras 3 model (make_private checks it) in a custom loop
  _guard_fit(model)
  running = _running_fit(model)
  # Eagerly, also while tracing: the ledgers read and write variables.
  with tf.init_scope():
    try:
      if running is not None:
        _check_fit(optimizer, running)
        _classify_fit_data(optimizer, running)
        # The first fit's callbacks (later fits: guarded_fit) are watched
        # from its first step on; they stay wrapped after it.
        validation.watch_callbacks(model, running.get("callbacks"))
      # fit checked its dataset; train_on_batch or a custom loop declares.
      ledger.require_poisson_dataset(optimizer, in_fit=running is not None)
      inner = getattr(optimizer, "keras_optimizer", optimizer)
      queries.check_not_under_xla(getattr(inner, "query", None),
                                  getattr(model, "_jit_compile", False))
    except ValueError:
      # Refused inside the first trace, which may have created variables:
      # the next fit makes a new train function instead of retracing it.
      model.train_function = None
      raise
    # The weights carry the releases of the DP optimizer this model trained
    # with before: a new one's ε composes them (as compile does in Keras 3).
    training._continue_accounting(model, None, optimizer)  # pylint: disable=protected-access
  object.__setattr__(model, validation.TRACED_OPTIMIZER,
                     weakref.ref(optimizer))
  _PRIVATE_MODELS.add(model)
  _install_blank_metric_saving()


# The compiled metrics of a model trained privately (the loss tracker's and
# the metrics' running totals over the epoch) hold un-noised training logs.
# tf_keras saves them with the model — .keras and SavedModel files, so
# ModelCheckpoint's too: a review told neighbouring datasets apart from the
# saved loss total (485 against 17,045) at any σ. They are saved as zeros:
# the live metrics (the logs, the progress bar) are untouched; a loaded
# model's metrics start from zero, as every epoch's do.
_PRIVATE_MODELS = weakref.WeakSet()
_BLANKS = "_tf_dpadambc_saved_blank"


def _keeps_logs(metric):
  for model in list(_PRIVATE_MODELS):
    try:
      metrics = model.metrics
    except Exception:  # pylint: disable=broad-except
      continue
    if any(m is metric for m in metrics):
      return True
  return False


def _saved_blank(metric, variable):
  """Makes ``variable`` (of ``metric``) write zeros into object-graph files
  (SavedModel: it is reached there by several paths, each writing the same
  object's serialized value) while ``metric`` is a private model's."""
  if variable.__dict__.get(_BLANKS):
    return
  serialize = variable._serialize_to_tensors  # pylint: disable=protected-access

  def blank_serialize():
    if not _keeps_logs(metric):
      return serialize()
    with tf.init_scope(), tf.device("/device:CPU:0"):
      return {trackable_base.VARIABLE_VALUE_KEY:
                  tf.zeros(variable.shape, variable.dtype)}

  variable._serialize_to_tensors = blank_serialize  # pylint: disable=protected-access
  variable.__dict__[_BLANKS] = True


def _install_blank_metric_saving():
  metric_class = tf_keras.metrics.Metric
  if metric_class.__dict__.get("_tf_dpadambc_blank_saving"):
    return
  save_own_variables = metric_class.save_own_variables
  trackable_children = metric_class._trackable_children  # pylint: disable=protected-access

  def blank_save_own_variables(self, store):  # .keras files
    if not _keeps_logs(self):
      return save_own_variables(self, store)
    weights = self._trainable_weights + self._non_trainable_weights  # pylint: disable=protected-access
    for i, variable in enumerate(weights):
      store[f"{i}"] = np.zeros(variable.shape, variable.dtype.as_numpy_dtype)
    return None

  def blank_trackable_children(self, save_type="checkpoint", **kwargs):
    children = trackable_children(self, save_type, **kwargs)  # SavedModel
    if _keeps_logs(self):
      for variable in self.variables:
        _saved_blank(self, variable)
    return children

  metric_class.save_own_variables = blank_save_own_variables
  metric_class._trackable_children = blank_trackable_children  # pylint: disable=protected-access
  metric_class._tf_dpadambc_blank_saving = True  # pylint: disable=protected-access


def _check_fit(optimizer, arguments):
  if ledger.ledger_of(optimizer) is None:
    return  # compiled again without a DP optimizer: nothing private runs
  validation.check_callbacks(arguments.get("callbacks"))
  ledger.check_poisson_data(optimizer, arguments.get("x"))


def _classify_fit_data(optimizer, arguments):
  """Tells the ledger whether this fit's epochs are passes over its data
  (the decision Keras 3's make_private fit takes: ``ledger.fit_data``)."""
  accounting = ledger.ledger_of(optimizer)
  inner = getattr(optimizer, "keras_optimizer", optimizer)
  if accounting is None or getattr(inner, "expected_batch_size",
                                   None) is not None:
    return  # no ledger, or Poisson batches (their ε counts steps)
  accounting.begin_fit(ledger.fit_data(
      arguments.get("x"), arguments.get("steps_per_epoch"),
      arguments.get("batch_size"), arguments.get("validation_split") or 0.,
      tf_keras=True))


def _running_fit(model):
  """The arguments of tf_keras ``Model.fit`` running for ``model`` (the
  frame of its own code, ``self`` the model), or None. In every thread: a
  tf.distribute strategy (MirroredStrategy, also on one device) traces the
  step in a replica thread while fit waits in the caller's (a review: its
  first fit went unchecked, TerminateOnNaN included)."""
  for top in sys._current_frames().values():  # pylint: disable=protected-access
    frame = top
    for _ in range(_MAX_FRAMES):
      if frame is None:
        break
      code = frame.f_code
      if (code.co_name == "fit" and frame.f_locals.get("self") is model
          and "tf_keras" in code.co_filename):
        return frame.f_locals
      frame = frame.f_back
  return None


def _guard_metrics(model):
  """tf_keras' train step updates the metrics from the batch after the
  private step (``compute_metrics``, also a subclass's override): there the
  model's and the optimizer's variables may not be written, as in Keras 3's
  logs stage (a review: a metric writing the kernel, 9,064C; the optimizer's
  momentum, 5,234C; a context variable the next step reads, 7.6C)."""
  compute_metrics = model.compute_metrics

  def guarded_compute_metrics(*args, **kwargs):
    with validation.model_unwritten(model):
      return compute_metrics(*args, **kwargs)

  object.__setattr__(model, "compute_metrics", guarded_compute_metrics)


def _guard_fit(model):
  if model.__dict__.get(_GUARDED):
    return
  fit = model.fit

  def guarded_fit(*args, **kwargs):
    validation.check_optimizer_is_traced(model)
    try:
      arguments = _FIT_SIGNATURE.bind(model, *args, **kwargs).arguments
    except TypeError:
      return fit(*args, **kwargs)  # let tf_keras report the bad call
    optimizer = getattr(model, "optimizer", None)
    _check_fit(optimizer, arguments)
    _classify_fit_data(optimizer, arguments)
    with validation.callbacks_write_nothing(model,
                                            arguments.get("callbacks")):
      return fit(*args, **kwargs)

  guarded_fit.__doc__ = fit.__doc__
  # object.__setattr__: out of tf_keras' tracking and of saved models.
  object.__setattr__(model, "fit", guarded_fit)
  _guard_metrics(model)
  training.declared_train_on_batch(model)
  object.__setattr__(model, _GUARDED, True)
