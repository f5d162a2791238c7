"""``tf-dpadambc audit``: an empirical lower bound on ε next to the claim.

    tf-dpadambc audit                                  # DPSGD, DPAdamBC at ε = 4
    tf-dpadambc audit --variants DPAdam DPAdamSTP --epsilon 8 --sampling poisson
    tf-dpadambc audit --noise-scale 0.5                # a broken mechanism: flagged
    tf-dpadambc audit --black-box                      # mislabeled digits canaries
    python -m tf_dpadambc audit --help

For each variant: σ is calibrated for the target ε (δ, the run's sampling),
one training run with white-box gradient canaries goes through the real
private step (``audit.canaries.white_box_scores``), and the canaries' scores
give ε lower bounds at the stated confidence (``audit.estimators``): the
Gaussian-DP and Clopper–Pearson estimators (many independent canaries) and
the one-run estimator (Steinke, Nasr & Jagielski 2023). A lower bound above the claimed
ε refutes the claim (a bug); one below it proves nothing, but a bound close
to the claim shows the audit had power. ``--noise-scale`` multiplies the
noise actually added (not the claim): below 1 the mechanism is broken on
purpose, and the audit should flag it.

Written to ``--out`` (default ``./dp-audit``): ``results.md`` and a PNG
histogram of in/out scores per variant.
"""
import argparse
import dataclasses
import os
import sys
import time

import keras
import numpy as np

import tf_dpadambc
from tf_dpadambc import experiments as ex
from tf_dpadambc import mf
from tf_dpadambc.accounting import epsilon as epsilon_lib
from tf_dpadambc.audit import canaries
from tf_dpadambc.audit import estimators

DEFAULT_VARIANTS = ("DPSGD", "DPAdamBC")
# Hyper-parameters do not change the release (the audited mechanism); these
# are merely valid ones.
_EXTRA = {"DPAdamPublicPreconditioner": None}


def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog="tf-dpadambc audit",
      description="Empirical privacy audit: ε lower bounds from canaries "
                  "next to the claimed ε.")
  parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                      help="optimizers to audit (default: "
                           f"{' '.join(DEFAULT_VARIANTS)})")
  parser.add_argument("--epsilon", type=float, default=4.0,
                      help="target ε the noise is calibrated for (default 4)")
  parser.add_argument("--delta", type=float, default=1e-5,
                      help="δ of the claimed (ε, δ) (default: %(default)g)")
  parser.add_argument("--sampling", choices=("shuffle", "poisson"),
                      default="shuffle",
                      help="batches the claim assumes: shuffled once per "
                           "epoch, or Poisson (default: %(default)s)")
  parser.add_argument("--noise", choices=("independent", "banded", "blt"),
                      default="independent",
                      help="independent Gaussian noise, or DP-MF correlated "
                           "noise (banded / BLT strategies, cyclic batches)")
  parser.add_argument("--clipping", choices=("auto", "ghost", "vectorized"),
                      default="auto",
                      help="make_private's clipping path (default: "
                           "%(default)s)")
  parser.add_argument("--canaries", type=int, default=2000,
                      help="white-box canaries m, each in with probability ½ "
                           "(default: %(default)s)")
  parser.add_argument("--background", type=int, default=2000,
                      help="ordinary (non-canary) training examples "
                           "(default: %(default)s)")
  parser.add_argument("--batch-size", type=int, default=400,
                      help="(expected) batch size (default: %(default)s)")
  parser.add_argument("--epochs", type=int, default=4,
                      help="passes over the data (default: %(default)s)")
  parser.add_argument("--accumulation", type=int, default=1,
                      help="gradient_accumulation_steps of the optimizers")
  parser.add_argument("--confidence", type=float, default=0.95,
                      help="confidence of the ε lower bounds (default: "
                           "%(default)g)")
  parser.add_argument("--noise-scale", type=float, default=1.0,
                      help="multiply the noise actually added (not the "
                           "claim): < 1 audits a broken mechanism")
  parser.add_argument("--black-box", action="store_true",
                      help="also run black-box mislabeled-input canaries "
                           "on scikit-learn's digits")
  parser.add_argument("--seed", type=int, default=0,
                      help="the audit's randomness (canary inclusion, "
                           "order); the noise seed stays secret")
  parser.add_argument("--out", default="dp-audit",
                      help="report folder (default: ./%(default)s)")
  return parser.parse_args(argv)


