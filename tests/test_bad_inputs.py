"""Bad inputs: a clear error or documented behaviour (README, "Bad inputs"),
never a silently non-private step, and the accounting never counts a step
that did not release.

* non-finite features, labels or sample weights: the unit's gradient is
  zeroed (``dp_nonfinite_examples``), the step still releases noise and is
  counted, and the bad unit has no influence on the update;
* empty data, and the end of a dataset of unknown size: no step (Keras'
  own ``iterations`` advances on the failed read; ours does not);
* a batch of one: trains, ε for q = B/N = 1;
* labels out of range, ids beyond an Embedding's vocabulary: TensorFlow
  raises before anything is released (CPU); under XLA ids are clamped;
* wrong dtypes: strings raise; numeric features and labels are cast.
"""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp

N, D, K = 8, 4, 3


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(N, D)).astype("float32"),
          rng.integers(0, K, size=N).astype("int32"))


def _model(sigma=1.0, loss="sparse_categorical_crossentropy", out=K,
           jit_compile="auto", **kwargs):
  keras.utils.set_random_seed(1)
  model = dp.make_private(keras.Sequential([
      keras.Input((D,)), keras.layers.Dense(6, activation="tanh"),
      keras.layers.Dense(out)]))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # σ = 0
    opt = dp.DPSGD(1.0, sigma, learning_rate=1.0, seed=3, **kwargs)
  model.compile(optimizer=opt, loss=loss, jit_compile=jit_compile)
  return model, opt


def _flat(model):
  return np.concatenate([w.ravel() for w in model.get_weights()])


_REFERENCES = {}  # (regression, σ) -> update: shared by the cases


@pytest.mark.parametrize("where", ["x_nan", "y_inf", "weight_nan"])
def test_a_nonfinite_unit_is_zeroed_and_the_step_still_releases(where):
  x, y = _data()
  regression = where == "y_inf"
  loss = "mse" if regression else "sparse_categorical_crossentropy"
  out = 1 if regression else K
  if regression:
    y = np.random.default_rng(1).normal(size=(N, 1)).astype("float32")
  w = np.ones(N, "float32")
  bad_x, bad_y, bad_w = x.copy(), y.copy(), w.copy()
  if where == "x_nan":
    bad_x[3, 1] = np.nan
  elif where == "y_inf":
    bad_y[3] = np.inf
  else:
    bad_w[3] = np.nan

  def step(xs, ys, ws, sigma=1.0):
    model, opt = _model(sigma, loss=loss, out=out)
    before = _flat(model)
    history = model.fit(xs, ys, sample_weight=ws, batch_size=N, epochs=1,
                        shuffle=False, verbose=0)
    return _flat(model) - before, opt, history.history

  update, opt, logs = step(bad_x, bad_y, bad_w)
  assert np.all(np.isfinite(update))
  assert opt.steps_taken == 1 and logs["dp_nonfinite_examples"] == [1.0]
  # The bad unit has no influence: the same step with that example's weight
  # 0 (a finite unit contributing exactly 0, the same B) gives the same
  # update, noise included (same seed).
  zero_w = w.copy()
  zero_w[3] = 0.0
  for sigma in (1.0, 0.0):
    if (regression, sigma) not in _REFERENCES:
      _REFERENCES[regression, sigma] = step(x, y, zero_w, sigma)[0]
  np.testing.assert_allclose(update, _REFERENCES[regression, 1.0], rtol=0,
                             atol=1e-6)
  # And the step released noise: without it the update differs.
  assert np.max(np.abs(update - _REFERENCES[regression, 0.0])) > 1e-2


@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_empty_data_takes_and_counts_no_step(kind):
  x, y = _data()
  model, opt = _model()
  before = _flat(model)
  if kind == "arrays":
    model.fit(x[:0], y[:0], batch_size=4, verbose=0)
  else:
    model.fit(tf.data.Dataset.from_tensor_slices((x[:0], y[:0])).batch(4),
              verbose=0)
  assert opt.steps_taken == 0
  np.testing.assert_array_equal(_flat(model), before)
  assert float(opt.noise_variance.numpy()) == 0.0
  with pytest.raises(ValueError, match="no private step"):
    dp.optimizer_privacy_statement(opt, N, 1e-5)


class _Sizes(keras.utils.PyDataset):
  """Batches of the given sizes, an empty one among them."""

  def __init__(self, x, y, sizes):
    super().__init__()
    self.x, self.y, self.sizes = x, y, sizes

  def __len__(self):
    return len(self.sizes)

  def __getitem__(self, i):
    start = sum(self.sizes[:i])
    return (self.x[start:start + self.sizes[i]],
            self.y[start:start + self.sizes[i]])


def test_an_empty_batch_releases_noise_divided_by_one():
  # It was divided by 0: noise_variance inf and every weight non-finite.
  x, y = _data()
  model, opt = _model(sigma=1.0)
  model.fit(_Sizes(x, y, [4, 0]), epochs=1, verbose=0, shuffle=False)
  assert opt.steps_taken == 2
  assert np.all(np.isfinite(_flat(model)))
  assert float(opt.noise_variance.numpy()) == pytest.approx(1.0)  # (σC/1)²


def test_the_end_of_a_dataset_of_unknown_size_is_not_a_step():
  """Keras runs one more compiled step per epoch that fails on reading its
  data; its `iterations` advances anyway (6 for 4 batches here). The DP
  optimizer's step waits for the data, so only the 4 releases count."""
  x, y = _data()
  data = tf.data.Dataset.from_tensor_slices((x, y)).filter(
      lambda a, b: True).batch(4)
  assert int(data.cardinality()) == tf.data.UNKNOWN_CARDINALITY
  model, opt = _model()
  model.fit(data, epochs=2, verbose=0)
  assert opt.steps_taken == 4
  plain = keras.Sequential([keras.Input((D,)), keras.layers.Dense(K)])
  plain.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
  plain.fit(data, epochs=2, verbose=0)
  assert int(plain.optimizer.iterations.numpy()) == 6  # Keras' own count


