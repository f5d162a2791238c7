"""``tf-dpadambc compare``: DP optimizers side by side at the same (ε, δ).

    tf-dpadambc compare                          # MNIST-1D, ε = 8, 3 variants
    tf-dpadambc compare --quick                  # smoke run (< 1 minute)
    tf-dpadambc compare --variants DPAdamBC DPAdamSTP DPRMSPropBC \\
        --dataset digits --epsilon 4 --out report/
    tf-dpadambc compare --dataset my_data.npz    # x_train, y_train, x_test, y_test
    python -m tf_dpadambc compare --help

Calibrates σ once for the target ε, then trains the main job's model
(:func:`tf_dpadambc.experiments.build_model`, a small Conv1D network), from the same initial weights and on
the same batches, with every variant asked for. All private variants share
C, σ, the (expected) batch size and the number of steps, hence the same
guarantee; each one's ε is nevertheless recomputed from its own ``dp_event``,
for the sampling its run used. Test
accuracy and loss, ε and the optimizer's diagnostics are recorded every
``--eval-every`` steps. Written to ``--out`` (default
``./dp-compare-<dataset>``):

* ``results.md`` and ``results.csv``: one row per variant (test accuracy and
  loss, ε, δ, σ, steps, wall time);
* ``history.csv``: every evaluation step of every variant;
* ``accuracy_loss_vs_steps.png``, ``accuracy_loss_vs_epsilon.png`` and
  ``diagnostics.png`` (v̂/Φ, clamped and negative-v̂ fractions, for the
  variants that report them).

Sampling, as in the main job (:mod:`tf_dpadambc.main`): by default
(``--sampling poisson``) the private variants train on Poisson-sampled
batches (:func:`tf_dpadambc.data.poisson_batches`, drawn from one secret
seed unless ``--sampling-seed``) with ``expected_batch_size=B``, so the
amplified ε they report holds; MNIST-1D uses the main job's settings (B =
250, σ = 1.26 at ε = 8). The IME variants cannot take Poisson batches (their
ḡ² sensitivity needs at most B examples per batch): ``all`` leaves them out,
naming them is an error. ``--sampling shuffle`` trains on ``model.fit``'s
shuffled fixed-size batches with the once-per-epoch ε, which does not depend
on the batch size: MNIST-1D then defaults to batches of 1,000 (σ = 4.0 at ε =
8; less noise per step than at 250).

Non-private baselines (``Adam``, ``SGD``, ``NoiselessPreconditionerAdam``)
are trained only when asked for by name, and are marked NOT PRIVATE. Keras'
``Adam`` and ``SGD`` train on shuffled batches of B with either sampling
(they have no ε to earn, and Keras' mean loss would count the padding).

Runtime on 2 CPU cores: about 3 minutes for the default (three variants,
640 steps each on Poisson batches padded to 354 rows; 196 s measured on a
machine shared with another job); ``--quick`` under a minute.
"""
import argparse
import csv
import math
import os
import sys
import time
import warnings

import keras
import numpy as np
from scipy import special

import tf_dpadambc
from tf_dpadambc import datasets
from tf_dpadambc import experiments as ex
from tf_dpadambc.accounting import epsilon as epsilon_lib
from tf_dpadambc.keras.optimizers import __all__ as _OPTIMIZER_CLASSES

# Variants compare cannot set up on its own, and why.
UNSUPPORTED = {
    "DPOptimizer": "the abstract base class of the others",
    "DPAdamPublicPreconditioner": "needs public data or a preconditioner "
                                  "from side information",
}
# Not private: trained only when named. Keras' own optimizers run without
# per-example clipping; NoiselessPreconditionerAdam keeps a noiseless v.
NON_PRIVATE = ("Adam", "SGD", "NoiselessPreconditionerAdam")
PRIVATE = tuple(sorted(set(_OPTIMIZER_CLASSES) - set(UNSUPPORTED)
                       - set(NON_PRIVATE)))
VARIANTS = PRIVATE + NON_PRIVATE
DEFAULT_VARIANTS = tuple(ex.TUNED)  # DPAdamBC, DPAdam, DPSGD

