"""The tf_keras adapter's checks around fit and compile (tf_keras.guards):
what make_private's wrappers do for Keras 3, on tf_keras' own fit."""
import warnings

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

tf_keras = pytest.importorskip(
    "tf_keras", reason="tf_keras is not installed (pip install tf-keras)")

import tf_dpadambc  # noqa: E402
from tf_dpadambc import data  # noqa: E402
from tf_dpadambc import tf_keras as dptk  # noqa: E402
from tf_dpadambc.accounting import epsilon as epsilon_lib  # noqa: E402

N, B, D, SIGMA, DELTA = 120, 20, 3, 1.0, 1e-5
LOSS = tf_keras.losses.MeanSquaredError(
    reduction=tf_keras.losses.Reduction.NONE)


def _data(n=N, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, D)).astype("float32"),
          rng.normal(size=(n, 1)).astype("float32"))


def _model(optimizer):
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(D,))])
  model.compile(optimizer=optimizer, loss=LOSS)
  return model


def _fit(model, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return model.fit(*args, verbose=0, **kwargs)


def _weights(model):
  return [w.copy() for w in model.get_weights()]


def _unchanged(model, before):
  return all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))


def _epsilon(event):
  return epsilon_lib.epsilon_of_event(event, DELTA, "rdp")


def _assert_nan_stop_refused(model):
  """TerminateOnNaN on data with one NaN example: refused before a step."""
  x, y = _data()
  y[5] = np.nan
  before = _weights(model)
  with pytest.raises(ValueError, match="TerminateOnNaN"):
    _fit(model, x, y, batch_size=B, callbacks=[
        tf_keras.callbacks.TerminateOnNaN()])
  assert _unchanged(model, before)
  assert model.optimizer.keras_optimizer.steps_taken == 0


def test_callbacks_on_the_training_loss_are_refused_before_any_step():
  # TerminateOnNaN with one NaN example stopped a review's run after 3 steps
  # against 40: the step count told neighbours apart at any σ.
  model = _model(dptk.DPSGD(1.0, SIGMA, learning_rate=0.1))
  _assert_nan_stop_refused(model)
  # A later fit reuses the traced step: its callbacks are checked by fit.
  x, y = _data()
  _fit(model, x, y, batch_size=B)
  for callback in ([tf_keras.callbacks.EarlyStopping(monitor="loss")],
                   [[tf_keras.callbacks.ReduceLROnPlateau(monitor="loss")]]):
    before = _weights(model)
    with pytest.raises(ValueError, match="monitor='loss'"):
      _fit(model, x, y, batch_size=B, callbacks=callback)
    assert _unchanged(model, before)
  # Validation quantities are not computed from the training data: allowed.
  _fit(model, x, y, batch_size=B, validation_data=_data(20, seed=1),
       callbacks=[tf_keras.callbacks.EarlyStopping(monitor="val_loss")])


def test_poisson_accounting_holds_only_for_the_poisson_batches_it_describes():
  x, y = _data()
  optimizer = dptk.DPSGD(1.0, SIGMA, learning_rate=0.1,
                         expected_batch_size=B)
  model = _model(optimizer)
  before = _weights(model)
  # Fixed-size batches: a review got ε 4.04 reported for 12.30.
  with pytest.raises(ValueError, match="poisson_batches"):
    _fit(model, x, y, batch_size=B)
  assert _unchanged(model, before) and optimizer.keras_optimizer.steps_taken == 0
  # train_on_batch: batches fit never sees, declared or refused.
  with pytest.raises(ValueError, match="register_dataset"):
    model.train_on_batch(x[:B], y[:B], sample_weight=np.ones(B, "float32"))
  assert _unchanged(model, before) and optimizer.keras_optimizer.steps_taken == 0
  small = N // 2
  budget = dptk.PrivacyBudget(small, DELTA, verbose=0)
  _fit(model, data.poisson_batches(x[:small], y[:small],
                                   expected_batch_size=B), epochs=2,
       callbacks=[budget])
  steps = optimizer.keras_optimizer.steps_taken
  assert steps > 0
  # Sampled from N/2 examples: accounting them with N understates ε (a
  # review: 3.18 reported for 5.88).
  with pytest.raises(ValueError, match="sampled from N = 60"):
    optimizer.dp_event(N)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      B / small, dp_accounting.GaussianDpEvent(SIGMA)), steps)
  np.testing.assert_allclose(_epsilon(optimizer.dp_event(small)),
                             accountant.get_epsilon(DELTA), rtol=1e-6)
  # The callback reads the Poisson sampling through the adapter (it raised
  # at every epoch's end, reading expected_batch_size from the wrapper).
  assert len(budget.history) == 2
  np.testing.assert_allclose(budget.history[-1], accountant.get_epsilon(DELTA),
                             rtol=1e-6)


