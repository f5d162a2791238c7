"""ε of the steps and epochs a run actually took (issue 13, item 3).

Every expected figure is computed here with dp_accounting directly, from the
epochs the run was seen to take (once per epoch: one Gaussian mechanism per
epoch; a logical step whose accumulated batches span two epochs can hold an
example twice: σ/2 for it), never with the library's own event builders.
"""
import glob
import itertools
import math

import dp_accounting
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc.accounting import ledger as ledger_lib

N, B, D = 95, 10, 4  # 9 full batches and a partial one per pass
DELTA = 1e-5


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, D)).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


def _dropping_remainder(x, y, batch=B):
  """A shuffled tf.data pipeline with drop_remainder: 9 batches of 10."""
  return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(
      batch, drop_remainder=True)


def _model(sigma=1.0, **kwargs):
  model = dp.make_private(keras.Sequential(
      [keras.Input((D,)), keras.layers.Dense(2)]))
  model.compile(
      optimizer=dp.DPAdamBC(l2_norm_clip=1.0, noise_multiplier=sigma,
                            **kwargs),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      jit_compile=False)
  return model


def _rdp(*parts):
  """ε (RDP) of the composition of (σ, count) Gaussian mechanisms."""
  accountant = dp_accounting.rdp.RdpAccountant()
  for sigma, count in parts:
    if count:
      accountant.compose(dp_accounting.GaussianDpEvent(sigma), count)
  return accountant.get_epsilon(DELTA)


def _reported(optimizer):
  return dp.epsilon_of_event(optimizer.dp_event(N, sampling="shuffle"), DELTA)


def test_drop_remainder_epochs_are_accounted_as_run(tmp_path):
  """The issue's example: N = 95, B = 10, drop_remainder, 11 epochs."""
  x, y = _data()
  model = _model()
  budget = dp.PrivacyBudget(N, DELTA, verbose=0)
  log_dir = str(tmp_path / "tb")
  history = model.fit(_dropping_remainder(x, y), epochs=11, verbose=0,
                      callbacks=[budget, dp.PrivacyTensorBoard(
                          log_dir, N, DELTA)])
  optimizer = model.optimizer
  assert optimizer.steps_taken == 99  # 11 epochs of 9 batches, not of 10
  expected = _rdp((1.0, 11))          # one Gaussian(σ) per epoch run
  assert expected == pytest.approx(20.259, abs=1e-3)
  assert _rdp((1.0, 10)) == pytest.approx(19.054, abs=1e-3)  # ceil(N/B)
  assert _reported(optimizer) == pytest.approx(expected, rel=1e-9)
  per_epoch = [_rdp((1.0, e)) for e in range(1, 12)]
  np.testing.assert_allclose(budget.history, per_epoch, rtol=1e-9)
  np.testing.assert_allclose(history.history["epsilon"], per_epoch,
                             rtol=1e-9)
  written = {}
  for path in glob.glob(f"{log_dir}/events.out.tfevents.*"):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == "privacy/epsilon":
          written[event.step] = float(tf.make_ndarray(value.tensor))
  assert sorted(written) == [9 * e for e in range(1, 12)]
  np.testing.assert_allclose([written[s] for s in sorted(written)],
                             per_epoch, rtol=1e-6)
  text = dp.optimizer_privacy_statement(optimizer, N, DELTA)
  assert f"ε = {expected:.3f} if each example is used exactly once" in text
  assert "11 epoch(s) as run (9 batch(es) each)" in text
  assert "upper bound" not in text


def test_partial_last_batches_and_several_fits():
  x, y = _data()
  model = _model(sigma=1.3)
  model.fit(x, y, batch_size=B, epochs=2, verbose=0)  # 10 batches: 9 + 1·5
  model.fit(x, y, batch_size=B, epochs=1, verbose=0)
  optimizer = model.optimizer
  assert optimizer.steps_taken == 30
  assert _reported(optimizer) == pytest.approx(_rdp((1.3, 3)), rel=1e-9)
  text = dp.optimizer_privacy_statement(optimizer, N, DELTA)
  assert "3 epoch(s) as run (10 batch(es) each)" in text


