"""tf_dpadambc: differentially private Adam and its variants for TensorFlow/Keras.

    import tf_dpadambc
    model = tf_dpadambc.make_private(model)
    model.compile(optimizer=tf_dpadambc.DPAdamBC(l2_norm_clip=1.0,
                                                 noise_multiplier=1.1,
                                                 learning_rate=1e-3),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=256, epochs=5)

Layout (the path a gradient takes): ``core.per_example`` → ``core.clipping``
→ ``core.noise`` → ``core.moments`` → ``core.updates``; ``accounting`` for ε;
``core.correlated_noise``, ``mechanisms`` and ``mf`` for DP-MF correlated
noise (``noise=CorrelatedNoise(...)``), ``data`` for cyclic batches;
``keras`` for the Keras 3 optimizers and train step; ``theory`` and
``advisor`` for the papers' formulas and a regime verdict.
"""
import importlib
import importlib.util
import os
import sys

from tf_dpadambc._version import __version__

# The public names come from ``tf_dpadambc._api``, imported (with TensorFlow)
# right here — so that ``import tf_dpadambc`` registers the optimizers with
# Keras and ``keras.models.load_model`` finds them — except when this process
# is the ``tf-dpadambc`` command (or ``python -m tf_dpadambc``): then they are
# imported on first use (PEP 562), so that the command can silence
# TensorFlow's start-up logging before TensorFlow loads and ``--help``
# answers at once (tf_dpadambc.cli).


def _load():
  api = importlib.import_module("tf_dpadambc._api")
  names = globals()
  for name in api.__all__:
    names.setdefault(name, getattr(api, name))
  names["__all__"] = list(api.__all__) + ["__version__"]
  return names


def __getattr__(name):
  if name.startswith("_") and name != "__all__":  # (and no recursion)
    raise AttributeError(name)
  if importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")  # a submodule
  names = _load()
  if name in names:
    return names[name]
  raise AttributeError(f"module 'tf_dpadambc' has no attribute {name!r}")


def __dir__():
  return sorted(set(_load()))


def _started_as_command():
  """True while ``tf-dpadambc`` or ``python -m tf_dpadambc`` starts (Python
  sets argv[0] to "-m" while it locates the module to run)."""
  argv = getattr(sys, "argv", None) or [""]
  return (os.path.basename(argv[0]).startswith("tf-dpadambc")
          or argv[0] == "-m")


if not _started_as_command():
  _load()