def test_the_first_fit_under_a_strategy_is_checked_too():
  # MirroredStrategy (one device too) traces the step in a replica thread:
  # the running fit was not found there, and its callbacks went unchecked
  # (TerminateOnNaN: 3 steps against 40) while its Poisson data was refused.
  with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
    model = _model(dptk.DPSGD(1.0, SIGMA, learning_rate=0.1))
  _assert_nan_stop_refused(model)
  x, y = _data()
  with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
    model = _model(dptk.DPSGD(1.0, SIGMA, learning_rate=0.1,
                              expected_batch_size=B))
  _fit(model, data.poisson_batches(x, y, expected_batch_size=B), epochs=1)
  assert model.optimizer.keras_optimizer.steps_taken > 0
  # The statement reads expected_batch_size through the adapter (it raised).
  assert "Poisson" in tf_dpadambc.optimizer_privacy_statement(
      model.optimizer, num_examples=N, delta=DELTA)


def test_a_recompiled_optimizer_accounts_the_earlier_run():
  # 3 epochs, compile again, 1 epoch: a review got 4.73 reported for 10.73.
  x, y = _data()
  model = _model(dptk.DPSGD(1.0, SIGMA, learning_rate=0.1))
  _fit(model, x, y, batch_size=B, epochs=3)
  model.compile(optimizer=dptk.DPSGD(1.0, SIGMA, learning_rate=0.01),
                loss=LOSS)
  _fit(model, x, y, batch_size=B, epochs=1)
  # The same as one optimizer's uninterrupted 4 epochs (accounted step by
  # step here: no epochs were recorded) ...
  whole = _model(dptk.DPSGD(1.0, SIGMA, learning_rate=0.1))
  _fit(whole, x, y, batch_size=B, epochs=4)
  continued = _epsilon(model.optimizer.dp_event(N, sampling="shuffle"))
  np.testing.assert_allclose(
      continued, _epsilon(whole.optimizer.dp_event(N, sampling="shuffle")),
      rtol=1e-9)
  # ... more than the last epoch's alone (what was reported before).
  last = _model(dptk.DPSGD(1.0, SIGMA, learning_rate=0.01))
  _fit(last, x, y, batch_size=B, epochs=1)
  assert continued > 2 * _epsilon(last.optimizer.dp_event(N,
                                                          sampling="shuffle"))


def test_an_assigned_optimizer_is_refused():
  # The traced step kept the old optimizer; the statement read the new one
  # (a review: ε 0 reported for a model that kept training).
  x, y = _data()
  model = _model(dptk.DPSGD(1.0, SIGMA, learning_rate=0.1))
  _fit(model, x, y, batch_size=B)
  model.optimizer = dptk.DPSGD(1.0, SIGMA, learning_rate=0.1)
  before = _weights(model)
  with pytest.raises(ValueError, match="was replaced"):
    _fit(model, x, y, batch_size=B)
  assert _unchanged(model, before)
  # Compiling it in is the way: the step is traced again, with it.
  model.compile(optimizer=model.optimizer, loss=LOSS)
  _fit(model, x, y, batch_size=B)
  assert model.optimizer.keras_optimizer.steps_taken == N // B
  assert tf.is_tensor(model.optimizer.iterations)


class _LossIntoWeights(tf_keras.callbacks.Callback):
  """Writes the (un-noised) training loss into the model's bias."""

  def on_train_batch_end(self, batch, logs=None):
    bias = self.model.layers[0].bias
    bias.assign(bias + float(logs["loss"]))


