"""Smoke tests of benchmarks/suite.py (in-process, MLP, batch 32, 2 steps) and
benchmarks/noise_floor.py."""
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import kernels  # noqa: E402
import noise_floor  # noqa: E402
import suite  # noqa: E402

# Two configurations keep it fast (each DP one compiles for seconds).
CONFIGS = ["Adam", "DPAdamBC"]


@pytest.fixture(scope="module")
def run():
  steps = dict(warmup=1, min_steps=2, max_steps=2, budget=0.0,
               hard_budget=0.0)
  return suite.run_suite(["mlp"], [32], steps, isolate=False,
                         tfp_python=False, configs=CONFIGS,
                         log=lambda *a: None)


def test_suite_measures_the_configurations(run):
  info, results = run
  assert info["cpus"] >= 1
  assert info["tfp"] is None and info["tfp_skipped"]
  assert [r["config"] for r in results] == CONFIGS
  for r in results:
    assert r["status"] == "ok", r
    assert r["steps_timed"] == 2 and r["ms_per_step"] > 0
    assert r["peak_mib"] >= 0


def test_table_and_targets(run):
  _, results = run
  table = suite.tables(results, ["mlp"], [32])
  assert ("| model | config | ms/step | ratio to non-private | peak MiB "
          "| memory ratio |") in table
  rows = [line for line in table if line.startswith("| mlp |")]
  assert [row.split(" | ")[1] for row in rows] == CONFIGS
  assert "| 1.00x |" in rows[0]
  targets = suite.targets(results, [32])
  assert any(line.startswith(("PASS", "MISS")) and "mlp, batch 32" in line
             for line in targets)


def _row(model, config, ms, peak=10.0, batch_size=256):
  return dict(model=model, config=config, batch_size=batch_size,
              status="ok", ms_per_step=ms, peak_mib=peak)


def test_jax_privacy_rows_are_compared_within_their_framework():
  """jax_privacy's ratios are to the JAX non-private row of the same run, and
  the target compares DPAdamBC with the faster jax_privacy configuration."""
  slow, fast = suite.JAXP_CONFIGS[1], suite.JAXP_CONFIGS[2]
  results = [_row("mlp", "Adam", 2.0), _row("mlp", "DPAdamBC", 3.0),
             _row("mlp", suite.JAX_BASELINE, 1.0), _row("mlp", slow, 50.0),
             _row("mlp", fast, 5.0)]
  rows = {r.split(" | ")[1]: r for r in suite.tables(results, ["mlp"], [256])
          if r.startswith("| mlp |")}
  assert "| 1.50x |" in rows["DPAdamBC"]
  assert "| 50.00x |" in rows[slow] and "| 5.00x |" in rows[fast]
  lines = [l for l in suite.targets(results, [256]) if "jax_privacy" in l]
  assert lines == [f"PASS DPAdamBC faster than {fast} (JAX), mlp, batch 256: "
                   "3.0 vs 5.0 ms (1.67x)"]
  results[-1]["ms_per_step"] = 2.5
  assert suite.targets(results, [256])[1].startswith("MISS DPAdamBC faster")


def test_profile_step_names_each_thunk_by_its_tensorflow_op(tmp_path):
  """benchmarks/profile_step.py reads the TensorFlow op of each XLA thunk
  from the largest train-step module's optimized HLO."""
  import profile_step  # pylint: disable=import-outside-toplevel
  hlo = tmp_path / "hlo"
  hlo.mkdir()
  text = (
      '  %Einsum.0 = f32[8,784,128]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, '
      'metadata={op_type="Einsum" op_name="cond_1/einsum/Einsum"}\n'
      '  ROOT %multiply_add_fusion.3 = f32[784,128]{1,0} fusion(%x), '
      'kind=kLoop, metadata={op_type="AddV2" op_name="DPAdamBC/add_2"}\n'
      '  %copy.1 = f32[10]{0} copy(%y)\n')
  (hlo / "m.a_inference_one_step_on_data_1.cpu_after_optimizations.txt"
   ).write_text(text)
  (hlo / "m.small_one_step_on_data_2.cpu_after_optimizations.txt"
   ).write_text("%Einsum.0 = f32[1] dot()\n")
  names = profile_step._op_names(  # pylint: disable=protected-access
      str(hlo), {"Einsum.0", "multiply_add_fusion.3", "copy.1", "absent"})
  assert names["Einsum.0"] == (
      "f32[8,784,128]{2,1,0}  Einsum cond_1/einsum/Einsum")
  assert names["multiply_add_fusion.3"].endswith("AddV2 DPAdamBC/add_2")
  assert names["copy.1"] == "f32[10]{0}"
  assert "absent" not in names


