"""Nothing secret or un-noised in any serialization (issue 13, item 4).

A training optimizer holds three kinds of secrets: the clipped sums of a
pending accumulation step (not noised yet), the noise seed, and the stream of
correlated (DP-MF) noise (past noise; a Dense strategy redraws it from the
seed). Each scenario below trains a tiny model until those exist, reads them
from the live optimizer, saves the model in every format, reads every saved
tensor — and every saved byte — back, and asserts that none of them is there.
Then restoring: accumulation restarts its logical step, the seed is fresh, a
DP-MF run refuses to resume mid-stream.
"""
import glob
import io
import json
import os
import pickle
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc import mechanisms
from tf_dpadambc import mf

X = np.random.RandomState(0).randn(48, 5).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
DEVICES = ["/cpu:0", "/cpu:1"]
FIXED_SEED = 987654321987  # a user's seed= must not reach a config either
_DENSE = np.tril(np.random.RandomState(1).uniform(-0.3, 0.3, (6, 6)), -1) + (
    np.diag(np.random.RandomState(2).uniform(0.8, 1.5, 6)))


def _banded(steps=8):
  return mechanisms.CorrelatedNoise(mf.Toeplitz([1.0, 0.6, 0.3, 0.1]), steps)


# name -> (optimizer factory, examples fitted in batches of 8, replicated)
SCENARIOS = {
    # 4 physical batches, k = 3: one release, one batch pending. JME also
    # accumulates Σ clip(g)² and draws two noise streams. ε = 1: with Adam's
    # 1e-7, a noisy v̂ clamped to 0 moves weights by ~1000 in the release,
    # the tanh layer saturates, and a pending batch the model then fits
    # with certainty has clipped sums of exactly 0 (nothing to look for).
    "accumulation": (lambda: dp.DPAdamJME(
        1.0, 1.0, gradient_accumulation_steps=3, epsilon=1.0), 32, False),
    # DP-MF with its banded stream, and a pending batch (5 batches, k = 2).
    "dpmf": (lambda: dp.DPAdamBC(1.0, 1.0, gradient_accumulation_steps=2,
                                 noise=_banded()), 40, False),
    # A Dense strategy redraws z_0..z_t from the (here fixed) seed.
    "dpmf_dense": (lambda: dp.DPAdam(
        1.0, 1.0, seed=FIXED_SEED,
        noise=mechanisms.CorrelatedNoise(mf.Dense(_DENSE), 6)), 24, False),
    # Two replicas: the seed lives in an optimizer variable; k = 2, 3 batches.
    "mirrored": (lambda: dp.DPAdamBC(1.0, 1.0, gradient_accumulation_steps=2),
                 24, True),
}


def _mlp():
  return keras.Sequential([keras.Input((5,)),
                           keras.layers.Dense(3, activation="tanh"),
                           keras.layers.Dense(2)])


def _compiled(optimizer, strategy=None, jit_compile=False):
  """A private MLP compiled with ``optimizer`` (or a factory of one, called
  in the strategy's scope, where a replicated optimizer must be made)."""
  with (strategy or tf.distribute.get_strategy()).scope():
    model = dp.make_private(_mlp())
    model.compile(optimizer=optimizer() if callable(optimizer) else optimizer,
                  loss=LOSS, jit_compile=jit_compile)
  return model


def _train(name):
  make, n, replicated = SCENARIOS[name]
  strategy = tf.distribute.MirroredStrategy(DEVICES) if replicated else None
  keras.utils.set_random_seed(3)
  model = _compiled(make, strategy)
  model.fit(X[:n], Y[:n], batch_size=8, shuffle=False, verbose=0)
  return model


