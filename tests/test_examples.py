"""The README quickstart (examples/quickstart.py) runs exactly as written."""
import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_runs_and_learns(capsys):
  namespace = runpy.run_path(str(ROOT / "examples" / "quickstart.py"))
  out = capsys.readouterr().out
  assert "Differential privacy statement" in out
  model = namespace["model"]
  _, accuracy = model.evaluate(namespace["x_test"], namespace["y_test"],
                               verbose=0)
  assert accuracy > 0.6  # chance is 0.1; ≈0.87 at ε = 8


def test_readme_quickstart_is_the_example():
  readme = (ROOT / "README.md").read_text()
  example = (ROOT / "examples" / "quickstart.py").read_text()
  body = example.split('"""', 2)[2].strip()
  assert body in readme


@pytest.mark.slow
def test_correlated_noise_example_runs_at_equal_epsilon(capsys):
  runpy.run_path(str(ROOT / "examples" / "correlated_noise.py"))
  out = capsys.readouterr().out
  lines = [line for line in out.splitlines() if "test accuracy" in line]
  assert len(lines) == 2
  assert all("ε = 4.00" in line for line in lines)
  assert "correlated noise (DP-MF)" in out


@pytest.mark.slow
def test_keras_hub_lora_example_runs_tiny(capsys):
  pytest.importorskip("keras_hub")
  namespace = runpy.run_path(str(ROOT / "examples" / "keras_hub_lora.py"))
  results = namespace["main"](["--tiny"])
  out = capsys.readouterr().out
  assert set(results) == {"DPAdamBC", "DPAdam", "DPSGD"}
  assert "Differential privacy statement" in out
  assert "ghost norms" in out and "LoRA r=4" in out
