"""Keras 3 optimizers: thin shells over the functional core."""
from tf_dpadambc.keras.optimizers.adam import DPAdam
from tf_dpadambc.keras.optimizers.adam import DPAdamBC
from tf_dpadambc.keras.optimizers.base import DPOptimizer
from tf_dpadambc.keras.optimizers.sgd import DPSGD

__all__ = ["DPAdam", "DPAdamBC", "DPOptimizer", "DPSGD"]