# experiments.TUNED's sweep found DPAdamBC's γ' had to scale with the noise
# variance Φ = (σC/B)²: its tuned γ' = 1e-5 is Φ/2.5 there (σ = 1.26, B =
# 250). Scaling it keeps that ratio at other σ, B and C.
GAMMA_PRIME_OVER_PHI = 0.4
# Untuned variants borrow the learning rate of the tuned optimizer whose
# step has the same scale: normalized by √v̂ (Adam, RMSProp) or bias-
# corrected. AdaGrad's v̂ accumulates, so its steps shrink with t: larger η.
_LEARNING_RATE_OF = {
    "DPAdamBC": "DPAdamBC", "DPRMSPropBC": "DPAdamBC",
    "DPAdamIME": "DPAdam", "DPAdamJME": "DPAdam", "DPAdamSTP": "DPAdam",
    "DPRMSProp": "DPAdam", "DPRMSPropIME": "DPAdam", "DPRMSPropSTP": "DPAdam",
    "NoiselessPreconditionerAdam": "DPAdam",
}
_UNTUNED = {
    "DPAdagrad": {"learning_rate": 0.1},
    "DPAdagradBC": {"learning_rate": 0.1},
    "DPAdagradIME": {"learning_rate": 0.1},
    "DPAdagradSTP": {"learning_rate": 0.1},
    "Adam": {"learning_rate": 1e-3},  # Keras' default
    "SGD": {"learning_rate": 0.1, "momentum": 0.9},
}  # DP2RMSProp, DP2Adagrad: their class defaults.

DIAGNOSTICS = ex.MOMENT_DIAGNOSTICS  # names and meanings: ex.DIAGNOSTICS
# Batch sizes: main.default_config. With Poisson sampling MNIST-1D keeps the
# main job's B = 250 (σ = 1.26, 640 steps): DPAdamBC/DPAdam/DPSGD reached
# .64/.67/.64 in one run, against .57/.62/.44 at B = 1000 (σ = 2.21, 160
# steps; 127 s instead of 196 s).
# For a user's .npz: MNIST-1D's, with at least 4 batches per epoch.
NPZ_DATASET = "mnist1d"
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


class DatasetError(ValueError):
  """A data set that compare cannot train on."""


def default_hparams(name, noise_variance):
  """(hyper-parameters, tuned?) of variant ``name`` at noise variance Φ."""
  tuned = name in ex.TUNED
  if tuned:
    hparams = dict(ex.TUNED[name])
  elif name in _LEARNING_RATE_OF:
    kin = ex.TUNED[_LEARNING_RATE_OF[name]]
    hparams = {"learning_rate": kin["learning_rate"]}
  else:
    hparams = dict(_UNTUNED.get(name, {}))
  if name.endswith("BC"):
    hparams["gamma_prime"] = GAMMA_PRIME_OVER_PHI * noise_variance
  if name.endswith(("IME", "JME")):
    # v̂ can reach 0 there, and the step m̂/ε blows up (Ganesh et al. §4.4):
    # a floor of √Φ caps it at DPAdam's m̂/√v̂ with v̂ ≥ Φ.
    hparams["denominator_floor"] = math.sqrt(noise_variance)
  return hparams, tuned


def sampling_refusal(name, sampling):
  """Why variant ``name`` cannot train with ``sampling``, or None.

  Asks the class itself: its constructor refuses ``expected_batch_size``
  where Poisson batches would break its guarantee (the IME variants).
  """
  if sampling != "poisson" or name in ("Adam", "SGD"):
    return None
  hparams, _ = default_hparams(name, 1.0)
  with warnings.catch_warnings():  # NoiselessPreconditionerAdam's warning
    warnings.simplefilter("ignore")
    try:
      ex.make_optimizer(name, 1.0, 1.0, expected_batch_size=1,
                              hparams=hparams)
    except ValueError as e:
      return str(e)
  return None


