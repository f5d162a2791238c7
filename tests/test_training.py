"""The private Keras 3 train step, end to end."""
import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc.keras import _compat
from tf_dpadambc.keras import training

N, D, K = 256, 12, 3


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, D)).astype("float32")
  y = (np.argmax(x[:, :K], axis=1)).astype("int32")
  return x, y


def _model(dropout=False, regularizer=None):
  layers = [keras.Input((D,)),
            keras.layers.Dense(16, activation="tanh",
                               kernel_regularizer=regularizer)]
  if dropout:
    layers.append(keras.layers.Dropout(0.2))
  layers.append(keras.layers.Dense(K))
  return keras.Sequential(layers)


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_plain_model_with_dp_optimizer_raises_on_first_step():
  x, y = _data()
  model = _model()
  model.compile(optimizer=dp.DPAdamBC(1.0, 1.0), loss=_loss())
  with pytest.raises(RuntimeError, match="make_private"):
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_private_model_with_plain_optimizer_raises():
  x, y = _data()
  model = dp.make_private(_model())
  model.compile(optimizer="adam", loss=_loss())
  with pytest.raises(TypeError, match="not a differentially private"):
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_batch_normalization_is_refused():
  model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(4),
                            keras.layers.BatchNormalization(),
                            keras.layers.Dense(K)])
  with pytest.raises(ValueError, match="GroupNormalization"):
    dp.make_private(model)


class _OwnLoss(keras.Model):
  """A subclass whose loss lives in compute_loss (as KerasHub's contrastive
  and detection tasks do)."""

  def __init__(self):
    super().__init__()
    self.dense = keras.layers.Dense(K)

  def call(self, x):
    return self.dense(x)

  def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                   training=True):
    return keras.ops.mean(keras.ops.square(y_pred)) * 10.0


class _OwnStep(_OwnLoss):
  compute_loss = keras.Model.compute_loss

  def train_step(self, data):
    raise AssertionError("never runs under make_private")


@pytest.mark.parametrize("cls, name", [(_OwnLoss, "compute_loss"),
                                       (_OwnStep, "train_step")])
def test_overridden_loss_or_step_is_refused_not_ignored(cls, name):
  # The private step evaluates the compiled loss per example: the user's
  # compute_loss or train_step would silently not run.
  model = cls()
  with pytest.raises(ValueError, match=f"{cls.__name__}.{name} is overridden"):
    dp.make_private(model)
  x, y = _data()
  model(x[:2])
  model.compile(optimizer=dp.DPSGD(1.0, 1.0), loss=_loss())
  from tf_dpadambc.keras import custom_loop  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="is overridden"):
    custom_loop.private_step(model, (x[:8], y[:8]))


class _Bank(keras.layers.Layer):
  """Adds a non-trainable context vector that a custom loop may set."""

  def build(self, input_shape):
    self.bank = self.add_weight(shape=(input_shape[-1],), initializer="zeros",
                                trainable=False, name="bank")

  def call(self, x):
    return x + self.bank


def test_a_loop_that_writes_the_batch_into_the_model_is_refused():
  # A custom loop assigned the batch's mean to a model weight before
  # private_step: every unit read it (a review: 11 C/B for a bound of 2 C/B).
  from tf_dpadambc.keras import custom_loop  # pylint: disable=g-import-not-at-top
  x, y = _data()
  bank = _Bank(name="bank_layer")
  model = keras.Sequential([keras.Input((D,)), bank, keras.layers.Dense(K)])
  model.compile(optimizer=dp.DPSGD(1.0, 1.0, learning_rate=0.1), loss=_loss())
  before = [w.copy() for w in model.get_weights()]

  @tf.function
  def leaky(batch):
    bank.bank.assign(tf.reduce_mean(batch[0], axis=0))
    return custom_loop.private_step(model, batch)

  with pytest.raises(ValueError, match="wrote the batch into a variable"):
    leaky((x[:16], y[:16]))
  assert all(np.array_equal(a, b) for a, b in zip(model.get_weights()[1:],
                                                  before[1:]))
  # Two steps in one trace: the first one's update of the trainable weights
  # is not the loop writing the batch.
  @tf.function
  def two_steps(first, second):
    custom_loop.private_step(model, first)
    return custom_loop.private_step(model, second)

  two_steps((x[:16], y[:16]), (x[16:32], y[16:32]))
  assert model.optimizer.steps_taken == 2


