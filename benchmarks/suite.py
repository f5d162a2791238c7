"""Benchmark suite: ms/step and peak memory of private vs non-private training.

    python benchmarks/suite.py                      # every model, batch 256 and 1024
    python benchmarks/suite.py --quick              # batch 256, 3 small models, few steps
    python benchmarks/suite.py --models mlp embedding_bag --batch-sizes 1024
    python benchmarks/suite.py --tfp-python .venv-tfp/bin/python --json results.json
    python benchmarks/suite.py --jaxp-python .venv-jaxp/bin/python   # + jax_privacy
    python benchmarks/suite.py --device gpu         # the same table on a GPU
    python benchmarks/suite.py --steps-per-execution 10   # less host work per step

What is measured, side by side on synthetic data (benchmarks/bench_models.py:
MLP 784-128-10, TF-Privacy's tutorial MNIST CNN, the DP-AdamBC paper's CIFAR-10
5-layer CNN, an embedding-bag text classifier, a 2-block text transformer
and an LSTM text classifier):

- ``Adam``: non-private Keras 3 ``keras.optimizers.Adam`` (jit_compile=True);
- ``DPAdam``, ``DPAdamBC``, ``DPAdamSTP``: tf_dpadambc on ``make_private(model)``
  (jit_compile=True; l2_norm_clip=1, noise_multiplier=1, learning_rate=1e-3).
  Where ``make_private`` takes ``clipping=``, these pass ``clipping="auto"``
  and the row ``DPAdamBC (vectorized)`` passes ``clipping="vectorized"`` (the
  per-example ``vmap`` path); without it the row reads n/a and the DP rows
  are whatever ``make_private`` does;
- TF-Privacy 0.9 on tf_keras (``TF_USE_LEGACY_KERAS=1``, the same
  architectures built with tf_keras): ``TFP DPKerasAdamOptimizer``
  (``num_microbatches`` = batch size, per-example loss with reduction NONE,
  no XLA: with jit_compile its step took 510 instead of 323 ms on the MLP)
  and ``TFP DPSequential`` (fast gradient clipping with TF-Privacy's default
  layer registry, XLA, tf_keras Adam; n/a where the model is not Sequential or
  has a layer the registry lacks). TF-Privacy needs Python < 3.12 and cannot
  be imported normally on TF >= 2.16, so these run under ``--tfp-python``
  (default: this interpreter) with ``sys.skip_tf_privacy_import = True``,
  only when that interpreter can import ``tf_keras`` and TF-Privacy's
  submodules; otherwise the suite says so and leaves them out. Ratios of
  these rows are to the Keras 3 non-private baseline.

- jax_privacy 2.x's Keras API on Keras 3's JAX backend (``--jaxp-python``,
  ``KERAS_BACKEND=jax`` in processes of their own, no TensorFlow there):
  ``JAX Adam (non-private)`` and ``jax_privacy make_private`` (its DP-SGD
  clipping and noise, per-example gradients by ``jax.vmap``, feeding the
  compiled Adam; noise multiplier fixed, not calibrated), with its default
  (the whole batch in one ``vmap``) and with ``microbatch_size=32`` (a
  ``scan`` over vmapped chunks: 10-20x faster on this CPU). Their ratios are
  to the JAX non-private row; the targets compare the faster one's ms/step
  with DPAdamBC's. Peak memory there is the RSS view on the CPU (JAX keeps no
  allocator statistics there) and JAX's allocator on a GPU (its peak over the
  whole fit, compilation included: JAX cannot reset it).

``--device``: ``cpu`` hides every GPU (``CUDA_VISIBLE_DEVICES=-1``, and
``JAX_PLATFORMS=cpu``), ``gpu`` refuses to run without one, ``auto`` (the
default) measures on ``GPU:0`` where TensorFlow sees one. The step timer
reads each step's loss, which waits for an asynchronous device. Where this
interpreter cannot import TensorFlow but ``--jaxp-python`` works (a GPU
machine with JAX alone), the jax_privacy rows run and the output says why
the Keras 3 rows did not.

How: every configuration runs in a process of its own (allocator pools and
peaks do not mix; a crash or a timeout costs one row: a fork of a server that
has imported TensorFlow but not started its runtime, or a new interpreter
with ``--fresh``) and trains with one
``model.fit`` on a ``tf.data`` pipeline of pre-batched synthetic tensors (the
same for every configuration). A callback stamps the end of every step: the
first ``--warmup`` step(s) (tracing, XLA compilation, first execution) are
not timed; then steps are timed until ``--budget`` seconds and
``--min-steps`` steps (at most ``--max-steps``; only 2 once ``--hard-budget``
seconds are spent, for the slow configurations). ms/step is the median of
the timed steps' durations.

Peak memory ("peak MiB"): the peak of TensorFlow's allocator during the timed
steps above its use just before them (``reset_memory_stats`` after the
warm-up, then ``get_memory_info(device)['peak'] - ['current']``), on
``GPU:0`` when there is a GPU and on ``CPU:0`` otherwise: the memory the
training steps take (activations, per-example gradients, XLA's temporary
buffers), not the model, optimizer state, data or compiled code, allocated
before. On the CPU, TensorFlow's oneDNN allocator is a BFC pool that counts
a tensor at the size of its chunk (up to 2x the request in a fresh region),
so each worker first reserves and frees one 2 GiB region (an uninitialized
tensor: no page touched), from which later tensors are carved at their own
size. The pool keeps what the first step took, so the process's RSS cannot
show the timed steps; where the allocator keeps no statistics (e.g.
TF_ENABLE_ONEDNN_OPTS=0) the suite falls back to the RSS: the peak (VmHWM,
reset through ``/proc/self/clear_refs`` after ``malloc_trim``) above the RSS
before the timed steps, or the peak of the whole fit where the reset is
impossible. The JSON also has the RSS view of the whole fit (compilation
included: ``rss_peak_whole_fit_mib`` above ``rss_before_fit_mib``), every
step's duration and the machine's load average. Workers run with
``TF_MKL_ALLOC_MAX_BYTES`` = half the machine's memory, so a configuration
that needs more fails with an OOM error instead of waking the OOM killer.

The summary checks the targets (issue 16): DPAdamBC <= 1.2x non-private
ms/step on the MLP, <= 1.5x on the embedding model, <= 1.4x on the MNIST CNN
and the transformer, <= 1.8x on the CIFAR CNN5, the batch-1024 ratio within
0.2 of the batch-256 one, <= 1.3x
on the LoRA-fine-tuned KerasHub backbones, <= 1.6x on the fully fine-tuned one,
<= 3x on the LSTM text model (``lstm_text``: run it with a small batch,
``--models lstm_text --batch-sizes 64``; not in the default model list);
DPKerasAdamOptimizer / DPAdamBC >= 30x on the MLP; DPAdamBC faster than
DPSequential on the MLP; DPAdamBC's peak memory <= 1.3x non-private at
batch 1024 -- PASS or MISS with the figures.

TF-Privacy environment (its pins would downgrade this project's
dp-accounting, so keep it apart; Python 3.11):

    python3.11 -m venv .venv-tfp
    .venv-tfp/bin/pip install "tensorflow==2.21.*" "tf_keras==2.21.*" \
        "tensorflow-privacy==0.9.0"
    python benchmarks/suite.py --tfp-python .venv-tfp/bin/python

jax_privacy environment (JAX only, no TensorFlow):

    python3.11 -m venv .venv-jaxp
    .venv-jaxp/bin/pip install "jax-privacy>=2" "keras==3.*"
    python benchmarks/suite.py --jaxp-python .venv-jaxp/bin/python
"""
import argparse
import contextlib
import ctypes
import gc
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_models  # noqa: E402