class _FakeRunner:
  """Stands in for suite._Runner: no TensorFlow in the "keras3" environment
  (a GPU machine with JAX alone), a JAX environment that sees a GPU."""

  def __init__(self, python, kind="keras3", fresh=False, device="auto"):
    self.kind, self.device = kind, device

  def start(self):
    if self.kind == "keras3":
      return False, "ModuleNotFoundError: No module named 'tensorflow'"
    return True, {"version": "2.0.0"}

  def run(self, spec, timeout):
    if spec.get("probe"):
      return dict(cpus=16, python="3.12", cpu_model="x", platform="p",
                  gpus=["NVIDIA H100"], jax="0.11", keras="3.15"), None
    ms = 1.0 if spec["config"] == suite.JAX_BASELINE else 4.0
    return dict(model=spec["name"], config=spec["config"],
                batch_size=spec["batch_size"], status="ok", ms_per_step=ms,
                peak_mib=1.0, steps_timed=3, warmup_s=1.0), None

  def close(self):
    pass


def test_without_tensorflow_the_jax_rows_still_run(monkeypatch):
  """Where this interpreter cannot import TensorFlow, the jax_privacy rows
  run (the machine as JAX sees it, --device gpu honoured) and the output
  says why the Keras 3 rows did not; without --jaxp-python it fails."""
  monkeypatch.setattr(suite, "_Runner", _FakeRunner)
  configs = ["Adam", "DPAdamBC", suite.JAXP_CONFIGS[2]]
  info, results = suite.run_suite(["mlp"], [256], configs=configs,
                                  jaxp_python="python3", tfp_python=False,
                                  device="gpu", log=lambda *a: None)
  assert [r["config"] for r in results] == [suite.JAX_BASELINE, configs[2]]
  assert "No module named 'tensorflow'" in info["keras3_skipped"]
  assert info["gpus"] == ["NVIDIA H100"] and info["device"] == "GPU:0"
  assert "no TensorFlow; JAX 0.11" in suite._machine_line(info)
  rows = [r for r in suite.tables(results, ["mlp"], [256]) if "mlp" in r]
  assert "| 4.00x |" in rows[1]
  with pytest.raises(RuntimeError, match="probe failed"):
    suite.run_suite(["mlp"], [256], configs=configs, tfp_python=False,
                    log=lambda *a: None)


def test_noise_floor_adds_the_noise_it_claims_and_runs():
  """benchmarks/noise_floor.py: its floor optimizer really draws N(0, s²)
  per coordinate (else the floor measures nothing), and the script runs."""
  opt = noise_floor.NoisyAdam(0.25)
  grads = [tf.zeros([200_000]), tf.ones([4, 5])]
  z, shifted = opt.noised(grads)
  # std of 200,000 draws: relative standard error 1/sqrt(2n) = 0.16%.
  assert float(np.std(z)) == pytest.approx(0.25, rel=0.01)
  assert abs(float(np.mean(z))) < 5 * 0.25 / np.sqrt(200_000)
  assert shifted.shape == (4, 5) and np.all(shifted.numpy() != 1.0)
  rows = noise_floor.main(["--models", "mlp", "--batch-sizes", "16",
                           "--steps", "3", "--rounds", "1"])
  assert [(r["model"], r["batch_size"]) for r in rows] == [("mlp", 16)]
  assert all(r[k] > 0 for r in rows for k in ("adam", "adam_noise",
                                               "dpadambc"))


def test_kernel_groups_compare_ways_of_doing_one_job(capsys):
  """benchmarks/kernels.py: each group's rows compute the same values (its
  check fails on a row that does not, so a ratio never compares different
  work), and the script prints every row with its ratio."""
  found = kernels.groups([12], size=40)
  for _, rows, inputs, rtol in found:
    kernels.check(rows, inputs, rtol)
  _, rows, inputs, rtol = found[0]
  wrong = rows + [("twice the sum", lambda *t: 2.0 * rows[0][1](*t))]
  with pytest.raises(AssertionError):
    kernels.check(wrong, inputs, rtol)
  assert kernels.main(["--batch-sizes", "12", "--rounds", "1", "--reps", "1",
                       "--sampler-size", "40"]) == 0
  out = capsys.readouterr().out
  for name, rows, _, _ in found:
    assert name in out
    assert all(label in out for label, _ in rows)
  assert out.count(" 1.00x") >= len(found)