def test_microbatches_not_dividing_the_batch_raise():
  x, y = _data()
  model = dp.make_private(_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0, num_microbatches=5),
                loss=_loss())
  with pytest.raises(ValueError, match="does not divide the batch size 32"):
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def _per_example_reference(model, x, y, w, clip):
  """Σ_i clip(∇ w_i ℓ_i) by a Python loop over examples with GradientTape."""
  total = [np.zeros(v.shape, "float64") for v in model.trainable_variables]
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = w[i] * _loss()(y[i:i + 1], model(x[i:i + 1], training=True))
      # A zero-weight example is absent, regularization term included.
      loss += sum(model.losses) if model.losses and w[i] else 0.0
    g = [t.numpy() for t in tape.gradient(loss, model.trainable_variables)]
    norm = np.sqrt(sum(np.sum(t.astype("float64") ** 2) for t in g))
    f = min(1.0, clip / max(norm, 1e-30))
    total = [a + f * t for a, t in zip(total, g)]
  return total


@pytest.mark.parametrize("regularizer", [None, "l2"])
def test_private_gradient_sum_equals_loop_reference(regularizer):
  x, y = _data()
  x, y = x[:16], y[:16]
  w = np.linspace(0.0, 2.0, 16).astype("float32")  # sample weights, one zero
  model = _model(regularizer=regularizer)
  model.compile(loss=_loss())
  result, losses, y_pred = tf.function(
      lambda: dp.private_gradient_sum(model, x, y, w, 0.3))()
  want = _per_example_reference(model, x, y, w, 0.3)
  for got, ref in zip(result.grads, want):
    np.testing.assert_allclose(got.numpy(), ref, rtol=2e-4, atol=1e-6)
  assert y_pred.shape == (16, K)
  np.testing.assert_allclose(y_pred.numpy(), model(x).numpy(), rtol=1e-5,
                             atol=1e-6)
  assert losses.shape == (16,)


def test_nonfinite_example_is_zeroed_and_counted():
  x, y = _data()
  x[3, 0] = np.nan
  model = dp.make_private(_model())
  model.compile(optimizer=dp.DPSGD(1.0, 0.5, learning_rate=0.1),
                loss=_loss(), jit_compile=True)
  history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  assert history.history["dp_nonfinite_examples"][-1] == 1.0
  for v in model.trainable_variables:
    assert np.all(np.isfinite(v.numpy()))


