"""Keras 3 adapters over the functional core."""
from tf_dpadambc.keras.optimizers import DPAdam
from tf_dpadambc.keras.optimizers import DPAdamBC
from tf_dpadambc.keras.optimizers import DPOptimizer
from tf_dpadambc.keras.optimizers import DPSGD
from tf_dpadambc.keras.training import is_private
from tf_dpadambc.keras.training import make_private
from tf_dpadambc.keras.training import private_gradient_sum