KERAS3_CONFIGS = ("Adam", "DPAdam", "DPAdamBC", "DPAdamSTP",
                  "DPAdamBC (vectorized)")
# Configurations that need TF-Privacy or tf_keras, so they run in the
# --tfp-python environment: TF-Privacy's own, and ours on tf_keras and with
# a TF-Privacy DPQuery (adaptive clipping) on Keras 3.
TFP_CONFIGS = ("TFP DPKerasAdamOptimizer", "TFP DPSequential",
               "DPKerasAdamOptimizer (ours, tf_keras)",
               "DPAdam (query=QuantileAdaptiveClipSumQuery)")
# Configurations in the jax_privacy environment (--jaxp-python): Keras 3 on
# the JAX backend (KERAS_BACKEND=jax), its own non-private baseline, and
# jax_privacy 2.x's Keras API -- the alternative a Keras 3 user would pick.
JAX_BASELINE = "JAX Adam (non-private)"
JAXP_MICROBATCH = 32
JAXP_CONFIGS = (JAX_BASELINE, "jax_privacy make_private",
                f"jax_privacy make_private (microbatch_size={JAXP_MICROBATCH})")
BASELINE = "Adam"
CLIP, NOISE, LR = 1.0, 1.0, 1e-3
RESULT_MARK = "SUITE-RESULT "
_KIND_VARIABLE = "TF_DPADAMBC_SUITE_RUNNER"  # which environment a server is
TFP_SKIP_MESSAGE = ("TF-Privacy skipped: install tensorflow-privacy and "
                    "tf_keras (Python < 3.12) or pass --tfp-python")
JAXP_SKIP_MESSAGE = ("jax_privacy skipped: pass --jaxp-python, an interpreter "
                     "with jax-privacy>=2 and keras (see the docstring)")

# Steps: (warm-up, min timed, max timed, budget s, hard budget s, steps per
# execution: K > 1 counts calls of K steps).
DEFAULT_STEPS = dict(warmup=1, min_steps=3, max_steps=20, budget=2.0,
                     hard_budget=6.0, steps_per_execution=1)
QUICK_MODELS = ["mlp", "mnist_cnn", "embedding_bag"]
# lstm_text only when named: its private step loops over units (batch 64).
DEFAULT_MODELS = [m for m in bench_models.MODELS if m != "lstm_text"]
QUICK_STEPS = dict(warmup=1, min_steps=3, max_steps=8, budget=0.5,
                   hard_budget=3.0, steps_per_execution=1)


# --------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------

def _status_kib(field):
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return None


def _maxrss_kib():
  import resource
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return rss // 1024 if sys.platform == "darwin" else rss


class _Memory:
  """Peak memory of the timed steps (see the module docstring)."""

  def __init__(self, tf):
    self.tf = tf  # None: not TensorFlow (the JAX worker), the RSS only
    gpu = tf is not None and bool(tf.config.list_physical_devices("GPU"))
    self.device = "GPU:0" if gpu else "CPU:0"
    self.allocator = tf is not None
    try:  # TensorFlow's allocator statistics (BFC pools: GPU; oneDNN: CPU).
      if tf is not None:
        tf.config.experimental.get_memory_info(self.device)
    except Exception:  # noqa: BLE001 -- no statistics: fall back to the RSS
      if gpu:
        raise
      self.allocator = False
    self.jax_gpu = None  # JAX on a GPU: its allocator's statistics
    if tf is None:
      with contextlib.suppress(Exception):
        import jax
        device = jax.devices()[0]
        if device.platform == "gpu" and device.memory_stats():
          self.jax_gpu = device
    self.rss_before_fit = _status_kib("VmRSS")
    self.maxrss_before_fit = _maxrss_kib()
    self.method = self.base = self.rss_hwm_warmup = None

  def _info(self):
    return self.tf.config.experimental.get_memory_info(self.device)

  def start(self):
    """After the warm-up: reset the peak, remember the baseline."""
    hwm = _status_kib("VmHWM")
    self.rss_hwm_warmup = hwm
    if self.allocator:
      self.tf.config.experimental.reset_memory_stats(self.device)
      self.base = self._info()["current"]
      self.method = f"tf-allocator:{self.device}"
      return
    if self.jax_gpu is not None:  # JAX cannot reset its peak
      self.base = self.jax_gpu.memory_stats()["bytes_in_use"]
      self.method = "jax-allocator:gpu, peak of the whole fit"
      return
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
      ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
      self.base = _status_kib("VmRSS") * 1024
      self.method = "rss:hwm-reset-after-warmup"
    except (OSError, TypeError):
      if self.rss_before_fit is not None:
        self.base = self.rss_before_fit * 1024
        self.method = "rss:hwm-whole-fit"
      else:
        self.base = self.maxrss_before_fit * 1024
        self.method = "ru_maxrss-whole-fit"

  def result(self):
    mib = 2.0 ** 20
    hwm = _status_kib("VmHWM")
    if self.allocator:
      peak = self._info()["peak"]
    elif self.jax_gpu is not None:
      peak = self.jax_gpu.memory_stats()["peak_bytes_in_use"]
    elif self.method == "ru_maxrss-whole-fit":
      peak = _maxrss_kib() * 1024
    else:
      peak = hwm * 1024
    out = dict(mem_method=self.method, peak_mib=(peak - self.base) / mib,
               base_mib=self.base / mib)
    if self.rss_before_fit is not None and hwm is not None:
      # RSS view of the whole fit (compilation included), for the record.
      out["rss_before_fit_mib"] = self.rss_before_fit / 1024
      out["rss_peak_whole_fit_mib"] = (
          max(hwm, self.rss_hwm_warmup or 0) - self.rss_before_fit) / 1024
    return out


# --------------------------------------------------------------------------
# One configuration (runs in the worker process)
# --------------------------------------------------------------------------