@pytest.mark.parametrize("jit", [False, True])
def test_fit_trains_with_metrics_validation_and_string_loss(jit):
  x, y = _data()
  model = dp.make_private(_model())
  model.compile(
      optimizer=dp.DPAdamBC(1.0, 0.3, learning_rate=3e-3, gamma_prime=1e-6),
      loss="sparse_categorical_crossentropy" if not jit else _loss(),
      metrics=["accuracy"], jit_compile=jit)
  if not jit:  # the string loss wants probabilities
    model = dp.make_private(keras.Sequential(
        [keras.Input((D,)), keras.layers.Dense(16, activation="tanh"),
         keras.layers.Dense(K, activation="softmax")]))
    model.compile(
        optimizer=dp.DPAdamBC(1.0, 0.3, learning_rate=3e-3,
                              gamma_prime=1e-6),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
  before = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
  history = model.fit(x, y, batch_size=32, epochs=6, verbose=0,
                      validation_data=(x[:64], y[:64]))
  logs = history.history
  assert {"loss", "accuracy", "val_loss", "val_accuracy",
          "dp_clipped_fraction"} <= set(logs)
  assert "dp_nonfinite_examples" not in logs  # logged only when non-zero
  assert "val_dp_clipped_fraction" not in logs
  assert logs["loss"][-1] < before
  assert model.optimizer.steps_taken == 6 * N // 32
  assert 0.0 <= logs["dp_clipped_fraction"][-1] <= 1.0


def test_dropout_model_trains_through_the_materialized_path():
  x, y = _data()
  model = dp.make_private(_model(dropout=True))
  model.compile(optimizer=dp.DPAdam(1.0, 0.5, learning_rate=1e-2),
                loss=_loss(), jit_compile=True)
  state = [sg.state.numpy().copy() for sg in _compat.seed_generators(model)]
  model.fit(x, y, batch_size=64, epochs=1, verbose=0)
  after = [sg.state.numpy() for sg in _compat.seed_generators(model)]
  assert state and all(np.any(a != b) for a, b in zip(after, state))


def test_optimizer_reports_its_dp_event_and_statement():
  x, y = _data()
  model = dp.make_private(_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.2, gradient_accumulation_steps=2),
                loss=_loss())
  model.fit(x, y, batch_size=32, epochs=2, verbose=0)
  opt = model.optimizer
  assert opt.steps_taken == 2 * N // 64
  assert opt.logical_batch_size == 64
  eps = dp.epsilon_of_event(opt.dp_event(N, sampling="poisson"), 1e-5)
  assert eps == pytest.approx(dp.compute_epsilon(N, 64, 2, 1.2, 1e-5))
  text = dp.optimizer_privacy_statement(opt, N, 1e-5)
  assert f"ε = {eps:.3f} with Poisson" in text
  # By default dp_event is the run's own: fixed-size batches, once per
  # epoch (it was the Poisson event, which does not hold for this run).
  ran = dp.epsilon_of_event(opt.dp_event(N), 1e-5)
  assert opt.dp_event(N) == opt.dp_event(N, sampling="shuffle") and ran > eps
  assert (f"ε = {ran:.3f} if each example is used exactly once per epoch"
          in text)


def test_microbatched_training_is_accounted_with_half_sigma():
  x, y = _data()
  model = dp.make_private(_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.2, num_microbatches=8),
                loss=_loss())
  model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  assert model.optimizer.effective_noise_multiplier == pytest.approx(0.6)


@pytest.mark.parametrize("sampling", ["shuffle", "poisson"])
def test_privacy_budget_callback_logs_and_stops(sampling):
  x, y = _data()
  model = dp.make_private(_model())
  # The Poisson ε holds only for Poisson batches: poisson_batches, and an
  # optimizer that knows their expected size (tests/test_poisson.py).
  poisson = {} if sampling == "shuffle" else {"expected_batch_size": 32}
  model.compile(optimizer=dp.DPSGD(1.0, 1.5, **poisson), loss=_loss())
  target = 8.0 if sampling == "shuffle" else 2.0
  kwargs = {} if sampling == "shuffle" else {"sampling": sampling}  # default
  budget = dp.PrivacyBudget(N, 1e-5, target_epsilon=target, verbose=0,
                            **kwargs)
  if sampling == "shuffle":
    data = dict(x=x, y=y, batch_size=32)
  else:
    data = dict(x=dp.data.poisson_batches(x, y, expected_batch_size=32))
  history = model.fit(**data, epochs=20, verbose=0, callbacks=[budget])
  logged = history.history["epsilon"]
  epochs = len(logged)
  assert 1 <= epochs < 20
  for e, eps in enumerate(logged, start=1):
    assert eps == pytest.approx(
        dp.compute_epsilon(N, 32, e, 1.5, 1e-5, sampling=sampling), rel=1e-6)
  assert logged[-1] <= target  # stopped within budget...
  assert dp.compute_epsilon(N, 32, epochs + 1, 1.5, 1e-5,
                            sampling=sampling) > target  # ...in time


