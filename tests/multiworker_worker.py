"""One worker of a two-process MultiWorkerMirroredStrategy run, for
tests/test_multiworker.py (not a test module).

    TF_CONFIG=... python tests/multiworker_worker.py OUT SCENARIO [SCENARIO ...]

runs the scenarios one after another in this process (one cluster start for
all: most of a launch is two TensorFlow imports and the strategy's setup)
and writes each one's results to OUT with ``{scenario}`` replaced.

SCENARIO: ``keras3-inside`` (custom loop with ``private_step``; model and
optimizer made in the strategy's scope), ``keras3-outside`` (the optimizer
constructed outside the scope, built by ``private_step`` on the first
step), ``keras3-prebuilt`` (the optimizer constructed and built outside the
scope: plain variables, a different OS seed in each process), ``tf_keras-inside``
/ ``tf_keras-outside`` (tf_keras ``fit`` with tf_dpadambc.tf_keras.DPSGD /
DPAdamBC, constructed in or outside the scope) or
``keras3-fit`` (Keras 3 ``fit``: must be refused).

Two models per scenario, trained on both workers:
* ``trained``: a small classifier, seed 3, GLOBAL batches of 32 (16 per
  worker), the same weights as ``reference`` (the same steps on one device,
  computed here without a strategy) if the replicas' clipped sums add up to
  the single-device sum and the noise is the single-device draw;
* ``noise``: a Dense(5000) without bias, zero kernel, zero inputs and a
  secret seed (drawn from the OS in each process): every gradient is 0, so
  one DPSGD step with learning rate 1 moves the kernel by -z/B, z ~
  N(0, σ²C²): its std, and equality across workers (same seed).
Writes the weights and statistics of each scenario to its JSON file.
"""
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
# Before any other TF op: the strategy configures the collectives.
STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import tf_keras  # noqa: E402

import tf_dpadambc  # noqa: E402
from tf_dpadambc.keras import custom_loop  # noqa: E402

N, GLOBAL_BATCH, D = 64, 32, 5
SIGMA, CLIP = 2.0, 1.0  # the noise model: std of Δw = σC/B = 0.0625
NOISE_UNITS = 5000
WORKER = STRATEGY.cluster_resolver.task_id
WORKERS = STRATEGY.num_replicas_in_sync  # one replica per worker
LOCAL = GLOBAL_BATCH // WORKERS


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, D)).astype("float32")
  return x, (x[:, 0] + 0.3 * x[:, 1] > 0).astype("int32")


def _classifier(lib):
  keras.utils.set_random_seed(1)
  tf_keras.utils.set_random_seed(1)
  return lib.Sequential([lib.Input((D,)),
                         lib.layers.Dense(4, activation="tanh"),
                         lib.layers.Dense(2)])


def _noise_model(lib):
  return lib.Sequential([lib.Input((4,)), lib.layers.Dense(
      NOISE_UNITS, use_bias=False, kernel_initializer="zeros")])


def _keras3_optimizers():
  return (tf_dpadambc.DPAdamBC(1.0, 1.0, seed=3, learning_rate=0.05),
          tf_dpadambc.DPSGD(CLIP, SIGMA, learning_rate=1.0))


def _local_batches(x, y):
  """This worker's share of every global batch: examples [16w, 16w + 16)
  of each block of 32 (global batch s = examples [32s, 32s + 32))."""
  def fn(context):
    w = context.input_pipeline_id
    index = np.concatenate([np.arange(s + w * LOCAL, s + (w + 1) * LOCAL)
                            for s in range(0, N, GLOBAL_BATCH)])
    return tf.data.Dataset.from_tensor_slices((x[index], y[index])).batch(
        LOCAL)
  return STRATEGY.distribute_datasets_from_function(fn)


