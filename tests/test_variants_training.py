"""The variant optimizers through make_private + fit: saving, diagnostics,
clipping options, public refreshes, the non-private baseline.

Models and data are tiny (Dense 4→3→2, 16 examples) and most fits run
eagerly: tracing a train function costs more than these few steps.
"""
import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp

N, D, K = 16, 4, 2
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(N, D)).astype("float32")
Y = (X[:, 0] + 0.5 * X[:, 1] > 0).astype("int32")


def _model(hidden=3, dropout=False):
  layers = [keras.Input((D,)), keras.layers.Dense(hidden, activation="tanh")]
  if dropout:  # rate 0: deterministic, but forces the materialized path
    layers.append(keras.layers.Dropout(0.0))
  layers.append(keras.layers.Dense(K))
  return keras.Sequential(layers)


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _private(optimizer, model=None, run_eagerly=True):
  model = dp.make_private(model or _model())
  model.compile(optimizer=optimizer, loss=_loss(), run_eagerly=run_eagerly)
  return model


def _quiet(cls, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    return cls(*args, **kwargs)


# Every class, with arguments exercising its own options.
ALL = [
    (dp.DPAdam, dict(epsilon=1e-6, beta_1=0.8)),
    (dp.DPAdamBC, dict(gamma_prime=1e-6, beta_2=0.99)),
    (dp.DPAdamIME, dict(denominator_floor=0.1)),
    (dp.DPAdamJME, dict(adjacency="replace_one", square_weight=0.25)),
    (dp.DPAdamSTP, dict(scale_epsilon=0.1)),
    (dp.NoiselessPreconditionerAdam, dict(epsilon=1e-5)),
    (dp.DPRMSProp, dict(rho=0.8)),
    (dp.DPRMSPropBC, dict(rho=0.8, gamma_prime=1e-6)),
    (dp.DPRMSPropIME, dict(rho=0.8)),
    (dp.DPRMSPropSTP, dict(rho=0.8, scale_epsilon=0.1)),
    (dp.DPAdagrad, dict(initial_accumulator_value=0.2)),
    (dp.DPAdagradBC, dict(initial_accumulator_value=0.0, gamma_prime=1e-6)),
    (dp.DPAdagradIME, dict(initial_accumulator_value=0.0)),
    (dp.DPAdagradSTP, dict(scale_epsilon=0.1)),
    (dp.DP2RMSProp, dict(sgd_steps=1, adaptive_steps=1, rho=0.5,
                         preconditioned_clip_norm=2.0, epsilon=1e-3)),
    (dp.DP2Adagrad, dict(sgd_steps=1, adaptive_steps=1, epsilon=1e-3)),
    (dp.DPAdamPublicPreconditioner, dict(public_data=(X[:8], Y[:8]),
                                         refresh_every=1,
                                         public_batch_size=4)),
    (dp.DPSGD, dict(momentum=0.5)),
]
ADAPTIVE_DIAGNOSTICS = {
    "post": {"dp_v_over_phi"},
    "bc": {"dp_v_over_phi", "dp_clamped_fraction"},
    "unbiased": {"dp_v_over_phi", "dp_negative_v_fraction"},
}


def _expected_diagnostics(cls):
  if cls in (dp.DPAdamBC, dp.DPRMSPropBC, dp.DPAdagradBC):
    return ADAPTIVE_DIAGNOSTICS["bc"]
  if cls in (dp.DPAdamIME, dp.DPRMSPropIME, dp.DPAdagradIME, dp.DPAdamJME):
    return ADAPTIVE_DIAGNOSTICS["unbiased"]
  if cls in (dp.DPSGD, dp.DP2RMSProp, dp.DP2Adagrad,
             dp.DPAdamPublicPreconditioner):
    return set()
  return ADAPTIVE_DIAGNOSTICS["post"]


STP = (dp.DPAdamSTP, dp.DPRMSPropSTP, dp.DPAdagradSTP)


def _flat(tensors):
  return np.concatenate([np.ravel(t) for t in tensors]).astype("float64")


def _check_diagnostics(history, opt, model):
  """8. The logged values against a direct computation from the state.

  One step per epoch: the epoch mean is that step's value. STP reports v̂
  in its scaled geometry, v̂·s²/Φ with the step's scale s₁ = 1/(√v̂₀ + ε_s1)
  (v̂₀ = 0, or a₀ for AdaGrad).
  """
  v_hat = _flat([opt.second_moment(v) for v in model.trainable_variables])
  phi = float(opt.phi())
  ratio = v_hat / phi
  if isinstance(opt, STP):
    v0 = getattr(opt, "initial_accumulator_value", 0.0)
    ratio = ratio / (np.sqrt(v0) + opt.scale_epsilon) ** 2
  # float32 statistics over 23 coordinates: rel 1e-5.
  assert history["dp_v_over_phi"][0] == pytest.approx(np.mean(ratio),
                                                      rel=1e-5)
  if "dp_clamped_fraction" in opt.DIAGNOSTICS:
    assert history["dp_clamped_fraction"][0] == pytest.approx(
        np.mean(v_hat - phi < opt.gamma_prime), abs=1e-6)
  if "dp_negative_v_fraction" in opt.DIAGNOSTICS:
    assert history["dp_negative_v_fraction"][0] == pytest.approx(
        np.mean(v_hat < 0), abs=1e-6)


def test_negative_v_counted_only_where_logged():
  """v̂ < 0 is counted (a pass over v̂ each step) only by the estimators
  that log it; for the others num_negative is 0 without counting."""
  from tf_dpadambc.core import diagnostics  # pylint: disable=import-outside-toplevel
  v_hat = tf.constant([-1.0, 0.5, -2.0, 3.0])
  counted = diagnostics.moment_statistics(v_hat, 0.5, floor=1.0)
  assert float(counted.num_negative) == 2.0
  assert float(counted.num_clamped) == 3.0  # v̂ − Φ < γ'
  assert float(counted.ratio_sum) == pytest.approx(1.0)
  skipped = diagnostics.moment_statistics(v_hat, 0.5, negative=False)
  assert float(skipped.num_negative) == 0.0
  for cls, extra in ALL:
    opt = _quiet(cls, 1.0, 1.0, **extra)
    if hasattr(opt, "_logs_negative"):
      assert opt._logs_negative == (  # pylint: disable=protected-access
          "dp_negative_v_fraction" in _expected_diagnostics(cls)), cls


def test_moment_statistics_agree_with_and_without_xla():
  """The diagnostics' reductions carry an XLA hint (core.xla_hints: an
  optimization barrier, traced only under jit_compile on a CPU): the same
  counts exactly, and Σ v̂/Φ to float32 rounding, eagerly, in a graph and
  under XLA, on a kernel large enough for XLA's tree rewrite."""
  from tf_dpadambc.core import diagnostics  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(3)
  v_hat = tf.constant(rng.normal(1.0, 1.0, (784, 128)).astype(np.float32))
  stats = lambda v: tuple(diagnostics.moment_statistics(v, 0.7, floor=0.2))
  want = [float(t) for t in stats(v_hat)]
  assert want[2] == float(np.sum(v_hat.numpy() < 0)) > 0
  assert want[1] == float(np.sum(v_hat.numpy() - 0.7 < 0.2))
  for jit in (False, True):
    fn = tf.function(stats, jit_compile=jit)
    got = [float(t) for t in fn(v_hat)]
    assert got[1:] == want[1:]
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    barriers = [op for op in fn.get_concrete_function(v_hat).graph
                .get_operations() if op.type == "XlaOptimizationBarrier"]
    assert bool(barriers) == (jit and not tf.config.list_logical_devices(
        "GPU")), jit


# ----------------------------------------------------- 5. config round trip
@pytest.mark.parametrize("cls, extra", ALL, ids=lambda a: getattr(
    a, "__name__", ""))
def test_config_round_trip(cls, extra):
  opt = _quiet(cls, 0.7, 1.1, learning_rate=0.003, seed=5, weight_decay=0.01,
               **extra)
  config = opt.get_config()
  json.dumps(config)  # what model.save writes
  clone = _quiet(cls.from_config, config)
  assert type(clone) is cls and clone.get_config() == config
  for key, value in extra.items():
    if key != "public_data":  # data is not configuration (not saved)
      assert config[key] == value, key
  assert "public_data" not in config
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
  assert type(restored) is cls and restored.get_config() == config


def test_per_layer_and_automatic_clipping_survive_the_config():
  opt = dp.DPAdamSTP([0.1, 0.2, 0.3, 0.4], 1.0, clipping="automatic",
                     automatic_gamma=0.05)
  clone = dp.DPAdamSTP.from_config(opt.get_config())
  assert clone.l2_norm_clip == [0.1, 0.2, 0.3, 0.4]
  assert clone.sensitivity == pytest.approx(np.sqrt(0.3))
  assert clone.clipping == "automatic" and clone.automatic_gamma == 0.05


# --------------------------------------------- 5. save / load / continue
@pytest.mark.parametrize("cls, extra", ALL, ids=lambda a: getattr(
    a, "__name__", ""))
def test_save_load_and_continue(cls, extra, tmp_path):
  keras.utils.set_random_seed(3)
  opt = _quiet(cls, 1.0, 0.8, learning_rate=0.01, seed=11, **extra)
  model = _private(opt)
  # One step per fit (eager steps are the cost here); DP² with s1 = s2 = 1
  # saves after its SGD phase and resumes in its adaptive phase.
  history = model.fit(X, Y, batch_size=N, epochs=1, verbose=0)
  assert opt.steps_taken == 1
  # The diagnostics each class reports, and only those.
  logged = {k for k in history.history if k in (
      "dp_v_over_phi", "dp_clamped_fraction", "dp_negative_v_fraction")}
  assert logged == _expected_diagnostics(cls)
  if logged:
    _check_diagnostics(history.history, opt, model)
  state = [v.numpy().copy() for v in opt._saved_variables()]
  weights = [w.copy() for w in model.get_weights()]
  path = str(tmp_path / "model.keras")
  model.save(path)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    loaded = keras.models.load_model(path)
  restored = loaded.optimizer
  assert type(restored) is cls
  assert restored.get_config() == opt.get_config()
  assert int(restored.iterations.numpy()) == 1
  got = [v.numpy() for v in restored._saved_variables()]
  assert len(got) == len(state)
  for a, b in zip(got, state):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(loaded.get_weights(), weights):
    np.testing.assert_array_equal(a, b)
  if cls is dp.DPAdamPublicPreconditioner:
    restored.public_data = extra["public_data"]  # not saved: pass it again
  loaded = dp.make_private(loaded)
  loaded.fit(X, Y, batch_size=N, epochs=1, verbose=0)
  assert restored.steps_taken == 2
  after = loaded.get_weights()
  assert all(np.all(np.isfinite(w)) for w in after)
  assert any(np.any(a != b) for a, b in zip(after, weights))


# ------------------------------------------- 4. the non-private baseline
def test_privacy_budget_refuses_the_noiseless_baseline():
  with pytest.warns(UserWarning, match="NOT differentially private"):
    opt = dp.NoiselessPreconditionerAdam(1.0, 1.0)
  model = _private(opt)
  budget = dp.PrivacyBudget(N, 1e-5, target_epsilon=10.0, verbose=0)
  with pytest.raises(ValueError, match="not differentially private"):
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[budget])


