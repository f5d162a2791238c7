"""Poisson sampling: data.poisson_batches, expected-B normalisation, accounting.

Statistical tests state their tolerance in standard errors (SE); with the
fixed seeds used they are deterministic.
"""
import contextlib
import math
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc import data

N, B, D, K = 200, 20, 4, 3
Q = B / N


def _ids_dataset(**kwargs):
  """x holds each example's id, so batches can be traced back to examples."""
  ids = np.arange(N)
  return data.poisson_batches(ids.astype("float32")[:, None], ids,
                              expected_batch_size=B, **kwargs)


def _inclusions(dataset, epochs):
  """[epochs, steps, N] 0/1: which examples each step's batch holds."""
  out = []
  for _ in range(epochs):
    epoch = []
    for x, y, w in dataset.as_numpy_iterator():
      real = y[w > 0]
      assert len(set(real)) == len(real)  # no example twice in a batch
      row = np.zeros(N)
      row[real] = 1
      epoch.append(row)
    out.append(epoch)
  return np.array(out)


def test_sampling_is_poisson_fresh_and_independent():
  epochs = 150
  inc = _inclusions(_ids_dataset(seed=3), epochs)
  steps = inc.shape[1]
  assert steps == round(N / B)
  flat = inc.reshape(-1, N)
  t = len(flat)
  # Batch sizes ~ Binomial(N, q): mean Nq, variance Nq(1 − q); within 5 SE.
  sizes = flat.sum(axis=1)
  mean, var = N * Q, N * Q * (1 - Q)
  assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / t)
  assert abs(sizes.var(ddof=1) - var) < 5 * var * math.sqrt(2 / (t - 1))
  # Sizes beyond the mean and variance: a χ² goodness of fit to the binomial.
  lo, hi = int(mean - 2 * math.sqrt(var)), int(mean + 2 * math.sqrt(var))
  observed = [np.sum(sizes < lo)] + [np.sum(sizes == k)
                                     for k in range(lo, hi + 1)] + [
                                         np.sum(sizes > hi)]
  p = ([stats.binom.cdf(lo - 1, N, Q)]
       + [stats.binom.pmf(k, N, Q) for k in range(lo, hi + 1)]
       + [stats.binom.sf(hi, N, Q)])
  assert stats.chisquare(observed, np.array(p) * t).pvalue > 1e-4
  # Each example's inclusion frequency ≈ q: every count within 6 SE of tq.
  counts = flat.sum(axis=0)
  se = math.sqrt(t * Q * (1 - Q))
  assert np.all(np.abs(counts - t * Q) < 6 * se)
  # Independence across consecutive steps (epoch boundaries included):
  # P(i in step s and in s + 1) = q²; within 5 SE of a Poisson count.
  both = np.sum(flat[1:] * flat[:-1])
  expect = (t - 1) * N * Q * Q
  assert abs(both - expect) < 5 * math.sqrt(expect)
  # Fresh every epoch: step s of epoch e and of epoch e + 1 share examples
  # at rate q², not q (a replayed sample would give q).
  both = np.sum(inc[1:] * inc[:-1])
  expect = (epochs - 1) * steps * N * Q * Q
  assert abs(both - expect) < 5 * math.sqrt(expect)


def test_padding_has_weight_zero_and_the_shape_is_fixed():
  weights = np.linspace(0.5, 2.0, N).astype("float32")
  ids = np.arange(N)
  ds = data.poisson_batches({"a": ids[:, None].astype("float32")}, ids,
                            expected_batch_size=B, sample_weight=weights,
                            seed=5)
  m = data.poisson_max_batch_size(N, B, round(N / B))
  assert ds.element_spec[0]["a"].shape == (m, 1)
  assert ds.element_spec[2].shape == (m,)
  # The default M: P(some step of an epoch overflows) ≤ 1e-9, and M is the
  # smallest such size.
  assert data.poisson_overflow_probability(N, B, m, round(N / B)) <= 1e-9
  assert data.poisson_overflow_probability(N, B, m - 1, round(N / B)) > 1e-9
  for _ in range(5):
    for x, y, w in ds.as_numpy_iterator():
      assert x["a"].shape == (m, 1) and y.shape == (m,) and w.shape == (m,)
      size = int(np.sum(w > 0))
      np.testing.assert_array_equal(w[size:], 0.0)  # padding: exactly 0
      np.testing.assert_array_equal(w[:size], weights[y[:size]])
      np.testing.assert_array_equal(x["a"][:size, 0], y[:size])


