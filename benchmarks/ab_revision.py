"""DP / non-private ms/step of this tree against an earlier revision's
``core/ghost.py`` and ``core/noise.py`` (or other modules), side by side in one process.

    python -m benchmarks.ab_revision fbc0dfd --models mlp embedding_bag
    python -m benchmarks.ab_revision fbc0dfd --models transformer --batch-size 64
    python -m benchmarks.ab_revision HEAD --modules tf_dpadambc/core/diagnostics.py

On a shared, noisy CPU, absolute timings drift with the load; ratios
measured in one process, configurations alternating, do not. Three
configurations train the same model (``bench_models``) with ``model.fit``
(XLA): non-private Keras Adam; DPAdamBC with the module-level functions of
``tf_dpadambc.core.ghost`` and ``tf_dpadambc.core.noise`` (or of the
``--modules`` given) replaced, while the step is traced, by those of
``REVISION`` (with ghost swapped, the rules' shared float32 per-unit
gradients switched off, as before they existed); DPAdamBC as it is now. Each repetition runs one epoch of every configuration in turn; a
figure is the median over repetitions of the median step (callback
timestamps, compilation excluded). Only those two modules are swapped: a
revision whose rules differ elsewhere is not reproduced.
"""
import argparse
import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpadambc as dp  # noqa: E402
from tf_dpadambc.core import ghost  # noqa: E402
from tf_dpadambc.core import noise  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402

MODELS = {"mlp": ((784,), "float32"), "mnist_cnn": ((28, 28, 1), "float32"),
          "cifar_cnn": ((32, 32, 3), "float32"),
          "embedding_bag": ((bench_models.TEXT_LEN,), "int32"),
          "transformer": ((bench_models.SEQ_LEN,), "int32")}


def _module_at(revision, path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  source = subprocess.check_output(["git", "-C", root, "show",
                                    f"{revision}:{path}"]).decode()
  handle, name = tempfile.mkstemp(suffix=".py")
  with os.fdopen(handle, "w") as f:
    f.write(source)
  spec = importlib.util.spec_from_file_location(
      "_at_" + os.path.basename(path)[:-3], name)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


DEFAULT_MODULES = ("tf_dpadambc/core/ghost.py", "tf_dpadambc/core/noise.py")


def revision_code(revision, paths=DEFAULT_MODULES):
  """A context manager: the module-level functions of the modules at
  ``paths`` (default: ghost's and noise's) as at ``revision``."""
  olds = [(importlib.import_module(p[:-3].replace("/", ".")),
           _module_at(revision, p)) for p in paths]

  @contextlib.contextmanager
  def swapped():
    saved = [(ghost, "materializes_both", ghost.materializes_both)]
    if any(module is ghost for module, _ in olds):
      ghost.materializes_both = lambda *args: False
    for module, old in olds:
      for name, value in vars(old).items():
        if isinstance(value, types.FunctionType) and hasattr(module, name):
          saved.append((module, name, getattr(module, name)))
          setattr(module, name, value)
    try:
      yield
    finally:
      for module, name, value in saved:
        setattr(module, name, value)
  return swapped


def _runner(name, private, batch_size, steps, patch=None):
  shape, dtype = MODELS[name]
  rng = np.random.default_rng(0)
  n = batch_size * steps
  x = (rng.integers(0, bench_models.VOCAB, (n,) + shape) if dtype == "int32"
       else rng.normal(size=(n,) + shape)).astype(dtype)
  y = rng.integers(0, 2, n).astype("int32")
  keras.utils.set_random_seed(0)
  model = getattr(bench_models, name)(keras)
  if private:
    model = dp.make_private(model)
  model.compile(
      optimizer=(dp.DPAdamBC(1.0, 1.0, 1e-3) if private
                 else keras.optimizers.Adam(1e-3)),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      jit_compile=True)
  stamps = []

  class Stamp(keras.callbacks.Callback):

    def on_train_batch_end(self, batch, logs=None):
      stamps.append(time.perf_counter())

  with patch() if patch else contextlib.nullcontext():
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)  # traces

  def run():
    stamps.clear()
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
              callbacks=[Stamp()])
    return float(np.median(np.diff(stamps))) * 1000
  return run


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("revision")
  parser.add_argument("--models", nargs="*", default=["mlp", "embedding_bag"],
                      choices=sorted(MODELS))
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--steps", type=int, default=25)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--modules", nargs="*", default=list(DEFAULT_MODULES),
                      help="the modules (paths) whose functions are swapped")
  args = parser.parse_args(argv)
  before = revision_code(args.revision, args.modules)
  for name in args.models:
    runs = {"Adam": _runner(name, False, args.batch_size, args.steps),
            f"DPAdamBC at {args.revision}": _runner(
                name, True, args.batch_size, args.steps, before),
            "DPAdamBC now": _runner(name, True, args.batch_size, args.steps)}
    times = {k: [] for k in runs}
    for _ in range(args.repeats):
      for k, run in runs.items():
        times[k].append(run())
    base = statistics.median(times["Adam"])
    print(f"{name}, batch {args.batch_size}, load average "
          f"{os.getloadavg()[0]:.2f}")
    for k, v in times.items():
      print(f"  {k:28s} {statistics.median(v):8.2f} ms  "
            f"{statistics.median(v) / base:5.2f}x")


if __name__ == "__main__":
  main()
