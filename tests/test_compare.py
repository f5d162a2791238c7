"""``tf-dpadambc compare``: arguments, data sets, and the report of a tiny run."""
import csv
import math
import os
import sys

import numpy as np
import pytest

import tf_dpadambc
from tf_dpadambc import compare
from tf_dpadambc import cli
from tf_dpadambc import experiments as ex
from tf_dpadambc.keras.optimizers import __all__ as optimizer_classes

_PNGS = ("accuracy_loss_vs_steps.png", "accuracy_loss_vs_epsilon.png",
         "diagnostics.png")


def _write_npz(path, **overrides):
  rng = np.random.default_rng(0)
  arrays = {}
  for part, n in (("train", 240), ("test", 120)):
    y = rng.integers(0, 3, n)
    # Separable classes: a per-class mean plus noise.
    x = (np.eye(3, 16)[y] * 3 + rng.normal(size=(n, 16))).astype("float32")
    arrays[f"x_{part}"], arrays[f"y_{part}"] = x, y
  arrays.update(overrides)
  np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
  return str(path)


# ------------------------------------------------------------- arguments
def test_defaults_are_private_and_main_jobs_three():
  args = compare.parse_args([])
  assert args.variants == ["DPAdamBC", "DPAdam", "DPSGD"]
  assert set(args.variants) <= set(compare.PRIVATE)
  assert args.dataset == "mnist1d" and args.sampling == "poisson"
  assert args.sampling_seed is None and args.left_out == {}
  assert args.jit_compile and not compare.parse_args(["--quick"]).jit_compile


def test_every_exported_optimizer_is_a_variant_or_says_why_not():
  assert set(optimizer_classes) <= (set(compare.PRIVATE)
                                    | set(compare.NON_PRIVATE)
                                    | set(compare.UNSUPPORTED))
  assert not set(compare.PRIVATE) & set(compare.NON_PRIVATE)
  assert "NoiselessPreconditionerAdam" in compare.NON_PRIVATE


def test_all_means_every_private_variant_and_no_baseline():
  args = compare.parse_args(["--variants", "DPSGD", "all", "Adam"])
  assert args.variants[0] == "DPSGD" and "Adam" in args.variants
  assert len(args.variants) == len(set(args.variants))  # no repeats
  # (Under the default Poisson sampling, less the variants that refuse it.)
  assert set(args.variants) == (set(compare.PRIVATE) - set(args.left_out)
                                | {"Adam"})
  for sampling in ex.SAMPLINGS:
    assert not set(compare.parse_args(
        ["--variants", "all", "--sampling", sampling]).variants) & set(
            compare.NON_PRIVATE)


