"""How exact is DPAdamBC's Φ_t under correlated noise once training feeds back?

    python benchmarks/mf_bias.py          # 400 steps, 20k coordinates
    python benchmarks/mf_bias.py --quick

Φ_t = (1−β2)/(1−β2^t)·Σ_i β2^{t−i}·(σC/B)²·sens²·‖row_i(C⁻¹)‖² is the exact
bias of v̂_t when the gradients are independent of the noise (tested against
Monte Carlo in tests/test_correlated_noise.py). In training they are not:
g_t depends on past noise, which DP-MF correlates with the current noise
(the notes' SGD toy: E[(g+n)²] 17% above the formula). Here DPAdam (post-
processing) minimizes f(θ) = ½ Σ a_i θ_i² through the library's optimizer
(clipping inactive, the clipped sum is B·∇f), and we compare v̂_t with
v_t^clean + Φ_t, v^clean the debiased EMA of the clean squared gradients,
for independent noise and two streamed strategies. The excess is the cross
term 2E[g·n] + E[g²] shifts, which no data-independent Φ can remove.
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpadambc as dp  # noqa: E402
from tf_dpadambc.core import clipping  # noqa: E402


def run(noise, steps, m, sigma=1.0, clip=1.0, units=10, lr=0.05, beta_2=0.99,
        seed=0):
  rng = np.random.default_rng(seed)
  curvature = tf.constant(rng.uniform(0.5, 2.0, m).astype("float32"))
  var = tf.Variable(rng.normal(0, 0.3, m).astype("float32"))
  opt = dp.DPAdam(clip, sigma, learning_rate=lr, beta_2=beta_2, seed=seed,
                  noise=noise)
  clean = np.zeros(m)
  ratios, final = {}, None
  for t in range(1, steps + 1):
    g = (curvature * var).numpy()
    clean = beta_2 * clean + (1 - beta_2) * g.astype("float64") ** 2
    opt.apply_private(
        clipping.assume_clipped([tf.constant(g * units)]), units, units, [var])
    if t in (10, 50, 100, 200, 400, steps):
      v_hat = float(tf.reduce_mean(opt.second_moment(var)))
      want = np.mean(clean / (1 - beta_2 ** t)) + float(opt.phi())
      ratios[t] = v_hat / want
      clean_t = np.mean(clean / (1 - beta_2 ** t))
      # Φ's share of v̂, and what bias correction leaves: (v̂ − Φ)/v^clean.
      final = (float(opt.phi()) / v_hat, (v_hat - float(opt.phi())) / clean_t)
  return ratios, final


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--coordinates", type=int, default=20_000)
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  steps = 100 if args.quick else args.steps
  noises = {
      "independent": dp.IndependentNoise(),
      "sqrt-Toeplitz b=16": dp.CorrelatedNoise(dp.mf.sqrt_toeplitz(16),
                                               steps),
      "BLT d=4 (optimized)": dp.CorrelatedNoise(dp.mf.optimize_blt(steps, 4),
                                                steps),
  }
  results = {k: run(n, steps, args.coordinates) for k, n in noises.items()}
  ts = sorted(next(iter(results.values()))[0])
  print("E[v̂_t] / (v_t^clean + Φ_t), DPAdam on a quadratic, "
        f"{args.coordinates:,} coordinates; at the last step, Φ's share of "
        "v̂ and (v̂ − Φ)/v^clean (what bias correction sees; 1 is exact)")
  print("| noise | " + " | ".join(f"t={t}" for t in ts)
        + " | Φ/v̂ | (v̂ − Φ)/v^clean |")
  print("|---|" + "---|" * (len(ts) + 2))
  for name, (ratios, (share, left)) in results.items():
    print(f"| {name} | " + " | ".join(f"{ratios[t]:.3f}" for t in ts)
          + f" | {share:.3f} | {left:.3f} |")


if __name__ == "__main__":
  main()
