"""The main job (``tf-dpadambc``), the command line and the data set loaders."""
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tf_dpadambc import cli
from tf_dpadambc import compare
from tf_dpadambc import datasets
from tf_dpadambc import experiments as ex
from tf_dpadambc import main as main_lib


@pytest.mark.parametrize("loader, n_train, n_test, features", [
    (datasets.load_mnist1d, 4000, 1000, 40),
    (datasets.load_digits, 1347, 450, 64),
])
def test_loader_shapes_and_dtypes(loader, n_train, n_test, features):
  data = loader()
  assert data.x_train.shape == (n_train, features)
  assert data.x_test.shape == (n_test, features)
  assert data.y_train.shape == (n_train,)
  assert data.y_test.shape == (n_test,)
  assert data.x_train.dtype == data.x_test.dtype == np.float32
  assert data.y_train.dtype == data.y_test.dtype == np.int32
  assert set(np.unique(data.y_train)) == set(range(10))
  assert np.all(np.isfinite(data.x_train))
  assert data.name in datasets.LOADERS


def test_digits_scaled_to_unit_interval():
  data = datasets.load_digits()
  assert data.x_train.min() >= 0.0 and data.x_train.max() == 1.0


def test_mnist1d_is_deterministic_and_leaves_numpy_rng_alone():
  np.random.seed(7)
  expected = np.random.rand()
  np.random.seed(7)
  a = datasets.load_mnist1d()
  assert np.random.rand() == expected
  b = datasets.load_mnist1d()
  np.testing.assert_array_equal(a.x_train, b.x_train)
  np.testing.assert_array_equal(a.y_test, b.y_test)


@pytest.mark.parametrize("loader, module", [
    (datasets.load_mnist1d, "mnist1d"),
    (datasets.load_digits, "sklearn"),
])
def test_missing_optional_dependency_says_what_to_install(
    loader, module, monkeypatch):
  for name in list(sys.modules):
    if name == module or name.startswith(module + "."):
      monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
  with pytest.raises(ImportError, match=r'tf-dpadambc\[examples\]'):
    loader()


def test_synthetic_text_task_is_deterministic_token_ids():
  a = datasets.load_synthetic_text(seed=3, num_train=500, num_test=100)
  b = datasets.load_synthetic_text(seed=3, num_train=500, num_test=100)
  assert a.x_train.shape == (500, 10) and a.x_train.dtype == np.int32
  assert a.y_test.shape == (100,) and set(np.unique(a.y_train)) == set(
      range(4))
  assert 0 <= a.x_train.min() and a.x_train.max() < 1000
  np.testing.assert_array_equal(a.x_train, b.x_train)
  assert not np.array_equal(a.x_train, datasets.load_synthetic_text(
      seed=4, num_train=500, num_test=100).x_train)


def test_synthetic_sentiment_task_is_deterministic_noisy_binary():
  a = datasets.load_synthetic_sentiment(seed=3, num_train=2000, num_test=500)
  b = datasets.load_synthetic_sentiment(seed=3, num_train=2000, num_test=500)
  assert a.x_train.shape == (2000, 20) and a.x_train.dtype == np.int32
  assert a.name == "synthetic-sentiment"
  assert set(np.unique(a.y_train)) == {0, 1} and 0.4 < a.y_train.mean() < 0.6
  assert 0 <= a.x_train.min() and a.x_train.max() < 1000
  counts = np.bincount(a.x_train.ravel(), minlength=1000)
  assert counts[0] > 50 * counts[100:].mean()  # Zipfian: heavy head
  np.testing.assert_array_equal(a.x_train, b.x_train)
  np.testing.assert_array_equal(a.y_test, b.y_test)
  assert not np.array_equal(a.x_train, datasets.load_synthetic_sentiment(
      seed=4, num_train=2000, num_test=500).x_train)