def test_overflow_raises_instead_of_truncating():
  # Binomial(200, 0.1) exceeds 20 with probability ≈ 0.44 per step.
  ds = _ids_dataset(max_batch_size=B, seed=0)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="max_batch_size = 20.*never truncated"):
    for _ in range(3):
      list(ds.as_numpy_iterator())
  with pytest.raises(ValueError, match="max_batch_size"):
    _ids_dataset(max_batch_size=B - 1)
  with pytest.raises(ValueError, match="expected_batch_size"):
    data.poisson_batches(np.zeros((10, 2)), np.zeros(10),
                         expected_batch_size=11)


def test_tf_data_input_is_materialized_and_checked():
  ids = np.arange(N)
  x = ids.astype("float32")[:, None]
  examples = tf.data.Dataset.from_tensor_slices((x, ids))
  from_numpy = data.poisson_batches(x, ids, expected_batch_size=B, seed=9)
  from_tf = data.poisson_batches(examples, expected_batch_size=B, seed=9)
  for a, b in zip(from_numpy.as_numpy_iterator(),
                  from_tf.as_numpy_iterator()):
    for u, v in zip(a, b):
      np.testing.assert_array_equal(u, v)
  with pytest.raises(ValueError, match="finite"):
    data.poisson_batches(examples.repeat(), expected_batch_size=B)
  with pytest.raises(ValueError, match="assert_cardinality"):
    data.poisson_batches(examples.filter(lambda a, b: b >= 0),
                         expected_batch_size=B)
  with pytest.raises(ValueError, match="unbatch"):
    data.poisson_batches(examples.batch(8), expected_batch_size=B)


def _linear_model(regularizer=None):
  return keras.Sequential([
      keras.Input((D,)),
      keras.layers.Dense(K, kernel_regularizer=regularizer,
                         kernel_initializer="glorot_normal",
                         bias_initializer=keras.initializers.RandomNormal(
                             stddev=0.3))])


def _softmax(z):
  z = z - z.max(axis=1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=1, keepdims=True)


def _problem():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, D)).astype("float32")
  y = rng.integers(0, K, size=N).astype("int32")
  w = rng.uniform(0.5, 1.5, size=N).astype("float32")
  return x, y, w


def _seed_with_size_far_from_b():
  """A sampling seed whose first batch has a size ≥ 15% away from B, so that
  dividing by the realized size would be caught."""
  x, y, w = _problem()
  for seed in range(100):
    ds = data.poisson_batches(x, y, expected_batch_size=B, sample_weight=w,
                              steps_per_epoch=1, seed=seed)
    _, _, wb = next(ds.as_numpy_iterator())
    if abs(np.sum(wb > 0) - B) >= 3:
      return seed
  raise AssertionError("no seed found")


def _poisson_model():
  """(x, y, a private linear model, its Poisson DPSGD), built."""
  x, y, _ = _problem()
  model = dp.make_private(_linear_model())
  opt = dp.DPSGD(1.0, 1.0, learning_rate=0.1, expected_batch_size=B)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  model(x[:1])
  return x, y, model, opt


@contextlib.contextmanager
def _refused_before_any_step(model, match, steps=0):
  """The block raises ValueError(match); no weight moved, no step counted."""
  before = [w.copy() for w in model.get_weights()]
  with pytest.raises(ValueError, match=match):
    yield
  assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
  assert model.optimizer.steps_taken == steps


