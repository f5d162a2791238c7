"""Preprocessing layers adapted on the data are refused (Keras 3, tf_keras).

adapt() computes its statistics from every raw example, without clipping or
noise, and they are saved with the model (a review: a saved Normalization
mean moved by |x|/N between neighbouring datasets). The same statistics
given to the constructor (public values) are allowed.
"""
import warnings

import keras
import numpy as np
import pytest

import tf_dpadambc as dp

N, D, K = 16, 3, 2


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, D)).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _numeric(layer):
  return keras.Sequential([keras.Input((D,)), layer, keras.layers.Dense(K)])


def _strings(layer, dtype="string"):
  return keras.Sequential([keras.Input((1,), dtype=dtype), layer,
                           keras.layers.Embedding(8, 2),
                           keras.layers.Flatten(), keras.layers.Dense(K)])


def _adapted(layer, data):
  layer.adapt(data)
  return layer


_WORDS = np.array([["a"], ["b"], ["a"], ["c"]])

ADAPTED = {
    "normalization": lambda: _numeric(_adapted(
        keras.layers.Normalization(name="adapted"), _data()[0])),
    "discretization": lambda: _numeric(_adapted(
        keras.layers.Discretization(num_bins=3, name="adapted"),
        _data()[0])),
    "string_lookup": lambda: _strings(_adapted(
        keras.layers.StringLookup(name="adapted"), _WORDS)),
    "integer_lookup": lambda: _strings(_adapted(
        keras.layers.IntegerLookup(name="adapted"),
        np.array([[1], [2], [1]])), dtype="int64"),
    "text_vectorization": lambda: keras.Sequential([
        keras.Input((1,), dtype="string"),
        _adapted(keras.layers.TextVectorization(
            output_sequence_length=2, name="adapted"), ["a b", "c a"]),
        keras.layers.Embedding(8, 2), keras.layers.Flatten(),
        keras.layers.Dense(K)]),
}

GIVEN = {
    "normalization": lambda: _numeric(keras.layers.Normalization(
        mean=[0., 1., 2.], variance=[1., 2., 3.])),
    "never_adapted": lambda: _numeric(keras.layers.Normalization()),
    "discretization": lambda: _numeric(keras.layers.Discretization(
        bin_boundaries=[-1., 0., 1.])),
    "string_lookup": lambda: _strings(keras.layers.StringLookup(
        vocabulary=["a", "b"])),
    "integer_lookup": lambda: _strings(keras.layers.IntegerLookup(
        vocabulary=[1, 2]), dtype="int64"),
    "text_vectorization": lambda: keras.Sequential([
        keras.Input((1,), dtype="string"),
        keras.layers.TextVectorization(vocabulary=["a", "b"],
                                       output_sequence_length=2),
        keras.layers.Embedding(8, 2), keras.layers.Flatten(),
        keras.layers.Dense(K)]),
}


@pytest.mark.parametrize("kind", sorted(ADAPTED))
def test_keras3_adapted_layer_is_refused(kind):
  model = ADAPTED[kind]()
  with pytest.raises(ValueError, match=(
      r"'adapted' \(\w+\) holds .* computed by adapt\(\).*without clipping "
      r"or noise.*pass them to the constructor \(\w+\((mean|bin_boundaries|"
      r"vocabulary)=")):
    dp.make_private(model)


@pytest.mark.parametrize("kind", sorted(GIVEN))
def test_keras3_layer_with_constructor_values_is_allowed(kind):
  dp.make_private(GIVEN[kind]())


def test_keras3_model_with_given_normalization_trains():
  x, y = _data()
  model = dp.make_private(GIVEN["normalization"]())
  model.compile(optimizer=dp.DPAdamBC(l2_norm_clip=1.0, noise_multiplier=1.0),
                loss=_loss())
  before = [v.numpy() for v in model.trainable_variables]
  model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  after = [v.numpy() for v in model.trainable_variables]
  assert all(np.all(np.isfinite(a)) for a in after)
  assert any(not np.array_equal(a, b) for a, b in zip(after, before))


