"""MultiWorkerMirroredStrategy with two worker processes on 127.0.0.1.

The tests launch tests/multiworker_worker.py twice with a TF_CONFIG cluster
of two workers on free loopback ports (one CPU replica each) — once for all
scenarios (a module fixture; under pytest-xdist once per test process that
runs one of them) and once for the example — wait at most TIMEOUT seconds a
scenario (then kill both) and compare what they wrote:

* the classifier (seed 3, two global steps of 32 examples, 16 per worker)
  ends with bit-identical weights on both workers, equal (to float32
  rounding of sums in another order, atol 1e-4) to the same steps on one
  device: the workers' clipped sums add up to the global sum and the noise
  is the single-device draw; the optimizer counts 2 steps of batch 32 and
  its DpEvent is the single-device one;
* the noise model (zero gradients, secret OS seed drawn in each process,
  DPSGD with learning rate 1): bit-identical weights on both workers (they
  agreed on one seed) and std(Δw) = σC/B_global = 2/32 within 3% (20,000
  coordinates: the sample std's sd is 0.5%, so 6 sd; noise per replica would
  give √2 times that, normalisation per worker twice that).
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # processes of their own: first (conftest)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiworker_worker.py")
TIMEOUT = 180  # seconds for both processes (about 10-30 s on 2 busy cores)
EXPECTED_STD = 2.0 / 32  # σ = 2, C = 1, B_global = 32
STD_RTOL = 0.03


def _free_ports(n):
  sockets = []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("127.0.0.1", 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  except OSError as e:
    pytest.skip(f"cannot open loopback sockets on this platform: {e}")
  finally:
    for s in sockets:
      s.close()


def _launch(argv, name, tmp_path, timeout=TIMEOUT):
  """Runs ``python *argv`` as workers 0 and 1 of one cluster; returns their
  exit codes and logs (both killed after ``timeout`` seconds)."""
  ports = _free_ports(2)
  cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
  procs, logs = [], []
  try:
    for index in range(2):
      env = dict(os.environ, TF_CONFIG=json.dumps(
          {"cluster": cluster, "task": {"type": "worker", "index": index}}),
                 TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
                 PYTHONPATH=os.pathsep.join([ROOT] + [
                     p for p in [os.environ.get("PYTHONPATH")] if p]))
      log = open(tmp_path / f"{name}-{index}.log", "w")  # pylint: disable=consider-using-with
      logs.append(log)
      procs.append(subprocess.Popen(  # pylint: disable=consider-using-with
          [sys.executable] + [a.format(index=index) for a in argv], env=env,
          stdout=log, stderr=subprocess.STDOUT))
    for proc in procs:
      try:
        proc.wait(timeout=timeout)
      except subprocess.TimeoutExpired:
        pass
  finally:
    for proc in procs:  # ours only, by handle
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    for log in logs:
      log.close()
  return ([proc.returncode for proc in procs],
          [(tmp_path / f"{name}-{index}.log").read_text() for index in (0, 1)])


SCENARIOS = ("keras3-inside", "keras3-outside", "keras3-prebuilt",
             "tf_keras-inside", "tf_keras-outside", "keras3-fit")


@pytest.fixture(scope="module")
def cluster(run_once):
  """Every scenario, one after another, in one launch of two workers (each
  launch imports TensorFlow twice and sets up the collectives: six launches
  took about 5 min of a 2-core CI run), once per test run (``run_once``).
  Returns ``results(scenario)``."""
  timeout = TIMEOUT * len(SCENARIOS) // 2
  with run_once("multiworker") as (tmp_path, fill):
    if fill:
      out = str(tmp_path / "{{scenario}}-{index}.json")
      launched = _launch([WORKER, out, *SCENARIOS], "workers", tmp_path,
                         timeout=timeout)
      (tmp_path / "launch.json").write_text(json.dumps(launched))
  codes, logs = json.loads((tmp_path / "launch.json").read_text())

  def results(scenario):
    found = []
    for index in (0, 1):
      path = tmp_path / f"{scenario}-{index}.json"
      if not path.exists():
        pytest.fail(f"worker {index} wrote nothing for {scenario!r} in "
                    f"{timeout} s (exit {codes[index]}):\n"
                    f"{logs[index][-3000:]}")
      result = json.loads(path.read_text())
      assert "crash" not in result, result.get("crash")
      found.append(result)
    return found
  return results


def _arrays(weights):
  return [np.asarray(w, np.float32) for w in weights]


def _check_release(results):
  first, second = results
  for name in ("trained", "noise"):
    for a, b in zip(_arrays(first[name]["weights"]),
                    _arrays(second[name]["weights"])):
      np.testing.assert_array_equal(a, b)  # one update on every worker
  trained, reference = first["trained"], first["reference"]
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
      _arrays(trained["weights"]), _arrays(trained["initial"])))
  assert moved > 1e-2  # the steps did train
  for a, b in zip(_arrays(trained["weights"]), _arrays(reference["weights"])):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
  assert trained["steps_taken"] == reference["steps_taken"] == 2
  assert trained["logical_batch_size"] == reference[
      "logical_batch_size"] == 32
  assert trained["dp_event"] == reference["dp_event"]
  noise = first["noise"]
  assert noise["steps_taken"] == 1 and noise["logical_batch_size"] == 32
  kernel = _arrays(noise["weights"])[0]
  assert kernel.size == 20000
  std = float(np.std(kernel))
  assert abs(std - EXPECTED_STD) / EXPECTED_STD < STD_RTOL, std


@pytest.mark.parametrize("how", ["inside", "outside", "prebuilt"])
def test_keras3_custom_loop_on_two_workers(how, cluster):
  # inside: optimizer made in the scope (its seed variable is mirrored,
  # initialised by broadcast from worker 0); outside: constructed outside,
  # built by private_step in the scope on the first step; prebuilt: built
  # outside (a plain variable holding each process's own OS seed), so only
  # the agreement in every release makes the workers draw the same noise.
  results = cluster(f"keras3-{how}")
  _check_release(results)
  kind = results[0]["noise"]["seed_variable"]
  assert kind == ("ResourceVariable" if how == "prebuilt"
                  else "MirroredVariable")


@pytest.mark.parametrize("how", ["inside", "outside"])
def test_tf_keras_fit_on_two_workers(how, cluster):
  results = cluster(f"tf_keras-{how}")
  _check_release(results)
  for result in results:
    for name in ("trained", "noise"):
      assert result[name]["per_unit_plan"] == "vectorized"
      assert result[name]["refused_steps"] == 0


def test_keras3_fit_is_refused_on_two_workers(cluster):
  for result in cluster("keras3-fit"):
    assert result["error"] == "NotImplementedError"
    assert "private_step" in result["message"]
    assert "tf_keras" in result["message"]


def test_multi_worker_example_runs_on_two_workers(tmp_path):
  # examples/multi_worker.py as written, two processes: both report the
  # same (globally reduced) losses, learn, and state ε for the global batch.
  # 150 steps: about 100 s on 2 busy cores, hence the longer limit.
  codes, logs = _launch([os.path.join(ROOT, "examples", "multi_worker.py")],
                        "example", tmp_path, timeout=2 * TIMEOUT)
  assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
  def lines(log, prefix):
    return [l for l in log.splitlines() if l.startswith(prefix)]
  losses = [lines(log, "epoch ") for log in logs]
  assert len(losses[0]) == 15 and losses[0] == losses[1]
  first, last = (float(losses[0][i].split()[-1]) for i in (0, -1))
  assert last < 0.5 * first
  for log in logs:
    accuracy = float(lines(log, "Test accuracy:")[0].split()[-1])
    assert accuracy > 0.7
    assert "batch size B = 150" in log and "steps = 150" in log
