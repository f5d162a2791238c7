"""RMSE / max error of DP-MF strategies for prefix sums, next to the notes.

    python benchmarks/mf_strategies.py            # n = 256, 1024, 2048 (~1 min)
    python benchmarks/mf_strategies.py --quick    # n = 256, 1024 (~15 s)

Noise multiplier 1, prefix-sum workload (SGD). Each cell is "ours (notes)",
the reference figures of /work/shared/notes/matrix-factorization.md
(NumPy/SciPy, cross-checked there against jax_privacy 2.0). Strategies:
identity (DP-SGD), sqrt-Toeplitz, BandMF (``mf.optimize_banded``, mean-
optimized) with b = 4/16/64/128 bands, the mean-optimized full Toeplitz
(b = n), BLTs with 2 and 4 buffers (``mf.optimize_blt``) and the dense
optimum (``mf.optimize_dense``, n ≤ 512 only: one n×n eigendecomposition
per L-BFGS step). Then the multiple-participation figures (k participations,
min-separation n/k, unamplified) and the optimizer timings.

Timings are wall-clock on this machine. OpenBLAS spins its threads: on a
machine shared with other busy processes the dense optimizer can be many
times slower than alone (OPENBLAS_NUM_THREADS=1 avoids that).
"""
import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from tf_dpadambc import mf  # noqa: E402
from tf_dpadambc.mf import strategies  # noqa: E402

# (RMSE, max error) from the notes; None where the notes give none.
REFERENCE = {
    "identity": {256: (11.336, 16.000), 1024: (22.639, 32.000),
                 2048: (32.008, 45.255)},
    "sqrt-Toeplitz": {256: (2.669, 2.831), 1024: (3.110, 3.273),
                      2048: (3.331, 3.493)},
    "banded b=4": {1024: (11.563, 16.228), 2048: (16.220, 22.830)},
    "banded b=16": {256: (3.638, 4.777), 1024: (6.343, 8.659),
                    2048: (8.627, 11.915)},
    "banded b=64": {256: (2.783, 3.341), 1024: (4.066, 5.219),
                    2048: (5.170, 6.811)},
    "banded b=128": {256: (2.648, 3.037), 1024: (3.523, 4.333),
                     2048: (4.284, 5.443)},
    "full Toeplitz (b=n)": {256: (2.617, 2.915), 1024: (3.057, 3.359),
                            2048: (3.277, 3.581)},
    "BLT 2 buffers": {256: (2.622, 2.923), 1024: (3.084, 3.408),
                      2048: (3.327, 3.666)},
    "BLT 4 buffers": {256: (2.617, 2.908), 1024: (3.057, 3.353),
                      2048: (3.278, 3.575)},
    "dense optimum": {256: (2.524, 2.749), 1024: (2.956, 3.194),
                      2048: (3.172, 3.417)},
}

STRATEGIES = {
    "identity": lambda n: strategies.Identity(),
    "sqrt-Toeplitz": strategies.sqrt_toeplitz,
    "banded b=4": lambda n: mf.optimize_banded(n, 4),
    "banded b=16": lambda n: mf.optimize_banded(n, 16),
    "banded b=64": lambda n: mf.optimize_banded(n, 64),
    "banded b=128": lambda n: mf.optimize_banded(n, 128),
    "full Toeplitz (b=n)": lambda n: mf.optimize_banded(n, n),
    "BLT 2 buffers": lambda n: mf.optimize_blt(n, 2),
    "BLT 4 buffers": lambda n: mf.optimize_blt(n, 4),
    "dense optimum": lambda n: mf.optimize_dense(n) if n <= 512 else None,
}

# n = 1024, RMSE with k participations at min-separation n/k.
MULTI = [
    (4, "identity", lambda n, k, s: strategies.Identity(), 45.28),
    (4, "sqrt-Toeplitz", lambda n, k, s: strategies.sqrt_toeplitz(n), 7.54),
    (4, "banded b=256", lambda n, k, s: mf.optimize_banded(n, 256, k, s),
     6.44),
    (4, "BLT 3 buffers", lambda n, k, s: mf.optimize_blt(n, 3, k, s), 6.67),
    (16, "identity", lambda n, k, s: strategies.Identity(), 90.55),
    (16, "sqrt-Toeplitz", lambda n, k, s: strategies.sqrt_toeplitz(n),
     23.90),
    (16, "banded b=64", lambda n, k, s: mf.optimize_banded(n, 64, k, s),
     16.26),
    (16, "BLT 3 buffers", lambda n, k, s: mf.optimize_blt(n, 3, k, s),
     17.22),
]