def test_truncated_dataset_epochs_hold_their_real_batches():
  x, y = _data()
  model = _model()
  # .take(4): 4 batches per epoch; 6 epochs = 24 steps, which ceil(N/B)
  # would have accounted as 3 passes.
  model.fit(_dropping_remainder(x, y).take(4), epochs=6, verbose=0)
  assert model.optimizer.steps_taken == 24
  assert _reported(model.optimizer) == pytest.approx(_rdp((1.0, 6)),
                                                     rel=1e-9)


def test_steps_per_epoch_below_a_pass_counts_every_epoch():
  """steps_per_epoch=2 on 9-batch passes: Keras' epochs hold 2, 2, 2, 2, 1,
  2, ... batches (it continues one pass across epochs and ends an epoch
  where the pass ends). Each epoch is counted as a pass: an upper bound on
  the 3 passes the 20 batches touched, which the ceil(N/B) formula (2) was
  under."""
  x, y = _data()
  model = _model()
  model.fit(_dropping_remainder(x, y), steps_per_epoch=2, epochs=11,
            verbose=0)
  optimizer = model.optimizer
  assert optimizer.steps_taken == 20
  structure = optimizer.accounting_ledger.structure()
  assert (structure.passes, structure.min_epoch_batches,
          structure.max_epoch_batches) == (11, 1, 2)
  eps = _reported(optimizer)
  assert eps == pytest.approx(_rdp((1.0, 11)), rel=1e-9)
  assert eps >= _rdp((1.0, 3)) > _rdp((1.0, 2))
  text = dp.optimizer_privacy_statement(optimizer, N, DELTA)
  assert "each of its epochs was counted as a full pass" in text


def test_accumulated_steps_spanning_epochs_are_accounted_with_half_sigma():
  """k = 2 on 9-batch epochs: batches 8-9 and 26-27 are one logical step
  each, spanning epochs 1-2 and 3-4, so an example can be in each of them
  twice (2Δ). Batch 18 starts a step, so epochs 2 and 3 share none."""
  x, y = _data()
  model = _model(gradient_accumulation_steps=2)
  budget = dp.PrivacyBudget(N, DELTA, verbose=0)
  model.fit(_dropping_remainder(x, y), epochs=4, verbose=0,
            callbacks=[budget])
  optimizer = model.optimizer
  assert optimizer.steps_taken == 18
  expected = [
      _rdp((1.0, 1)),              # 4 steps + 1 batch pending: epoch 1
      _rdp((0.5, 1)),              # step 4 holds epochs 1 and 2
      _rdp((0.5, 1), (1.0, 1)),    # + epoch 3 (its last batch pending)
      _rdp((0.5, 2)),              # step 13 holds epochs 3 and 4
  ]
  np.testing.assert_allclose(budget.history, expected, rtol=1e-9)
  assert _reported(optimizer) == pytest.approx(expected[-1], rel=1e-9)
  # What ceil(N/B) = 10 batches per epoch (k divides it) reported: σ
  # unhalved, 4 epochs.
  assert expected[-1] > _rdp((1.0, 4))
  assert optimizer.accounted_noise_multiplier(N) == pytest.approx(0.5)
  text = dp.optimizer_privacy_statement(optimizer, N, DELTA)
  assert "has 2 such step(s)" in text and "σ/2 = 0.5" in text


def test_accumulation_compounds_with_microbatching():
  x, y = _data()
  model = _model(gradient_accumulation_steps=2, num_microbatches=5)
  model.fit(_dropping_remainder(x, y), epochs=2, verbose=0)
  # Microbatches of 2 examples (2Δ: σ/2), one step spanning both epochs
  # (2 × 2Δ: σ/4).
  assert _reported(model.optimizer) == pytest.approx(_rdp((0.25, 1)),
                                                     rel=1e-9)


def test_a_resumed_run_covers_every_epoch(tmp_path):
  x, y = _data()
  model = _model()
  model.fit(_dropping_remainder(x, y), epochs=2, verbose=0)
  path = str(tmp_path / "run.keras")
  model.save(path)
  resumed = dp.make_private(keras.models.load_model(path))
  resumed.fit(_dropping_remainder(x, y), epochs=2, verbose=0)
  optimizer = resumed.optimizer
  assert optimizer.steps_taken == 36
  assert _reported(optimizer) == pytest.approx(_rdp((1.0, 4)), rel=1e-9)
  text = dp.optimizer_privacy_statement(optimizer, N, DELTA)
  assert "4 epoch(s) as run (9 batch(es) each)" in text


