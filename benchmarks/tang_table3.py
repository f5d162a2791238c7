"""Tang et al. (AAAI 2024) Table 3, recomputed from Proposition 3.

    python benchmarks/tang_table3.py               # as stated (ν = 4Φ·…)
    python benchmarks/tang_table3.py --nu-scale 2  # the proof's constant

Prints ξ with P[|v̂_t^corr − v̂_t^clean| ≥ ξ] ≤ α from
``tf_dpadambc.theory.bias_correction_error_bound`` beside the values the
paper prints, their relative difference, and which branch of the bound
applies (sub-Gaussian "G" or sub-exponential "E"). Pure arithmetic: instant.
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from tf_dpadambc import theory  # noqa: E402

BATCH_SIZE, NOISE_MULTIPLIER, BETA_2 = 256, 0.4, 0.999
STEPS = (10, 100, 1000, 10000)
# Table 3 as printed: {C: {α: values at STEPS}}.
PAPER = {
    0.1: {0.01: (1.005e-07, 3.180e-08, 1.046e-08, 7.110e-09),
          0.05: (8.388e-08, 2.654e-08, 8.725e-09, 5.933e-09),
          0.10: (7.559e-08, 2.391e-08, 7.863e-09, 5.347e-09)},
    1.0: {0.01: (1.005e-06, 3.180e-06, 1.046e-06, 7.110e-07),
          0.05: (8.388e-06, 2.654e-06, 8.725e-07, 5.933e-07),
          0.10: (7.559e-06, 2.391e-06, 7.863e-07, 5.347e-07)},
}


def branch(clip, alpha, step, nu_scale):
  """"G" if δ is in the sub-Gaussian range of Proposition 3, else "E"."""
  phi = theory.phi(BATCH_SIZE, clip, NOISE_MULTIPLIER)
  nu = nu_scale * phi * np.sqrt((1 - BETA_2**(2 * step)) / (1 - BETA_2**2))
  return "G" if 2 * np.log(2 / alpha) * (4 * phi)**2 <= nu**2 else "E"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--nu-scale", type=float, default=4.0,
                      help="k in ν = kΦ·sqrt((1-β2^2t)/(1-β2²)): 4 as "
                      "Proposition 3 states it, 2 as its proof derives it")
  args = parser.parse_args(argv)
  print(f"Tang et al. 2024, Table 3 (Proposition 3): B = {BATCH_SIZE}, "
        f"σ = {NOISE_MULTIPLIER}, β2 = {BETA_2}, ν = {args.nu_scale:g}Φ·…\n")
  print("| C | α | t | computed | 3 s.d. | paper | relative difference "
        "| branch |")
  print("|---|---|---|---|---|---|---|---|")
  mismatches = []
  for clip, rows in PAPER.items():
    for alpha, printed in rows.items():
      computed = theory.bias_correction_error_bound(
          BATCH_SIZE, clip, NOISE_MULTIPLIER, BETA_2, STEPS, alpha,
          nu_scale=args.nu_scale)
      for step, ours, theirs in zip(STEPS, computed, printed):
        rounded = float(f"{ours:.3e}")
        if rounded != theirs:
          mismatches.append((clip, alpha, step))
        print(f"| {clip:g} | {alpha:g} | {step} | {ours:.6e} | "
              f"{rounded:.3e} | {theirs:.3e} | {(ours - theirs) / theirs:+.2e} "
              f"| {branch(clip, alpha, step, args.nu_scale)} |")
  print(f"\nΦ = (σC/B)² = {theory.phi(BATCH_SIZE, 0.1, NOISE_MULTIPLIER):.4e}"
        f" (C = 0.1), {theory.phi(BATCH_SIZE, 1.0, NOISE_MULTIPLIER):.4e}"
        " (C = 1).")
  print(f"{12 * len(PAPER) - len(mismatches)} of {12 * len(PAPER)} entries "
        "agree to 3 significant digits.")
  if args.nu_scale == 4.0:
    print("Expected differences: at α = 0.01, t = 10 δ exceeds ν²/b, so "
          "Proposition 3 takes the sub-exponential branch (E) where the "
          "paper prints the sub-Gaussian value (1.005e-07 for C = 0.1); for "
          "C = 1 the paper's 1.005e-06 is also a factor 10 off (every other "
          "C = 1 entry is exactly 100x its C = 0.1 entry, as Φ ∝ C²).")


if __name__ == "__main__":
  main()