def test_synthetic_negation_task_needs_the_negator():
  a = datasets.load_synthetic_negation(seed=3, num_train=4000, num_test=500)
  b = datasets.load_synthetic_negation(seed=3, num_train=4000, num_test=500)
  assert a.x_train.shape == (4000, 16) and a.x_train.dtype == np.int32
  assert a.name == "synthetic-negation"
  assert set(np.unique(a.y_train)) == {0, 1} and 0.4 < a.y_train.mean() < 0.6
  assert 0 <= a.x_train.min() and a.x_train.max() < 504
  np.testing.assert_array_equal(a.x_train, b.x_train)
  np.testing.assert_array_equal(a.y_test, b.y_test)
  assert not np.array_equal(a.x_train, datasets.load_synthetic_negation(
      seed=4, num_train=4000, num_test=500).x_train)
  # The label is the majority polarity of the sentiment words (ids
  # 400..499), flipped by a negator (ids 500..503), then 5% label noise.
  vectors = datasets.negation_embeddings(seed=3)
  assert vectors.shape == (504, 32) and vectors.dtype == np.float32
  polarity = np.sign(vectors[400:500] @ _sentiment_direction(vectors))
  x = a.x_train
  sentiment = np.where((x >= 400) & (x < 500), polarity[np.clip(x - 400, 0,
                                                                99)], 0)
  negated = np.any(x >= 500, axis=1)
  rule = np.mean(((sentiment.sum(axis=1) > 0) ^ negated) == a.y_train)
  assert 0.93 < max(rule, 1 - rule) < 0.97  # (the direction's sign: either)
  # Polarity alone, without the negator: chance.
  alone = np.mean((sentiment.sum(axis=1) > 0) == a.y_train)
  assert abs(alone - 0.5) < 0.05
  # Outlier dimensions: about ±3 for every word, the others ≈ 0.2.
  assert np.all(np.abs(vectors[:, :2]) > 1.5)
  assert np.abs(vectors[:, 2:]).mean() < 0.5


def _sentiment_direction(vectors):
  """The direction that separates the sentiment words: their top principal
  component (outlier dimensions left out)."""
  words = vectors[400:500].copy()
  words[:, :2] = 0
  return np.linalg.svd(words - words.mean(0))[2][0]


def test_verdict_explains_dpadam_with_signal_in_v_hat():
  pairs = {("DPAdam", "DPSGD"): main_lib.Interval(0.07, 0.06, 0.08, 5)}
  text = main_lib.verdict(pairs, {"DPAdam": {"dp_v_over_phi": 2.8}})
  assert "DPAdam beats DPSGD" in text
  assert "keeps Adam's per-coordinate scaling" in text
  assert "its advantage over DPSGD" in text
  assert "behaves as DP-SGD with momentum" not in text


# ------------------------------------------------------------- statistics
def test_t_interval_matches_the_textbook_formula():
  values = [0.70, 0.72, 0.74]
  interval = main_lib.t_interval(values)
  # mean 0.72, s = 0.02, t(0.975, 2) = 4.3027: half-width 0.0497
  assert interval.mean == pytest.approx(0.72)
  assert interval.high - interval.mean == pytest.approx(
      4.302653 * 0.02 / math.sqrt(3), rel=1e-5)
  assert interval.n == 3
  assert math.isnan(main_lib.t_interval([0.5]).low)


def test_verdict_calls_a_consistent_gain_significant():
  # DPAdamBC beats DPAdam by 3-5 points on every seed; DPAdam and DPSGD
  # trade places: the verdict must say exactly that.
  accuracies = {"DPAdamBC": [0.80, 0.82, 0.81, 0.82, 0.80],
                "DPAdam": [0.76, 0.78, 0.77, 0.78, 0.76],
                "DPSGD": [0.77, 0.77, 0.78, 0.77, 0.75]}
  pairs = main_lib.compare_pairs(accuracies, list(accuracies))
  assert main_lib.significant(pairs[("DPAdamBC", "DPAdam")])
  assert main_lib.significant(pairs[("DPAdamBC", "DPSGD")])
  assert not main_lib.significant(pairs[("DPAdam", "DPSGD")])
  text = main_lib.verdict(
      pairs, {"DPAdam": {"dp_v_over_phi": 1.03},
              "DPAdamBC": {"dp_v_over_phi": 1.03,
                           "dp_clamped_fraction": 0.45}}, "low-dimensional")
  assert text.startswith("Verdict: at the same ε, DPAdamBC beats DPAdam; "
                         "DPAdamBC beats DPSGD (significant at 95%, paired "
                         "over 5 seeds); no significant difference between "
                         "DPAdam and DPSGD at 5 seeds.")
  assert "v̂/Φ = 1.03" in text and "almost all DP noise" in text
  assert "it does no better than DPSGD" in text
  assert "which is where its advantage comes from" in text
  assert "55% of coordinates" in text
  assert "advise: low-dimensional regime" in text
  line = main_lib.pair_sentence("DPAdamBC", "DPAdam",
                                pairs[("DPAdamBC", "DPAdam")])
  assert line.startswith("DPAdamBC − DPAdam: +4.0 points, 95% CI [+")
  assert line.endswith("significant, DPAdamBC better than DPAdam.")