def test_an_earlier_checkpoint_restored_in_process_is_flagged(tmp_path):
  # The ledger is optimizer state: load_weights of an earlier checkpoint
  # rolls it back, and the releases made after that checkpoint (whose
  # checkpoints are outputs too) left the statement without a word.
  x, y = _data()
  model = _model()
  model.fit(_dropping_remainder(x, y), epochs=1, verbose=0)
  path = str(tmp_path / "first.weights.h5")
  model.save_weights(path)
  model.fit(_dropping_remainder(x, y), epochs=2, verbose=0)
  optimizer = model.optimizer
  assert "WARNING" not in dp.optimizer_privacy_statement(optimizer, N, DELTA)
  model.load_weights(path)
  assert optimizer.steps_taken == 9
  with pytest.warns(UserWarning, match="restored in this process to 9"):
    text = dp.optimizer_privacy_statement(optimizer, N, DELTA)
  assert "after it had released 27" in text.splitlines()[1]
  model.fit(_dropping_remainder(x, y), epochs=1, verbose=0)  # still short
  with pytest.warns(UserWarning, match="to 18 physical batches"):
    dp.optimizer_privacy_statement(optimizer, N, DELTA)


def test_a_mid_epoch_checkpoint_resumes_as_an_upper_bound(tmp_path):
  """Saved after 16 batches (epoch 2 open): the 7 batches of epoch 2 before
  the checkpoint cannot be told from steps run after loading, so each is
  accounted as its own epoch; an epoch-end checkpoint is exact."""
  x, y = _data()
  for save_freq, expected in (("epoch", _rdp((1.0, 3))),
                              (16, _rdp((1.0, 2 + 7)))):
    model = _model()
    path = str(tmp_path / f"{save_freq}.keras")
    model.fit(_dropping_remainder(x, y), epochs=2, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(
                  path, save_freq=save_freq)])
    resumed = dp.make_private(keras.models.load_model(path))
    resumed.fit(_dropping_remainder(x, y), epochs=1, verbose=0)
    assert _reported(resumed.optimizer) == pytest.approx(expected, rel=1e-9)
    text = dp.optimizer_privacy_statement(resumed.optimizer, N, DELTA)
    assert ("upper bound" in text) == (save_freq != "epoch")


def test_resumed_mid_accumulation_keeps_what_was_released(tmp_path):
  """Saved with batch 9 of epoch 1 accumulated but not released: loading
  drops it, so epoch 2's batches start a logical step of their own."""
  x, y = _data()
  model = _model(gradient_accumulation_steps=2)
  model.fit(_dropping_remainder(x, y), epochs=1, verbose=0)
  path = str(tmp_path / "mid.keras")
  model.save(path)
  resumed = dp.make_private(keras.models.load_model(path))
  resumed.fit(_dropping_remainder(x, y), epochs=1, verbose=0)
  assert resumed.optimizer.steps_taken == 8
  assert _reported(resumed.optimizer) == pytest.approx(_rdp((1.0, 2)),
                                                       rel=1e-9)
  # Without the restart, step 4 held batches of both epochs.
  model.fit(_dropping_remainder(x, y), epochs=1, verbose=0)
  assert _reported(model.optimizer) == pytest.approx(_rdp((0.5, 1)),
                                                     rel=1e-9)


class _Interrupted(Exception):
  pass


def test_an_interrupted_epoch_is_a_prefix_of_one_pass():
  class Stop(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if self.model.optimizer.steps_taken == 12:
        raise _Interrupted

  x, y = _data()
  model = _model()
  with pytest.raises(_Interrupted):
    model.fit(_dropping_remainder(x, y), epochs=3, verbose=0,
              callbacks=[Stop()])
  assert model.optimizer.steps_taken == 12
  structure = model.optimizer.accounting_ledger.structure()
  assert (structure.passes, structure.unknown_batches) == (2, 0)
  assert _reported(model.optimizer) == pytest.approx(_rdp((1.0, 2)),
                                                     rel=1e-9)


def _custom_loop(model, epochs, batches, end_epochs):
  x, y = _data()
  optimizer = model.optimizer
  for _ in range(epochs):
    for i in range(batches):
      xb, yb = x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]
      result, _, _ = dp.private_gradient_sum(
          model, xb, yb, None, optimizer.clip_spec(model.trainable_variables))
      optimizer.apply_private(result, B, B, model.trainable_variables)
    if end_epochs:
      optimizer.accounting_ledger.end_epoch()