def timed(fn, *args, **kwargs):
  start = time.perf_counter()
  out = fn(*args, **kwargs)
  return out, time.perf_counter() - start


def cell(value, reference):
  if value is None:
    return "—"
  if reference is None:
    return f"{value:.3f}"
  return f"{value:.3f} ({reference:.3f})"


def single_participation(sizes):
  print("\nSingle participation, prefix sums: RMSE (notes) / max error "
        "(notes); [s] = optimization time")
  print("| strategy | " + " | ".join(f"n={n}" for n in sizes) + " |")
  print("|---" * (len(sizes) + 1) + "|")
  for name, build in STRATEGIES.items():
    cells = []
    for n in sizes:
      strategy, seconds = timed(build, n)
      ref = REFERENCE[name].get(n, (None, None))
      if strategy is None:
        cells.append("— (n > 512)")
        continue
      rmse = mf.rmse(strategy, n)
      max_error = mf.max_error(strategy, n)
      cells.append(f"{cell(rmse, ref[0])} / {cell(max_error, ref[1])} "
                   f"[{seconds:.2f}s]")
    print(f"| {name} | " + " | ".join(cells) + " |")


def max_optimized_blt(sizes):
  print("\nMax-error-optimized BLT, 4 buffers, vs sqrt-Toeplitz (the notes:"
        " they match)")
  print("| n | BLT-4 max-opt: max error | sqrt-Toeplitz max error | "
        "BLT-4 RMSE |")
  print("|---|---|---|---|")
  for n in sizes:
    blt = mf.optimize_blt(n, 4, objective="max")
    print(f"| {n} | {mf.max_error(blt, n):.3f} | "
          f"{mf.max_error(strategies.sqrt_toeplitz(n), n):.3f} | "
          f"{mf.rmse(blt, n):.3f} |")


def multiple_participations(n=1024):
  print(f"\nMultiple participations, n={n}, min-separation n/k, RMSE "
        "(notes)")
  print("| k | strategy | RMSE (notes) | time |")
  print("|---|---|---|---|")
  for k, name, build, reference in MULTI:
    s = n // k
    strategy, seconds = timed(build, n, k, s)
    rmse = mf.rmse(strategy, n, participations=k, min_separation=s)
    print(f"| {k} | {name} | {cell(rmse, reference)} | {seconds:.2f}s |")


def timings(repeats):
  print("\nOptimizer timings (best of %d), wall-clock" % repeats)
  print("| optimizer | time | target | RMSE |")
  print("|---|---|---|---|")
  cases = [
      ("optimize_banded(2000, 64)", lambda: mf.optimize_banded(2000, 64),
       2000, "< 30 s"),
      ("optimize_banded(2000, 256)", lambda: mf.optimize_banded(2000, 256),
       2000, "—"),
      ("optimize_blt(2000, 2)", lambda: mf.optimize_blt(2000, 2), 2000,
       "seconds"),
      ("optimize_blt(2000, 4)", lambda: mf.optimize_blt(2000, 4), 2000,
       "seconds"),
      ("optimize_dense(256)", lambda: mf.optimize_dense(256), 256, "—"),
      ("optimize_dense(512)", lambda: mf.optimize_dense(512), 512, "—"),
  ]
  for name, fn, n, target in cases:
    best = np.inf
    for _ in range(repeats):
      strategy, seconds = timed(fn)
      best = min(best, seconds)
    print(f"| {name} | {best:.2f}s | {target} | "
          f"{mf.rmse(strategy, n):.3f} |")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="n = 256 and 1024 only; one timing repeat")
  args = parser.parse_args(argv)
  sizes = [256, 1024] if args.quick else [256, 1024, 2048]
  print(f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}, "
        f"{os.cpu_count()} CPUs")
  single_participation(sizes)
  max_optimized_blt(sizes)
  multiple_participations()
  timings(1 if args.quick else 3)


if __name__ == "__main__":
  main()