def load_npz(path):
  """A :class:`datasets.Dataset` from a .npz with x_train, y_train, x_test,
  y_test; ``x`` is flattened to one vector per example."""
  try:
    with np.load(path, allow_pickle=False) as f:
      arrays = {k: f[k] for k in f.files}
  except (OSError, ValueError) as e:
    raise DatasetError(f"{path}: cannot read it as a .npz file ({e}).") from e
  missing = [k for k in NPZ_KEYS if k not in arrays]
  if missing:
    raise DatasetError(
        f"{path}: missing {', '.join(missing)} (a .npz needs "
        f"{', '.join(NPZ_KEYS)}; found {', '.join(sorted(arrays)) or 'none'}).")
  for part in ("train", "test"):
    x, y = arrays[f"x_{part}"], arrays[f"y_{part}"]
    if x.dtype.kind not in "biuf" or x.ndim < 2 or len(x) == 0:
      raise DatasetError(
          f"{path}: x_{part} must be a non-empty numeric array [N, features"
          f"...]; got dtype {x.dtype}, shape {x.shape}.")
    if y.ndim != 1 or len(y) != len(x):
      raise DatasetError(
          f"{path}: y_{part} must be a 1-D array of {len(x)} class labels "
          f"(one per row of x_{part}); got shape {y.shape}.")
    integral = (y.dtype.kind in "iu" or (
        y.dtype.kind == "f" and np.all(np.isfinite(y)) and
        np.all(y == np.round(y))))
    if not integral or (len(y) and y.min() < 0):
      raise DatasetError(f"{path}: y_{part} must hold non-negative integer "
                         f"class labels; got dtype {y.dtype}.")
    if not np.all(np.isfinite(x)):
      raise DatasetError(f"{path}: x_{part} has non-finite values.")
  if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
    raise DatasetError(
        f"{path}: x_train and x_test examples differ in shape: "
        f"{arrays['x_train'].shape[1:]} vs {arrays['x_test'].shape[1:]}.")
  flat = {k: (v.reshape(len(v), -1) if k.startswith("x") else v)
          for k, v in arrays.items()}
  name = os.path.splitext(os.path.basename(path))[0]
  return datasets.Dataset(
      flat["x_train"].astype(np.float32), flat["y_train"].astype(np.int32),
      flat["x_test"].astype(np.float32), flat["y_test"].astype(np.int32),
      name)


def load_dataset(spec, seed):
  """``mnist1d``, ``digits`` or a path to a .npz file."""
  if spec in datasets.LOADERS:
    try:
      return datasets.LOADERS[spec](seed=seed)
    except ImportError as e:  # an optional dependency: one line, no trace
      raise ex.MissingDependency(f"tf-dpadambc compare: error: {e}") from None
  if spec.endswith(".npz") or os.path.exists(spec):
    if not os.path.exists(spec):
      raise DatasetError(f"{spec}: no such file.")
    return load_npz(spec)
  raise DatasetError(f"unknown data set {spec!r}: use "
                     f"{' or '.join(sorted(datasets.LOADERS))}, or a path to "
                     "a .npz file with " + ", ".join(NPZ_KEYS) + ".")


def _variant(name):
  """argparse type: a variant name, case as in the class."""
  if name in VARIANTS or name == "all":
    return name
  if name in UNSUPPORTED:
    raise argparse.ArgumentTypeError(
        f"{name} is not supported by compare: {UNSUPPORTED[name]}.")
  raise argparse.ArgumentTypeError(
      f"unknown variant {name!r}; valid: {', '.join(PRIVATE)}; non-private "
      f"baselines (only when named): {', '.join(NON_PRIVATE)}; or 'all' "
      "(every private variant).")


def build_parser():
  parser = argparse.ArgumentParser(
      prog="tf-dpadambc compare",
      description="Train DP optimizers at the same (ε, δ) (same C, σ, batch "
                  "size and steps) and write a report: results.md, "
                  "results.csv, history.csv and PNG plots.",
      epilog="Private variants: " + ", ".join(PRIVATE) + ". Non-private "
             "baselines, trained only when named: " + ", ".join(NON_PRIVATE)
             + ".")
  parser.add_argument(
      "--variants", nargs="+", type=_variant, default=list(DEFAULT_VARIANTS),
      metavar="NAME",
      help=f"optimizers to compare (default: {' '.join(DEFAULT_VARIANTS)}; "
           "'all': every private variant)")
  parser.add_argument(
      "--dataset", default="mnist1d",
      help="mnist1d (default; generated locally), digits, or a .npz file "
           "with x_train, y_train, x_test, y_test (integer labels)")
  parser.add_argument("--out", default=None,
                      help="report folder (default: ./dp-compare-<dataset>)")
  parser.add_argument("--eval-every", type=int, default=None,
                      help="steps between evaluations (default: about 40 "
                           "evaluations per run)")
  ex.add_training_arguments(parser)
  return parser