def _live_secrets(opt):
  """(float arrays, seed words) that must not be in any file, read from the
  live optimizer: pending clipped sums, DP-MF stream state, seeds."""
  arrays = [v.numpy() for v in list(getattr(opt, "_accumulated_sums", []))
            + list(getattr(opt, "_accumulated_squares", []))]
  for states in getattr(opt, "_noise_state", {}).values():
    arrays += [v.numpy() for v in states if v is not None]
  arrays = [a for a in arrays if np.any(a != 0)]
  seeds = [np.asarray(opt._seed_pair, np.int64)]
  if getattr(opt, "_seed_variable", None) is not None:
    seeds.append(opt._seed_variable.numpy())
  # 0x5EED is the public tag of a user's seed pair, not a secret.
  words = {int(w) for s in seeds for w in np.ravel(s)} - {0x5EED}
  if opt.seed is not None:
    words.add(int(opt.seed))
  return arrays, words


@pytest.fixture(scope="module")
def trained():
  cache = {}

  def get(name):
    if name not in cache:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cache[name] = _train(name)
    return cache[name]
  return get


# ------------------------------------------------ reading the files back
def _h5_tensors(source):
  out = []
  with h5py.File(source, "r") as f:
    f.visititems(lambda _, obj: out.append(np.asarray(obj[()]))
                 if isinstance(obj, h5py.Dataset) else None)
  return out


def _checkpoint_tensors(prefix):
  return [np.asarray(tf.train.load_variable(prefix, name))
          for name, _ in tf.train.list_variables(prefix)]


def _files_bytes(directory):
  return [open(p, "rb").read() for p in glob.glob(
      os.path.join(directory, "**"), recursive=True) if os.path.isfile(p)]


def _keras_zip(data):
  """Tensors and bytes of a .keras archive (bytes or a path)."""
  tensors, blobs = [], []
  with zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes)
                       else data) as archive:
    for member in archive.namelist():
      content = archive.read(member)
      blobs.append(content)
      if member.endswith(".h5"):
        tensors += _h5_tensors(io.BytesIO(content))
  return tensors, blobs


def _save(fmt, model, directory):
  """Saves ``model`` in ``fmt``; returns (tensors, byte blobs) written."""
  opt = model.optimizer
  path = os.path.join(directory, fmt)
  if fmt == "keras":
    model.save(path + ".keras")
    return _keras_zip(path + ".keras")
  if fmt == "weights_h5":
    model.save_weights(path + ".weights.h5")
    return (_h5_tensors(path + ".weights.h5"),
            [open(path + ".weights.h5", "rb").read()])
  if fmt == "checkpoint":
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).save(path)
    return _checkpoint_tensors(prefix), _files_bytes(directory)
  if fmt == "saved_model":
    tf.saved_model.save(model, path)
  elif fmt == "export":
    model.export(path, verbose=False)
  if fmt in ("saved_model", "export"):
    return (_checkpoint_tensors(os.path.join(path, "variables", "variables")),
            _files_bytes(path))
  if fmt == "config":
    texts = [keras.optimizers.serialize(opt), opt.get_config(),
             model.get_compile_config()]
    return [], [json.dumps(t, default=str).encode() for t in texts]
  if fmt == "pickle":
    tensors, blobs = [], []
    for obj in (model, opt):
      blobs.append(pickle.dumps(obj))
      _, (buffer,) = obj.__reduce__()  # Keras pickles a .keras archive
      more = _keras_zip(buffer.getvalue())
      tensors += more[0]
      blobs += more[1]
    return tensors, blobs
  raise ValueError(fmt)


def _assert_nothing_secret(tensors, blobs, arrays, words):
  assert tensors or blobs
  for t in tensors:
    for secret in arrays:
      if t.shape == secret.shape and t.dtype.kind == "f":
        assert not np.allclose(t, secret), "a secret tensor was saved"
    if t.dtype.kind in "iu":
      assert not words & {int(w) for w in np.ravel(t)}, "a seed was saved"
  for blob in blobs:
    for secret in arrays:  # (pending sums are float64: either rounding)
      for form in (secret.tobytes(), secret.astype(np.float32).tobytes()):
        assert form not in blob
    for w in words:
      assert np.int64(w).tobytes() not in blob, "a seed's bytes were saved"
      assert str(w).encode() not in blob, "a seed's digits were saved"