# ------------------------------------------------------- 8. diagnostics
def _per_example_grads(model, x, y):
  out = []
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = _loss()(y[i:i + 1], model(x[i:i + 1], training=True))
    out.append([g.numpy().astype("float64")
                for g in tape.gradient(loss, model.trainable_variables)])
  return out


@pytest.mark.parametrize("dropout", [False, True],
                         ids=["reweighted", "materialized"])
def test_automatic_clipping_through_fit(dropout):
  clip, gamma = 0.5, 0.01
  with pytest.warns(UserWarning, match="NOT differentially private"):
    opt = dp.DPSGD(clip, 0.0, learning_rate=1.0, clipping="automatic",
                   automatic_gamma=gamma)
  model = _private(opt, _model(dropout=dropout))
  before = [w.numpy().astype("float64") for w in model.trainable_variables]
  grads = _per_example_grads(model, X, Y)
  model.fit(X, Y, batch_size=N, epochs=1, verbose=0)
  total = [np.zeros_like(w) for w in before]
  for g in grads:
    norm = np.sqrt(sum(np.sum(t ** 2) for t in g))
    total = [a + clip / (norm + gamma) * t for a, t in zip(total, g)]
  for w, w0, s in zip(model.trainable_variables, before, total):
    np.testing.assert_allclose(w.numpy(), w0 - s / N, rtol=1e-4, atol=1e-6)