def parse_args(argv):
  parser = build_parser()
  args = parser.parse_args(argv)
  ex.check_training_arguments(parser, args)
  for name in args.variants:
    why = name != "all" and sampling_refusal(name, args.sampling)
    if why:
      parser.error(f"{name} cannot train with --sampling {args.sampling}: "
                   f"{why} Use --sampling shuffle.")
  # Variants 'all' leaves out because they cannot take the sampling.
  args.left_out = {}
  if "all" in args.variants:
    every = []
    for name in PRIVATE:
      why = sampling_refusal(name, args.sampling)
      if why:
        args.left_out[name] = why
      else:
        every.append(name)
    args.variants = [v for v in args.variants if v != "all"] + every
  args.variants = list(dict.fromkeys(args.variants))  # drops repeats
  if args.jit_compile is None:
    args.jit_compile = not args.quick
  if args.eval_every is not None and args.eval_every < 1:
    parser.error("--eval-every must be ≥ 1.")
  return args


def _require_matplotlib():
  ex.require("matplotlib", "tf-dpadambc compare (its plots)")


def evaluate(model, x, y, batch_size=2048):
  """(accuracy, mean cross-entropy) of the model's logits on (x, y)."""
  logits = np.concatenate([
      keras.ops.convert_to_numpy(model(x[i:i + batch_size], training=False))
      for i in range(0, len(x), batch_size)]).astype(np.float64)
  log_p = special.log_softmax(logits, axis=1)
  loss = -np.mean(log_p[np.arange(len(y)), y])
  return float(np.mean(np.argmax(logits, axis=1) == y)), float(loss)


class _Monitor(keras.callbacks.Callback):
  """Progress bar; every `eval_every` steps, test metrics, ε, diagnostics."""

  def __init__(self, data, eval_every, steps_per_epoch, total_steps,
               epsilon_at, verbose):
    super().__init__()
    self.steps_per_epoch = steps_per_epoch
    self.data = data
    self.eval_every = eval_every
    self.total_steps = total_steps
    self.epsilon_at = epsilon_at
    self.history = []
    self.eval_seconds = 0.0  # kept out of the wall time
    self.step = 0
    self.progbar = keras.utils.Progbar(
        total_steps, verbose=verbose, unit_name="step",
        stateful_metrics=["loss", "test_acc", "epsilon"])

  def on_train_batch_end(self, batch, logs=None):
    self.step += 1
    values = [("loss", float(logs["loss"]))] if logs and "loss" in logs else []
    if self.step % self.eval_every == 0 or self.step == self.total_steps:
      start = time.perf_counter()
      row = self._record(values[0][1] if values else math.nan)
      self.eval_seconds += time.perf_counter() - start
      values += [("test_acc", row["test_accuracy"])]
      if math.isfinite(row["epsilon"]):
        values += [("epsilon", row["epsilon"])]
    self.progbar.update(self.step, values)

  def _record(self, train_loss):
    accuracy, loss = evaluate(self.model, self.data.x_test, self.data.y_test)
    optimizer = self.model.optimizer
    diagnostics = (optimizer.diagnostics()
                   if hasattr(optimizer, "diagnostics") else {})
    row = {"step": self.step,
           "epoch": self.step / self.steps_per_epoch,
           "test_accuracy": accuracy, "test_loss": loss,
           "train_loss": train_loss, "epsilon": self.epsilon_at(self.step)}
    row.update({k: float(keras.ops.convert_to_numpy(v))
                for k, v in diagnostics.items() if k in DIAGNOSTICS})
    self.history.append(row)
    return row


class Run:
  """One trained variant: its settings, final metrics and history."""

  def __init__(self, name, private, tuned, hparams, noise_multiplier):
    self.name = name
    self.private = private
    self.tuned = tuned
    self.hparams = hparams
    self.noise_multiplier = noise_multiplier
    self.history = []
    self.epsilon = math.inf
    self.seconds = math.nan
    self.optimizer = None

  @property
  def test_accuracy(self):
    return self.history[-1]["test_accuracy"]

  @property
  def test_loss(self):
    return self.history[-1]["test_loss"]

  @property
  def label(self):
    return self.name if self.private else f"{self.name} (NOT PRIVATE)"


