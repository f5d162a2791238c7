"""Ghost-clipping rules, one module per family, and their registry.

``register_ghost_rule(LayerClass, rule)`` adds a rule (see
:mod:`~tf_dpadambc.keras.rules.registry` for the contract); the built-in
rules register the same way, in ``linear``, ``embedding``,
``normalization`` and ``recurrent``.
"""
from tf_dpadambc.keras.rules import embedding  # noqa: F401  (registers)
from tf_dpadambc.keras.rules import linear  # noqa: F401  (registers)
from tf_dpadambc.keras.rules import normalization  # noqa: F401  (registers)
from tf_dpadambc.keras.rules import recurrent  # noqa: F401  (registers)
from tf_dpadambc.keras.rules.base import GhostRule
from tf_dpadambc.keras.rules.base import RuleContext
from tf_dpadambc.keras.rules.base import UnitCall
from tf_dpadambc.keras.rules.base import gradient_term
from tf_dpadambc.keras.rules.base import linear_term
from tf_dpadambc.keras.rules.registry import register_ghost_rule

__all__ = ["GhostRule", "RuleContext", "UnitCall", "gradient_term",
           "linear_term", "register_ghost_rule"]
