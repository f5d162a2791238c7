"""Keras 3 adapters over the functional core."""
from tf_dpadambc.keras.optimizers import *  # noqa: F401,F403
from tf_dpadambc.keras.optimizers import __all__ as _OPTIMIZERS
from tf_dpadambc.keras.custom_loop import private_step
from tf_dpadambc.keras.custom_loop import register_dataset
from tf_dpadambc.keras.ghost import ClippingPlan
from tf_dpadambc.keras.rules import GhostRule
from tf_dpadambc.keras.rules import gradient_term
from tf_dpadambc.keras.rules import linear_term
from tf_dpadambc.keras.rules import register_ghost_rule
from tf_dpadambc.keras.training import clipping_plan
from tf_dpadambc.keras.training import is_private
from tf_dpadambc.keras.training import make_private
from tf_dpadambc.keras.training import private_gradient_sum

__all__ = list(_OPTIMIZERS) + ["ClippingPlan", "GhostRule", "clipping_plan",
                               "gradient_term", "is_private",
                               "linear_term", "make_private",
                               "private_gradient_sum", "private_step",
                               "register_dataset", "register_ghost_rule"]