def test_save_load_continue_equals_uninterrupted(tmp_path):
  x, y = _data()

  def build():
    keras.utils.set_random_seed(7)
    model = dp.make_private(_model())
    # 8 batches per epoch, k = 4: the save falls on a logical step.
    model.compile(optimizer=dp.DPAdamBC(1.0, 1.0, learning_rate=1e-3,
                                        gradient_accumulation_steps=4,
                                        seed=99),
                  loss=_loss(), metrics=["accuracy"])
    return model

  straight = build()
  straight.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)

  first = build()
  first.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
  path = str(tmp_path / "mid.keras")
  first.save(path)
  loaded = keras.models.load_model(path)
  assert type(loaded.optimizer) is dp.DPAdamBC
  assert not dp.is_private(loaded)
  # No seed is saved (not even seed=99): the loaded optimizer draws a new
  # one. To reproduce, build the optimizer with its seed and load the state.
  assert loaded.optimizer.seed is None
  resumed = build()
  resumed.optimizer.build(resumed.trainable_variables)
  resumed.load_weights(path)
  resumed.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
  assert resumed.optimizer.steps_taken == straight.optimizer.steps_taken
  for a, b in zip(resumed.get_weights(), straight.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_unreleased_clipped_sums_are_not_saved(tmp_path):
  # Mid-accumulation, the optimizer holds clipped sums without noise: they
  # must not be written to a file that may be shared.
  x, y = _data()
  model = dp.make_private(_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0, gradient_accumulation_steps=3),
                loss=_loss())
  model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)  # 2 of 3
  opt = model.optimizer
  assert opt.steps_taken == 0
  assert any(np.any(a.numpy() != 0) for a in opt._accumulated_sums)
  path = str(tmp_path / "partial.keras")
  model.save(path)
  saved = {id(v) for v in opt._saved_variables()}
  assert not saved & {id(v) for v in opt._accumulated_sums}
  restored = keras.models.load_model(path)
  restored.optimizer.build(restored.trainable_variables)
  for acc in restored.optimizer._accumulated_sums:
    assert not np.any(acc.numpy())
  assert int(restored.optimizer._physical_step.numpy()) == 0


def test_accumulation_spanning_epochs_is_accounted_with_half_sigma():
  x, y = _data()
  model = dp.make_private(_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.2, gradient_accumulation_steps=3),
                loss=_loss())
  model.fit(x, y, batch_size=32, epochs=3, verbose=0)  # 8 batches/epoch
  opt = model.optimizer
  assert opt.accounted_noise_multiplier(N) == pytest.approx(0.6)
  # 24 batches = 8 logical steps over 3 epochs; steps 3 (batches 6-8) and 6
  # (15-17) span two epochs but share epoch 2, so at worst one step holds
  # an example twice (σ/2) and one more step holds it once.
  event = opt.dp_event(N, sampling="shuffle")
  assert event == dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.2), 1),
      dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.6), 1),
  ])


def test_accumulation_spanning_epochs_compounds_with_microbatching():
  """Microbatches (2C each) and a logical step holding an example twice:
  sensitivity 4C, σ/4 (not min(σ/2, σ/2))."""
  x, y = _data()
  model = dp.make_private(_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.2, num_microbatches=8,
                                   gradient_accumulation_steps=3),
                loss=_loss())
  model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  # 8 batches: steps 1-2 are within epoch 1 (batches 7-8 still pending).
  assert model.optimizer.accounted_noise_multiplier(N) == pytest.approx(0.6)
  model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  # Step 3 (batches 7-9) spans epochs 1 and 2.
  assert model.optimizer.accounted_noise_multiplier(N) == pytest.approx(0.3)