def test_verdict_says_not_significant_when_the_interval_contains_zero():
  accuracies = {"DPAdamBC": [0.80, 0.76, 0.79], "DPAdam": [0.78, 0.79, 0.77]}
  pairs = main_lib.compare_pairs(accuracies, list(accuracies))
  interval = pairs[("DPAdamBC", "DPAdam")]
  assert interval.low < 0 < interval.high
  text = main_lib.verdict(pairs, {"DPAdamBC": {"dp_clamped_fraction": 0.5}})
  assert text.startswith("Verdict: at the same ε, no significant difference "
                         "between DPAdamBC and DPAdam at 3 seeds.")
  assert "beats" not in text and "advantage comes from" not in text
  assert "did not give a significant advantage" in text
  assert main_lib.pair_sentence("DPAdamBC", "DPAdam", interval).endswith(
      "not significant (the interval contains 0).")
  # A significant loss is called a loss.
  worse = main_lib.compare_pairs(
      {"DPAdamBC": [0.70, 0.71, 0.70], "DPAdam": [0.78, 0.79, 0.78]},
      ["DPAdamBC", "DPAdam"])
  assert "DPAdam beats DPAdamBC" in main_lib.verdict(worse)


# ------------------------------------------------------------ command line
@pytest.mark.parametrize("build", [main_lib.build_parser,
                                   compare.build_parser])
def test_every_flag_has_help_text(build):
  for action in build()._actions:  # pylint: disable=protected-access
    assert action.help and len(action.help) > 10, action.option_strings


def test_help_is_fast_and_quiet():
  """The command's --help imports neither TensorFlow nor Keras (instant, and
  no C++ log lines)."""
  code = ("import sys\n"
          "sys.argv = ['tf-dpadambc', '--help']  # as the console script\n"
          "from tf_dpadambc import cli\n"
          "try:\n  cli.main()\nexcept SystemExit:\n  pass\n"
          "print('loaded:', sorted({'tensorflow', 'keras'} & set(sys.modules)))")
  out = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True,
      check=True, timeout=120,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert "--seeds" in out.stdout and "--epsilon" in out.stdout
  assert "loaded: []" in out.stdout
  assert out.stderr == ""


def test_import_registers_the_optimizers_for_load_model():
  code = ("import sys, tf_dpadambc, keras\n"
          "print(keras.saving.get_registered_object('tf_dpadambc>DPAdamBC'))")
  out = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True,
      check=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert "DPAdamBC" in out.stdout


def test_cli_silences_tensorflow_before_it_loads(monkeypatch):
  monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "3"
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # the user's choice wins
  assert not cli.quiet_tensorflow()
  assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"


def test_missing_optional_dependency_is_one_line(monkeypatch):
  for name in list(sys.modules):
    if name == "mnist1d" or name.startswith("mnist1d."):
      monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(sys.modules, "mnist1d", None)
  with pytest.raises(SystemExit) as e:
    compare.load_dataset("mnist1d", seed=0)
  message = str(e.value.code)
  assert "\n" not in message and 'tf-dpadambc[examples]' in message
  assert e.value.__cause__ is None and e.value.__suppress_context__
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(SystemExit, match=r"^tf-dpadambc: error: .*matplotlib"):
    ex.require("matplotlib", "plots")


