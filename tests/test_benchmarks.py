"""Smoke test of benchmarks/suite.py: in-process, MLP, batch 32, 2 steps."""
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

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