def test_unknown_variant_lists_the_valid_ones(capsys):
  with pytest.raises(SystemExit) as e:
    compare.parse_args(["--variants", "DPAdamBC", "DPAdamXYZ"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "unknown variant 'DPAdamXYZ'" in err
  for name in ("DPAdamBC", "DPRMSPropIME", "DP2Adagrad", "Adam"):
    assert name in err


def test_poisson_leaves_out_the_variants_that_refuse_it(capsys):
  ime = {"DPAdamIME", "DPRMSPropIME", "DPAdagradIME"}
  args = compare.parse_args(["--variants", "all"])
  assert set(args.left_out) == ime and not ime & set(args.variants)
  assert set(args.variants) == set(compare.PRIVATE) - ime
  assert "sensitivity" in args.left_out["DPAdamIME"]  # the class's reason
  shuffle = compare.parse_args(["--variants", "all", "--sampling",
                                "shuffle"])
  assert set(shuffle.variants) == set(compare.PRIVATE)
  assert shuffle.left_out == {}
  with pytest.raises(SystemExit) as e:
    compare.parse_args(["--variants", "DPAdamIME"])
  assert e.value.code == 2
  err = " ".join(capsys.readouterr().err.split())
  assert "DPAdamIME cannot train with --sampling poisson" in err
  assert "Use --sampling shuffle" in err
  assert compare.parse_args(["--variants", "DPAdamIME", "--sampling",
                             "shuffle"]).variants == ["DPAdamIME"]


def test_unsupported_variant_says_why(capsys):
  with pytest.raises(SystemExit):
    compare.parse_args(["--variants", "DPAdamPublicPreconditioner"])
  assert "public data" in capsys.readouterr().err


def test_subcommand_dispatch_and_help_lists_variants(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["compare", "--help"])
  assert e.value.code == 0
  out = " ".join(capsys.readouterr().out.split())
  assert "tf-dpadambc compare" in out
  for name in compare.VARIANTS:
    assert name in out


@pytest.mark.filterwarnings("ignore:NoiselessPreconditionerAdam is NOT")
def test_default_hparams_reuse_the_tuned_ones():
  # At the main job's tuning point γ' = Φ/2.5 is its tuned 1e-5.
  phi = (1.2614 * 1.0 / 250) ** 2
  hparams, tuned = compare.default_hparams("DPAdamBC", phi)
  assert tuned and hparams["learning_rate"] == ex.TUNED["DPAdamBC"][
      "learning_rate"]
  assert hparams["gamma_prime"] == pytest.approx(
      ex.TUNED["DPAdamBC"]["gamma_prime"], rel=0.05)
  assert compare.default_hparams("DPSGD", phi) == (ex.TUNED["DPSGD"],
                                                   True)
  hparams, tuned = compare.default_hparams("DPAdamIME", phi)
  assert not tuned and hparams["denominator_floor"] == pytest.approx(
      math.sqrt(phi))
  for name in compare.VARIANTS:  # every default is accepted by its class
    hparams, _ = compare.default_hparams(name, phi)
    if name in ("Adam", "SGD"):
      continue
    getattr(tf_dpadambc, name)(l2_norm_clip=1.0, noise_multiplier=1.0,
                               **hparams)


def test_training_config_defaults_and_overrides():
  def config(*argv, n=4000):
    return compare.training_config(compare.parse_args(list(argv)), n)
  # Poisson (the default): the main job's settings.
  assert config() == ex.DEFAULTS["mnist1d"]
  assert config().batch_size == 250 and config().epochs == 40
  # Once-per-epoch ε does not depend on B: larger batches.
  assert config("--sampling", "shuffle").batch_size == 1000
  assert config("--dataset", "digits") == ex.DEFAULTS["digits"]
  assert config("--batch-size", "64", "--epochs", "3").batch_size == 64
  assert config("--quick") == ex.QUICK
  assert config("--dataset", "x.npz", n=200).batch_size == 50


# ------------------------------------------------------------- data sets
@pytest.mark.parametrize("overrides, message", [
    ({"y_test": None, "x_test": None}, r"missing x_test, y_test"),
    ({"y_train": np.linspace(0, 1, 240)}, r"y_train must hold non-negative "
                                          r"integer class labels"),
    ({"y_train": np.eye(3)[np.zeros(240, int)]}, r"y_train must be a 1-D"),
    ({"y_test": np.zeros(7, int)}, r"y_test must be a 1-D array of 120"),
    ({"x_test": np.zeros((120, 5), "float32")}, r"differ in shape"),
    ({"x_train": np.array(["a"] * 240)}, r"x_train must be a non-empty "
                                         r"numeric array"),
])
def test_bad_npz_is_refused_with_a_clear_error(tmp_path, overrides, message):
  path = _write_npz(tmp_path / "bad.npz", **overrides)
  with pytest.raises(compare.DatasetError, match=message):
    compare.load_dataset(path, seed=0)


def test_npz_flattens_and_accepts_integral_float_labels(tmp_path):
  path = _write_npz(tmp_path / "images.npz",
                    x_train=np.zeros((240, 4, 4), "uint8"),
                    x_test=np.zeros((120, 4, 4), "uint8"),
                    y_test=np.ones(120, "float64"))
  data = compare.load_dataset(path, seed=0)
  assert data.x_train.shape == (240, 16) and data.name == "images"
  assert data.y_test.dtype == np.int32 and set(data.y_test) == {1}


def test_cli_errors_name_the_problem(tmp_path):
  with pytest.raises(SystemExit, match="unknown data set 'cifar'"):
    compare.main(["--dataset", "cifar"])
  with pytest.raises(SystemExit, match="no such file"):
    compare.main(["--dataset", str(tmp_path / "nope.npz")])
  path = _write_npz(tmp_path / "bad.npz", y_train=None)
  with pytest.raises(SystemExit, match="missing y_train"):
    cli.main(["compare", "--dataset", path])


def test_missing_matplotlib_names_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
  with pytest.raises(SystemExit, match=r"tf-dpadambc\[examples\]"):
    compare.main(["--dataset", "digits"])


# ------------------------------------------------------------- a tiny run
_TINY = ["--variants", "DPAdamBC", "DPSGD", "Adam", "--epochs", "1",
         "--batch-size", "60", "--epsilon", "4", "--eval-every", "1",
         "--no-jit-compile", "--verbose", "0", "--noise-seed", "3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(report folder, runs) of a tiny run with the default sampling, and the
  data arguments each variant's fit got."""
  root = tmp_path_factory.mktemp("compare")
  out = root / "report"
  args = compare.parse_args(
      _TINY + ["--dataset", _write_npz(root / "tiny.npz"), "--out", str(out)])
  inputs = []
  fit_inputs = ex.fit_inputs
  def record(*a, **k):
    inputs.append(fit_inputs(*a, **k))
    return inputs[-1]
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(ex, "fit_inputs", record)
    runs = compare.run(args)
  return out, runs, inputs


@pytest.fixture(scope="module")
def tiny_report(tiny):
  return tiny[0]


def test_private_variants_train_on_poisson_batches(tiny):
  _, runs, inputs = tiny
  assert [r.name for r in runs] == ["DPAdamBC", "DPSGD", "Adam"]
  for run, fit in zip(runs[:2], inputs[:2]):  # normalise by B, q = B/N
    assert run.optimizer.expected_batch_size == 60
    assert run.optimizer.steps_taken == 4  # ceil(240/60) steps per epoch
    padded = ex.poisson_padding(240, 60)
    assert fit["x"].element_spec[2].shape == (padded,)  # sample weights
  # Keras' Adam has no ε to earn: shuffled fixed-size batches.
  assert runs[2].optimizer.__class__.__name__ == "Adam"
  assert inputs[2]["batch_size"] == 60


def _read_csv(path):
  with open(path, newline="", encoding="utf-8") as f:
    return list(csv.DictReader(f))


def test_report_files_and_rows(tiny_report):
  for name in ("results.md", "results.csv", "history.csv") + _PNGS:
    assert (tiny_report / name).is_file(), name
  rows = _read_csv(tiny_report / "results.csv")
  assert [r["variant"] for r in rows] == ["DPAdamBC", "DPSGD", "Adam"]
  assert list(rows[0]) == list(compare._COLUMNS)
  for r in rows:
    assert 0 <= float(r["test accuracy"]) <= 1
    assert math.isfinite(float(r["test loss"]))
    assert r["steps"] == "4" and r["delta"] == "1e-05"
  assert rows[2]["private"] == "NO" and rows[2]["epsilon"] == "inf"
  assert rows[2]["sigma"] == ""


def test_private_variants_share_sigma_and_epsilon_from_the_accounting(
    tiny_report):
  private = [r for r in _read_csv(tiny_report / "results.csv")
             if r["private"] == "yes"]
  assert len(private) == 2
  assert len({r["sigma"] for r in private}) == 1
  assert len({r["epsilon"] for r in private}) == 1
  sigma, eps = float(private[0]["sigma"]), float(private[0]["epsilon"])
  expected = tf_dpadambc.compute_epsilon(240, 60, 1, sigma, 1e-5,
                                         sampling="poisson")
  assert eps == pytest.approx(expected, abs=1e-3)
  assert 3.9 < eps <= 4.0 + 1e-3
  # The once-per-epoch figure of the same σ differs: eps is not it.
  assert abs(tf_dpadambc.compute_epsilon(240, 60, 1, sigma, 1e-5,
                                         sampling="shuffle") - eps) > 0.1
  text = (tiny_report / "results.md").read_text(encoding="utf-8")
  assert "RDP accountant, Poisson sampling: each example joins" in text
  assert "expected batch 60" in text
  assert f"ε = {eps:.3f} with Poisson sampling: the guarantee of this run" in (
      text)
  assert "does NOT apply" not in text


def test_history_has_every_evaluation_and_diagnostics(tiny_report):
  history = _read_csv(tiny_report / "history.csv")
  by_variant = {}
  for row in history:
    by_variant.setdefault(row["variant"], []).append(row)
  assert set(by_variant) == {"DPAdamBC", "DPSGD", "Adam"}
  for name, rows in by_variant.items():
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    eps = [float(r["epsilon"]) for r in rows]
    assert eps == sorted(eps)
    assert math.isinf(eps[-1]) == (name == "Adam")
  assert all(float(r["dp_v_over_phi"]) > 0
             and 0 <= float(r["dp_clamped_fraction"]) <= 1
             for r in by_variant["DPAdamBC"])
  assert all(r["dp_v_over_phi"] == "" for r in by_variant["DPSGD"])


def test_markdown_marks_the_baseline_and_links_the_plots(tiny_report):
  text = (tiny_report / "results.md").read_text(encoding="utf-8")
  assert "| variant | private | hyper-parameters | test accuracy |" in text
  assert "| **DPAdamBC** | yes |" in text and "| **DPSGD** | yes |" in text
  assert "Adam (**NOT PRIVATE**) | NO |" in text
  for name in _PNGS:
    assert f"]({name})" in text
  assert "Differential privacy statement" in text


def test_plots_are_valid_pngs(tiny_report):
  from matplotlib import image  # pylint: disable=import-outside-toplevel
  for name in _PNGS:
    path = tiny_report / name
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100
    assert pixels.std() > 0  # not blank
    assert os.path.getsize(path) > 5000