def make_optimizer_factory(name, noise_multiplier, args):
  """``(l2_norm_clip) -> optimizer`` for variant ``name``."""
  cls = getattr(tf_dpadambc, name, None)
  if cls is None or not isinstance(cls, type) or not issubclass(
      cls, tf_dpadambc.DPOptimizer):
    raise SystemExit(f"tf-dpadambc audit: error: unknown optimizer {name!r}")
  poisson = args.sampling == "poisson"

  def make(l2_norm_clip):
    kwargs = dict(l2_norm_clip=l2_norm_clip,
                  noise_multiplier=noise_multiplier * args.noise_scale,
                  learning_rate=0.1)
    if args.noise != "independent":
      kwargs["noise"] = correlated_noise(args)
    if args.accumulation > 1:
      kwargs["gradient_accumulation_steps"] = args.accumulation
    if poisson:
      kwargs["expected_batch_size"] = args.batch_size
    return cls(**kwargs)
  return make


def _sampling(args):
  return "cyclic" if args.noise != "independent" else args.sampling


def correlated_noise(args):
  """DP-MF noise for the audit run's cyclic batches."""
  n = args.canaries + args.background
  steps = n // (args.batch_size * args.accumulation) * args.epochs
  strategy = (mf.optimize_banded(steps, bands=4) if args.noise == "banded"
              else mf.optimize_blt(steps, buffers=2))
  return tf_dpadambc.CorrelatedNoise.for_cyclic_training(
      strategy, n, args.batch_size * args.accumulation, args.epochs)


def calibrate(args):
  n = args.canaries + args.background
  if args.noise != "independent":
    return epsilon_lib.compute_mf_noise_multiplier(args.epsilon, args.delta)
  return epsilon_lib.compute_noise_multiplier(
      num_examples=n, batch_size=args.batch_size * args.accumulation,
      epochs=args.epochs, target_epsilon=args.epsilon, delta=args.delta,
      sampling=args.sampling)


# Valid for any mechanism: these alone can refute a claim. The GDP bound
# assumes a Gaussian trade-off curve (true of the Gaussian mechanism the
# white-box canaries see, not of an arbitrary broken one).
GENERAL = ("Clopper-Pearson", "one-run")


def estimate(scores, confidence):
  """The estimators' ε lower bounds for one run's scores."""
  return {
      "GDP": estimators.epsilon_gdp(scores.in_scores, scores.out_scores,
                                    scores.delta, confidence).epsilon,
      "Clopper-Pearson": estimators.epsilon_clopper_pearson(
          scores.in_scores, scores.out_scores, scores.delta,
          confidence).epsilon,
      "one-run": estimators.epsilon_one_run(scores.scores, scores.is_in,
                                            scores.delta,
                                            confidence).epsilon,
  }


def verdict(scores, bounds):
  """"REFUTED" where a general bound exceeds the claim, "refuted if
  Gaussian" where only the GDP bound does, else "consistent"."""
  if any(bounds[m] > scores.claimed_epsilon for m in GENERAL):
    return "REFUTED"
  if bounds["GDP"] > scores.claimed_epsilon:
    return "REFUTED (GDP)"
  return "consistent"


def write_histogram(path, scores, title):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
  figure, axis = pyplot.subplots(figsize=(6, 3.5))
  bins = np.histogram_bin_edges(scores.scores, 50)
  axis.hist(scores.out_scores, bins, alpha=0.6, label="out (not trained on)")
  axis.hist(scores.in_scores, bins, alpha=0.6, label="in (trained on)")
  axis.set_xlabel("canary score")
  axis.set_ylabel("canaries")
  axis.set_title(title, fontsize=9)
  axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  pyplot.close(figure)


