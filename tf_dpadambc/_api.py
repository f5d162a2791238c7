"""The public API of :mod:`tf_dpadambc`, imported on first use (see
``tf_dpadambc/__init__.py``)."""
from tf_dpadambc.accounting import PrivacyBudget
from tf_dpadambc.accounting import PrivacyTensorBoard
from tf_dpadambc.accounting import compute_epsilon
from tf_dpadambc.accounting import compute_mf_noise_multiplier
from tf_dpadambc.accounting import compute_noise_multiplier
from tf_dpadambc.accounting import dp_sgd_event
from tf_dpadambc.accounting import epsilon_of_event
from tf_dpadambc.accounting import optimizer_privacy_statement
from tf_dpadambc.accounting import privacy_statement
from tf_dpadambc.advisor import Advice
from tf_dpadambc.advisor import advise
from tf_dpadambc import data  # noqa: F401
from tf_dpadambc import mf  # noqa: F401
from tf_dpadambc.keras import *  # noqa: F401,F403
from tf_dpadambc.mechanisms import CorrelatedNoise
from tf_dpadambc.mechanisms import IndependentNoise
from tf_dpadambc.theory import bias_correction_error_bound
from tf_dpadambc.theory import dpsgdm_equivalent_learning_rate
from tf_dpadambc.theory import dpsgdm_equivalent_momentum
from tf_dpadambc.keras import __all__ as _KERAS

__all__ = list(_KERAS) + [
    "Advice", "advise", "CorrelatedNoise", "IndependentNoise", "bias_correction_error_bound",
    "dpsgdm_equivalent_learning_rate", "dpsgdm_equivalent_momentum",
    "PrivacyBudget", "PrivacyTensorBoard", "compute_epsilon",
    "compute_mf_noise_multiplier", "compute_noise_multiplier",
    "dp_sgd_event", "epsilon_of_event", "optimizer_privacy_statement",
    "privacy_statement",
]
