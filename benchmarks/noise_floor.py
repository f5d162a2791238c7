"""The floor under any private Adam step: Keras Adam plus the Gaussian noise.

    python benchmarks/noise_floor.py                      # MLP, embedding bag, MNIST CNN
    python benchmarks/noise_floor.py --models mlp --batch-sizes 256 1024

The Gaussian mechanism draws N(0, σ²C²) for every coordinate of every
trainable variable at every step, whatever the clipping costs: for a model
whose non-private step is short next to its parameter count (the MLP's 102k
parameters, the embedding bag's 160k, against a 1–4 ms Adam step on a
2-core CPU) that draw alone is a sizeable part of the step.

Three configurations per model, each trained with ``model.fit`` (XLA, the
same synthetic data as ``suite.py``, bench_models.py's builders) in one
process: each compiled by a first epoch, then one epoch each in turn, seven
times; a figure is the best epoch's median step (between two steps' ends):

- ``Adam``: Keras 3 Adam, non-private;
- ``Adam + noise``: the same optimizer, whose step first adds to each
  gradient the noise a private step draws (this library's sampler,
  ``core.noise.gaussian_noise_like``, a fresh seed per step): not private
  (nothing is clipped), the step time no private Adam can go below;
- ``DPAdamBC``: ``make_private`` and DPAdamBC, the defaults.

It prints each time, the floor (Adam + noise over Adam), DPAdamBC's ratio and
what DPAdamBC spends above the floor.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpadambc as dp  # noqa: E402
from tf_dpadambc.core import noise  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402  (shared with suite.py)

MODELS = ("mlp", "embedding_bag", "mnist_cnn")


class NoisyAdam(keras.optimizers.Adam):
  """Adam on g + N(0, stddev²) per coordinate: the noise draw of a private
  step without its clipping (not private)."""

  def __init__(self, stddev, **kwargs):
    super().__init__(**kwargs)
    self.stddev = stddev
    self._noise_seed = noise.random_seed()

  def noised(self, grads):
    seed = noise.step_seed(self._noise_seed, self.iterations)
    return [g + z for g, z in zip(
        grads, noise.gaussian_noise_like(grads, self.stddev, seed))]

  def apply(self, grads, trainable_variables=None):
    return super().apply(self.noised(grads), trainable_variables)


def compiled(name, optimizer, private, x, y, batch_size):
  """A model of ``name`` trained one epoch (so compiled)."""
  keras.utils.set_random_seed(0)
  model = getattr(bench_models, name)(keras)
  if private:
    model = dp.make_private(model)
  model.compile(optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), jit_compile=True)
  model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
  return model


class _Stamps(keras.callbacks.Callback):
  """The time at the end of every step."""

  def on_epoch_begin(self, epoch, logs=None):
    self.times = []

  def on_train_batch_end(self, batch, logs=None):
    self.times.append(time.perf_counter())


def alternating_times(models, x, y, batch_size, rounds):
  """ms/step of each model: one epoch each in turn, ``rounds`` times. A
  step's time is between two steps' ends (an epoch's start is left out);
  an epoch's figure is the median of its steps, a model's the best epoch
  (a shared machine drifts: alternating spreads the drift over all of them,
  the best is the least disturbed)."""
  times = [[] for _ in models]
  stamps = _Stamps()
  for _ in range(rounds):
    for model, spent in zip(models, times):
      model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
                callbacks=[stamps])
      spent.append(1000 * float(np.median(np.diff(stamps.times))))
  return [min(t) for t in times]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="*", default=list(MODELS))
  parser.add_argument("--batch-sizes", nargs="*", type=int, default=[256])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=7)
  args = parser.parse_args(argv)
  print(f"TensorFlow {tf.__version__}, {os.cpu_count()} CPUs; ms/step, the "
        f"best of {args.rounds} epochs' median steps ({args.steps} steps "
        "each), the three configurations in turn")
  print(f"{'model':<15}{'batch':>6}{'params':>9}{'Adam':>8}{'+noise':>8}"
        f"{'floor':>7}{'DPAdamBC':>10}{'ratio':>7}{'over floor':>12}")
  rows = []
  for name in args.models:
    for batch in args.batch_sizes:
      x, y = bench_models.synthetic_data(name, batch * args.steps)
      models = [
          compiled(name, keras.optimizers.Adam(1e-3), False, x, y, batch),
          compiled(name, NoisyAdam(1.0 / batch, learning_rate=1e-3), False,
                   x, y, batch),
          compiled(name, dp.DPAdamBC(1.0, 1.0, 1e-3), True, x, y, batch)]
      adam, floor, private = alternating_times(models, x, y, batch,
                                               args.rounds)
      print(f"{name:<15}{batch:>6}{models[0].count_params():>9}{adam:>8.2f}"
            f"{floor:>8.2f}{floor / adam:>6.2f}x{private:>10.2f}"
            f"{private / adam:>6.2f}x{private / floor:>11.2f}x", flush=True)
      rows.append(dict(model=name, batch_size=batch, adam=adam,
                       adam_noise=floor, dpadambc=private))
  return rows


if __name__ == "__main__":
  main()