def _reserve_cpu_pool(tf, mib=2048):
  """Makes the CPU allocator's statistics exact; returns the MiB reserved.

  TensorFlow's oneDNN CPU allocator is a BFC pool that grows by regions and
  counts a tensor at the size of the chunk it got, up to 2x the request when
  the chunk is a fresh region. One large region reserved (and freed) first,
  with an uninitialized tensor that touches no page, lets later tensors be
  carved from it at their own size.
  """
  if tf.config.list_physical_devices("GPU"):
    return 0
  try:
    tf.config.experimental.get_memory_info("CPU:0")
    with tf.device("CPU:0"):
      block = tf.raw_ops.Empty(shape=[mib << 18], dtype=tf.float32,
                               init=False)
    del block
  except Exception:  # noqa: BLE001 -- no statistics, or no room: no reserve
    return 0
  return mib


def _timer_class(k):

  class Timer(k.callbacks.Callback):
    """Stamps every step's end; resets the memory peak after the warm-up."""

    def __init__(self, memory, warmup, min_steps, max_steps, budget,
                 hard_budget):
      super().__init__()
      self.memory, self.warmup = memory, warmup
      self.min_steps, self.max_steps = min_steps, max_steps
      self.budget, self.hard_budget = budget, hard_budget
      self.count, self.last, self.durations = 0, None, []
      self.start = time.perf_counter()
      self.warmup_s = None

    def on_train_batch_end(self, batch, logs=None):
      if logs:  # waits for an asynchronous device: one value, every row
        with contextlib.suppress(TypeError, ValueError):
          float(logs.get("loss", next(iter(logs.values()))))
      now = time.perf_counter()
      self.count += 1
      if self.count < self.warmup:
        return
      if self.count == self.warmup:
        self.warmup_s = now - self.start
        self.memory.start()
        self.last = time.perf_counter()
        return
      self.durations.append(now - self.last)
      self.last = now
      n, spent = len(self.durations), sum(self.durations)
      if (n >= self.max_steps or (n >= self.min_steps and spent >= self.budget)
          or (n >= 2 and spent >= self.hard_budget)):
        self.model.stop_training = True

  return Timer


def make_private_accepts_clipping():
  import tf_dpadambc
  return "clipping" in inspect.signature(tf_dpadambc.make_private).parameters


def _dataset(tf, name, batch_size, distinct=4):
  x, y = bench_models.synthetic_data(name, distinct * batch_size)
  x = x.reshape((distinct, batch_size) + x.shape[1:])
  y = y.reshape((distinct, batch_size))
  return tf.data.Dataset.from_tensor_slices((x, y)).repeat().prefetch(2)


def _build_keras3(name, config, batch_size, steps_per_execution=1):
  import keras
  import tf_dpadambc as dp
  build = bench_models.MODELS[name][0]
  keras.utils.set_random_seed(0)
  model = build(keras)
  info = {}
  if config == BASELINE:
    optimizer = keras.optimizers.Adam(LR)
  else:
    accepts = make_private_accepts_clipping()
    if config == "DPAdamBC (vectorized)":
      if not accepts:
        return None, keras, {"status": "n/a", "reason": (
            "make_private has no clipping=; the DPAdamBC row is its only "
            "path")}
      model = dp.make_private(model, clipping="vectorized")
      info["clipping"] = "vectorized"
    elif accepts:
      model = dp.make_private(model, clipping="auto")
      info["clipping"] = "auto"
    else:
      model = dp.make_private(model)
      info["clipping"] = "(make_private without clipping=)"
    cls = {"DPAdam": dp.DPAdam, "DPAdamBC": dp.DPAdamBC,
           "DPAdamSTP": dp.DPAdamSTP,
           "DPAdamBC (vectorized)": dp.DPAdamBC}[config]
    optimizer = cls(l2_norm_clip=CLIP, noise_multiplier=NOISE,
                    learning_rate=LR)
  model.compile(optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), jit_compile=True,
                steps_per_execution=steps_per_execution)
  return model, keras, info


def _arrays(name, batch_size, steps, distinct=4):
  """The same batches as :func:`_dataset`, as NumPy arrays of ``steps``."""
  import numpy as np
  x, y = bench_models.synthetic_data(name, distinct * batch_size)
  reps = -(-steps // distinct)
  return (np.concatenate([x] * reps)[:steps * batch_size],
          np.concatenate([y] * reps)[:steps * batch_size])


def _build_jax(name, config, batch_size, steps, steps_per_execution=1):
  """Keras 3 on JAX: non-private Adam, or jax_privacy's ``make_private``
  (DP-SGD's clipping and noise, then the compiled Adam: DP-Adam)."""
  import keras
  build = bench_models.MODELS[name][0]
  keras.utils.set_random_seed(0)
  model = build(keras)
  model.compile(optimizer=keras.optimizers.Adam(LR),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), jit_compile=True,
                steps_per_execution=steps_per_execution)
  info = {"backend": keras.backend.backend()}
  if config != JAX_BASELINE:
    import jax_privacy
    from jax_privacy import keras_api
    # A huge ε target: the noise multiplier is fixed (NOISE), not calibrated.
    params = keras_api.DPKerasConfig(
        epsilon=1e9, delta=1e-5, clipping_norm=CLIP, batch_size=batch_size,
        gradient_accumulation_steps=1, train_steps=steps,
        train_size=steps * batch_size, noise_multiplier=NOISE,
        rescale_to_unit_norm=False, seed=0,
        microbatch_size=JAXP_MICROBATCH if "microbatch" in config else None)
    model = keras_api.make_private(model, params)
    info["jax_privacy"] = getattr(jax_privacy, "__version__", "?")
  return model, keras, info


def _import_tfp():
  sys.skip_tf_privacy_import = True
  # pylint: disable=g-import-not-at-top
  from tensorflow_privacy.privacy.fast_gradient_clipping import (
      gradient_clipping_utils, layer_registry)
  from tensorflow_privacy.privacy.keras_models import dp_keras_model
  from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras
  return gradient_clipping_utils, layer_registry, dp_keras_model, \
      dp_optimizer_keras