def _make_optimizer(name, hparams, config, sigma, noise_seed,
                    expected_batch_size):
  """(optimizer, sampling its batches need): Keras' own optimizers train on
  shuffled batches, tf_dpadambc's on the run's sampling."""
  if name in ("Adam", "SGD"):
    return getattr(keras.optimizers, name)(**hparams), "shuffle"
  optimizer, _ = ex.make_optimizer(
      name, config.l2_norm_clip, sigma, noise_seed,
      expected_batch_size=expected_batch_size, hparams=hparams)
  return optimizer, "poisson" if expected_batch_size else "shuffle"


def train_variant(name, data, config, sigma, args, eval_every,
                  seed_of_sampling=None):
  """Trains a fresh model with variant `name`; returns a :class:`Run`.

  ``seed_of_sampling``: the seed of the Poisson batches
  (:func:`tf_dpadambc.main.sampling_seed`), the same for every variant.
  """
  phi = (sigma * config.l2_norm_clip / config.batch_size) ** 2
  hparams, tuned = default_hparams(name, phi)
  keras.utils.set_random_seed(args.seed)  # same weights (and batch order)
  num_classes = int(max(data.y_train.max(), data.y_test.max())) + 1
  model = ex.build_model(data.x_train.shape[1], num_classes)
  optimizer, sampling = _make_optimizer(
      name, hparams, config, sigma, args.noise_seed,
      config.batch_size if args.sampling == "poisson" else None)
  ours = isinstance(optimizer, tf_dpadambc.DPOptimizer)
  private = ours and optimizer.is_private
  if ours:  # DP optimizers need the private train step
    model = tf_dpadambc.make_private(model)
  run = Run(name, private, tuned, hparams, sigma if ours else None)
  num_examples = len(data.y_train)

  def epsilon_at(step=None):  # default: the steps taken
    if not private:
      return math.inf
    return ex.run_epsilon(optimizer, num_examples, args.delta, step)

  model.compile(
      optimizer=optimizer,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], jit_compile=args.jit_compile)
  per_epoch = ex.steps_per_epoch(num_examples, config.batch_size)
  total = config.epochs * per_epoch
  monitor = _Monitor(data, eval_every, per_epoch, total, epsilon_at,
                     verbose=1 if args.verbose else 0)
  start = time.perf_counter()
  model.fit(**ex.fit_inputs(data, config, sampling, seed_of_sampling),
            epochs=config.epochs, verbose=0, callbacks=[monitor])
  run.seconds = time.perf_counter() - start - monitor.eval_seconds
  run.history = monitor.history
  run.epsilon = epsilon_at()
  run.optimizer = optimizer
  return run


# ------------------------------------------------------------------ report
_COLUMNS = ("variant", "private", "hyper-parameters", "test accuracy",
            "test loss", "epsilon", "delta", "sigma", "steps", "wall time (s)")


def _format_hparams(run):
  text = ex.format_hparams(run.hparams)
  return f"{text or 'class defaults'} ({'tuned' if run.tuned else 'untuned'})"


def _row(run, delta, steps):
  return {
      "variant": run.name,
      "private": "yes" if run.private else "NO",
      "hyper-parameters": _format_hparams(run),
      "test accuracy": f"{run.test_accuracy:.4f}",
      "test loss": f"{run.test_loss:.4f}",
      "epsilon": f"{run.epsilon:.4f}" if run.private else "inf",
      "delta": f"{delta:g}",
      "sigma": ("" if run.noise_multiplier is None
                else f"{run.noise_multiplier:.4f}"),
      "steps": str(steps),
      "wall time (s)": f"{run.seconds:.1f}",
  }


def write_csv(path, runs, delta, steps):
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=_COLUMNS)
    writer.writeheader()
    for run in runs:
      writer.writerow(_row(run, delta, steps))


def write_history(path, runs):
  fields = ["variant", "step", "epoch", "test_accuracy", "test_loss",
            "train_loss", "epsilon", *DIAGNOSTICS]
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=fields, restval="")
    writer.writeheader()
    for run in runs:
      for row in run.history:
        writer.writerow({"variant": run.name, **row})