FORMATS = ["keras", "weights_h5", "checkpoint", "saved_model", "export",
           "config", "pickle"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_format_saves_a_secret(trained, name, fmt, tmp_path):
  model = trained(name)
  opt = model.optimizer
  arrays, words = _live_secrets(opt)
  assert words
  if name != "dpmf_dense":  # a pending batch, or DP-MF buffers, exist
    assert arrays
  if name == "accumulation":  # every variable's pending sum is looked for
    assert len(arrays) == len(opt._accumulated_sums)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    tensors, blobs = _save(fmt, model, str(tmp_path))
  _assert_nothing_secret(tensors, blobs, arrays, words)
  if fmt in ("keras", "weights_h5", "checkpoint"):
    # ...while the public optimizer state is there (the step counter).
    assert any(t.shape == () and t.dtype.kind == "i"
               and int(t) == opt.iterations.numpy() for t in tensors)


def test_model_checkpoint_callback_writes_no_pending_sum(tmp_path):
  # save_weights_only after every batch: the files written while a logical
  # step is pending must not hold its clipped sums (read at each save).
  path = str(tmp_path / "w.weights.h5")
  seen = []

  class Collect(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      seen.append((_live_secrets(self.model.optimizer), _h5_tensors(path)))

  model = _compiled(dp.DPSGD(1.0, 1.0, gradient_accumulation_steps=3))
  checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=True,
                                               save_freq=1)
  model.fit(X[:32], Y[:32], batch_size=8, verbose=0,
            callbacks=[checkpoint, Collect()])
  assert len(seen) == 4 and any(arrays for (arrays, _), _ in seen)
  for (arrays, words), tensors in seen:
    _assert_nothing_secret(tensors, [], arrays, words)


def test_tf_keras_model_checkpoint_in_tf_format_writes_no_secret(tmp_path):
  # The tf_keras adapter: ModelCheckpoint(save_weights_only) writes a TF
  # checkpoint after every batch, pending steps included.
  tf_keras = pytest.importorskip("tf_keras")
  from tf_dpadambc import tf_keras as dptk
  tf_keras.utils.set_random_seed(0)
  model = tf_keras.Sequential([
      tf_keras.layers.Dense(3, activation="tanh", input_shape=(5,)),
      tf_keras.layers.Dense(2)])
  optimizer = dptk.DPAdamBC(1.0, 1.0, gradient_accumulation_steps=3)
  model.compile(optimizer=optimizer, loss=tf_keras.losses.
                SparseCategoricalCrossentropy(
                    from_logits=True,
                    reduction=tf_keras.losses.Reduction.NONE))
  prefix = str(tmp_path / "ckpt")
  seen = []

  class Collect(tf_keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      seen.append((_live_secrets(optimizer.keras_optimizer),
                   _checkpoint_tensors(prefix), _files_bytes(str(tmp_path))))

  model.fit(X[:32], Y[:32], batch_size=8, shuffle=False, verbose=0,
            callbacks=[tf_keras.callbacks.ModelCheckpoint(
                prefix, save_weights_only=True, save_freq=1), Collect()])
  assert len(seen) == 4 and any(arrays for (arrays, _), _, _ in seen)
  for (arrays, words), tensors, blobs in seen:
    _assert_nothing_secret(tensors, blobs, arrays, words)


# ------------------------------------------------------------ restoring
def _fit(model, n, x=X, y=Y):
  model.fit(x[:n], y[:n], batch_size=8, shuffle=False, verbose=0)


@pytest.mark.parametrize("fmt", ["keras", "checkpoint"])
def test_a_restored_accumulation_restarts_its_logical_step(fmt, tmp_path):
  model = _compiled(dp.DPSGD(1.0, 1.0, gradient_accumulation_steps=3))
  _fit(model, 32)  # 4 batches: one release, one batch pending
  opt = model.optimizer
  assert opt.steps_taken == 1 and int(opt._accumulated_units.numpy()) == 8
  if fmt == "keras":
    model.save(str(tmp_path / "m.keras"))
    restored = dp.make_private(keras.models.load_model(str(tmp_path /
                                                           "m.keras")))
  else:
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "c"))
    restored = _compiled(dp.DPSGD(1.0, 1.0, gradient_accumulation_steps=3))
    tf.train.Checkpoint(model=restored).restore(path)
  new = restored.optimizer
  assert new.steps_taken == 1
  _fit(restored, 16)  # two batches: with the half-sum they would release
  assert new.steps_taken == 1
  assert int(new._accumulated_units.numpy()) == 16
  _fit(restored, 8)
  assert new.steps_taken == 2  # k fresh batches make the next step
  assert int(new._accumulated_units.numpy()) == 0