def _reference():
  """The same two global steps of the classifier on one device."""
  x, y = _data()
  model = _classifier(keras)
  optimizer = _keras3_optimizers()[0]
  model.compile(optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  for s in range(0, N, GLOBAL_BATCH):
    custom_loop.private_step(model, (x[s:s + GLOBAL_BATCH],
                                     y[s:s + GLOBAL_BATCH]))
  return model, optimizer


def _keras3(how):
  x, y = _data()
  results = {}
  for name in ("trained", "noise"):
    if how == "inside":
      with STRATEGY.scope():
        model = _classifier(keras) if name == "trained" else _noise_model(
            keras)
        optimizer = _keras3_optimizers()[0 if name == "trained" else 1]
    else:
      optimizer = _keras3_optimizers()[0 if name == "trained" else 1]
      with STRATEGY.scope():
        model = _classifier(keras) if name == "trained" else _noise_model(
            keras)
      if how == "prebuilt":
        optimizer.build(model.trainable_variables)
    with STRATEGY.scope():
      model.compile(optimizer=optimizer, loss=(
          keras.losses.SparseCategoricalCrossentropy(from_logits=True)
          if name == "trained" else "mse"))
    initial = [v.numpy().tolist() for v in model.trainable_variables]

    @tf.function
    def step(batch, model=model):
      losses = STRATEGY.run(custom_loop.private_step, args=(model, batch))
      return STRATEGY.reduce("MEAN", losses, axis=None)

    if name == "trained":
      for batch in _local_batches(x, y):
        step(batch)
    else:
      step((tf.zeros([LOCAL, 4]), tf.zeros([LOCAL, NOISE_UNITS])))
    results[name] = dict(
        _summary(model, optimizer), initial=initial,
        seed_variable=type(optimizer._seed_variable.value).__name__)  # pylint: disable=protected-access
  results["reference"] = _summary(*_reference())
  return results


def _summary(model, optimizer):
  """Weights and accounting of one run, as JSON values."""
  return {"weights": [v.numpy().tolist() for v in model.trainable_variables],
          "steps_taken": int(optimizer.steps_taken),
          "logical_batch_size": int(optimizer.logical_batch_size),
          "dp_event": str(optimizer.dp_event(N, sampling="poisson"))}


def _keras3_fit():
  x, y = _data()
  with STRATEGY.scope():
    model = tf_dpadambc.make_private(_classifier(keras))
    model.compile(optimizer=_keras3_optimizers()[0],
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  try:
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
  except Exception as e:  # pylint: disable=broad-except
    return {"error": type(e).__name__, "message": str(e)}
  return {"error": None}


def _tf_keras(how):
  x, y = _data()
  results = {}
  none = tf_keras.losses.Reduction.NONE
  for name in ("trained", "noise"):
    if name == "trained":
      def make():
        return tf_dpadambc.tf_keras.DPAdamBC(1.0, 1.0, seed=3,
                                             learning_rate=0.05)
      loss = tf_keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction=none)
    else:
      def make():
        return tf_dpadambc.tf_keras.DPSGD(CLIP, SIGMA, learning_rate=1.0)
      loss = tf_keras.losses.MeanSquaredError(reduction=none)
    optimizer = make() if how == "outside" else None
    with STRATEGY.scope():
      model = _classifier(tf_keras) if name == "trained" else _noise_model(
          tf_keras)
      optimizer = optimizer or make()
      model.compile(optimizer=optimizer, loss=loss)
    initial = [np.asarray(w).tolist() for w in model.get_weights()]
    if name == "trained":
      # fit splits each global batch of 32 across the replicas.
      model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
                verbose=0)
    else:
      model.fit(np.zeros((GLOBAL_BATCH, 4), "float32"),
                np.zeros((GLOBAL_BATCH, NOISE_UNITS), "float32"),
                batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    results[name] = {
        "initial": initial,
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "steps_taken": int(optimizer.steps_taken),
        "logical_batch_size": int(optimizer.logical_batch_size),
        "dp_event": str(optimizer.dp_event(N, sampling="poisson")),
        "per_unit_plan": optimizer.per_unit_plan,
        "refused_steps": optimizer.refused_steps,
        "seed_variable": type(optimizer.keras_optimizer._seed_variable.value  # pylint: disable=protected-access
                              ).__name__}
  # The reference: the same steps on one device with the Keras 3 optimizer.
  results["reference"] = _summary(*_reference())
  return results


def run(scenario, out):
  try:
    if scenario.startswith("keras3-") and scenario != "keras3-fit":
      results = _keras3(scenario.split("-", 1)[1])
    elif scenario == "keras3-fit":
      results = _keras3_fit()
    elif scenario.startswith("tf_keras-"):
      results = _tf_keras(scenario.split("-", 1)[1])
    else:
      raise ValueError(f"unknown scenario {scenario!r}")
    results["worker"] = WORKER
  except Exception:  # pylint: disable=broad-except
    results = {"worker": WORKER, "crash": traceback.format_exc()}
  with open(out + ".tmp", "w") as f:
    json.dump(results, f)
  os.replace(out + ".tmp", out)


def main(out, scenarios):
  for scenario in scenarios:
    run(scenario, out.format(scenario=scenario))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
