"""Keras 3 optimizers: thin shells over the functional core.

``base``: the Gaussian mechanism every optimizer shares (one release path;
``state``: its unsaved state, ``arguments``: its validation, ``distributed``:
the cross-replica update). ``traits``: what each class declares about its
privatization, and how to add a variant. ``adaptive``: the
moment families (Adam, RMSProp, AdaGrad). ``estimators``: how each variant
privatizes or corrects the second moment. ``adam``, ``rmsprop``, ``adagrad``:
the public classes, one composition each. ``delayed`` (DP²), ``public``
(AdaDPS), ``sgd``: the optimizers with their own update rules.
"""
from tf_dpadambc.keras.optimizers.adagrad import DPAdagrad
from tf_dpadambc.keras.optimizers.adagrad import DPAdagradBC
from tf_dpadambc.keras.optimizers.adagrad import DPAdagradIME
from tf_dpadambc.keras.optimizers.adagrad import DPAdagradSTP
from tf_dpadambc.keras.optimizers.adam import DPAdam
from tf_dpadambc.keras.optimizers.adam import DPAdamBC
from tf_dpadambc.keras.optimizers.adam import DPAdamIME
from tf_dpadambc.keras.optimizers.adam import DPAdamJME
from tf_dpadambc.keras.optimizers.adam import DPAdamSTP
from tf_dpadambc.keras.optimizers.adam import NoiselessPreconditionerAdam
from tf_dpadambc.keras.optimizers.base import DPOptimizer
from tf_dpadambc.keras.optimizers.delayed import DP2Adagrad
from tf_dpadambc.keras.optimizers.delayed import DP2RMSProp
from tf_dpadambc.keras.optimizers.public import DPAdamPublicPreconditioner
from tf_dpadambc.keras.optimizers.rmsprop import DPRMSProp
from tf_dpadambc.keras.optimizers.rmsprop import DPRMSPropBC
from tf_dpadambc.keras.optimizers.rmsprop import DPRMSPropIME
from tf_dpadambc.keras.optimizers.rmsprop import DPRMSPropSTP
from tf_dpadambc.keras.optimizers.sgd import DPSGD

__all__ = [
    "DP2Adagrad", "DP2RMSProp", "DPAdagrad", "DPAdagradBC", "DPAdagradIME",
    "DPAdagradSTP", "DPAdam", "DPAdamBC", "DPAdamIME", "DPAdamJME",
    "DPAdamPublicPreconditioner", "DPAdamSTP", "DPOptimizer", "DPRMSProp",
    "DPRMSPropBC", "DPRMSPropIME", "DPRMSPropSTP", "DPSGD",
    "NoiselessPreconditionerAdam",
]
