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
from tf_dpadambc._version import __version__
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
    "privacy_statement", "__version__",
]