def test_a_custom_loop_of_unknown_epochs_is_an_upper_bound():
  model = _model(sigma=2.0)
  _custom_loop(model, epochs=3, batches=4, end_epochs=False)
  optimizer = model.optimizer
  true = _rdp((2.0, 3))     # what 3 passes of 4 batches would give
  eps = _reported(optimizer)
  assert eps == pytest.approx(_rdp((2.0, 12)), rel=1e-9)  # every batch
  assert eps >= true
  text = dp.optimizer_privacy_statement(optimizer, N, DELTA)
  assert "ε is an upper bound because 12 physical batch(es) ran outside a " \
         "recorded epoch" in text
  assert "end_epoch()" in text

  declared = _model(sigma=2.0)
  _custom_loop(declared, epochs=3, batches=4, end_epochs=True)
  assert _reported(declared.optimizer) == pytest.approx(true, rel=1e-9)
  text = dp.optimizer_privacy_statement(declared.optimizer, N, DELTA)
  assert "upper bound" not in text and "3 epoch(s) as run" in text


def test_repeated_data_with_steps_per_epoch_is_an_upper_bound():
  """An infinite dataset: fit's epochs need not be passes (one can hold an
  example twice), so every batch is accounted as possibly holding it."""
  x, y = _data()
  model = _model()
  model.fit(_dropping_remainder(x, y).repeat(), steps_per_epoch=5, epochs=2,
            verbose=0)
  assert _reported(model.optimizer) == pytest.approx(_rdp((1.0, 10)),
                                                     rel=1e-9)
  assert _reported(model.optimizer) >= _rdp((1.0, 2))  # 10 of 9-batch passes
  text = dp.optimizer_privacy_statement(model.optimizer, N, DELTA)
  assert "ε is an upper bound because" in text and "steps_per_epoch" in text


def test_callbacks_record_epochs_where_fit_is_not_tracked():
  """keras.Model.fit itself (as tf_keras' fit): the privacy callbacks record
  the epochs; without them the batches are unknown (upper bound)."""
  x, y = _data()
  model = _model()
  budget = dp.PrivacyBudget(N, DELTA, verbose=0)
  keras.Model.fit(model, _dropping_remainder(x, y), epochs=3, verbose=0,
                  callbacks=[budget])
  assert budget.history[-1] == pytest.approx(_rdp((1.0, 3)), rel=1e-9)
  keras.Model.fit(model, _dropping_remainder(x, y), epochs=1, verbose=0)
  assert _reported(model.optimizer) == pytest.approx(
      _rdp((1.0, 3 + 9)), rel=1e-9)


def test_privacy_budget_looks_ahead_by_the_real_epoch():
  """Stops when one more 9-batch epoch would exceed the budget."""
  x, y = _data()
  model = _model(sigma=2.0)
  target = _rdp((2.0, 4)) + 1e-6  # 4 epochs fit, 5 do not
  budget = dp.PrivacyBudget(N, DELTA, target_epsilon=target, verbose=0)
  model.fit(_dropping_remainder(x, y), epochs=10, verbose=0,
            callbacks=[budget])
  assert len(budget.history) == 4 and model.optimizer.steps_taken == 36


def test_poisson_counts_the_steps_run():
  x, y = _data()
  model = _model(expected_batch_size=B)
  data = dp.data.poisson_batches(x, y, expected_batch_size=B,
                                 steps_per_epoch=3, seed=1)
  model.fit(data, epochs=2, verbose=0)
  event = model.optimizer.dp_event(N)
  assert event == dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          B / N, dp_accounting.GaussianDpEvent(1.0)), 6)