def test_keras3_layer_adapted_after_make_private_is_refused_by_fit():
  x, y = _data()
  norm = keras.layers.Normalization(name="late")
  model = dp.make_private(_numeric(norm))
  model.compile(optimizer=dp.DPAdamBC(l2_norm_clip=1.0, noise_multiplier=1.0),
                loss=_loss())
  norm.adapt(x)
  before = [v.numpy() for v in model.trainable_variables]
  with pytest.raises(ValueError, match=r"'late' \(Normalization\).*adapt"):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  for v, b in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(v.numpy(), b)


# ------------------------------------------------------------------ tf_keras
def _tf_keras_fit(model, x, y):
  tf_keras = pytest.importorskip("tf_keras")
  from tf_dpadambc import tf_keras as dptk  # pylint: disable=g-import-not-at-top
  model.compile(
      optimizer=dptk.DPAdamBC(l2_norm_clip=1.0, noise_multiplier=1.0),
      loss=tf_keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction=tf_keras.losses.Reduction.NONE))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def _tf_keras_model(norm):
  tf_keras = pytest.importorskip("tf_keras")
  return tf_keras.Sequential([tf_keras.Input((D,)), norm,
                              tf_keras.layers.Dense(K)])


def test_tf_keras_adapted_normalization_is_refused_before_any_update():
  tf_keras = pytest.importorskip("tf_keras")
  x, y = _data()
  norm = tf_keras.layers.Normalization(name="adapted")
  norm.adapt(x)
  model = _tf_keras_model(norm)
  before = [v.numpy() for v in model.trainable_variables]
  with pytest.raises(ValueError, match=(
      r"'adapted' \(Normalization\) holds a mean and variance.*adapt\(\)"
      r".*Normalization\(mean=\.\.\., variance=\.\.\.\)")):
    _tf_keras_fit(model, x, y)
  for v, b in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(v.numpy(), b)


def test_keras3_adapted_layer_inside_tf_keras_model_is_refused():
  tf_keras = pytest.importorskip("tf_keras")
  x, y = _data()

  class Net(tf_keras.Model):
    def __init__(self):
      super().__init__()
      self.norm = _adapted(keras.layers.Normalization(name="adapted3"), x)
      self.out = tf_keras.layers.Dense(K)

    def call(self, inputs):
      return self.out(self.norm(inputs))

  with pytest.raises(ValueError, match=r"'adapted3' \(Normalization\)"):
    _tf_keras_fit(Net(), x, y)


def test_tf_keras_layers_with_constructor_values_are_allowed():
  tf_keras = pytest.importorskip("tf_keras")
  from tf_dpadambc.keras import validation  # pylint: disable=g-import-not-at-top
  for layer in (tf_keras.layers.Normalization(mean=[0., 1., 2.],
                                              variance=[1., 2., 3.]),
                tf_keras.layers.Normalization(),
                tf_keras.layers.StringLookup(vocabulary=["a", "b"]),
                tf_keras.layers.TextVectorization(vocabulary=["a", "b"]),
                tf_keras.layers.Discretization(bin_boundaries=[0., 1.]),
                tf_keras.layers.Hashing(num_bins=3)):
    assert validation.adapted_preprocessing(layer) is None, layer.name


def test_tf_keras_model_with_given_discretization_trains():
  # (A given Normalization's mean is an eager constant, which per-unit
  # evaluation refuses as captured data; bin boundaries are Python.)
  tf_keras = pytest.importorskip("tf_keras")
  x, y = _data()
  model = _tf_keras_model(tf_keras.layers.Discretization(
      bin_boundaries=[-1., 0., 1.], output_mode="count"))
  before = [v.numpy() for v in model.trainable_variables]
  _tf_keras_fit(model, x, y)
  after = [v.numpy() for v in model.trainable_variables]
  assert all(np.all(np.isfinite(a)) for a in after)
  assert any(not np.array_equal(a, b) for a, b in zip(after, before))
