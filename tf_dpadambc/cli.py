"""The ``tf-dpadambc`` command: one dispatch for the main job and the
subcommands.

    tf-dpadambc [flags]            the main job (tf_dpadambc.main)
    tf-dpadambc compare [flags]    tf_dpadambc.compare
    tf-dpadambc audit [flags]      tf_dpadambc.audit.cli

Before anything imports TensorFlow, TensorFlow's C++ logging is silenced
(``TF_CPP_MIN_LOG_LEVEL=3``, and TensorFlow's start-up messages, which
ignore it, are sent to /dev/null: no absl pre-init warning, no "failed call
to cuInit" on a CPU machine; set the variable yourself to see them all). ``tf_dpadambc``
itself imports TensorFlow lazily, so the main job's ``--help`` is instant.
"""
import os
import sys

SUBCOMMANDS = ("compare", "audit")


def quiet_tensorflow():
  """Silences TensorFlow's C++ logging (unless the user set
  ``TF_CPP_MIN_LOG_LEVEL``); effective only before TensorFlow loads.

  Returns True when it took over (the variable was not set)."""
  if "TF_CPP_MIN_LOG_LEVEL" in os.environ:
    return False
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
  return True


def load_tensorflow_quietly():
  """Imports TensorFlow and starts its runtime with the process's stderr
  (file descriptor 2) pointed at /dev/null.

  TensorFlow ≥ 2.16 logs through absl before ``TF_CPP_MIN_LOG_LEVEL`` is
  read ("All log messages before absl::InitializeLog() …", oneDNN and CUDA
  notices, "failed call to cuInit" on a CPU machine): only the descriptor
  catches those. Python errors are raised after stderr is restored.
  """
  if "tensorflow" in sys.modules:
    return
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, "w", encoding="utf-8") as null:
      os.dup2(null.fileno(), 2)
      import tensorflow as tf  # pylint: disable=import-outside-toplevel
      tf.config.list_logical_devices()  # device discovery (cuInit) too
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def main(argv=None):
  """Entry point of the console script and ``python -m tf_dpadambc``."""
  argv = sys.argv[1:] if argv is None else list(argv)
  subcommand = argv[0] if argv and argv[0] in SUBCOMMANDS else None
  # The main job's --help needs no TensorFlow; compare's and audit's parsers
  # (and every run) do.
  main_job_help = subcommand is None and {"-h", "--help"} & set(argv)
  if quiet_tensorflow() and not main_job_help:
    load_tensorflow_quietly()
  if subcommand == "compare":
    from tf_dpadambc import compare  # pylint: disable=import-outside-toplevel
    return compare.main(argv[1:])
  if subcommand == "audit":
    from tf_dpadambc.audit import cli  # pylint: disable=import-outside-toplevel
    return cli.main(argv[1:])
  from tf_dpadambc import main as main_job  # pylint: disable=import-outside-toplevel
  return main_job.main(argv)