def test_rolling_back_in_process_drops_the_live_pending_sums(tmp_path):
  # A restore into the same live optimizer (BackupAndRestore after an
  # interruption does this): the partial sums gathered since the checkpoint
  # belong to batches the resumed run may feed again.
  model = _compiled(dp.DPSGD(1.0, 1.0, gradient_accumulation_steps=3))
  _fit(model, 32)  # step 1, one batch pending
  opt = model.optimizer
  ckpt = tf.train.Checkpoint(model=model)
  path = ckpt.save(str(tmp_path / "c"))
  weights = str(tmp_path / "w.weights.h5")
  model.save_weights(weights)
  for restore in (lambda: ckpt.restore(path),
                  lambda: model.load_weights(weights)):
    _fit(model, 8)  # two batches pending now, step 1
    assert int(opt._accumulated_units.numpy()) == 16
    restore()
    _fit(model, 8)  # the window restarted: one batch, no release
    assert opt.steps_taken == 1
    assert int(opt._accumulated_units.numpy()) == 8


def test_the_seed_is_fresh_after_every_restore(tmp_path):
  model = _compiled(dp.DPSGD(1.0, 1.0, learning_rate=0.1))
  _fit(model, 16)
  opt = model.optimizer
  before = opt._seed().numpy().copy()
  model.save(str(tmp_path / "m.keras"))
  loaded = keras.models.load_model(str(tmp_path / "m.keras"))
  assert not np.array_equal(loaded.optimizer._seed().numpy(), before)

  # In process, a Keras restore draws a new seed from the OS...
  weights = str(tmp_path / "w.weights.h5")
  model.save_weights(weights)
  _fit(model, 8)
  model.load_weights(weights)
  after_load = opt._seed().numpy().copy()
  assert not np.array_equal(after_load, before)
  # ...and a step index drawn before with the current seed (a TF checkpoint
  # rolled the counter back) gets a fresh one derived from it in the step.
  ckpt = tf.train.Checkpoint(model=model)
  path = ckpt.save(str(tmp_path / "c"))
  _fit(model, 8)
  assert np.array_equal(opt._seed().numpy(), after_load)
  ckpt.restore(path)
  _fit(model, 8)
  assert not np.array_equal(opt._seed().numpy(), after_load)


def test_the_same_noise_is_never_drawn_twice_after_a_rollback(tmp_path):
  # Zero inputs, no bias: the gradients are 0, so a DPSGD step (lr 1) moves
  # the kernel by exactly −noise/B. Replaying step 1 after a rollback must
  # add different noise (equal noise would let two releases cancel it).
  model = dp.make_private(keras.Sequential([
      keras.Input((3,)), keras.layers.Dense(4, use_bias=False,
                                            kernel_initializer="zeros")]))
  model.compile(optimizer=dp.DPSGD(1.0, 1.0, learning_rate=1.0), loss="mse")
  x, y = np.zeros((8, 3), "float32"), np.zeros((8, 4), "float32")
  model.fit(x, y, batch_size=8, verbose=0)
  ckpt = tf.train.Checkpoint(model=model)
  path = ckpt.save(str(tmp_path / "c"))
  start = model.get_weights()[0].copy()
  model.fit(x, y, batch_size=8, verbose=0)
  first = model.get_weights()[0] - start
  ckpt.restore(path)
  np.testing.assert_array_equal(model.get_weights()[0], start)
  model.fit(x, y, batch_size=8, verbose=0)
  again = model.get_weights()[0] - start
  assert np.all(first != 0) and not np.allclose(first, again)