def test_a_custom_loop_declares_its_poisson_batches():
  # A review's custom loop fed a Poisson optimizer fixed-size batches with
  # unit weights (ε 7.33 reported for 9.01), or Poisson batches of 20 of 40
  # examples accounted with N = 40 (5.62 for 8.98): fit checks both, a loop
  # declares its dataset with register_dataset.
  x, y, model, opt = _poisson_model()
  with _refused_before_any_step(model, "register_dataset"):
    dp.private_step(model, (x[:B], y[:B], np.ones(B, "float32")))
  with _refused_before_any_step(model, "poisson_batches"):
    dp.register_dataset(opt, tf.data.Dataset.from_tensor_slices(
        (x, y, np.ones(N, "float32"))).batch(B))
  half = N // 2
  batches = dp.register_dataset(opt, data.poisson_batches(
      x[:half], y[:half], expected_batch_size=B, steps_per_epoch=3, seed=0))
  step = tf.function(lambda batch: dp.private_step(model, batch))
  for batch in batches:
    step(batch)
  assert opt.steps_taken == 3
  with pytest.raises(ValueError, match=f"sampled from N = {half}"):
    opt.dp_event(N)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      B / half, dp_accounting.GaussianDpEvent(1.0)), 3)
  got = dp_accounting.rdp.RdpAccountant()
  got.compose(opt.dp_event(half))
  np.testing.assert_allclose(got.get_epsilon(1e-5),
                             accountant.get_epsilon(1e-5), rtol=1e-9)


def test_train_on_batch_declares_its_poisson_batches():
  # train_on_batch runs fit's step on batches fit never sees: with unit
  # weights it claimed the Poisson ε for fixed-size batches.
  x, y, model, opt = _poisson_model()
  with _refused_before_any_step(model, "register_dataset"):
    model.train_on_batch(x[:B], y[:B], sample_weight=np.ones(B, "float32"))
  # A Poisson fit checks its own dataset, not later train_on_batch batches
  # (a review: a Poisson epoch, then fixed-size fine-tuning, all accounted
  # as Poisson: ε 4.33 reported for 12.45).
  model.fit(data.poisson_batches(x, y, expected_batch_size=B,
                                 steps_per_epoch=2, seed=0), verbose=0)
  assert opt.steps_taken == 2
  with _refused_before_any_step(model, "register_dataset", steps=2):
    model.train_on_batch(x[:B], y[:B], sample_weight=np.ones(B, "float32"))
  batches = dp.register_dataset(opt, data.poisson_batches(
      x, y, expected_batch_size=B, steps_per_epoch=2, seed=1))
  for xb, yb, wb in batches:
    model.train_on_batch(xb, yb, sample_weight=wb)
  assert opt.steps_taken == 4