def test_per_layer_clipping_through_fit():
  clips = [0.05, 0.01, 0.2, 0.02]
  with pytest.warns(UserWarning, match="NOT differentially private"):
    opt = dp.DPSGD(clips, 0.0, learning_rate=1.0)
  model = _private(opt)
  before = [w.numpy().astype("float64") for w in model.trainable_variables]
  grads = _per_example_grads(model, X, Y)
  model.fit(X, Y, batch_size=N, epochs=1, verbose=0)
  for k, (w, w0) in enumerate(zip(model.trainable_variables, before)):
    want = sum(g[k] * min(1.0, clips[k] / np.linalg.norm(g[k]))
               for g in grads)
    step = w0 - w.numpy()
    np.testing.assert_allclose(step, want / N, rtol=1e-4, atol=1e-7)
    assert np.linalg.norm(step) <= clips[k] * (1 + 1e-5)


def test_per_layer_clip_count_mismatch_fails_fit_clearly():
  model = _private(dp.DPAdamBC([0.1, 0.1, 0.1], 1.0))  # 4 variables
  with pytest.raises(ValueError, match="3 per-layer clip norms for 4"):
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)


# ------------------------------------------ 10. public preconditioner
def test_public_moment_refreshes_at_steps_0_k_2k():
  k = 2
  x_pub, y_pub = X[:8], Y[:8]
  opt = dp.DPAdamPublicPreconditioner(1.0, 1.0, learning_rate=0.01,
                                      public_data=(x_pub, y_pub),
                                      refresh_every=k, public_batch_size=4,
                                      beta_2=0.5, seed=14)
  model = _private(opt)
  # The first refresh: A = (mean public gradient at θ₀)² on the minibatch
  # the train step draws for step 0.
  index = tf.random.stateless_uniform([4], tf.constant([0, 0x9B1C], tf.int64),
                                      0, 8, dtype=tf.int64).numpy()
  with tf.GradientTape() as tape:
    loss = _loss()(y_pub[index], model(x_pub[index]))
  first = [g.numpy() ** 2 for g in tape.gradient(
      loss, model.trainable_variables)]
  snapshots = []

  class Record(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      snapshots.append([a.numpy().copy() for a in opt._public_moments])

  model.fit(X[:12], Y[:12], batch_size=4, epochs=1, verbose=0,
            shuffle=False, callbacks=[Record()])
  assert opt.steps_taken == 3
  assert int(opt._refreshes.numpy()) == 2  # steps 0 and 2
  for a, want in zip(snapshots[0], first):
    np.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-12)
  changed = [any(np.any(a != b) for a, b in zip(snapshots[i],
                                                snapshots[i - 1]))
             for i in range(1, len(snapshots))]
  assert changed == [False, True]  # steps 1 and 2