@pytest.mark.parametrize("first_fit", [True, False])
def test_a_callback_writing_the_logs_into_the_model_is_refused(first_fit):
  """As for make_private's fit (tests/test_unit_reads.py): a custom
  callback may not write the model's variables between steps, on the
  first fit (watched from its first trace) and on later ones."""
  model = _model(dptk.DPKerasAdamOptimizer(1.0, SIGMA, learning_rate=0.01))
  x, y = _data()
  if not first_fit:
    _fit(model, x, y, batch_size=B)
  with pytest.raises(ValueError, match="wrote the variable"):
    _fit(model, x, y, batch_size=B, callbacks=[_LossIntoWeights()])


def _saved_metric_values(path):
  """Every saved value of a metric variable in a .keras file or a
  SavedModel directory."""
  import io  # pylint: disable=g-import-not-at-top
  import zipfile  # pylint: disable=g-import-not-at-top
  import h5py  # pylint: disable=g-import-not-at-top
  values = {}
  if path.endswith(".keras"):
    with zipfile.ZipFile(path) as archive:
      weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r")
      weights.visititems(lambda name, item: values.__setitem__(
          name, np.asarray(item)) if isinstance(item, h5py.Dataset)
                         and "metrics" in name else None)
    return values
  checkpoint = f"{path}/variables/variables"
  return {name: tf.train.load_variable(checkpoint, name)
          for name, _ in tf.train.list_variables(checkpoint)
          if "metrics" in name}


@pytest.mark.parametrize("save", ["keras", "savedmodel", "checkpoint_callback"])
def test_saved_models_hold_no_training_metric_totals(save, tmp_path):
  """A review: tf_keras saved the compiled metrics' running totals (the
  epoch's un-noised loss sum) with the model, in .keras files, SavedModels
  and so ModelCheckpoint's files: 485 against 17,045 for neighbours at any
  σ. They are saved as zeros; the live logs are untouched."""
  x, y = _data()
  model = _model(dptk.DPKerasSGDOptimizer(
      l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=B // 4,
      learning_rate=1e-3))
  model.compile(optimizer=model.optimizer, loss=LOSS, metrics=["mae"])
  path = str(tmp_path / ("m.keras" if save == "keras" else "m"))
  callbacks = ([tf_keras.callbacks.ModelCheckpoint(path)]
               if save == "checkpoint_callback" else [])
  history = _fit(model, x, y, batch_size=B, epochs=1, callbacks=callbacks)
  assert history.history["loss"][0] > 0 and history.history["mae"][0] > 0
  if save != "checkpoint_callback":
    model.save(path)
  values = _saved_metric_values(path)
  assert values, "no metric variable found in the file"
  for name, value in values.items():
    assert np.all(np.asarray(value) == 0), (name, value)
  # The live metrics still hold the epoch's totals, and a .keras file
  # loads. (A SavedModel of an adapter optimizer's model does not load
  # with tf_keras' load_model, blanks or not: its optimizer's iteration.)
  assert any(float(v.numpy()) > 0 for m in model.metrics for v in m.variables)
  if save == "keras":
    loaded = tf_keras.models.load_model(path, compile=False)
    np.testing.assert_allclose(loaded.predict(x, verbose=0),
                               model.predict(x, verbose=0), rtol=1e-6)


_RELAY = []  # a variable no model tracks


class _BatchedWrite(tf_keras.layers.Layer):
  """Writes the batch's mean into a weight, only in the batched forward
  pass (each unit, evaluated alone, has one row): directly, from a nested
  tf.function, or relayed through a variable no model tracks."""

  def __init__(self, how="direct"):
    super().__init__()
    self.how = how

  def build(self, input_shape):
    self.junk = self.add_weight("junk", shape=(input_shape[-1],),
                                initializer="zeros")
    if not _RELAY:
      _RELAY.append(tf.Variable(tf.zeros([input_shape[-1]])))

  def call(self, x):
    if x.shape[0] != 1:
      mean = tf.reduce_mean(x, 0) * 100.0
      if self.how == "direct":
        self.junk.assign(mean)
      elif self.how == "nested":
        tf.function(lambda m: self.junk.assign(m))(mean)
      else:
        _RELAY[0].assign(mean)
        self.junk.assign(_RELAY[0].read_value())
    return x + 0.0 * self.junk