@pytest.mark.parametrize("regularizer", [None, 0.05])
def test_private_step_equals_the_numpy_reference(regularizer):
  """Σ over the REAL rows of clip_C(w_i ∇ℓ_i [+ ∇reg]), divided by B."""
  x, y, w = _problem()
  seed = _seed_with_size_far_from_b()
  c, lr = 0.5, 1.0

  def batches():
    return data.poisson_batches(x, y, expected_batch_size=B, sample_weight=w,
                                steps_per_epoch=1, seed=seed)
  xb, yb, wb = next(batches().as_numpy_iterator())
  real = wb > 0
  assert abs(real.sum() - B) >= 3 and not real.all()

  model = dp.make_private(_linear_model(
      keras.regularizers.L2(regularizer) if regularizer else None))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # σ = 0: not private
    opt = dp.DPSGD(c, 0.0, learning_rate=lr, expected_batch_size=B)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), jit_compile=True)
  kernel, bias = [v.copy() for v in model.get_weights()]

  total_k, total_b = np.zeros_like(kernel), np.zeros_like(bias)
  p = _softmax(xb @ kernel + bias)
  delta = p - np.eye(K)[yb]
  for i in np.flatnonzero(real):
    gk = wb[i] * np.outer(xb[i], delta[i])
    gb = wb[i] * delta[i]
    if regularizer:
      gk = gk + 2 * regularizer * kernel
    norm = math.sqrt(np.sum(gk ** 2) + np.sum(gb ** 2))
    factor = min(1.0, c / norm)
    total_k += factor * gk
    total_b += factor * gb
  model.fit(batches(), epochs=1, verbose=0)
  new_kernel, new_bias = model.get_weights()
  np.testing.assert_allclose(new_kernel, kernel - lr * total_k / B,
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(new_bias, bias - lr * total_b / B,
                             rtol=1e-4, atol=1e-6)


def test_noise_std_is_sigma_c_over_expected_b():
  """The noise in ḡ has std σC/B (not σC/|batch|): 4,160 coordinates, 5%
  tolerance (≈ 4.5 SE of a sample std); Φ = (σC/B)² exactly."""
  x, y, w = _problem()
  seed = _seed_with_size_far_from_b()
  sigma, c = 1.0, 1.0
  width = 64
  rng = np.random.default_rng(1)
  xw = rng.normal(size=(N, width)).astype("float32")

  def run(noise_multiplier):
    keras.utils.set_random_seed(4)
    model = dp.make_private(keras.Sequential([
        keras.Input((width,)), keras.layers.Dense(width)]))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)
      opt = dp.DPSGD(c, noise_multiplier, learning_rate=1.0,
                     expected_batch_size=B, seed=11)
    model.compile(optimizer=opt, loss="mse")
    before = np.concatenate([v.ravel() for v in model.get_weights()])
    model.fit(data.poisson_batches(xw, xw * 0.5, expected_batch_size=B,
                                   sample_weight=w, steps_per_epoch=1,
                                   seed=seed), epochs=1, verbose=0)
    after = np.concatenate([v.ravel() for v in model.get_weights()])
    return after - before, opt

  clean, _ = run(0.0)
  noisy, opt = run(sigma)
  noise = noisy - clean
  assert noise.size == width * width + width
  want = sigma * c / B
  assert abs(noise.mean()) < 5 * want / math.sqrt(noise.size)
  assert noise.std() == pytest.approx(want, rel=0.05)
  assert float(opt.noise_variance.numpy()) == pytest.approx(want ** 2,
                                                            rel=1e-6)


def test_logged_loss_and_metrics_count_only_real_rows():
  x, y, _ = _problem()
  seed = _seed_with_size_far_from_b()

  def batches():
    return data.poisson_batches(x, y, expected_batch_size=B,
                                steps_per_epoch=1, seed=seed)
  xb, yb, wb = next(batches().as_numpy_iterator())
  real = wb > 0
  model = dp.make_private(_linear_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0, learning_rate=0.0,
                                   expected_batch_size=B),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), metrics=["accuracy"])
  logits = model.predict(xb, verbose=0)
  history = model.fit(batches(), epochs=1, verbose=0).history
  p = _softmax(logits)
  want_loss = -np.mean(np.log(p[real, yb[real]]))
  want_acc = np.mean(np.argmax(logits[real], axis=1) == yb[real])
  assert history["loss"][0] == pytest.approx(want_loss, rel=1e-5)
  assert history["accuracy"][0] == pytest.approx(want_acc)