@pytest.mark.parametrize("steps, epochs_touched", [(16, 2), (20, 3), (4, 1)])
def test_a_logical_step_spanning_m_epochs_is_accounted_with_sigma_over_m(
    steps, epochs_touched):
  """8 batches per epoch; k = 16 covers 2 whole epochs, k = 20 (batches
  0-19) touches 3 (a window starting at an epoch's last batch could touch 4:
  what a plan assumes), k = 4 divides the epoch."""
  x, y = _data()
  model = dp.make_private(_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.2,
                                   gradient_accumulation_steps=steps),
                loss=_loss())
  model.fit(x, y, batch_size=32, epochs=3, verbose=0)
  assert model.optimizer.accounted_noise_multiplier(N) == pytest.approx(
      1.2 / epochs_touched)


def test_keras_private_attributes_still_exist():
  # _compat relies on these; a Keras release that renames them must fail here.
  model = _model(dropout=True)
  model.compile(optimizer="adam", loss=_loss())
  assert callable(_compat.compiled_loss(model))
  assert isinstance(_compat.loss_tracker(model), keras.metrics.Mean)
  assert len(_compat.seed_generators(model)) == 1
  assert model in _compat.flatten_layers(model)


@pytest.mark.parametrize("options,poisson,metrics,with_input", [
    ({}, False, ["accuracy"], True),
    ({}, False, [], False),
    ({"gradient_accumulation_steps": 2, "num_microbatches": 4}, False, [],
     True),
    ({"noise": "banded"}, False, [], True),
    ({"expected_batch_size": 32}, True, ["accuracy"], True),
], ids=["plain", "no_input", "accumulation", "dpmf", "poisson"])
def test_the_private_step_is_traced_once(monkeypatch, options, poisson,
                                         metrics, with_input):
  """fit builds the model's, metrics' and optimizer's state before tracing:
  a step whose first trace creates variables is traced twice
  (_compat.build_before_first_trace, Keras' _symbolic_build). A Sequential
  model without an Input is built there too (per-unit evaluation needs its
  variables before the step)."""
  traced = []
  step = training._dp_train_step
  monkeypatch.setattr(training, "_dp_train_step",
                      lambda self, data: traced.append(1) or step(self, data))
  if options.get("noise") == "banded":
    options = {"noise": dp.CorrelatedNoise(dp.mf.Toeplitz([1.0, 0.5]),
                                           steps=8)}
  x, y = _data()
  model = dp.make_private(keras.Sequential(
      [keras.Input((D,))] * with_input
      + [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(K)]))
  model.compile(optimizer=dp.DPAdamBC(1.0, 1.0, **options), loss=_loss(),
                metrics=metrics)
  if poisson:
    model.fit(dp.data.poisson_batches(x, y, expected_batch_size=32,
                                      steps_per_epoch=2, seed=1),
              epochs=1, verbose=0)
  else:
    model.fit(x[:64], y[:64], batch_size=16, epochs=1, verbose=0)
  assert model.optimizer.built and len(traced) == 1


def test_weights_created_inside_the_step_are_refused_before_any_update():
  """A layer built only in training mode creates its weights inside the
  step, after fit built the optimizer from the inference-mode build: the
  step refuses (clearly) instead of clipping or updating a variable set the
  optimizer does not know."""

  class TrainingOnlyBlock(keras.Model):

    def __init__(self):
      super().__init__()
      self.first, self.extra = keras.layers.Dense(4), keras.layers.Dense(4)
      self.last = keras.layers.Dense(K)

    def call(self, x, training=None):
      h = self.first(x)
      return self.last(self.extra(h) if training else h)

  x, y = _data()
  model = dp.make_private(TrainingOnlyBlock())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0), loss=_loss())
  with pytest.raises(ValueError, match="built for other trainable variables"):
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  assert int(model.optimizer.iterations.numpy()) == 0