def _build_tfp(name, config, batch_size):
  import tf_keras as k
  utils, registry_lib, dp_keras_model, dp_optimizer_keras = _import_tfp()
  build = bench_models.MODELS[name][0]
  k.utils.set_random_seed(0)
  info = {}
  if config == "DPAdam (query=QuantileAdaptiveClipSumQuery)":
    import keras
    import tf_dpadambc as dp
    from tf_dpadambc import tf_privacy
    keras.utils.set_random_seed(0)
    model = dp.make_private(build(keras))
    query = tf_privacy.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=CLIP, noise_multiplier=NOISE,
        target_unclipped_quantile=0.5, learning_rate=0.2,
        clipped_count_stddev=batch_size / 20, expected_num_records=batch_size)
    # Without XLA: a TF-Privacy query's noise (TensorFlow's stateful random
    # ops) is refused under XLA, which draws the same numbers every run.
    model.compile(optimizer=dp.DPAdam(query=query, learning_rate=LR),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), jit_compile=False)
    return model, keras, info
  if config in ("TFP DPKerasAdamOptimizer",
                "DPKerasAdamOptimizer (ours, tf_keras)"):
    model = build(k)
    if config == "TFP DPKerasAdamOptimizer":
      optimizers = dp_optimizer_keras
    else:
      from tf_dpadambc import tf_keras as optimizers
    optimizer = optimizers.DPKerasAdamOptimizer(
        l2_norm_clip=CLIP, noise_multiplier=NOISE,
        num_microbatches=batch_size, learning_rate=LR)
    loss = k.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=k.losses.Reduction.NONE)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    info["jit_compile"] = False
    return model, k, info
  # DPSequential: fast gradient clipping, only for registered layers.
  registry = registry_lib.make_default_layer_registry()
  if "sequential" not in inspect.signature(build).parameters:
    return None, k, {"status": "n/a", "reason": "not a Sequential model"}
  model = build(k, sequential=lambda layers: dp_keras_model.DPSequential(
      l2_norm_clip=CLIP, noise_multiplier=NOISE, use_xla=True,
      layer_registry=registry, layers=layers))
  missing = sorted({type(layer).__name__ for layer in model.layers
                    if layer.trainable_weights
                    and not registry.is_elem(layer)})
  if missing or not utils.all_trainable_layers_are_registered(model,
                                                              registry):
    return None, k, {"status": "n/a", "reason": (
        f"{', '.join(missing) or 'a layer'} not in TF-Privacy's fast-clipping "
        "registry")}
  model.compile(optimizer=k.optimizers.Adam(LR),
                loss=k.losses.SparseCategoricalCrossentropy(from_logits=True))
  info["fast_clipping"] = True
  return model, k, info


def _condense(error):
  """A short line for a (TensorFlow) error: its type and its message."""
  import re
  text = str(error)
  shape = re.search(r"OOM when allocating tensor with shape(\[[^\]]*\])", text)
  size = re.search(r"Out of memory while trying to allocate ([\d.]+\s*\w+)",
                   text)
  if shape or size:
    what = f"tensor {shape.group(1)}" if shape else size.group(1)
    return f"{type(error).__name__}: out of memory (allocating {what})"
  skip = ("File ", "Detected at node", "<stack traces", "[[", "Hint:", "[Op:",
          "Graph execution error")
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  message = [l for l in lines if not l.startswith(skip)]
  return f"{type(error).__name__}: {(message or lines or [''])[0]}"[:300]


def measure(name, config, batch_size, warmup=1, min_steps=3, max_steps=20,
            budget=2.0, hard_budget=6.0, steps_per_execution=1):
  """Trains ``name`` under ``config`` in this process; returns a result dict.

  With ``steps_per_execution`` K > 1 (Keras 3 rows only: TF-Privacy's run
  one step per call), fit runs K steps per call of its compiled function and
  the callbacks see one batch per K steps: warm-up and step counts are in
  such calls, and a step's time is a call's divided by K."""
  result = dict(model=name, config=config, batch_size=batch_size)
  started = time.perf_counter()
  total = warmup + max_steps
  per_call = 1 if config in TFP_CONFIGS else steps_per_execution
  result["steps_per_execution"] = per_call
  try:
    if config in JAXP_CONFIGS:  # no TensorFlow in this worker
      tf = None
      model, k, info = _build_jax(name, config, batch_size,
                                  total * per_call, per_call)
    else:
      import tensorflow as tf
      result["pool_reserved_mib"] = _reserve_cpu_pool(tf)
      if config in TFP_CONFIGS:
        model, k, info = _build_tfp(name, config, batch_size)
      else:
        model, k, info = _build_keras3(name, config, batch_size, per_call)
    result.update(info)
    if model is None:
      return result
    memory = _Memory(tf)
    timer = _timer_class(k)(memory, warmup, min_steps, max_steps, budget,
                            hard_budget)
    if tf is None:
      x, y = _arrays(name, batch_size, total * per_call)
      model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
                shuffle=False, callbacks=[timer])
    else:
      model.fit(_dataset(tf, name, batch_size), epochs=1,
                steps_per_epoch=total * per_call, verbose=0, shuffle=False,
                callbacks=[timer])
    steps = [d * 1000 / per_call for d in timer.durations]
    if not steps:
      raise RuntimeError("no step was timed")
    result.update(memory.result())
    result.update(
        status="ok", ms_per_step=statistics.median(steps),
        ms_median=statistics.median(steps),
        ms_mean=statistics.fmean(steps), ms_min=min(steps),
        steps_timed=len(steps), step_ms=steps, warmup_steps=warmup,
        warmup_s=timer.warmup_s,
        params=int(sum(math.prod(v.shape) for v in model.trainable_weights)))
  except Exception as e:  # noqa: BLE001 -- reported in the table
    result.update(status="error", reason=_condense(e),
                  error=f"{type(e).__name__}: {e}"[:4000])
  result["wall_s"] = time.perf_counter() - started
  return result


def _cpu_model():
  with contextlib.suppress(OSError):
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  return platform.processor() or "?"


def _load():
  with contextlib.suppress(OSError, AttributeError):
    return "load average %.1f %.1f %.1f" % os.getloadavg()
  return "load average ?"


def machine_info(kind="keras3"):
  """CPU count, GPU name, versions, and whether make_private takes clipping=.

  ``kind="jaxp"``: what the JAX environment sees (no TensorFlow there).
  """
  info = dict(cpus=os.cpu_count(), python=platform.python_version(), gpus=[],
              cpu_model=_cpu_model(), platform=platform.platform())
  if kind == "jaxp":
    import jax
    import keras
    info.update(jax=jax.__version__, keras=keras.__version__, gpus=[
        d.device_kind for d in jax.devices() if d.platform == "gpu"])
    return info
  import tensorflow as tf
  info["tensorflow"] = tf.__version__
  for gpu in tf.config.list_physical_devices("GPU"):
    details = tf.config.experimental.get_device_details(gpu)
    info["gpus"].append(details.get("device_name", gpu.name))
  with contextlib.suppress(Exception):
    import keras
    info["keras"] = keras.__version__
  with contextlib.suppress(Exception):
    info["make_private_clipping"] = make_private_accepts_clipping()
  return info


def _worker(spec):
  with contextlib.suppress(OSError):  # the OOM killer takes it first
    with open("/proc/self/oom_score_adj", "w") as f:
      f.write("1000")
  out = (machine_info(os.environ.get(_KIND_VARIABLE, "keras3"))
         if spec.get("probe") else measure(**spec))
  print(RESULT_MARK + json.dumps(out), flush=True)