@pytest.mark.parametrize("how", ["direct", "nested", "relay"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_write_from_the_batched_pass_is_refused(jit_compile, how):
  """A review: a layer wrote the batch mean into a trained weight in the
  batched forward pass only, which the per-unit evaluation never traces:
  691C between neighbours, no error."""
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([tf_keras.Input((D,)), _BatchedWrite(how),
                               tf_keras.layers.Dense(1)])
  model.compile(optimizer=dptk.DPSGD(1.0, 1.0, learning_rate=0.1), loss=LOSS,
                jit_compile=jit_compile)
  before = _weights(model)
  x, y = _data()
  with pytest.raises(ValueError, match="wrote a value computed from the batch"):
    _fit(model, x, y, batch_size=B)
  assert _unchanged(model, before)


class _LeakyMetric(tf_keras.metrics.Metric):
  """Adds 100·mean(y) to a variable of the model or of its optimizer."""

  def __init__(self, target):
    super().__init__(name="leaky")
    self.target = target
    self.total = self.add_weight("t", shape=(), initializer="zeros")

  def update_state(self, y_true, y_pred, sample_weight=None):
    stat = 100.0 * tf.reduce_mean(y_true)
    for v in self.target():
      v.assign_add(tf.cast(stat, v.dtype) * tf.ones_like(v))
    self.total.assign(stat)

  def result(self):
    return self.total


@pytest.mark.parametrize("target", ["kernel", "momentum"])
def test_a_metric_writing_the_model_or_optimizer_is_refused(target):
  """A review: on tf_keras nothing guarded the metrics (a metric wrote the
  kernel, 9,064C; the optimizer's momentum, 5,234C)."""
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([tf_keras.Input((D,)), tf_keras.layers.Dense(1)])
  optimizer = dptk.DPSGD(1.0, 1.0, learning_rate=0.1, momentum=0.5)
  def variables():
    if target == "kernel":
      return [model.layers[0].kernel]
    inner = optimizer.keras_optimizer
    return [v for v in inner.variables if "momentum" in v.path]
  model.compile(optimizer=optimizer, loss=LOSS,
                metrics=[_LeakyMetric(variables)])
  x, y = _data()
  with pytest.raises(ValueError, match="A metric wrote the variable"):
    _fit(model, x, y, batch_size=B)
  model.compile(optimizer=dptk.DPSGD(1.0, 1.0, learning_rate=0.1),
                loss=LOSS, metrics=["mae"])  # ordinary metrics still work
  assert "mae" in _fit(model, x, y, batch_size=B).history


def test_a_seed_generator_written_from_a_unit_is_refused():
  """A review: a Keras 3 SeedGenerator's state (written freely: it is the
  layer's randomness) carried one unit's example to the next units and
  steps: 17.5C at B = 16."""
  import keras  # pylint: disable=g-import-not-at-top

  class Carrier(keras.layers.Layer):
    def __init__(self):
      super().__init__()
      self.seed = keras.random.SeedGenerator(0)

  class Model(tf_keras.Model):
    def __init__(self):
      super().__init__()
      self.carrier = Carrier()
      self.dense = tf_keras.layers.Dense(1)

    def call(self, x, training=None):
      state = self.carrier.seed.state
      out = self.dense(x + tf.cast(state.value, tf.float32)[None, :1] * 1e-3)
      if x.shape[0] == 1:  # inside the per-unit evaluation
        state.assign(tf.cast(tf.round(
            tf.pad(x[0, :1], [[0, 1]]) * 1e3), state.dtype))
      return out

  tf_keras.utils.set_random_seed(0)
  x, y = _data()
  model = Model()
  model(x[:1])
  model.compile(optimizer=dptk.DPSGD(1.0, 1.0, learning_rate=0.1), loss=LOSS)
  before = _weights(model)
  with pytest.raises(ValueError, match="writes state"):
    _fit(model, x, y, batch_size=B)
  assert _unchanged(model, before)