def test_reduced_loss_is_refused():
  x, y = _data()

  def batch_mean_loss(y_true, y_pred):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True))

  model = dp.make_private(_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0), loss=batch_mean_loss)
  with pytest.raises(ValueError, match="one value per example"):
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_loss_object_reduction_does_not_change_the_private_gradient():
  # The DP step defines its own aggregation (mean over each unit, clipped
  # sum / B); a user loss's reduction must not change what gets clipped.
  x, y = _data()
  x, y = x[:8], y[:8]
  sums = []
  for reduction in ("sum_over_batch_size", "sum", None):
    model = _model()
    model.set_weights(_model_weights)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction))
    result, _, _ = dp.private_gradient_sum(model, x, y, None, 0.5)
    sums.append([g.numpy() for g in result.grads])
  for other in sums[1:]:
    for a, b in zip(sums[0], other):
      np.testing.assert_allclose(a, b, rtol=1e-6)


keras.utils.set_random_seed(0)
_model_weights = _model().get_weights()


def test_multi_output_model_clips_through_the_compiled_loss():
  # Two outputs and two losses: the compiled loss is evaluated per example
  # (materialized path). Σ_u clip_C(g_u) can have norm at most U·C, and with
  # a tiny C every unit is clipped to exactly C.
  x, y = _data()
  x, y = x[:16], y[:16]
  inputs = keras.Input((D,))
  h = keras.layers.Dense(8, activation="tanh")(inputs)
  model = keras.Model(inputs, [keras.layers.Dense(K, name="a")(h),
                               keras.layers.Dense(1, name="b")(h)])
  model.compile(loss=[_loss(), "mse"])
  targets = (y, x[:, :1])
  result, losses, _ = tf.function(
      lambda: dp.private_gradient_sum(model, x, targets, None, 1e-4))()
  norm = np.sqrt(sum(np.sum(g.numpy() ** 2) for g in result.grads))
  assert 0 < norm <= 16 * 1e-4 * (1 + 1e-5)
  assert int(result.num_clipped) == 16
  assert losses.shape == (16,)
  fit_model = dp.make_private(model)
  fit_model.compile(optimizer=dp.DPAdam(1.0, 0.5), loss=[_loss(), "mse"])
  fit_model.fit(x, targets, batch_size=8, epochs=1, verbose=0)
  assert all(np.all(np.isfinite(w)) for w in fit_model.get_weights())


def _contribution_norms(model, x, y, w, clip):
  """‖Σ_u clip(g_u)‖ of the whole batch and of every leave-one-out batch."""
  full, _, _ = dp.private_gradient_sum(model, x, y, w, clip)
  out = []
  for i in range(len(x)):
    keep = np.arange(len(x)) != i
    part, _, _ = dp.private_gradient_sum(
        model, x[keep], y[keep], None if w is None else w[keep], clip)
    out.append(np.sqrt(sum(np.sum((a.numpy() - b.numpy()) ** 2)
                           for a, b in zip(full.grads, part.grads))))
  return full, np.array(out)


def test_sample_weights_of_shape_b1_stay_clipped():
  x, y = _data()
  x, y = x[:8], y[:8]
  w = np.full((8, 1), 3.0, "float32")
  model = _model()
  model.compile(loss=_loss())
  full, contributions = _contribution_norms(model, x, y, w, 0.05)
  assert not bool(full.mismatch)
  # Removing one example changes the clipped sum by at most C.
  assert np.all(contributions <= 0.05 * (1 + 1e-4)), contributions
  with pytest.raises(ValueError, match="one sample weight per example"):
    dp.private_gradient_sum(model, x, y, np.ones((8, 2), "float32"), 1.0)


class BatchCentering(keras.layers.Layer):
  """Subtracts the batch mean: the output of one example depends on others."""

  def call(self, inputs):
    return inputs - keras.ops.mean(inputs, axis=0, keepdims=True)


