"""The main job (``python -m tf_dpadambc``) and the data set loaders."""
import math
import re
import sys

import numpy as np
import pytest

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


@pytest.mark.slow
def test_main_quick_prints_the_table(capsys):
  assert main_lib.main(["--quick", "--verbose", "0"]) == 0
  out = capsys.readouterr().out
  assert "test accuracy" in out and "δ = 1e-05" in out
  rows = {m.group(1): m.groups() for m in map(_ROW.match, out.splitlines())
          if m}
  assert set(rows) == {"DPAdamBC", "DPAdam", "DPSGD"}
  epsilons = []
  for _, lr, _, accuracy, loss, eps, _ in rows.values():
    assert float(lr) > 0
    assert 0.0 <= float(accuracy) <= 1.0
    assert math.isfinite(float(loss))
    epsilons.append(float(eps))
  # Same σ, batch and steps: the same ε, at most the 8.0 target.
  assert max(epsilons) == min(epsilons)
  assert 0 < epsilons[0] <= 8.0 + 1e-3
  assert "Differential privacy statement" in out