# ------------------------------------------- the worst case, by brute force
def _brute_force(segments, k):
  """max Σ c² over every placement of one example: once in each known
  epoch (one of the logical steps it intersects), once in each unknown
  batch; c = its occurrences in a released step."""
  passes, position = [], 0
  for length, known in segments:
    passes += ([(position, position + length)] if known else
               [(p, p + 1) for p in range(position, position + length)])
    position += length
  released = position // k
  options = [[r for r in range(s // k, (e - 1) // k + 1) if r < released]
             or [None] for s, e in passes]
  best = 0
  for choice in itertools.product(*options):
    counts = {}
    for r in choice:
      if r is not None:
        counts[r] = counts.get(r, 0) + 1
    best = max(best, sum(c * c for c in counts.values()))
  return best


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    k=st.integers(1, 5),
    segments=st.lists(st.tuples(st.integers(1, 7), st.booleans()),
                      min_size=1, max_size=6).filter(
                          lambda s: sum(n for n, known in s if not known)
                          <= 6))
def test_ledger_worst_case_equals_brute_force(k, segments):
  state = ledger_lib.LedgerState(k=k)
  position = 0
  for length, known in segments:
    if known:
      state.begin(position)
      position += length
      state.end(position)
    else:
      position += length  # batches no epoch accounts for
  structure = state.structure(position)
  assert structure.releases.total == _brute_force(segments, k)
  assert structure.steps == position // k
  restored = ledger_lib.LedgerState.decode(state.encode(), k)
  assert restored == state


def test_gaussian_event_of_the_worst_case_is_exact():
  """c occurrences in one release (sensitivity cΔ) = σ/c; three or more are
  written as c² releases at σ: the same ε."""
  releases = ledger_lib.Releases(single=2, double=1).close(3)
  event = dp.accounting.events.shuffled_gaussian_event(1.5, releases)
  assert dp.epsilon_of_event(event, DELTA) == pytest.approx(
      _rdp((1.5, 2), (0.75, 1), (0.5, 1)), rel=1e-9)
  assert math.isinf(dp.epsilon_of_event(
      dp.accounting.events.shuffled_gaussian_event(0.0, releases), DELTA))


def test_an_epoch_that_repeats_the_data_is_not_taken_for_one_pass():
  """Dataset.repeat(3) before fit: one Keras epoch holds 3 passes. Taking it
  for one pass would report the ε of 1 participation instead of 3; the
  ledger sees an epoch longer than ceil(N/B) batches and accounts every
  batch as its own pass (an upper bound), and the statement says why."""
  x, y = _data()
  model = _model()
  repeated = tf.data.Dataset.from_tensor_slices((x, y)).repeat(3).batch(B)
  model.fit(repeated, epochs=1, verbose=0)
  optimizer = model.optimizer
  assert optimizer.steps_taken == 29  # ceil(285 / 10)
  eps = _reported(optimizer)
  assert eps >= _rdp((1.0, 3)) - 1e-9   # at least the 3 passes it held
  assert eps == pytest.approx(_rdp((1.0, 29)), rel=1e-9)
  text = dp.optimizer_privacy_statement(optimizer, N, DELTA)
  # Its pipeline repeats: not a pass (ledger.fit_data), before any count.
  assert "can emit an element more than once" in text
  assert "upper bound" in text


def test_steps_per_epoch_over_a_repeated_dataset_is_not_under_counted():
  """shuffle(N).repeat(3).batch(B) with steps_per_epoch=10: 2 Keras epochs
  of 10 batches hold 200 examples of a 95-example set, so some example ran
  3 times; taking each epoch for a pass reported ε(2 passes) = 7.08 (found
  by a review). More examples than the recorded passes hold: every batch is
  accounted as its own pass."""
  x, y = _data()
  model = _model()
  repeated = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).repeat(
      3).batch(B)
  model.fit(repeated, epochs=2, steps_per_epoch=10, verbose=0)
  optimizer = model.optimizer
  assert optimizer.steps_taken == 20
  eps = _reported(optimizer)
  assert eps >= _rdp((1.0, 3))  # at least the 3 passes an example can see
  text = dp.optimizer_privacy_statement(optimizer, N, DELTA)
  # Its pipeline repeats: not a pass (ledger.fit_data), before any count.
  assert "upper bound" in text and "can emit an element more than once" in text