def test_a_batch_of_one_trains_and_is_accounted():
  x, y = _data()
  model, opt = _model()
  before = _flat(model)
  model.fit(x[:1], y[:1], batch_size=1, verbose=0)
  assert opt.steps_taken == 1 and opt.logical_batch_size == 1
  assert np.all(np.isfinite(_flat(model))) and np.any(_flat(model) != before)
  assert float(opt.noise_variance.numpy()) == pytest.approx(1.0)  # (σC/1)²
  text = dp.optimizer_privacy_statement(opt, 1, 1e-5)
  assert "q = B/N = 1" in text


@pytest.mark.parametrize("make", [
    lambda path: keras.callbacks.TerminateOnNaN(),
    lambda path: keras.callbacks.EarlyStopping(monitor="loss"),
    lambda path: keras.callbacks.ReduceLROnPlateau(monitor="accuracy"),
    lambda path: keras.callbacks.ModelCheckpoint(
        path, monitor="loss", save_best_only=True),
])
def test_callbacks_acting_on_the_training_logs_are_refused(make, tmp_path):
  # The logs are not noised: a review told a dataset from its neighbour by
  # the saved step count, at any σ, with TerminateOnNaN and one NaN example
  # or EarlyStopping(monitor="loss") and one outlier.
  x, y = _data()
  model, opt = _model()
  before = _flat(model)
  callback = make(str(tmp_path / "best.keras"))
  with pytest.raises(ValueError, match="noise"):
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback])
  _assert_nothing_released(model, opt, before)
  # Validation quantities, and checkpoints of every epoch, are fine.
  model.fit(x, y, batch_size=4, verbose=0, validation_data=(x, y),
            callbacks=[keras.callbacks.EarlyStopping(),
                       keras.callbacks.ModelCheckpoint(
                           str(tmp_path / "each.keras"), monitor="loss")])
  assert opt.steps_taken == 2


def _assert_nothing_released(model, opt, before):
  assert opt.steps_taken == 0
  np.testing.assert_array_equal(_flat(model), before)
  assert not opt.built or float(opt.noise_variance.numpy()) == 0.0


@pytest.mark.parametrize("label", [K, -1])
def test_labels_out_of_range_raise_before_any_release(label):
  x, y = _data()
  y[2] = label
  model, opt = _model()
  before = _flat(model)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="outside the valid range"):
    model.fit(x, y, batch_size=N, verbose=0)
  _assert_nothing_released(model, opt, before)


def _embedding_model(jit_compile):
  keras.utils.set_random_seed(1)
  model = dp.make_private(keras.Sequential([
      keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4),
      keras.layers.Flatten(), keras.layers.Dense(K)]))
  opt = dp.DPSGD(1.0, 1.0, learning_rate=1.0, seed=3)
  model.compile(optimizer=opt, loss="sparse_categorical_crossentropy",
                jit_compile=jit_compile)
  return model, opt


@pytest.mark.slow
def test_ids_beyond_the_vocabulary():
  ids = np.random.default_rng(2).integers(0, 10, size=(N, 3)).astype("int32")
  _, y = _data()
  bad = ids.copy()
  bad[1, 0] = 25
  # Without XLA TensorFlow's lookup raises: nothing released or counted.
  model, opt = _embedding_model(False)
  before = _flat(model)
  with pytest.raises(tf.errors.InvalidArgumentError, match="not in"):
    model.fit(bad, y, batch_size=N, verbose=0)
  _assert_nothing_released(model, opt, before)
  # Under XLA the lookup clamps the id to the last row (9): the step is the
  # step of that clamped id, clipped as such (the per-unit norms use the same
  # clamped rows), so it is private — and documented.
  model, opt = _embedding_model(True)
  before = _flat(model)
  model.fit(bad, y, batch_size=N, verbose=0)
  clamped_update = _flat(model) - before
  clamped = ids.copy()
  clamped[1, 0] = 9
  model, opt = _embedding_model(True)
  model.fit(clamped, y, batch_size=N, verbose=0)
  np.testing.assert_allclose(clamped_update, _flat(model) - before,
                             rtol=0, atol=1e-6)
  assert opt.steps_taken == 1


def test_wrong_dtypes():
  x, y = _data()
  # Strings where numbers are expected: a clear error, nothing released.
  model, opt = _model()
  before = _flat(model)
  with pytest.raises(ValueError, match="dtype"):
    model.fit(np.full((N, D), "a"), y, batch_size=N, verbose=0)
  _assert_nothing_released(model, opt, before)
  # Numeric features of another dtype are cast to the layer's (float32):
  # the same step as float32 features.
  updates = []
  for xs in (x, x.astype("float64")):
    model, opt = _model()
    before = _flat(model)
    model.fit(xs, y, batch_size=N, verbose=0)
    updates.append(_flat(model) - before)
  np.testing.assert_allclose(updates[0], updates[1], rtol=0, atol=1e-6)
  # Float labels for a sparse loss are cast to integers (Keras truncates):
  # the same step as the integer labels.
  model, opt = _model()
  before = _flat(model)
  model.fit(x, y.astype("float32") + 0.25, batch_size=N, verbose=0)
  np.testing.assert_allclose(_flat(model) - before, updates[0], rtol=0,
                             atol=1e-6)