def test_fit_end_to_end_accounts_poisson_sampling(tmp_path):
  x, y, _ = _problem()
  sigma, delta, epochs = 1.2, 1e-5, 3
  model = dp.make_private(_linear_model())
  model.compile(optimizer=dp.DPAdamBC(1.0, sigma, learning_rate=1e-2,
                                      expected_batch_size=B),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), metrics=["accuracy"],
                jit_compile=True)
  budget = dp.PrivacyBudget(N, delta, verbose=0)
  board = dp.PrivacyTensorBoard(str(tmp_path / "tb"), N, delta)
  history = model.fit(data.poisson_batches(x, y, expected_batch_size=B),
                      epochs=epochs, verbose=0, callbacks=[budget, board])
  assert np.all(np.isfinite(history.history["loss"]))
  opt = model.optimizer
  assert opt.steps_taken == epochs * N // B
  assert budget.run_sampling == board.run_sampling == "poisson"
  # The event: Poisson sampling with q = B/N, one Gaussian per step.
  event = opt.dp_event(N)
  assert event == dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          B / N, dp_accounting.GaussianDpEvent(sigma)), epochs * N // B)
  for e, eps in enumerate(history.history["epsilon"], start=1):
    assert eps == pytest.approx(dp.compute_epsilon(N, B, e, sigma, delta),
                                rel=1e-9)
  text = dp.optimizer_privacy_statement(opt, N, delta)
  eps = history.history["epsilon"][-1]
  assert f"ε = {eps:.3f} with Poisson sampling: the guarantee of this run" \
      in text
  assert "expected batch size B = 20" in text
  assert "once per epoch" not in text.split("(No once-per-epoch")[0]
  # The once-per-epoch accounting does not describe Poisson batches.
  with pytest.raises(ValueError, match="Poisson-sampled"):
    opt.dp_event(N, sampling="shuffle")
  with pytest.raises(ValueError, match="Poisson-sampled"):
    opt.dp_event(N, batch_size=B + 1)


def test_fixed_batch_statement_labels_the_poisson_figure_as_not_applying():
  x, y, _ = _problem()
  model = dp.make_private(_linear_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.2),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  budget = dp.PrivacyBudget(N, 1e-5, verbose=0)
  model.fit(x, y, batch_size=B, epochs=2, verbose=0, callbacks=[budget])
  assert budget.run_sampling == "shuffle"
  text = dp.optimizer_privacy_statement(model.optimizer, N, 1e-5)
  shuffle = dp.compute_epsilon(N, B, 2, 1.2, 1e-5, sampling="shuffle")
  poisson = dp.compute_epsilon(N, B, 2, 1.2, 1e-5)
  assert budget.history[-1] == pytest.approx(shuffle)
  assert (f"ε = {shuffle:.3f} if each example is used exactly once per "
          "epoch") in text and "the guarantee of this run" in text
  line = next(l for l in text.splitlines()
              if f"ε = {poisson:.3f} with Poisson" in l)
  assert "does NOT apply to this run" in line and "poisson_batches" in line
  assert text.index(f"ε = {shuffle:.3f}") < text.index(f"ε = {poisson:.3f}")


def test_callbacks_refuse_a_sampling_the_run_did_not_use():
  x, y, _ = _problem()
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  model = dp.make_private(_linear_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0), loss=loss)
  with pytest.raises(ValueError, match="poisson_batches"):
    model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[
        dp.PrivacyBudget(N, 1e-5, sampling="poisson")])
  model = dp.make_private(_linear_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0, expected_batch_size=B),
                loss=loss)
  with pytest.raises(ValueError, match="only the Poisson ε holds"):
    model.fit(data.poisson_batches(x, y, expected_batch_size=B), epochs=1,
              verbose=0,
              callbacks=[dp.PrivacyBudget(N, 1e-5, sampling="shuffle")])


@pytest.mark.parametrize("weights", [None, "sample_weight", "class_weight"])
def test_poisson_optimizer_refuses_fixed_batches(weights):
  # With sample weights (Keras makes them from class_weight) the step's own
  # check passed: fixed-size batches got the Poisson ε (5.9 for 12.3).
  x, y, _ = _problem()
  model = dp.make_private(_linear_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0, expected_batch_size=B),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  before = model.get_weights()
  kwargs = {"sample_weight": dict(sample_weight=np.ones(N, "float32")),
            "class_weight": dict(class_weight={k: 1.0 for k in range(K)}),
            None: {}}[weights]
  with pytest.raises(ValueError, match="poisson_batches"):
    model.fit(x, y, batch_size=B, epochs=1, verbose=0, **kwargs)
  for w, w0 in zip(model.get_weights(), before):
    np.testing.assert_array_equal(w, w0)