def run(args):
  sigma = calibrate(args)
  os.makedirs(args.out, exist_ok=True)
  rows = []
  progbar = keras.utils.Progbar(len(args.variants) * args.epochs,
                                unit_name="epoch")
  done = [0]

  def tick(_):
    done[0] += 1
    progbar.update(done[0])
  for name in args.variants:
    start = time.time()
    scores = canaries.white_box_scores(
        make_optimizer_factory(name, sigma, args),
        num_canaries=args.canaries, num_background=args.background,
        batch_size=args.batch_size, epochs=args.epochs,
        delta=args.delta, sampling=_sampling(args), clipping=args.clipping,
        seed=args.seed, progress=tick)
    if args.noise_scale != 1.0:  # the claim is the calibrated σ's
      scores = dataclasses.replace(scores, claimed_epsilon=args.epsilon)
    bounds = estimate(scores, args.confidence)
    rows.append((name, "white-box gradient", scores, bounds,
                 time.time() - start))
    write_histogram(os.path.join(args.out, f"scores_{name}.png"), scores,
                    scores.description)
  if args.black_box:
    rows.append(_black_box(args, sigma))
  table = markdown_table(rows, args)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(f"# tf-dpadambc audit\n\n{_settings(args, sigma)}\n\n{table}\n\n"
            f"{_READING}\n")
  print("\n" + table)
  refuted = [r[0] for r in rows if verdict(r[2], r[3]) != "consistent"]
  if refuted:
    print(f"\nREFUTED: an ε lower bound exceeds the claimed ε for "
          f"{', '.join(refuted)}: the mechanism does not deliver its claim.")
  print(f"\nReport written to {os.path.abspath(args.out)}/")
  return rows


def _black_box(args, sigma):
  from sklearn import datasets  # pylint: disable=import-outside-toplevel
  x, y = datasets.load_digits(return_X_y=True)
  x = (x / 16.0).astype("float32")
  start = time.time()

  def build():
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10)])
  black_args = argparse.Namespace(**{**vars(args), "sampling": "shuffle",
                                     "batch_size": 100})
  scores = canaries.black_box_scores(
      make_optimizer_factory(args.variants[0], sigma, black_args), x, y,
      num_canaries=200, num_classes=10, build_model=build, batch_size=100,
      epochs=args.epochs * 5, delta=args.delta, seed=args.seed)
  if args.noise_scale != 1.0:  # the claim is the calibrated σ's
    scores = dataclasses.replace(scores, claimed_epsilon=float(
        epsilon_lib.compute_epsilon(len(x) - 100, 100, args.epochs * 5, sigma,
                                    args.delta, sampling="shuffle")))
  write_histogram(os.path.join(args.out, "scores_black_box.png"), scores,
                  scores.description)
  return (args.variants[0], "black-box mislabeled", scores,
          estimate(scores, args.confidence), time.time() - start)


def markdown_table(rows, args):
  lines = ["| optimizer | canaries | claimed ε | ε_lower GDP | ε_lower "
           "Clopper-Pearson | ε_lower one-run | confidence | in / out | steps "
           "| verdict |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for name, kind, scores, bounds, _ in rows:
    lines.append(
        f"| {name} | {kind} | {scores.claimed_epsilon:.2f} | "
        f"{bounds['GDP']:.2f} | {bounds['Clopper-Pearson']:.2f} | "
        f"{bounds['one-run']:.2f} | {args.confidence:.0%} | "
        f"{len(scores.in_scores)} / {len(scores.out_scores)} | "
        f"{scores.steps} | {verdict(scores, bounds)} |")
  return "\n".join(lines)


def _settings(args, sigma):
  return (f"Target ε = {args.epsilon:g}, δ = {args.delta:g}, {_sampling(args)} "
          f"batches of {args.batch_size}, {args.epochs} epochs, "
          f"σ = {sigma:.4g} (noise actually added: σ × {args.noise_scale:g}), "
          f"clipping = {args.clipping}, accumulation = {args.accumulation}, "
          f"noise = {args.noise}, "
          f"{args.canaries} white-box canaries + {args.background} other "
          "examples.")


_READING = (
    "An ε lower bound above the claimed ε refutes the claim: the mechanism "
    "leaks more than its accounting says. A bound below the claim proves "
    "nothing about privacy; its closeness to the claim shows the audit's "
    "power. Clopper-Pearson and GDP treat the canaries as independent trials "
    "(valid here: orthogonal canary directions and isotropic Gaussian noise "
    "make their scores independent); GDP also assumes a Gaussian trade-off "
    "curve (that of the Gaussian mechanism audited: \"REFUTED (GDP)\" holds "
    "under that assumption only). The one-run estimator (Steinke, Nasr & "
    "Jagielski 2023) is valid for any mechanism, from one training run.")


def main(argv=None):
  """``tf-dpadambc audit``; ``argv`` without the subcommand."""
  args = parse_args(sys.argv[1:] if argv is None else argv)
  ex.require("matplotlib", "tf-dpadambc audit (its histograms)")
  if args.black_box:
    ex.require("sklearn", "tf-dpadambc audit --black-box (scikit-learn's "
               "digits)")
  run(args)
  return 0
