import contextlib
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# XLA's CPU backend without LLVM's optimization passes: the same optimized
# HLO (XLA's own passes, fusion and the order of reductions do not depend on
# it), compiled in about half the time, and compiling train steps is a large
# part of this suite's time. Inherited by the processes tests launch;
# benchmarks keep the default.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

import tensorflow as tf  # noqa: E402

# Two logical CPU devices, for tests of tf.distribute behaviour.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

# Tracebacks unfiltered: with filtering on, Keras wraps every op and layer
# call to add its arguments to error messages, about 10% of this suite's
# time (tracing train steps). The messages tests match are the same.
keras.config.disable_traceback_filtering()
tf.debugging.disable_traceback_filtering()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The modules imported so far live for the whole run: out of the collector's
# full passes, which otherwise rescan them as traced graphs accumulate.
gc.freeze()


def pytest_collection_modifyitems(items):
  """The tests marked ``slow`` first, each group in its usual order.

  pytest-xdist hands tests out in collection order; a long test near the end
  left the other worker idle for most of its run (36 s of a 15-minute run
  here). Started first, the long tests overlap the short ones. Keep the mark
  to the few longest: xdist's first chunk (a quarter of a worker's share)
  takes all of them to one worker, which the rest of the run must balance
  (in CI's configuration 2, 195 tests, five more marks: 182 s against 157)."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _seed():
  keras.utils.set_random_seed(1234)
  yield


def drive(optimizer, init, mean_gradients, batch_size):
  """Feeds noiseless clipped *means* to ``optimizer.apply_private``.

  Each mean g becomes the clipped sum B·g of a batch of B units; returns the
  parameter trajectory (list of NumPy arrays after each step).
  """
  from tf_dpadambc.core import clipping  # pylint: disable=g-import-not-at-top
  var = keras.Variable(np.array(init, dtype="float32"))
  out = []
  for g in mean_gradients:
    optimizer.apply_private(
        clipping.assume_clipped([np.asarray(g, "float32") * batch_size]),
        batch_size, batch_size, [var])
    out.append(var.numpy().copy())
  return out


@pytest.fixture(scope="session")
def run_once(tmp_path_factory):
  """``with run_once(name) as (folder, fill):`` a folder shared by this
  run's xdist workers; ``fill`` is True for the first worker to get there,
  which fills it while the others wait on a lock, then reuse it. For the
  module-scoped fixtures that launch processes (resume, multi-worker): run
  once, not once per worker that gets one of their tests. (xdist's
  ``--dist loadgroup`` would do it, but with pytest 9.2 its group suffix no
  longer reaches the scheduler.)"""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # pytest-N/, above the workers' popen-gwK/

  @contextlib.contextmanager
  def once(name):
    folder = root / f"once-{name}"
    folder.mkdir(exist_ok=True)
    with open(root / f"once-{name}.lock", "w") as lock:
      try:
        import fcntl  # pylint: disable=import-outside-toplevel
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
      except ImportError:  # (not POSIX: each worker fills its own)
        folder = tmp_path_factory.mktemp(name)
      done = folder / ".done"
      fill = not done.exists()
      yield folder, fill
      if fill:
        done.touch()
  return once
