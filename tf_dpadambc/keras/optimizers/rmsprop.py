"""Private RMSProp: the RMSProp family composed with each estimator."""
from tf_dpadambc.keras.optimizers import adaptive
from tf_dpadambc.keras.optimizers import base
from tf_dpadambc.keras.optimizers import estimators

_ARGS = """
  Args:
    l2_norm_clip, noise_multiplier, ...: see
    :class:`~tf_dpadambc.keras.optimizers.base.DPOptimizer`.
    learning_rate: η.  rho: ρ, the decay of v.
  The estimator's own arguments: see ``estimators.py``.
"""

_register = base.register(_ARGS)


@_register
class DPRMSProp(estimators.PostProcessing, adaptive.RMSPropFamily):
  """RMSProp on ḡ: v ← ρv + (1-ρ)ḡ², θ ← θ − η ḡ/(√v + ε). Privacy = DP-SGD."""


@_register
class DPRMSPropBC(estimators.BiasCorrection, adaptive.RMSPropFamily):
  """Bias-corrected RMSProp: θ ← θ − η ḡ / sqrt(max(v − Φ_t, γ')).

  Φ_t = Σ_{i≤t} (1-ρ) ρ^{t-i} Var_i = (1-ρ^t)(σC/B)² at a constant batch
  size (v is not debiased). Privacy = DP-SGD.
  """


@_register
class DPRMSPropIME(estimators.IndependentMoments, adaptive.RMSPropFamily):
  """RMSProp with independent moment estimation: v accumulates the unbiased
  release of ḡ²; θ ← θ − η ḡ/(sqrt(max(v,0)) + ε). Privacy = DP-SGD."""


@_register
class DPRMSPropSTP(estimators.ScaleThenPrivatize, adaptive.RMSPropFamily):
  """RMSProp with scale-then-privatize: clip/noise s_t⊙g_u with
  s_t = 1/(sqrt(v_{t-1}) + ε_s1), unscale, RMSProp step. Privacy = DP-SGD."""