def test_defaults_and_seeds():
  args = main_lib.parse_args([])
  assert args.optimizers == list(main_lib.OPTIMIZERS)
  assert (args.epsilon, args.delta, args.seeds, args.sampling) == (
      main_lib.DEFAULT_EPSILON, 1e-5, main_lib.DEFAULT_SEEDS, "poisson")
  assert args.seeds >= 3 and args.jit_compile == main_lib.JIT_COMPILE
  quick = main_lib.parse_args(["--quick"])
  assert quick.seeds == main_lib.QUICK_SEEDS and not quick.jit_compile
  # Replicates differ in weights, batches and noise; secret unless given.
  a, b = (main_lib.replicate_seeds(args, k) for k in (0, 1))
  assert len({a[1], b[1]}) == 2 and len({a[2], b[2]}) == 2 and a[0] != b[0]
  given = main_lib.parse_args(["--noise-seed", "5", "--sampling-seed", "7"])
  assert main_lib.replicate_seeds(given, 2) == (2, 9, 7)
  with pytest.raises(SystemExit):  # shuffled batches follow --seed
    main_lib.parse_args(["--sampling", "shuffle", "--sampling-seed", "5"])


def test_fit_inputs_poisson_padded_batches_steps_and_seed():
  n, b = 300, 40  # B does not divide N: ceil(N/B) = 8 steps per epoch
  data = datasets.Dataset(np.arange(n, dtype="float32")[:, None],
                          np.arange(n, dtype="int32"), None, None, "ids")
  config = ex.QUICK._replace(batch_size=b)
  poisson = ex.fit_inputs(data, config, "poisson", seed=1)
  assert set(poisson) == {"x", "shuffle"} and poisson["shuffle"] is False
  batches = list(poisson["x"].as_numpy_iterator())
  m = ex.poisson_padding(n, b)
  assert len(batches) == ex.steps_per_epoch(n, b) == 8 and b < m < n
  for x, y, w in batches:
    assert x.shape == (m, 1) and w.shape == (m,)
    real = y[w > 0]
    assert len(set(real)) == len(real) and set(w) <= {0.0, 1.0}
  sizes = [int(np.sum(w > 0)) for _, _, w in batches]
  assert len(set(sizes)) > 1  # random sizes, not fixed batches of B
  again = ex.fit_inputs(data, config, "poisson", seed=1)["x"]
  for (_, y1, w1), (_, y2, w2) in zip(batches, again.as_numpy_iterator()):
    np.testing.assert_array_equal(y1[w1 > 0], y2[w2 > 0])
  shuffle = ex.fit_inputs(data, config, "shuffle")
  assert shuffle["batch_size"] == b and shuffle["x"] is data.x_train


@pytest.mark.slow
def test_main_quick_runs_seeds_and_prints_a_verdict(capsys):
  assert cli.main(["--quick", "--seeds", "2", "--epochs", "1",
                   "--verbose", "0"]) == 0
  out = capsys.readouterr().out
  assert "Task: synthetic sentiment classification" in out
  assert "Model: transformer classifier" in out
  assert "ε in plain words" in out
  for name in main_lib.OPTIMIZERS:
    row = next(line for line in out.splitlines() if line.startswith(name))
    assert "learning_rate=" in row and " ± " in row
    assert re.search(r"  7\.9[0-9]{2}  |  8\.000  ", row)  # ε ≤ the target 8
  assert "gamma_prime=" in out and "eps_adam" not in out
  assert "DPAdamBC − DPAdam:" in out and "Verdict: at the same ε" in out
  assert "dp_v_over_phi:" in out and "dp_clamped_fraction:" in out
  assert "dp_nonfinite_examples" not in out  # zero: not shown
  assert "Differential privacy statement" in out
  assert "(--quick: a smoke test" in out
  # The paired design shares the noise: the job must not claim that its
  # models compose (a review told neighbours apart from two models).
  assert "composes" not in out and "release at most one of them" in out
