"""Functional core: small, pure TensorFlow functions, no Keras objects inside.

The modules follow the path a gradient takes through private training:

    per_example  ->  clipping  ->  noise  ->  moments  ->  updates
    (per-unit        (bound each    (Gaussian   (EMA of m, v,   (Adam / bias-corrected
     gradients        unit's norm    release)    Φ tracking)     directions)
     and norms)       by C)

Keras (and later tf_keras) adapters compose these pieces; they hold no formula
of their own.
"""
from tf_dpadambc.core import clipping
from tf_dpadambc.core import moments
from tf_dpadambc.core import noise
from tf_dpadambc.core import per_example
from tf_dpadambc.core import updates

__all__ = ["clipping", "moments", "noise", "per_example", "updates"]
