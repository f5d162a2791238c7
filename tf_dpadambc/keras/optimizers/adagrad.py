"""Private AdaGrad: the AdaGrad family composed with each estimator."""
from tf_dpadambc.keras.optimizers import adaptive
from tf_dpadambc.keras.optimizers import base
from tf_dpadambc.keras.optimizers import estimators

_ARGS = """
  Args:
    l2_norm_clip, noise_multiplier, ...: see
    :class:`~tf_dpadambc.keras.optimizers.base.DPOptimizer`.
    learning_rate: η.  initial_accumulator_value: a₀ ≥ 0.
  The estimator's own arguments: see ``estimators.py``.
"""

_register = base.register(_ARGS)


@_register
class DPAdagrad(estimators.PostProcessing, adaptive.AdagradFamily):
  """AdaGrad on ḡ: v ← v + ḡ², θ ← θ − η ḡ/(√v + ε) (Ganesh et al. Alg. 3
  with Alg. 5's release). Privacy = DP-SGD."""


@_register
class DPAdagradBC(estimators.BiasCorrection, adaptive.AdagradFamily):
  """Bias-corrected AdaGrad: θ ← θ − η ḡ / sqrt(max(v − Σ_{i≤t} Var_i, γ'))
  (= v − tΦ at a constant batch size). Privacy = DP-SGD."""


@_register
class DPAdagradIME(estimators.IndependentMoments, adaptive.AdagradFamily):
  """AdaGrad with independent moment estimation (Ganesh et al. Fig. 2):
  v accumulates the unbiased release of ḡ²; θ ← θ − η ḡ/(sqrt(max(v,0)) + ε).
  Privacy = DP-SGD."""


@_register
class DPAdagradSTP(estimators.ScaleThenPrivatize, adaptive.AdagradFamily):
  """AdaGrad with scale-then-privatize: s_t = 1/(sqrt(v_{t-1}) + ε_s1).
  Privacy = DP-SGD."""
