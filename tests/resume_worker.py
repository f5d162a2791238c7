"""A training process for tests/test_resume.py (not a test module).

    python tests/resume_worker.py MODE OUT_DIR CONFIG...

MODE: ``full`` (uninterrupted), ``kill`` (SIGKILLs itself mid-epoch, after
BackupAndRestore wrote the checkpoint of the previous epoch) or ``resume``
(a new process: BackupAndRestore restores, fit finishes). CONFIG:
``NOISE-K-SEED``, NOISE ``independent`` or ``banded``, K the gradient
accumulation steps, SEED an integer or ``secret``. Writes, per config,
OUT_DIR/CONFIG-MODE.npz: the weights after every physical batch (keys
``e{epoch}b{batch}``), the final weights, the accounting (steps, ledger
epochs, ε statement), or the error a resumed fit raised.
"""
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import tf_dpadambc as dp  # noqa: E402

N, BATCH, EPOCHS, D, K = 64, 8, 3, 5, 3
KILL_EPOCH, KILL_BATCH = 1, 4  # after 5 batches of the second epoch
DELTA = 1e-5


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(N, D)).astype("float32"),
          rng.integers(0, K, size=N).astype("int32"))


def _flat(model):
  return np.concatenate([w.ravel() for w in model.get_weights()])


class _Tap(keras.callbacks.Callback):
  """Weights after every physical batch, written before any kill."""

  def __init__(self, path, kill):
    super().__init__()
    self.path, self.kill, self.record, self.epoch = path, kill, {}, 0

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    self.record[f"e{self.epoch}b{batch}"] = _flat(self.model)
    if self.kill and (self.epoch, batch) == (KILL_EPOCH, KILL_BATCH):
      np.savez(self.path, **self.record)
      os.kill(os.getpid(), signal.SIGKILL)


def run(mode, out, config):
  noise_name, k, seed = config.split("-")
  k, seed = int(k), (None if seed == "secret" else int(seed))
  steps = EPOCHS * N // BATCH // k
  noise = (dp.CorrelatedNoise(dp.mf.Toeplitz([1.0, 0.5]), steps=steps)
           if noise_name == "banded" else None)
  keras.utils.set_random_seed(7)  # the initial weights (not the DP noise)
  model = dp.make_private(keras.Sequential([
      keras.Input((D,)), keras.layers.Dense(8, activation="tanh"),
      keras.layers.Dense(K)]))
  opt = dp.DPAdamBC(1.0, 1.0, learning_rate=0.05, seed=seed, noise=noise,
                    gradient_accumulation_steps=k if k > 1 else None)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  path = os.path.join(out, f"{config}-{mode}.npz")
  tap = _Tap(path, kill=mode == "kill")
  callbacks = [tap]
  if mode != "full":
    callbacks.insert(0, keras.callbacks.BackupAndRestore(
        os.path.join(out, f"backup-{config}"), save_freq="epoch"))
  x, y = _data()
  result = {}
  try:
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
              verbose=0, callbacks=callbacks)
  except ValueError as e:  # the refusal of a DP-MF resume
    result["error"] = str(e)
    result["steps"] = int(opt.iterations.numpy())
  else:
    result["steps"] = int(opt.steps_taken)
    result["epochs"] = int(opt.accounting_ledger.structure().passes)
    result["statement"] = dp.optimizer_privacy_statement(opt, N, DELTA)
    result["final"] = _flat(model)
  result["initial_epoch"] = int(getattr(model, "_initial_epoch", 0) or 0)
  np.savez(path, meta=json.dumps({k: v for k, v in result.items()
                                  if k != "final"}),
           **{"final": result.get("final", np.zeros(0))}, **tap.record)


if __name__ == "__main__":
  mode, out, *configs = sys.argv[1:]
  for c in configs:
    run(mode, out, c)