# ------------------------------------------------ adjacency, named per run
def test_each_statement_names_the_adjacency_its_epsilon_holds_under():
  """Fixed-size batches make N public (the number of batches and the last
  one's divisor depend on it): their ε is under zero-out adjacency, with a
  replace-one bound at σ/2; Poisson batches divide by B and keep add/remove.
  """
  x, y = _data()
  fixed = _model(sigma=1.0)
  fixed.fit(_dropping_remainder(x, y), epochs=2, verbose=0)
  text = dp.optimizer_privacy_statement(fixed.optimizer, N, DELTA)
  assert "adjacency: zero-out" in text
  assert "adding or removing an example is NOT covered" in text
  assert f"ε = {_rdp((1.0, 2)):.3f} if each example" in text
  assert f"ε ≤ {_rdp((0.5, 2)):.3f} if one example is replaced" in text

  poisson = _model(sigma=1.0, expected_batch_size=B)
  poisson.fit(dp.data.poisson_batches(x, y, expected_batch_size=B,
                                      steps_per_epoch=3, seed=1),
              epochs=1, verbose=0)
  text = dp.optimizer_privacy_statement(poisson.optimizer, N, DELTA)
  assert "adjacency: adding or removing one training example" in text
  assert "zero-out" not in text and "replace" not in text

  planned = dp.privacy_statement(N, B, 2, 1.0, DELTA)
  assert "for the Poisson figure" in planned
  assert "zero-out" in planned and "for the once-per-epoch figure" in planned


def test_replace_one_halves_every_gaussian_and_refuses_sampling():
  from tf_dpadambc.accounting import events  # pylint: disable=g-import-not-at-top
  releases = ledger_lib.Releases(single=3, double=2, more_squares=9)
  event = events.replace_one(events.shuffled_gaussian_event(1.2, releases))
  assert dp.epsilon_of_event(event, DELTA) == pytest.approx(
      _rdp((0.6, 3), (0.3, 2), (0.6, 9)), rel=1e-9)
  assert events.replace_one(dp_accounting.NoOpDpEvent()) == (
      dp_accounting.NoOpDpEvent())
  with pytest.raises(ValueError, match="PoissonSampled"):
    events.replace_one(dp.dp_sgd_event(1.0, N, B, 5, "poisson"))


def test_a_model_compiled_again_composes_the_earlier_runs(tmp_path):
  # The weights carry every earlier optimizer's releases: a new optimizer's
  # ε reported 4.73 for a model of 10.73 (3 epochs, recompiled, 1 more).
  x, y = _data()
  model = _model(sigma=1.0)
  model.fit(x, y, batch_size=B, epochs=3, verbose=0)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  for _ in range(2):
    # (A non-DP compile in between, whose fit would be refused, broke the
    # chain: ε 4.73 again; so would a DP optimizer compiled and never fit.)
    model.compile(optimizer="sgd", loss=loss)
    for _ in range(2):
      model.compile(optimizer=dp.DPAdamBC(l2_norm_clip=1.0,
                                          noise_multiplier=1.0),
                    loss=loss, jit_compile=False)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
  opt = model.optimizer
  assert opt.steps_taken == 10
  assert _reported(opt) == pytest.approx(_rdp((1.0, 5)), rel=1e-9)
  text = dp.optimizer_privacy_statement(opt, N, DELTA)
  assert f"ε = {_rdp((1.0, 5)):.3f} if each example" in text
  assert "includes the run this model had before" in text
  assert "40 physical batch(es)" in text and "WARNING" not in text
  # Saved and loaded, the earlier optimizers are gone, but their count is in
  # the ledger: the statement warns that ε does not include them.
  path = str(tmp_path / "model.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  with pytest.warns(UserWarning, match="ran 40 physical batches"):
    text = dp.optimizer_privacy_statement(loaded.optimizer, N, DELTA)
  assert "WARNING" in text


def test_an_optimizer_assigned_without_compile_is_refused():
  # The traced step kept training with the first optimizer while
  # model.optimizer (what the statement and PrivacyBudget read) said ε 0.
  x, y = _data()
  model = _model(sigma=1.0)
  model.fit(x, y, batch_size=B, epochs=1, verbose=0)
  model.optimizer = dp.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0)
  with pytest.raises(ValueError, match="Compile again"):
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
