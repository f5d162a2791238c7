"""ms/step of non-private Keras 3 Adam vs tf_dpadambc's DPAdamBC, side by side.

    python benchmarks/step_time.py            # MLP and MNIST CNN, batch 256
    python benchmarks/step_time.py --quick    # fewer steps

Synthetic data with the shapes of the performance note: the MLP 784-128-10
and TF-Privacy's tutorial MNIST CNN (conv 16 8x8/2, conv 32 4x4/2, dense 32,
dense 10; builders in bench_models.py, shared with suite.py, the
fuller benchmark). Each configuration trains with ``model.fit`` (XLA, the same input
pipeline); epochs after the first are timed, so compilation is
excluded; each figure is the best of three epochs. Ratios are DP /
non-private measured in the same run.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpadambc as dp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_models  # noqa: E402  (shared with suite.py)


def mlp():
  return bench_models.mlp(keras)


def mnist_cnn():
  return bench_models.mnist_cnn(keras)


MODELS = {"mlp_784_128_10": (mlp, (784,)),
          "mnist_cnn": (mnist_cnn, (28, 28, 1))}


def time_fit(build, shape, optimizer, private, batch_size, steps, jit=True,
             repeats=3):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch_size * steps,) + shape).astype("float32")
  y = rng.integers(0, 10, size=batch_size * steps).astype("int32")
  keras.utils.set_random_seed(0)
  model = build()
  if private:
    model = dp.make_private(model)
  model.compile(optimizer=optimizer,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), jit_compile=jit)
  model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)  # compile
  times = []
  for _ in range(repeats):  # best of: the least disturbed measurement
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    times.append((time.perf_counter() - start) / steps * 1000)
  return min(times)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--models", nargs="*", default=list(MODELS))
  args = parser.parse_args(argv)
  steps = 10 if args.quick else args.steps
  rows = []
  for name in args.models:
    build, shape = MODELS[name]
    plain = time_fit(build, shape, keras.optimizers.Adam(1e-3), False,
                     args.batch_size, steps)
    private = time_fit(build, shape, dp.DPAdamBC(1.0, 1.0, 1e-3), True,
                       args.batch_size, steps)
    private_nojit = time_fit(build, shape, dp.DPAdamBC(1.0, 1.0, 1e-3), True,
                             args.batch_size, steps, jit=False)
    rows.append((name, plain, private, private_nojit))
  print(f"\nms/step, batch {args.batch_size}, {steps} timed steps, "
        f"{os.cpu_count()} CPU cores")
  print("| model | Adam (non-private, XLA) | DPAdamBC (XLA) | ratio "
        "| DPAdamBC (no XLA) | ratio |")
  print("|---|---|---|---|---|---|")
  for name, plain, private, nojit in rows:
    print(f"| {name} | {plain:.1f} | {private:.1f} | {private / plain:.2f}x "
          f"| {nojit:.1f} | {nojit / plain:.2f}x |")


if __name__ == "__main__":
  main()