def markdown_table(runs, delta, steps):
  lines = ["| " + " | ".join(_COLUMNS) + " |",
           "|" + "|".join("---" if i < 3 else "---:"
                          for i in range(len(_COLUMNS))) + "|"]
  for run in runs:
    row = _row(run, delta, steps)
    row["variant"] = (f"**{run.name}**" if run.private
                      else f"{run.name} (**NOT PRIVATE**)")
    if not run.private:
      row["epsilon"] = "∞"
    row["sigma"] = row["sigma"] or "—"
    lines.append("| " + " | ".join(row[c] for c in _COLUMNS) + " |")
  return "\n".join(lines)


def _figure(ncols):
  # Agg canvas, no pyplot: no global backend state, works headless.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=import-outside-toplevel
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  figure = Figure(figsize=(5.5 * ncols, 4), layout="constrained")
  FigureCanvasAgg(figure)
  return figure, figure.subplots(1, ncols, squeeze=False)[0]


def _plot(axes, runs, x_key, y_keys, labels, x_label, log_y=()):
  for ax, key, label in zip(axes, y_keys, labels):
    for run in runs:
      xs = [r[x_key] for r in run.history if key in r]
      ys = [r[key] for r in run.history if key in r]
      if xs:
        ax.plot(xs, ys, marker="." if len(xs) < 60 else None,
                linestyle="-" if run.private else "--", label=run.label)
    ax.set_xlabel(x_label)
    ax.set_ylabel(label)
    values = [r[key] for run in runs for r in run.history if key in r]
    if key in log_y and values and min(values) > 0 and (
        max(values) > 10 * min(values)):  # else log ticks are unreadable
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def write_plots(out_dir, runs, title):
  """Writes the PNGs; returns {file name: caption}."""
  written = {}

  def save(figure, name, caption):
    figure.suptitle(title, fontsize="medium")
    figure.savefig(os.path.join(out_dir, name), dpi=110)
    written[name] = caption

  figure, axes = _figure(2)
  _plot(axes, runs, "step", ["test_accuracy", "test_loss"],
        ["test accuracy", "test loss"], "step")
  save(figure, "accuracy_loss_vs_steps.png", "Test accuracy and loss vs steps")
  private = [r for r in runs if r.private]
  if private:
    figure, axes = _figure(2)
    _plot(axes, private, "epsilon", ["test_accuracy", "test_loss"],
          ["test accuracy", "test loss"], "ε spent so far")
    save(figure, "accuracy_loss_vs_epsilon.png",
         "Test accuracy and loss vs ε spent (private variants)")
  keys = [k for k in DIAGNOSTICS if any(k in r.history[-1] for r in runs)]
  if keys:
    figure, axes = _figure(len(keys))
    _plot(axes, [r for r in runs if any(k in r.history[-1] for k in keys)],
          "step", keys, [ex.DIAGNOSTICS[k][0] for k in keys], "step",
          log_y=("dp_v_over_phi",))
    save(figure, "diagnostics.png",
         "Optimizer diagnostics at each evaluation step (last step's value)")
  return written


def write_report(out_dir, runs, data, config, sigma, args, steps, header):
  os.makedirs(out_dir, exist_ok=True)
  write_csv(os.path.join(out_dir, "results.csv"), runs, args.delta, steps)
  write_history(os.path.join(out_dir, "history.csv"), runs)
  plots = write_plots(out_dir, runs, f"{data.name}: {header}")
  table = markdown_table(runs, args.delta, steps)
  private = [r for r in runs if r.private]
  lines = [f"# DP optimizers at the same (ε, δ): {data.name}", "",
           _settings_text(data, config, sigma, args, steps), "", table, "",
           "Hyper-parameters: *tuned*: the main job's (`tf-dpadambc`), tuned "
           "on MNIST-1D at ε = 8 (Poisson), with γ' scaled to Φ = (σC/B)²; "
           "*untuned*: borrowed from the tuned optimizer of the same step "
           "scale, or the class defaults. Wall time: `fit` including XLA "
           "compilation, excluding the periodic evaluations. Test accuracy "
           "and loss after the last step.", ""]
  if len(runs) > len(private):
    lines += ["Rows marked NOT PRIVATE were trained without a privacy "
              "guarantee (ε = ∞), as baselines only.", ""]
  lines += ["## Plots", ""]
  lines += [f"![{caption}]({name})" for name, caption in plots.items()]
  if private:
    lines += ["", f"## Privacy statement ({private[0].name})", "",
              "Every private row has this guarantee.", "", "```",
              tf_dpadambc.optimizer_privacy_statement(
                  private[0].optimizer, len(data.y_train), args.delta),
              "```"]
  with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  return table


