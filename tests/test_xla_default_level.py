"""The tests whose outcome depends on XLA's generated code, at XLA's default
optimization level.

``conftest.py`` compiles this suite without LLVM's optimization passes
(``--xla_backend_optimization_level=0``), to halve compile times. Users run
the default (3), where LLVM may schedule and contract floating-point code
differently. The tests that pin XLA's arithmetic — the sampler (bitwise the
same with and without XLA, its polynomial's error on every angle), the
exact pooled-embedding norms, ghost sums identical with and without
``jit_compile``, one-channel convolutions' per-unit gradients each a function
of its own row, and an XLA-compiled ``fit`` held to the clip bound on a
model that folds the batch — run again here, in a process of their own at
level 3.
"""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SELECTED = [
    "tests/test_noise.py",
    "tests/test_ghost.py::test_embedding_norms_of_pooled_gradients_by_counting",
    "tests/test_ghost.py::test_identical_with_and_without_jit_compile"
    "[embedding_layernorm]",
    "tests/test_ghost.py::test_single_channel_conv_unit_grads_are_each_rows_own"
    "[True]",
    "tests/test_adversarial.py::test_fit_moves_the_weights_by_at_most_the_bound"
    "[fold_rows-options0]",
]


@pytest.mark.slow
def test_xla_dependent_tests_pass_at_the_default_optimization_level():
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "xla_backend_optimization_level" not in f]
  env = dict(os.environ, XLA_FLAGS=" ".join(
      flags + ["--xla_backend_optimization_level=3"]))
  env.pop("PYTEST_XDIST_WORKER", None)
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-p", "no:xdist", *SELECTED],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
      check=False)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
  assert " passed" in run.stdout and "deselected" not in run.stdout
  assert "no tests ran" not in run.stdout