@pytest.mark.parametrize("fmt", ["keras", "checkpoint"])
def test_a_dpmf_run_refuses_to_resume_mid_stream(fmt, tmp_path):
  model = _compiled(dp.DPAdamBC(1.0, 1.0, noise=_banded()),
                    jit_compile=fmt == "keras")  # one run under XLA
  _fit(model, 24)
  assert model.optimizer.steps_taken == 3
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    if fmt == "keras":
      model.save(str(tmp_path / "m.keras"))
      restored = dp.make_private(keras.models.load_model(
          str(tmp_path / "m.keras")))
    else:
      path = tf.train.Checkpoint(model=model).save(str(tmp_path / "c"))
      restored = _compiled(dp.DPAdamBC(1.0, 1.0, noise=_banded()))
      tf.train.Checkpoint(model=restored).restore(path)
  # The weights and the public optimizer state are back (inference works)...
  for a, b in zip(restored.get_weights(), model.get_weights()):
    np.testing.assert_array_equal(a, b)
  assert restored.optimizer.steps_taken == 3
  # ...but the noise stream is not, so training refuses to go on.
  with pytest.raises(ValueError, match="cannot resume mid-stream"):
    _fit(restored, 8)
  assert restored.optimizer.steps_taken == 3


def test_a_dpmf_rollback_of_a_compiled_run_refuses_at_restore(tmp_path):
  model = _compiled(dp.DPAdamBC(1.0, 1.0, noise=_banded()))
  _fit(model, 8)
  weights = str(tmp_path / "w.weights.h5")
  model.save_weights(weights)
  _fit(model, 8)
  with pytest.raises(ValueError, match="cannot resume mid-stream"):
    model.load_weights(weights)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_compiled_dpmf_step_refuses_a_rollback_it_was_not_told_of(
    jit_compile, tmp_path):
  # tf.train.Checkpoint.restore into the live optimizer reaches no hook of
  # ours: the compiled step itself refuses. XLA drops asserts, so there the
  # step is skipped: nothing released, nothing updated.
  model = _compiled(dp.DPAdamBC(1.0, 1.0, noise=_banded()),
                    jit_compile=jit_compile)
  _fit(model, 8)
  ckpt = tf.train.Checkpoint(model=model)
  path = ckpt.save(str(tmp_path / "c"))
  _fit(model, 8)
  ckpt.restore(path)
  weights = model.get_weights()
  if jit_compile:
    _fit(model, 8)
  else:
    with pytest.raises(tf.errors.InvalidArgumentError, match="mid-stream"):
      _fit(model, 8)
  assert model.optimizer.steps_taken == 1
  for a, b in zip(model.get_weights(), weights):
    np.testing.assert_array_equal(a, b)


