"""The main job (``python -m tf_dpadambc``) and the data set loaders."""
import math
import re
import sys

import numpy as np
import pytest

import tf_dpadambc
from tf_dpadambc import datasets
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


_ROW = re.compile(r"^(DPAdamBC|DPAdam|DPSGD)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)"
                  r"\s+(\S+)\s+(\S+)\s*$")
_SIGMA = re.compile(r"σ = ([0-9.]+), (expected batch|batch) (\d+), (\d+) steps")


def _run_main(argv, capsys, monkeypatch):
  """Runs the job; returns (stdout, its Results, model.fit's data args)."""
  results, inputs = [], []
  train_one, fit_inputs = main_lib.train_one, main_lib.fit_inputs

  def record_train(*args, **kwargs):
    results.append(train_one(*args, **kwargs))
    return results[-1]

  def record_inputs(*args, **kwargs):
    inputs.append(fit_inputs(*args, **kwargs))
    return inputs[-1]
  monkeypatch.setattr(main_lib, "train_one", record_train)
  monkeypatch.setattr(main_lib, "fit_inputs", record_inputs)
  assert main_lib.main(argv) == 0
  return capsys.readouterr().out, results, inputs


def _table(out):
  rows = {m.group(1): m.groups() for m in map(_ROW.match, out.splitlines())
          if m}
  for _, lr, _, accuracy, loss, _, _ in rows.values():
    assert float(lr) > 0
    assert 0.0 <= float(accuracy) <= 1.0
    assert math.isfinite(float(loss))
  sigma, batch, batch_size, steps = _SIGMA.search(out).groups()
  return rows, float(sigma), batch, int(batch_size), int(steps)


def test_defaults_sample_poisson_and_shuffle_takes_larger_batches():
  args = main_lib.parse_args([])
  assert args.sampling == "poisson" and args.sampling_seed is None
  assert main_lib.default_config("mnist1d", "poisson").batch_size == 250
  assert main_lib.default_config("mnist1d", "shuffle").batch_size == 1000
  assert main_lib.default_config("digits", "shuffle").batch_size == 150


def test_sampling_seed_is_secret_unless_given(capsys):
  args = main_lib.parse_args([])
  assert main_lib.sampling_seed(args) != main_lib.sampling_seed(args)
  assert main_lib.sampling_seed(main_lib.parse_args(
      ["--sampling-seed", "5"])) == 5
  with pytest.raises(SystemExit):  # shuffled batches follow --seed
    main_lib.parse_args(["--sampling", "shuffle", "--sampling-seed", "5"])
  assert "--sampling-seed seeds Poisson" in capsys.readouterr().err


def test_fit_inputs_poisson_padded_batches_steps_and_seed():
  n, b = 300, 40  # B does not divide N: ceil(N/B) = 8 steps per epoch
  data = datasets.Dataset(np.arange(n, dtype="float32")[:, None],
                          np.arange(n, dtype="int32"), None, None, "ids")
  config = main_lib.QUICK._replace(batch_size=b)
  poisson = main_lib.fit_inputs(data, config, "poisson", seed=1)
  assert set(poisson) == {"x", "shuffle"} and poisson["shuffle"] is False
  batches = list(poisson["x"].as_numpy_iterator())
  m = main_lib.poisson_padding(n, b)
  assert len(batches) == main_lib.steps_per_epoch(n, b) == 8 and b < m < n
  for x, y, w in batches:
    assert x.shape == (m, 1) and w.shape == (m,)
    real = y[w > 0]
    assert len(set(real)) == len(real) and set(w) <= {0.0, 1.0}
  sizes = [int(np.sum(w > 0)) for _, _, w in batches]
  assert len(set(sizes)) > 1  # random sizes, not fixed batches of B
  again = main_lib.fit_inputs(data, config, "poisson", seed=1)["x"]
  for (_, y1, w1), (_, y2, w2) in zip(batches, again.as_numpy_iterator()):
    np.testing.assert_array_equal(y1[w1 > 0], y2[w2 > 0])
  shuffle = main_lib.fit_inputs(data, config, "shuffle")
  assert shuffle["batch_size"] == b and shuffle["x"] is data.x_train


@pytest.mark.slow
def test_main_quick_trains_on_poisson_batches(capsys, monkeypatch):
  out, results, inputs = _run_main(["--quick", "--epochs", "1", "--verbose",
                                    "0"], capsys, monkeypatch)
  rows, sigma, batch, batch_size, steps = _table(out)
  assert set(rows) == {"DPAdamBC", "DPAdam", "DPSGD"}
  assert (batch, batch_size, steps) == ("expected batch", 100, 10)
  # The optimizers normalise by B and account Poisson sampling with q = B/N;
  # fit got padded Poisson batches, all from one sampling seed.
  for r in results:
    assert r.optimizer.expected_batch_size == 100
    assert r.optimizer.steps_taken == 10
  assert all(i["x"].element_spec[2].shape == (main_lib.poisson_padding(
      1000, 100),) for i in inputs) and len(inputs) == 3
  # ε of the run's own sampling: Poisson, at the 8.0 target.
  expected = tf_dpadambc.compute_epsilon(1000, 100, 1, sigma, 1e-5)
  assert 7.9 < expected <= 8.0 + 1e-3
  # The once-per-epoch ε of that σ differs: the rows below tell them apart.
  assert abs(tf_dpadambc.compute_epsilon(
      1000, 100, 1, sigma, 1e-5, sampling="shuffle") - expected) > 0.1
  for name, row in rows.items():
    assert float(row[5]) == pytest.approx(expected, abs=1e-3), name
  assert "ε: RDP accountant, Poisson sampling (the run's sampling)" in out
  assert "Differential privacy statement" in out
  assert "expected batch size B = 100" in out
  assert (f"ε = {rows['DPAdamBC'][5]} with Poisson sampling: the guarantee "
          "of this run") in out
  assert "does NOT apply" not in out


@pytest.mark.slow
def test_main_shuffle_reports_the_once_per_epoch_epsilon(capsys, monkeypatch):
  out, results, _ = _run_main(
      ["--quick", "--epochs", "1", "--sampling", "shuffle", "--optimizers",
       "DPSGD", "--verbose", "0"], capsys, monkeypatch)
  rows, sigma, batch, batch_size, steps = _table(out)
  assert set(rows) == {"DPSGD"} and (batch, batch_size, steps) == (
      "batch", 100, 10)
  assert results[0].optimizer.expected_batch_size is None
  expected = tf_dpadambc.compute_epsilon(1000, 100, 1, sigma, 1e-5,
                                         sampling="shuffle")
  assert float(rows["DPSGD"][5]) == pytest.approx(expected, abs=1e-3)
  assert 7.9 < expected <= 8.0 + 1e-3
  assert "each example once per epoch (the run's sampling)" in out
  assert (f"ε = {rows['DPSGD'][5]} if each example is used exactly once per "
          "epoch (shuffled fixed-size batches; no amplification by sampling "
          "assumed): the guarantee of this run") in out