def test_poisson_batches_of_another_expected_size_are_refused():
  # Accounted at the optimizer's q = 10/N while q = 4·10/N ran.
  x, y, _ = _problem()
  model = dp.make_private(_linear_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0, expected_batch_size=B),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  other = data.poisson_batches(x, y, expected_batch_size=4 * B, seed=1)
  with pytest.raises(ValueError, match=f"expected size of {4 * B}"):
    model.fit(other, epochs=1, verbose=0)
  assert model.optimizer.steps_taken == 0


def test_an_n_larger_than_the_sampled_one_is_refused(tmp_path):
  # Batches sampled from the first 100 examples have q = 20/100; accounting
  # them with N = 200 took q = 20/200: ε 2.90 reported for a run of 4.54
  # (σ = 1, δ = 1e-5, the 5 steps of one epoch).
  x, y, _ = _problem()
  small = N // 2
  model = dp.make_private(_linear_model())
  model.compile(optimizer=dp.DPSGD(1.0, 1.0, expected_batch_size=B),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  with pytest.raises(ValueError, match=f"sampled from N = {small}"):
    model.fit(data.poisson_batches(x[:small], y[:small],
                                   expected_batch_size=B, seed=1),
              epochs=2, verbose=0, callbacks=[dp.PrivacyBudget(N, 1e-5)])
  opt = model.optimizer
  assert opt.steps_taken > 0  # the budget checks after the first epoch
  for bad in (lambda: opt.dp_event(N),
              lambda: dp.optimizer_privacy_statement(opt, N, 1e-5)):
    with pytest.raises(ValueError, match="understate ε"):
      bad()
  want = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      B / small, dp_accounting.GaussianDpEvent(1.0)), opt.steps_taken)
  assert opt.dp_event(small) == want
  assert opt.dp_event(small - 5) is not None  # a smaller N over-states ε
  # The record is saved with the optimizer, so a restored run checks too.
  path = str(tmp_path / "run.keras")
  model.save(path)
  restored = keras.models.load_model(path)
  with pytest.raises(ValueError, match=f"sampled from N = {small}"):
    restored.optimizer.dp_event(N)
  # Two datasets: the smaller N bounds both.
  model.fit(data.poisson_batches(x, y, expected_batch_size=B, seed=2),
            epochs=1, verbose=0)
  with pytest.raises(ValueError, match=f"sampled from N = {small}"):
    opt.dp_event(N)


@pytest.mark.parametrize("make, match", [
    (lambda: dp.DPAdamBC(1.0, 1.0, expected_batch_size=0),
     "expected_batch_size"),
    (lambda: dp.DPAdamBC(1.0, 1.0, expected_batch_size=8.5),
     "expected_batch_size"),
    (lambda: dp.DPAdamBC(1.0, 1.0, expected_batch_size=8,
                         num_microbatches=2), "num_microbatches"),
    (lambda: dp.DPAdamBC(1.0, 1.0, expected_batch_size=8,
                         gradient_accumulation_steps=2),
     "gradient_accumulation_steps"),
    (lambda: dp.DPSGD(1.0, 1.0, expected_batch_size=8,
                      noise=dp.CorrelatedNoise(dp.mf.sqrt_toeplitz(8), 4)),
     "not banded"),
    (lambda: dp.DPAdamIME(1.0, 1.0, expected_batch_size=8), "IME"),
])
def test_unsupported_combinations_are_refused(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_expected_batch_size_is_saved_in_the_config():
  opt = dp.DPAdamBC(1.0, 1.0, expected_batch_size=32)
  config = opt.get_config()
  assert config["expected_batch_size"] == 32
  assert dp.DPAdamBC.from_config(config).expected_batch_size == 32
  assert dp.DPAdamBC(1.0, 1.0).get_config()["expected_batch_size"] is None