def _preload(kind):
  """Imports what the configurations need, without starting TF's runtime."""
  if kind == "jaxp":
    import jax_privacy
    import keras  # noqa: F401
    from jax_privacy import keras_api  # noqa: F401
    return {"version": getattr(jax_privacy, "__version__", "?")}
  import tensorflow  # noqa: F401
  if kind == "tfp":
    import tf_keras  # noqa: F401
    _import_tfp()
    import tensorflow_privacy
    return {"version": getattr(tensorflow_privacy, "__version__", "?")}
  import keras  # noqa: F401
  import tf_dpadambc  # noqa: F401
  return {}


def _serve():
  """Fork server: imports once, then forks a fresh child per configuration.

  Reads one JSON request per line on stdin ({"spec": ..., "timeout": s}) and
  answers one JSON line each ({"result": ...} or {"error": ...}). The
  children start TensorFlow's runtime; this process never does (forking
  after it started would not be safe), so every child is as fresh as a new
  interpreter, without the seconds of importing TensorFlow.
  """
  import select
  import signal
  import tempfile
  answer = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # stray prints of the imports go to stderr
  try:
    extra = _preload(os.environ.get(_KIND_VARIABLE, "keras3"))
  except Exception as e:  # noqa: BLE001 -- reported to the driver
    answer.write(json.dumps({"fail": _condense(e)}) + "\n")
    answer.flush()
    return
  answer.write(json.dumps({"ready": extra}) + "\n")
  answer.flush()
  for line in sys.stdin:
    request = json.loads(line)
    log = tempfile.TemporaryFile()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
      os.close(read_end)
      with contextlib.suppress(OSError):  # the OOM killer takes it first
        with open("/proc/self/oom_score_adj", "w") as f:
          f.write("1000")
      os.dup2(log.fileno(), 1)
      os.dup2(log.fileno(), 2)
      spec = request["spec"]
      try:
        out = (machine_info(os.environ.get(_KIND_VARIABLE, "keras3"))
               if spec.get("probe") else measure(**spec))
        data = json.dumps({"result": out}).encode()
      except BaseException as e:  # noqa: BLE001
        data = json.dumps({"error": _condense(e)}).encode()
      view = memoryview(data)
      while view:
        view = view[os.write(write_end, view):]
      os.close(write_end)
      os._exit(0)  # skip interpreter teardown (TF can crash in it)
    os.close(write_end)
    chunks, deadline = [], time.monotonic() + request["timeout"]
    timed_out = False
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        timed_out = True
        break
      ready, _, _ = select.select([read_end], [], [], left)
      if ready:
        chunk = os.read(read_end, 1 << 16)
        if not chunk:
          break
        chunks.append(chunk)
    if timed_out:
      os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(read_end)
    if timed_out:
      response = {"error": f"timeout after {request['timeout']:.0f} s"}
    elif chunks:
      response = json.loads(b"".join(chunks))
    else:
      log.seek(0)
      tail = [l.strip() for l in log.read().decode(errors="replace")
              .splitlines() if l.strip()][-3:]
      how = (signal.Signals(os.WTERMSIG(status)).name
             if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
      response = {"error": f"worker died ({how}){': ' if tail else ''}"
                           f"{' | '.join(tail)}"[:1000]}
    log.close()
    answer.write(json.dumps(response) + "\n")
    answer.flush()


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

class _Runner:
  """Runs configurations in fresh processes of one interpreter.

  By default through a fork server (``_serve``); ``fresh=True`` starts a new
  interpreter per configuration instead (slower: TensorFlow is imported each
  time), as does a platform without ``os.fork``.
  """

  def __init__(self, python, kind="keras3", fresh=False, device="auto"):
    self.python, self.kind = python, kind
    self.fresh = fresh or not hasattr(os, "fork")
    self.env = dict(os.environ, **{_KIND_VARIABLE: kind})
    if kind == "tfp":
      self.env["TF_USE_LEGACY_KERAS"] = "1"
    if kind == "jaxp":
      self.env["KERAS_BACKEND"] = "jax"
      if device == "cpu":
        self.env["JAX_PLATFORMS"] = "cpu"
    if device == "cpu":  # hide any GPU from TensorFlow
      self.env["CUDA_VISIBLE_DEVICES"] = "-1"
    limit = _memory_limit()
    if limit and "TF_MKL_ALLOC_MAX_BYTES" not in self.env:
      # Caps TensorFlow's CPU allocator: a configuration that needs more
      # fails with ResourceExhaustedError instead of waking the OOM killer.
      self.env["TF_MKL_ALLOC_MAX_BYTES"] = str(limit)
    self.proc = self.stderr = None

  def start(self):
    """(True, details) once ready; (False, why) if the imports fail."""
    if self.fresh:
      if self.kind == "keras3":
        return True, {}
      return available(self.python, self.kind)
    import tempfile
    self.stderr = tempfile.TemporaryFile()
    try:
      self.proc = subprocess.Popen(
          [self.python, os.path.abspath(__file__), "--serve"], env=self.env,
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
          text=True)
    except OSError as e:
      return False, str(e)
    line = self.proc.stdout.readline()
    reply = json.loads(line) if line.strip() else {"fail": self._tail()}
    if "ready" not in reply:
      self.close()
      return False, reply.get("fail", "?")
    return True, reply["ready"]

  def _tail(self):
    self.stderr.seek(0)
    lines = self.stderr.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"

  def run(self, spec, timeout):
    """(result, None) or (None, error)."""
    if self.fresh:
      return _run_subprocess(self.python, spec, self.env, timeout)
    if self.proc is None or self.proc.poll() is not None:
      ok, why = self.start()
      if not ok:
        return None, f"fork server failed: {why}"
    self.proc.stdin.write(json.dumps({"spec": spec, "timeout": timeout})
                          + "\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      self.close()
      return None, f"fork server died: {self._tail()}"
    reply = json.loads(line)
    if "result" in reply:
      return reply["result"], None
    return None, reply["error"]

  def close(self):
    if self.proc is not None:
      with contextlib.suppress(OSError):
        self.proc.stdin.close()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
      self.proc = None


def _memory_limit(fraction=0.5):
  """Bytes of TensorFlow's CPU allocator cap: half the machine's memory."""
  total = _meminfo_kib("MemTotal")
  return int(total * 1024 * fraction) if total else None


def _meminfo_kib(field):
  with contextlib.suppress(OSError, ValueError, IndexError):
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  return None


def _run_subprocess(python, spec, env=None, timeout=None):
  cmd = [python, os.path.abspath(__file__), "--worker", json.dumps(spec)]
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return None, f"timeout after {timeout:.0f} s"
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith(RESULT_MARK):
      return json.loads(line[len(RESULT_MARK):]), None
  tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
  return None, f"worker exited {proc.returncode}: {' | '.join(tail)}"[:1000]


def available(python, kind):
  """(True, details) if ``python`` imports what runner ``kind`` needs."""
  if kind == "jaxp":
    code = ("import jax_privacy as t, keras\n"
            "from jax_privacy import keras_api\n"
            "print('VERSION', getattr(t, '__version__', '?'))")
    env = dict(os.environ, KERAS_BACKEND="jax")
  else:
    code = ("import sys; sys.skip_tf_privacy_import = True\n"
            "import tf_keras\n"
            "from tensorflow_privacy.privacy.keras_models import "
            "dp_keras_model\n"
            "from tensorflow_privacy.privacy.optimizers import "
            "dp_optimizer_keras\n"
            "import tensorflow_privacy as t; print('VERSION', t.__version__)")
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
  try:
    proc = subprocess.run([python, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    return False, str(e)
  if proc.returncode != 0:
    return False, (proc.stderr.strip().splitlines() or ["?"])[-1]
  version = [l for l in proc.stdout.splitlines() if l.startswith("VERSION")]
  return True, {"version": version[-1][8:] if version else "?"}


def run_suite(models, batch_sizes, steps=None, isolate=True, tfp_python=None,
              timeout=420, tfp_timeout=90, configs=None, fresh=False,
              jaxp_python=None, device="auto", log=print):
  """Measures every (batch size, model, configuration); returns (info, results).

  ``isolate=False`` runs the Keras 3 configurations in this process (for
  tests) and never TF-Privacy or JAX. ``tfp_python``: the interpreter for the
  TF-Privacy configurations, ``False`` to leave them out. ``jaxp_python``:
  the interpreter for the jax_privacy configurations (None: left out).
  ``configs``: the configurations to run (default: all; the baseline always
  runs). ``fresh``: a new interpreter per configuration instead of the fork
  server. ``device``: "cpu" hides every GPU; "gpu" requires one; "auto"
  uses a GPU where there is one.
  """
  wanted = set(configs or KERAS3_CONFIGS + TFP_CONFIGS + JAXP_CONFIGS) | {
      BASELINE}
  if wanted & set(JAXP_CONFIGS):
    wanted.add(JAX_BASELINE)
  steps = dict(DEFAULT_STEPS, **(steps or {}))
  runners = {}
  try:
    keras3_skipped = None
    if isolate:
      runners["keras3"] = _Runner(sys.executable, fresh=fresh, device=device)
      ok, why = runners["keras3"].start()
      info, error = (runners["keras3"].run({"probe": True}, timeout) if ok
                     else (None, why))
      if info is None:
        if not (jaxp_python and wanted & set(JAXP_CONFIGS)):
          raise RuntimeError(f"probe failed: {error}")
        # No TensorFlow here (a GPU machine with JAX alone, say): the
        # jax_privacy rows still run, and the output says why ours did not.
        runners.pop("keras3").close()
        keras3_skipped = f"Keras 3 on TensorFlow not run here: {error}"
        info = dict(gpus=None)
    else:
      info = machine_info()
    if device == "gpu" and info["gpus"] == []:
      raise RuntimeError("--device gpu: TensorFlow sees no GPU here")
    info["device"] = "GPU:0" if info["gpus"] else "CPU:0"
    info["keras3_skipped"] = keras3_skipped
    configs = [c for c in KERAS3_CONFIGS if c in wanted and not keras3_skipped]
    info["tfp"] = None
    if not wanted & set(TFP_CONFIGS):
      info["tfp_skipped"] = "TF-Privacy not run: not among --configs"
    elif tfp_python is False or not isolate:
      info["tfp_skipped"] = (TFP_SKIP_MESSAGE if isolate else
                             "TF-Privacy skipped: it runs only in subprocesses")
    else:
      python = tfp_python or sys.executable
      runners["tfp"] = _Runner(python, kind="tfp", fresh=fresh,
                               device=device)
      ok, detail = runners["tfp"].start()
      if ok:
        info["tfp"] = dict(python=python, version=detail.get("version", "?"))
        configs += [c for c in TFP_CONFIGS if c in wanted]
      else:
        info["tfp_skipped"] = f"{TFP_SKIP_MESSAGE} ({python}: {detail})"
    info["jaxp"] = None
    if not wanted & set(JAXP_CONFIGS):
      info["jaxp_skipped"] = "jax_privacy not run: not among --configs"
    elif not jaxp_python or not isolate:
      info["jaxp_skipped"] = JAXP_SKIP_MESSAGE
    else:
      runners["jaxp"] = _Runner(jaxp_python, kind="jaxp", fresh=fresh,
                                device=device)
      ok, detail = runners["jaxp"].start()
      probe, error = (runners["jaxp"].run({"probe": True}, timeout) if ok
                      else (None, detail))
      if probe is not None:
        if device == "gpu" and not probe["gpus"]:
          raise RuntimeError("--device gpu: JAX sees no GPU here")
        info["jaxp"] = dict(python=jaxp_python, gpus=probe["gpus"],
                            jax=probe["jax"], keras=probe["keras"],
                            version=detail.get("version", "?"))
        if keras3_skipped:  # the machine as the JAX environment sees it
          info.update({k: v for k, v in probe.items() if k != "keras"},
                      device="GPU:0" if probe["gpus"] else "CPU:0")
        configs += [c for c in JAXP_CONFIGS if c in wanted]
      else:
        info["jaxp_skipped"] = f"{JAXP_SKIP_MESSAGE} ({jaxp_python}: {error})"
    info["load_before"] = _load()
    log(_machine_line(info) + "; " + info["load_before"])
    for skipped in ("keras3_skipped", "tfp_skipped", "jaxp_skipped"):
      if info.get(skipped):
        log(info[skipped])
    results = []
    for batch_size in batch_sizes:
      for name in models:
        for config in configs:
          results.append(_one(runners, isolate, name, config, batch_size,
                              steps, tfp_timeout if config in TFP_CONFIGS
                              else timeout))
          log(f"  {batch_size:>5} {name:<14} {config:<26} "
              f"{_short(results[-1])}")
    info["load_after"] = _load()
  finally:
    for runner in runners.values():
      runner.close()
  return info, results


def _one(runners, isolate, name, config, batch_size, steps, timeout):
  spec = dict(name=name, config=config, batch_size=batch_size, **steps)
  build = bench_models.MODELS[name][0]
  if (config == "TFP DPSequential"
      and "sequential" not in inspect.signature(build).parameters):
    result = dict(model=name, config=config, batch_size=batch_size,
                  status="n/a", reason="not a Sequential model")
  elif not isolate:
    result = measure(**spec)
  else:
    runner = runners["tfp" if config in TFP_CONFIGS else
                     "jaxp" if config in JAXP_CONFIGS else "keras3"]
    result, error = runner.run(spec, timeout)
    if result is None:
      result = dict(model=name, config=config, batch_size=batch_size,
                    status="timeout" if error.startswith("timeout")
                    else "error", reason=error)
  result["load"] = _load()
  return result


def _calls(r):
  k = r.get("steps_per_execution", 1)
  return "steps" if k == 1 else f"calls of {k} steps"


def _short(r):
  if r.get("status") == "ok":
    return (f"{r['ms_per_step']:9.1f} ms/step  peak +{r['peak_mib']:.1f} MiB"
            f"  ({r['steps_timed']} {_calls(r)}, warm-up {r['warmup_s']:.1f} s)")
  return f"{r.get('status')}: {r.get('reason', '')}"[:200]


def _machine_line(info):
  gpus = ", ".join(info.get("gpus") or []) or "none"
  frameworks = (f"TensorFlow {info.get('tensorflow')}, Keras "
                f"{info.get('keras', '?')}; make_private(clipping=): "
                f"{'yes' if info.get('make_private_clipping') else 'no'}")
  if info.get("keras3_skipped"):
    frameworks = f"no TensorFlow; JAX {info.get('jax', '?')}"
  return (f"Machine: {info.get('cpus')} CPUs ({info.get('cpu_model')}), "
          f"GPU: {gpus}; Python {info.get('python')}, {frameworks}")


def _lookup(results, batch_size, name, config):
  for r in results:
    if (r["batch_size"], r["model"], r["config"]) == (batch_size, name,
                                                      config):
      return r
  return None


def _baseline(config):
  """The non-private configuration a row's ratios are to (its framework's)."""
  return JAX_BASELINE if config in JAXP_CONFIGS else BASELINE


def _ratios(results, r):
  base = _lookup(results, r["batch_size"], r["model"], _baseline(r["config"]))
  ok = (r.get("status") == "ok" and base is not None
        and base.get("status") == "ok")
  time_ratio = r["ms_per_step"] / base["ms_per_step"] if ok else None
  mem_ratio = None
  if ok and base["peak_mib"] >= 0.5:
    mem_ratio = r["peak_mib"] / base["peak_mib"]
  return time_ratio, mem_ratio


def tables(results, models, batch_sizes, configs=None):
  """One Markdown table per batch size (a list of strings)."""
  out = []
  for batch_size in batch_sizes:
    out.append(f"\n### batch {batch_size}\n")
    out.append("| model | config | ms/step | ratio to non-private | peak MiB "
               "| memory ratio |")
    out.append("|---|---|---|---|---|---|")
    for name in models:
      for r in results:
        if r["batch_size"] != batch_size or r["model"] != name:
          continue
        if configs is not None and r["config"] not in configs:
          continue
        if r.get("status") != "ok":
          reason = r.get("reason", "").replace("|", "/").replace("\n", " ")
          status = "n/a" if r.get("status") == "n/a" else r.get("status")
          out.append(f"| {name} | {r['config']} | {status} "
                     f"({reason[:120]}) | | | |")
          continue
        t, m = _ratios(results, r)
        out.append(
            f"| {name} | {r['config']} | {r['ms_per_step']:.1f} "
            f"| {t:.2f}x | {r['peak_mib']:.1f} "
            f"| {'—' if m is None else f'{m:.2f}x'} |")
  return out


def targets(results, batch_sizes):
  """PASS/MISS lines for the performance targets."""
  lines = []

  def verdict(ok):
    return "PASS" if ok else "MISS"

  def ratio(b, name, config="DPAdamBC"):
    r = _lookup(results, b, name, config)
    return None if r is None else _ratios(results, r)

  for b in batch_sizes:
    for names, bound in ((("mlp",), 1.2), (("embedding_bag",), 1.5),
                         (("mnist_cnn", "transformer"), 1.4),
                         (("cifar_cnn",), 1.8),
                         (("lstm_text",), 3.0),
                         (("gemma_lora", "bert_lora"), 1.3),
                         (("gemma_full",), 1.6)):
      for name in names:
        rr = ratio(b, name)
        if rr is None or rr[0] is None:
          continue
        lines.append(f"{verdict(rr[0] <= bound)} DPAdamBC <= {bound}x "
                     f"non-private, {name}, batch {b}: {rr[0]:.2f}x")
    bc = _lookup(results, b, "mlp", "DPAdamBC")
    keras_opt = _lookup(results, b, "mlp", "TFP DPKerasAdamOptimizer")
    if (bc and keras_opt and bc.get("status") == "ok"
        and keras_opt.get("status") == "ok"):
      q = keras_opt["ms_per_step"] / bc["ms_per_step"]
      lines.append(f"{verdict(q >= 30)} DPKerasAdamOptimizer/DPAdamBC >= 30x,"
                   f" mlp, batch {b}: {q:.1f}x ({keras_opt['ms_per_step']:.0f}"
                   f" vs {bc['ms_per_step']:.1f} ms)")
    for name in sorted({r["model"] for r in results if r["batch_size"] == b}):
      ours = _lookup(results, b, name, "DPAdamBC")
      peers = [r for r in (_lookup(results, b, name, c)
                           for c in JAXP_CONFIGS[1:])
               if r and r.get("status") == "ok"]
      if ours and ours.get("status") == "ok" and peers:
        peer = min(peers, key=lambda r: r["ms_per_step"])
        lines.append(
            f"{verdict(ours['ms_per_step'] < peer['ms_per_step'])} DPAdamBC "
            f"faster than {peer['config']} (JAX), {name}, batch {b}: "
            f"{ours['ms_per_step']:.1f} vs {peer['ms_per_step']:.1f} ms "
            f"({peer['ms_per_step'] / ours['ms_per_step']:.2f}x)")
    seq = _lookup(results, b, "mlp", "TFP DPSequential")
    if bc and seq and bc.get("status") == "ok" and seq.get("status") == "ok":
      lines.append(f"{verdict(bc['ms_per_step'] < seq['ms_per_step'])} "
                   f"DPAdamBC faster than DPSequential, mlp, batch {b}: "
                   f"{bc['ms_per_step']:.2f} vs {seq['ms_per_step']:.2f} ms")
  if 256 in batch_sizes and 1024 in batch_sizes:  # the ratio must not grow
    for name in sorted({r["model"] for r in results}):
      small, large = ratio(256, name), ratio(1024, name)
      if small and large and small[0] is not None and large[0] is not None:
        lines.append(
            f"{verdict(large[0] <= small[0] + 0.2)} DPAdamBC batch-1024 ratio "
            f"within 0.2 of batch 256's, {name}: {large[0]:.2f}x vs "
            f"{small[0]:.2f}x")
  memory_batch = 1024 if 1024 in batch_sizes else max(batch_sizes)
  note = "" if memory_batch == 1024 else " (1024 not run)"
  for r in results:
    if (r["batch_size"] != memory_batch or r["config"] != "DPAdamBC"
        or r.get("status") != "ok"):
      continue
    _, m = _ratios(results, r)
    base = _lookup(results, memory_batch, r["model"], BASELINE)
    if m is None:
      lines.append(f"n/a  peak memory <= 1.3x, {r['model']}, batch "
                   f"{memory_batch}{note}: non-private peak "
                   f"{base['peak_mib'] if base else float('nan'):.1f} MiB too "
                   f"small for a ratio (DPAdamBC {r['peak_mib']:.1f} MiB)")
      continue
    lines.append(f"{verdict(m <= 1.3)} peak memory <= 1.3x, {r['model']}, "
                 f"batch {memory_batch}{note}: {m:.2f}x ({r['peak_mib']:.1f} "
                 f"vs {base['peak_mib']:.1f} MiB)")
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", nargs="+", default=None,
                      choices=list(bench_models.MODELS),
                      help="default: all but lstm_text (--quick: %s)"
                      % " ".join(QUICK_MODELS))
  parser.add_argument("--batch-sizes", nargs="+", type=int, default=None,
                      help="default 256 1024 (--quick: 256)")
  parser.add_argument("--quick", action="store_true",
                      help="batch 256, fewer steps, the three small models")
  parser.add_argument("--tfp-python", default=None,
                      help="interpreter with tensorflow-privacy and tf_keras "
                      "(default: this one)")
  parser.add_argument("--no-tfp", action="store_true",
                      help="leave TF-Privacy out")
  parser.add_argument("--jaxp-python", default=None,
                      help="interpreter with jax-privacy>=2 and keras: adds "
                      "jax_privacy's Keras API on the JAX backend (default: "
                      "left out)")
  parser.add_argument("--device", choices=("auto", "cpu", "gpu"),
                      default="auto",
                      help="cpu hides every GPU; gpu requires one; auto "
                      "(default) uses a GPU where there is one")
  parser.add_argument("--configs", nargs="+", default=None,
                      choices=list(KERAS3_CONFIGS + TFP_CONFIGS
                                   + JAXP_CONFIGS),
                      help="configurations to run (default: all; the "
                      "non-private baseline always runs)")
  parser.add_argument("--json", default=None, help="save raw results here")
  parser.add_argument("--stat", choices=("median", "best"), default="median",
                      help="ms/step: median (default) or best of the timed "
                      "steps (best resists a busy machine)")
  parser.add_argument("--warmup", type=int, default=None)
  parser.add_argument("--min-steps", type=int, default=None)
  parser.add_argument("--max-steps", type=int, default=None)
  parser.add_argument(
      "--steps-per-execution", type=int, default=None,
      help="Keras 3 rows: compile with steps_per_execution=K (K steps per "
           "call of the compiled function: less host work per step, as on a "
           "GPU); counts are then in calls, ms/step a call's time / K")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds of timed steps per configuration")
  parser.add_argument("--hard-budget", type=float, default=None)
  parser.add_argument("--timeout", type=float, default=420,
                      help="seconds per Keras 3 configuration (subprocess)")
  parser.add_argument("--tfp-timeout", type=float, default=90,
                      help="seconds per TF-Privacy configuration")
  parser.add_argument("--fresh", action="store_true",
                      help="a new interpreter per configuration instead of "
                      "forks of one that has imported TensorFlow (slower)")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker is not None:
    _worker(json.loads(args.worker))
    return
  if args.serve:
    _serve()
    return
  steps = dict(QUICK_STEPS if args.quick else DEFAULT_STEPS)
  for key in steps:
    if getattr(args, key) is not None:
      steps[key] = getattr(args, key)
  if steps["warmup"] < 1 or steps["min_steps"] < 2:
    parser.error("--warmup must be >= 1 and --min-steps >= 2")
  batch_sizes = args.batch_sizes or ([256] if args.quick else [256, 1024])
  args.models = args.models or (QUICK_MODELS if args.quick
                                else DEFAULT_MODELS)
  started = time.perf_counter()
  info, results = run_suite(
      args.models, batch_sizes, steps,
      tfp_python=False if args.no_tfp else args.tfp_python,
      timeout=args.timeout, tfp_timeout=args.tfp_timeout, configs=args.configs,
      fresh=args.fresh, jaxp_python=args.jaxp_python, device=args.device)
  elapsed = time.perf_counter() - started
  if args.stat == "best":
    for r in results:
      if r.get("status") == "ok":
        r["ms_per_step"] = r["ms_min"]
  print()
  print(_machine_line(info))
  print(f"{info['load_before']} at the start, {info['load_after']} at the end"
        " (a busy machine slows every configuration)")
  if info.get("tfp"):
    print(f"TF-Privacy {info['tfp']['version']} (tf_keras) under "
          f"{info['tfp']['python']}")
  else:
    print(info.get("tfp_skipped", ""))
  if info.get("keras3_skipped"):
    print(info["keras3_skipped"])
  if info.get("jaxp"):
    jaxp = info["jaxp"]
    print(f"jax_privacy {jaxp['version']} (Keras {jaxp['keras']}, JAX "
          f"{jaxp['jax']}, GPU: {', '.join(jaxp['gpus']) or 'none'}) under "
          f"{jaxp['python']}; its ratios are to '{JAX_BASELINE}' of the same "
          "run")
  else:
    print(info.get("jaxp_skipped", ""))
  methods = sorted({r["mem_method"] for r in results if r.get("mem_method")})
  print(f"ms/step: {args.stat} of the timed steps ({steps['warmup']} warm-up "
        f"step(s) untimed); peak MiB: peak memory of the timed steps above the"
        f" use before them ({', '.join(methods) or '-'}); ratios to "
        f"non-private Keras 3 Adam of the same run.")
  for line in tables(results, args.models, batch_sizes):
    print(line)
  print("\nTargets:")
  for line in targets(results, batch_sizes):
    print("  " + line)
  failures = [r for r in results if r.get("status") in ("error", "timeout")]
  if failures:
    print("\nErrors:")
    for r in failures:
      print(f"  batch {r['batch_size']} {r['model']} {r['config']}: "
            f"{r.get('reason')}")
  print(f"\nTotal time: {elapsed / 60:.1f} min")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(machine=info, steps=steps, stat=args.stat,
                     batch_sizes=batch_sizes,
                     models=args.models, elapsed_s=elapsed, results=results),
                f, indent=1)
    print(f"Raw results: {args.json}")


if __name__ == "__main__":
  main()