def test_public_refresh_counts_logical_steps_under_accumulation():
  opt = dp.DPAdamPublicPreconditioner(1.0, 1.0, public_data=(X[:8], Y[:8]),
                                      refresh_every=1, public_batch_size=4,
                                      gradient_accumulation_steps=2, seed=15)
  model = _private(opt)
  model.fit(X[:4], Y[:4], batch_size=2, epochs=1, verbose=0)  # 2 physical
  assert opt.steps_taken == 1
  assert int(opt._refreshes.numpy()) == 1  # one logical step, one refresh


# -------------------------------------- freezing after the optimizer is built
@pytest.mark.parametrize("cls, extra", [
    (dp.DPAdamBC, {}),
    (dp.DPAdamIME, {}),
    (dp.DPAdamSTP, {}),
    (dp.DPAdamPublicPreconditioner, dict(public_data=(X[:8], Y[:8]),
                                         refresh_every=1)),
], ids=lambda a: getattr(a, "__name__", ""))
def test_training_continues_after_freezing_a_layer(cls, extra):
  # Keras' fine-tuning flow: train (here: just build the optimizer, as the
  # first fit does), freeze the first layer, recompile with the same
  # optimizer, train the rest. (At commit 92ab9d3 this crashed IME and STP:
  # see test_variants.py::test_training_a_subset_equals_a_fresh_optimizer...)
  opt = cls(1.0, 1.0, learning_rate=0.01, seed=16, **extra)
  model = _private(opt, keras.Sequential([
      keras.Input((D,)), keras.layers.Dense(3, activation="tanh"),
      keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(K)]))
  opt.build(model.trainable_variables)
  model.layers[0].trainable = False
  model.compile(optimizer=opt, loss=_loss(), run_eagerly=True)
  frozen = [w.numpy().copy() for w in model.layers[0].weights]
  rest = [w.numpy().copy() for w in model.trainable_variables]
  model.fit(X, Y, batch_size=N, epochs=1, verbose=0)
  for w, f in zip(model.layers[0].weights, frozen):
    np.testing.assert_array_equal(w.numpy(), f)
  assert all(np.any(w.numpy() != r)
             for w, r in zip(model.trainable_variables, rest))
  assert opt.steps_taken == 1


def test_learning_rate_is_the_third_positional_argument_of_every_optimizer():
  # As in DPSGD and Keras' own optimizers: DPAdamBC(C, σ, η).
  import warnings
  for name in dp.__all__:
    cls = getattr(dp, name)
    if not (isinstance(cls, type) and issubclass(cls, dp.DPOptimizer)) or (
        cls is dp.DPOptimizer):
      continue
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      opt = cls(1.0, 1.0, 0.0123)
    assert float(opt.learning_rate) == pytest.approx(0.0123), name


def test_xla_hint_passes_gradients():
  """core.xla_hints.opaque is an identity for gradients too, under XLA
  (where it is an optimization barrier, which has no registered gradient)
  and outside it."""
  from tf_dpadambc.core import xla_hints  # pylint: disable=import-outside-toplevel
  x = tf.constant([1.0, -2.0, 3.0])

  def grad(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.reduce_sum(tf.square(xla_hints.opaque(x)))
    return tape.gradient(y, x)
  for jit in (False, True):
    np.testing.assert_allclose(tf.function(grad, jit_compile=jit)(x).numpy(),
                               [2.0, -4.0, 6.0])