@pytest.mark.parametrize("jit", [False, True])
def test_batch_dependent_forward_is_refused_on_the_first_step(jit):
  x, y = _data()
  model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(6),
                            BatchCentering(), keras.layers.Dense(K)])
  model.compile(loss=_loss())
  # Evaluated per unit, the clipped sum is bounded anyway (each unit's batch
  # mean is its own): removing one example moves it by at most C.
  full, contributions = _contribution_norms(model, x[:8], y[:8], None, 1e-3)
  assert np.all(contributions <= 1e-3 * (1 + 1e-4)), contributions
  model = dp.make_private(model)
  with pytest.warns(UserWarning):
    optimizer = dp.DPSGD(1.0, 0.0, learning_rate=1.0)
  model.compile(optimizer=optimizer, loss=_loss(), jit_compile=jit)
  before = model.get_weights()
  with pytest.raises(RuntimeError, match="depends on the other examples"):
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
  # That one step released its per-unit clipped mean (σ = 0, learning rate
  # 1: it moved by at most C = 1), as for a model that does not mix.
  assert int(optimizer.iterations.numpy()) == 1
  moved = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(
      model.get_weights(), before)))
  assert 0 < moved <= 1.0 + 1e-4


def test_plain_model_passes_the_verification():
  x, y = _data()
  model = _model()
  model.compile(loss=_loss())
  assert bool(training.examples_independent(model, x[:8]))
  model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(6),
                            BatchCentering(), keras.layers.Dense(K)])
  assert not bool(training.examples_independent(model, x[:8]))


def _scalars(log_dir):
  """tag -> [(step, value)] from the event files under ``log_dir``."""
  import glob
  out = {}
  for path in glob.glob(f"{log_dir}/events.out.tfevents.*"):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        number = float(tf.make_ndarray(value.tensor))
        out.setdefault(value.tag, []).append((event.step, number))
  return out


def test_privacy_tensorboard_writes_epsilon_and_diagnostics(tmp_path):
  x, y = _data()
  model = dp.make_private(_model())
  opt = dp.DPAdamBC(1.0, 1.1, learning_rate=1e-3)
  model.compile(optimizer=opt, loss=_loss())
  log_dir = str(tmp_path / "tb")
  budget = dp.PrivacyBudget(N, 1e-5, verbose=0)
  model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[
      budget, dp.PrivacyTensorBoard(log_dir, N, 1e-5, update_freq=4)])
  scalars = _scalars(log_dir)
  epsilons = scalars["privacy/epsilon"]
  assert [s for s, _ in epsilons] == [8, 16]  # logical steps, per epoch
  np.testing.assert_allclose([e for _, e in epsilons], budget.history,
                             rtol=1e-6)
  # Every 4 batches and at each epoch end: steps 4, 8, 8, 12, 16, 16.
  assert [s for s, _ in scalars["dp/dp_v_over_phi"]] == [4, 8, 8, 12, 16, 16]
  assert {"dp/dp_clamped_fraction", "privacy/noise_variance"} <= set(scalars)
  phi = scalars["privacy/noise_variance"][-1][1]
  np.testing.assert_allclose(phi, (1.1 * 1.0 / 32) ** 2, rtol=1e-5)
  with pytest.raises(ValueError, match="update_freq"):
    dp.PrivacyTensorBoard(log_dir, N, 1e-5, update_freq=0)


def test_steps_per_execution_trains_exactly_the_same_run():
  """Keras' loop of several steps per call (what a GPU user sets for small
  models) runs the same private steps: the same weights, bit for bit, and
  the same number of releases, as one step per call. With accumulation
  (pending sums carried across steps and calls) and Dropout (the per-unit
  passes' seeds)."""
  x, y = _data()
  options = {"gradient_accumulation_steps": 3}
  runs = []
  for steps_per_execution in (1, 4):
    keras.utils.set_random_seed(0)
    model = dp.make_private(_model(dropout=True))
    model.compile(optimizer=dp.DPAdamBC(1.0, 1.0, 1e-2, seed=3, **options),
                  loss=_loss(), jit_compile=True,
                  steps_per_execution=steps_per_execution)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    runs.append((model.get_weights(), int(model.optimizer.iterations)))
  (one, steps_one), (four, steps_four) = runs
  assert steps_one == steps_four == 2 * N // 32 // options.get(
      "gradient_accumulation_steps", 1)
  for a, b in zip(one, four):
    np.testing.assert_array_equal(a, b)
