"""TF-Privacy's DP queries and analysis, importable on TensorFlow ≥ 2.16.

``import tensorflow_privacy`` fails on current TensorFlow: its ``__init__``
imports the Estimator modules. The package honours a skip flag
(``sys.skip_tf_privacy_import``); this module sets it and imports the
submodules directly::

    from tf_dpadambc import tf_privacy
    query = tf_privacy.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=1.0, noise_multiplier=1.1,
        target_unclipped_quantile=0.5, learning_rate=0.2,
        clipped_count_stddev=256 / 20, expected_num_records=256)
    optimizer = tf_dpadambc.DPAdamBC(query=query, learning_rate=1e-3)

Install with ``pip install "tf-dpadambc[tf-privacy]"`` (tensorflow-privacy
0.9 supports Python < 3.12 and pins dp-accounting 0.4.3, numpy < 2).
"""
import importlib
import sys

_QUERIES = "tensorflow_privacy.privacy.dp_query."
_NAMES = {
    "DPQuery": _QUERIES + "dp_query",
    "SumAggregationDPQuery": _QUERIES + "dp_query",
    "GaussianSumQuery": _QUERIES + "gaussian_query",
    "NormalizedQuery": _QUERIES + "normalized_query",
    "NestedQuery": _QUERIES + "nested_query",
    "NoPrivacySumQuery": _QUERIES + "no_privacy_query",
    "QuantileAdaptiveClipSumQuery":
        _QUERIES + "quantile_adaptive_clip_sum_query",
    "QuantileEstimatorQuery": _QUERIES + "quantile_estimator_query",
    "TreeCumulativeSumQuery": _QUERIES + "tree_aggregation_query",
    "TreeResidualSumQuery": _QUERIES + "tree_aggregation_query",
    "RestartQuery": _QUERIES + "restart_query",
    "PeriodicRoundRestartIndicator": _QUERIES + "restart_query",
    "compute_dp_sgd_privacy_statement":
        "tensorflow_privacy.privacy.analysis.compute_dp_sgd_privacy_lib",
}

__all__ = sorted(_NAMES)


def available():
  """True if tensorflow-privacy is installed (and importable with the flag)."""
  try:
    _module(_NAMES["DPQuery"])
  except ImportError:
    return False
  return True


def _module(name):
  sys.skip_tf_privacy_import = True
  try:
    return importlib.import_module(name)
  except ImportError as e:
    raise ImportError(
        f"{name} is not available ({e}). Install TF-Privacy with: pip install "
        '"tf-dpadambc[tf-privacy]" (Python < 3.12).') from e


def __getattr__(name):
  if name not in _NAMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(_module(_NAMES[name]), name)