@pytest.mark.filterwarnings("ignore:The DPQuery draws its noise:UserWarning")
def test_a_dpquery_state_is_saved_only_where_it_is_public(tmp_path):
  specs = [tf.TensorSpec(w.shape) for w in _mlp().trainable_variables]
  secret = _compiled(dp.DPSGD(query=mechanisms.CorrelatedNoise(
      mf.Toeplitz([1.0, 0.6, 0.3, 0.1]), 8, l2_norm_clip=1.0,
      noise_multiplier=1.0, record_specs=specs)))
  public = _compiled(dp.DPSGD(query=mechanisms.IndependentNoise(1.0, 1.0)))
  for model in (secret, public):
    _fit(model, 16)
  # The correlated query's state holds its past noise: in no file.
  opt = secret.optimizer
  stream = [v.numpy() for v in opt._query_variables if v.shape.rank > 1]
  assert stream and all(np.any(a != 0) for a in stream)
  assert not {id(v) for v in opt._query_variables} & {
      id(v) for v in opt.variables}
  _, words = _live_secrets(opt)
  for fmt in ("weights_h5", "checkpoint"):
    tensors, blobs = _save(fmt, secret, str(tmp_path))
    _assert_nothing_secret(tensors, blobs, stream, words)
  # Independent noise's state (clip, std, step) is public and saved.
  ids = {id(v) for v in public.optimizer.variables}
  assert all(id(v) in ids for v in public.optimizer._query_variables)


def test_a_dpmf_checkpoint_of_step_zero_trains(tmp_path):
  # Saved before the first step: nothing of the stream is missing.
  model = _compiled(dp.DPAdamBC(1.0, 1.0, noise=_banded()))
  model.save(str(tmp_path / "m.keras"))
  restored = dp.make_private(keras.models.load_model(str(tmp_path /
                                                         "m.keras")))
  _fit(restored, 16)
  assert restored.optimizer.steps_taken == 2


def test_a_mirrored_run_restores_and_trains_with_a_fresh_seed(trained,
                                                               tmp_path):
  model = trained("mirrored")
  opt = model.optimizer
  path = tf.train.Checkpoint(model=model).save(str(tmp_path / "c"))
  strategy = tf.distribute.MirroredStrategy(DEVICES)
  restored = _compiled(
      lambda: dp.DPAdamBC(1.0, 1.0, gradient_accumulation_steps=2), strategy)
  with strategy.scope():
    restored.optimizer.build(restored.trainable_variables)
  tf.train.Checkpoint(model=restored).restore(path).assert_consumed()
  new = restored.optimizer
  assert isinstance(new._seed_variable.value, tf.distribute.DistributedValues)
  assert new.steps_taken == opt.steps_taken == 1
  assert not np.array_equal(new._seed().numpy(), opt._seed().numpy())
  _fit(restored, 16)  # the pending batch was dropped: two fresh ones
  assert new.steps_taken == 2


# ------------------------------------------- saving before the first step
def test_an_unbuilt_optimizer_saves_and_loads(tmp_path):
  opt = dp.DPAdamBC(1.0, 1.0, gradient_accumulation_steps=2)
  model = _compiled(opt)
  model.save(str(tmp_path / "m.keras"))  # right after compile
  tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "c"))
  pickle.loads(pickle.dumps(opt))
  _, words = _live_secrets(opt)
  _assert_nothing_secret([], [pickle.dumps(opt), pickle.dumps(model)], [],
                         words)
  restored = dp.make_private(keras.models.load_model(str(tmp_path /
                                                         "m.keras")))
  _fit(restored, 16)
  assert restored.optimizer.steps_taken == 1


def test_a_fixed_seed_is_not_saved_but_reproduces_when_passed_again(
    tmp_path):
  def build():
    keras.utils.set_random_seed(5)
    return _compiled(dp.DPAdamBC(1.0, 1.0, learning_rate=0.01, seed=1234567))

  straight = build()
  _fit(straight, 32)
  first = build()
  _fit(first, 16)
  first.save(str(tmp_path / "m.keras"))
  assert keras.models.load_model(
      str(tmp_path / "m.keras")).optimizer.seed is None
  resumed = build()  # seed= passed again; the state comes from the file
  resumed.optimizer.build(resumed.trainable_variables)
  resumed.load_weights(str(tmp_path / "m.keras"))
  assert resumed.optimizer.steps_taken == 2
  _fit(resumed, 16, X[16:], Y[16:])
  for a, b in zip(resumed.get_weights(), straight.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
