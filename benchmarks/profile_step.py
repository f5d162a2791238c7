"""Where a compiled train step spends its time: XLA's fusions and library
calls, DPAdamBC's step beside non-private Keras Adam's.

    python benchmarks/profile_step.py mlp                    # batch 256
    python benchmarks/profile_step.py transformer --steps 3 --top 40
    python benchmarks/profile_step.py mnist_cnn --configs DPAdamBC

Each configuration trains a ``bench_models`` model with ``model.fit``
(``jit_compile=True``, synthetic data, the first epoch untimed) in a process
of its own, under TensorFlow's profiler with XLA's per-thunk trace events on
(``--xla_cpu_enable_xprof_traceme``) and its optimized HLO dumped. The table
sums each thunk's time over the profiled steps (per step; thunks on several
threads add up, so the total can exceed the wall time, and profiling slows
the step) and names the TensorFlow op each fusion came from, read from the
HLO's metadata. Use it to find what to speed up; measure a change with
``suite.py`` or ``ab_revision.py``, not with these (inflated) figures.
"""
import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_models  # noqa: E402  (no TensorFlow import)
CONFIGS = ("Adam", "DPAdamBC")
# Trace events that are containers or runtime bookkeeping, not thunks.
_NOT_THUNKS = ("ThunkExecutor", "ExecutorState", "CpuExecutable",
               "BlockUntilReady", "Iterator", "Prefetch", "ParallelMap",
               "EagerExecute", "ExecutorDoneCallback", "SlinkyThreadPool")


def _child(args):
  """Runs in the profiled process: trains, traces, writes a JSON summary."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ["XLA_FLAGS"] = " ".join([
      os.environ.get("XLA_FLAGS", ""), "--xla_cpu_enable_xprof_traceme=true",
      f"--xla_dump_to={args.workdir}/hlo", "--xla_dump_hlo_as_text",
      "--xla_dump_hlo_pass_re=^$"])
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tf_dpadambc as dp  # pylint: disable=import-outside-toplevel
  x, y = bench_models.synthetic_data(args.model, args.batch_size * args.steps)
  model = bench_models.MODELS[args.model][0](keras)
  private = args.config != "Adam"
  if private:
    model = dp.make_private(model)
  model.compile(optimizer=(dp.DPAdamBC(1.0, 1.0, 1e-3) if private
                           else keras.optimizers.Adam(1e-3)),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), jit_compile=True)
  model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
  logdir = os.path.join(args.workdir, "trace")
  tf.profiler.experimental.start(logdir)
  model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
  tf.profiler.experimental.stop()
  times = _thunk_times(logdir)
  ops = _op_names(os.path.join(args.workdir, "hlo"), set(times))
  with open(os.path.join(args.workdir, "summary.json"), "w",
            encoding="utf-8") as f:
    json.dump({name: [ms / args.steps, ops.get(name, "")]
               for name, ms in times.items()}, f)


def _thunk_times(logdir):
  """{thunk name: total ms} over the trace's XLA threads."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
  space = xplane_pb2.XSpace()
  path = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0]
  with open(path, "rb") as f:
    space.ParseFromString(f.read())
  total = collections.Counter()
  for plane in space.planes:
    names = {k: v.name for k, v in plane.event_metadata.items()}
    for line in plane.lines:
      if line.name == "python" or line.name.startswith("tf_data"):
        continue
      for event in line.events:
        name = names.get(event.metadata_id, "?")
        if not any(s in name for s in _NOT_THUNKS):
          total[name] += event.duration_ps / 1e9
  return total


def _op_names(hlo_dir, names):
  """{HLO instruction name: 'shape  TF op type and name'} of the largest
  train-step module's optimized HLO."""
  modules = glob.glob(f"{hlo_dir}/*one_step_on_data*after_optimizations.txt")
  if not modules:
    return {}
  with open(max(modules, key=os.path.getsize), encoding="utf-8") as f:
    text = f.read()
  out = {}
  for name in names:
    match = re.search(r"^\s*(?:ROOT )?%" + re.escape(name)
                      + r" = (\S+) .*$", text, re.M)
    if not match:
      continue
    op = re.search(r'op_type="([^"]*)" op_name="([^"]*)"', match.group(0))
    out[name] = match.group(1)[:40] + (
        f"  {op.group(1)} {op.group(2)[-70:]}" if op else "")
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("model", choices=sorted(bench_models.MODELS))
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--steps", type=int, default=10,
                      help="profiled steps (default 10)")
  parser.add_argument("--top", type=int, default=25,
                      help="rows per configuration (default 25)")
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS),
                      choices=CONFIGS)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--config", help=argparse.SUPPRESS)
  parser.add_argument("--workdir", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    return _child(args)
  for config in args.configs:
    with tempfile.TemporaryDirectory() as workdir:
      subprocess.run(
          [sys.executable, os.path.abspath(__file__), args.model, "--child",
           "--config", config, "--workdir", workdir,
           "--batch-size", str(args.batch_size), "--steps", str(args.steps)],
          check=True, stderr=subprocess.DEVNULL)
      with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    rows = sorted(summary.items(), key=lambda kv: -kv[1][0])
    print(f"\n{args.model}, batch {args.batch_size}, {config}: "
          f"{sum(ms for ms, _ in summary.values()):.2f} ms/step in "
          f"{len(summary)} thunks (profiled)")
    for name, (ms, op) in rows[:args.top]:
      print(f"  {ms:9.3f}  {name[:34]:34s} {op}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
