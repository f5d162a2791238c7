"""The full audit: README's table of claimed ε against audited ε lower bounds.

    python benchmarks/audit.py            # every configuration, ε = 4 and 8
    python benchmarks/audit.py --quick    # fewer canaries

Each configuration trains once with white-box gradient canaries through the
real private step (``tf_dpadambc.audit``) and prints the claimed ε next to
the 95% lower bounds (GDP, Clopper-Pearson and one-run estimators, 95%), plus one deliberately
broken mechanism (noise halved) that the audit must flag.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from tf_dpadambc.audit import cli  # noqa: E402

CONFIGURATIONS = [  # (label, CLI flags)
    ("DPSGD, shuffled", ["--variants", "DPSGD"]),
    ("DPAdam, shuffled", ["--variants", "DPAdam"]),
    ("DPAdamBC, shuffled", ["--variants", "DPAdamBC"]),
    ("DPAdamIME, shuffled", ["--variants", "DPAdamIME"]),
    ("DPAdamSTP, shuffled", ["--variants", "DPAdamSTP"]),
    ("DPAdamBC, Poisson", ["--variants", "DPAdamBC", "--sampling",
                           "poisson"]),
    ("DPSGD, Poisson", ["--variants", "DPSGD", "--sampling", "poisson"]),
    ("DPAdamBC, banded MF", ["--variants", "DPAdamBC", "--noise", "banded"]),
    ("DPAdamBC, BLT MF", ["--variants", "DPAdamBC", "--noise", "blt"]),
    ("DPAdamBC, vectorized clipping", ["--variants", "DPAdamBC",
                                       "--clipping", "vectorized"]),
    ("DPAdamBC, accumulation k = 2", ["--variants", "DPAdamBC",
                                      "--accumulation", "2",
                                      "--batch-size", "200"]),
    ("BROKEN: DPSGD with half the noise", ["--variants", "DPSGD",
                                           "--noise-scale", "0.5"]),
]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--epsilons", nargs="+", type=float, default=[4.0, 8.0])
  parser.add_argument("--out", default="dp-audit-benchmark")
  args = parser.parse_args(argv)
  size = ["--canaries", "1000", "--background", "1000", "--batch-size",
          "200"] if args.quick else []
  lines = ["| configuration | claimed ε | ε_lower GDP | ε_lower "
           "Clopper-Pearson | ε_lower one-run | canaries in / out | steps | "
           "verdict |", "|---|---|---|---|---|---|---|---|"]
  for epsilon in args.epsilons:
    for label, flags in CONFIGURATIONS:
      if args.quick and "--batch-size" in flags:
        continue
      out = os.path.join(args.out, f"eps{epsilon:g}_{len(lines)}")
      (_, _, scores, bounds, _), = cli.run(cli.parse_args(
          flags + size + ["--epsilon", str(epsilon), "--out", out]))
      lines.append(
          f"| {label} | {scores.claimed_epsilon:.2f} | {bounds['GDP']:.2f} | "
          f"{bounds['Clopper-Pearson']:.2f} | {bounds['one-run']:.2f} | "
          f"{len(scores.in_scores)} / {len(scores.out_scores)} | "
          f"{scores.steps} | {cli.verdict(scores, bounds)} |")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