def _settings_text(data, config, sigma, args, steps):
  num_examples = len(data.y_train)
  eps = epsilon_lib.compute_epsilon(
      num_examples, config.batch_size, config.epochs, sigma, args.delta,
      sampling=args.sampling)
  sampling = ex.sampling_text(args.sampling, num_examples,
                                    config.batch_size)
  poisson = args.sampling == "poisson"
  batch = "expected batch" if poisson else "batch"
  baselines = ""
  if poisson and set(args.variants) & {"Adam", "SGD"}:
    baselines = (" (Keras' Adam and SGD, not private: shuffled batches of "
                 f"{config.batch_size})")
  return (
      f"{data.name}{' (--quick)' if args.quick else ''}: "
      f"{len(data.y_train):,} train / {len(data.y_test):,} test examples, "
      f"{data.x_train.shape[1]} features; the main job's Conv1D model, same "
      f"initial weights and batches for every variant{baselines}. Every "
      f"private variant: C = {config.l2_norm_clip:g}, σ = {sigma:.4f}, "
      f"{batch} {config.batch_size}, {config.epochs} epochs = {steps:,} "
      f"steps: ε = {eps:.4f} at δ = {args.delta:g} (target "
      f"{args.epsilon:g}; RDP accountant, {sampling}).")


def training_config(args, num_examples):
  """Epochs, batch size and C of the run: the defaults, then the flags."""
  npz = args.dataset not in datasets.LOADERS
  config = ex.training_config(args, ex.default_config(
      NPZ_DATASET if npz else args.dataset, args.sampling))
  if npz and args.batch_size is None:
    n = min(num_examples, config.train_examples or num_examples)
    config = config._replace(
        batch_size=max(1, min(config.batch_size, n // 4)))
  return config


def _eval_every(args, steps):
  return args.eval_every or max(1, math.ceil(steps / 40))


def run(args):
  """Trains every variant and writes the report; returns the runs."""
  data = load_dataset(args.dataset, args.seed)
  config = training_config(args, len(data.y_train))
  data = ex.check_training_data(data, config)
  num_examples = len(data.y_train)
  sigma, steps = ex.calibrate(num_examples, config, args)
  print(_settings_text(data, config, sigma, args, steps), flush=True)
  for name, why in args.left_out.items():
    print(f"Left out of 'all': {name} ({why})", flush=True)
  for name in args.variants:
    if name in NON_PRIVATE:
      print(f"WARNING: {name} is NOT PRIVATE: trained as a baseline only, "
            "because it was asked for by name.", flush=True)
  seed_of_sampling = (ex.sampling_seed(args)
                      if args.sampling == "poisson" else None)
  runs = []
  for name in args.variants:
    print(f"\n== {name} ==", flush=True)
    runs.append(train_variant(name, data, config, sigma, args,
                              _eval_every(args, steps), seed_of_sampling))
  out_dir = args.out or f"dp-compare-{data.name}"
  header = (f"C = {config.l2_norm_clip:g}, σ = {sigma:.3f}, B = "
            f"{config.batch_size}, δ = {args.delta:g}")
  table = write_report(out_dir, runs, data, config, sigma, args, steps,
                       header)
  print("\n" + table)
  print(f"\nReport written to {os.path.abspath(out_dir)}/ (results.md, "
        "results.csv, history.csv, PNG plots).")
  return runs


def main(argv=None):
  """``tf-dpadambc compare``; ``argv`` without the subcommand."""
  start = time.time()
  args = parse_args(sys.argv[1:] if argv is None else argv)
  _require_matplotlib()  # before training, not after
  try:
    run(args)
  except DatasetError as e:
    raise SystemExit(f"tf-dpadambc compare: error: {e}") from e
  print(f"\nTotal wall-clock time: {time.time() - start:.0f} s.")
  return 0
