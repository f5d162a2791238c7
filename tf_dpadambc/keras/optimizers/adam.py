"""The private Adam variants: compositions of the Adam family and an estimator.

Decoupled weight decay (AdamW) is Keras' ``weight_decay`` argument for every
class here (θ ← θ − η·λ_wd·θ before the step; no privacy cost).
"""
from tf_dpadambc.keras.optimizers import adaptive
from tf_dpadambc.keras.optimizers import base
from tf_dpadambc.keras.optimizers import estimators

_ARGS = """
  Args:
    l2_norm_clip, noise_multiplier, num_microbatches,
    gradient_accumulation_steps, seed, clipping, automatic_gamma: see
    :class:`~tf_dpadambc.keras.optimizers.base.DPOptimizer`.
    learning_rate: η.
    beta_1, beta_2: EMA decays of the first and second moments.
    weight_decay: decoupled (AdamW) weight decay, as in Keras.
"""

_register = base.register(_ARGS)


@_register
class DPAdam(estimators.PostProcessing, adaptive.AdamFamily):
  """DP-Adam by post-processing: Adam on the private mean gradient ḡ.

      m ← β1 m + (1-β1) ḡ;  v ← β2 v + (1-β2) ḡ²;  θ ← θ − η m̂ / (√v̂ + ε)

  Privacy: exactly DP-SGD's (same σ, sampling rate and steps).
  E[v̂] = v̂^clean + Φ with Φ = (σC/B)²: when Φ dominates, this is DP-SGD with
  momentum under a decaying learning rate (Tang et al. 2024, Eq. 3;
  ``tf_dpadambc.dpsgdm_equivalent_learning_rate``). Algorithm 5 of Ganesh,
  McMahan & Thakurta (2025). ``epsilon``: ε added to √v̂.
  """


@_register
class DPAdamBC(estimators.BiasCorrection, adaptive.AdamFamily):
  """DP-AdamBC: Adam with the DP noise bias Φ removed from the second moment.

      θ ← θ − η · m̂ / sqrt(max(v̂ − Φ_t, γ'))

  with Φ_t = (1-β2)/(1-β2^t) Σ_{i≤t} β2^{t-i} (σC/B_i)², which is exactly
  Φ = (σC/B)² when every logical batch has B units (Tang, Shpilevskiy &
  Lécuyer, AAAI 2024, Algorithm 1; Algorithm 7 of Ganesh et al. 2025). Φ is
  subtracted after Adam's 1/(1−β2^t) correction; γ' is a floor, not an
  additive ε.

  Privacy: exactly DP-SGD's — Φ depends only on public σ, C, B, β2, t.
  Tuned learning rates are smaller than DP-Adam's (1.4–10x in Tang et al.'s
  runs), because the step is m̂/√γ' wherever v̂ − Φ < γ'. The papers tune ``gamma_prime`` γ' in
  1e-10 … 5e-8 (scale it with Φ; ``tf_dpadambc.advise`` suggests one).
  """


@_register
class DPAdamIME(estimators.IndependentMoments, adaptive.AdamFamily):
  """DP-Adam with independent moment estimation (Ganesh et al. 2025, Alg. 6).

      m ← β1 m + (1-β1)(ḡ_c + (√2σC/B) z1)
      v ← β2 v + (1-β2)(ḡ_c² + (√2σ(2B+1)C²/B²) z2)
      θ ← θ − η m̂ / (sqrt(max(v̂, 0)) + ε)

  Privacy: exactly DP-SGD's (two releases at √2σ compose to one at σ). The
  first moment carries twice DP-SGD's noise variance; worthwhile when the
  model is small relative to B/σ (``tf_dpadambc.advise``).
  """


@_register
class DPAdamJME(estimators.JointMoments, adaptive.AdamFamily):
  """DP-Adam with joint moment estimation (Kalinin, Upadhyay & Lampert 2025).

  One Gaussian release of (Σ clip(g_u), √λ Σ clip(g_u)²); v accumulates the
  mean of the squared clipped per-example gradients;
  θ ← θ − η m̂ / (sqrt(max(v̂, 0)) + ε). ``adjacency`` says how the extra
  sensitivity is handled (noise under add/remove, or the reported DpEvent
  under replace-one): see :class:`~.estimators.JointMoments`.
  """


@_register
class DPAdamSTP(estimators.ScaleThenPrivatize, adaptive.AdamFamily):
  """DP-Adam with scale-then-privatize (Ganesh et al. 2025, Algorithm 8).

      s_t = 1/(sqrt(v̂_{t-1}) + ε_s1);  g̃ = (Σ clip_C(s_t⊙g_u) + N(0,σ²C²))/(B s_t)

  then Adam on g̃. Privacy: exactly DP-SGD's. Best of the variants in
  high dimension (Ganesh et al.'s TinyBERT run); C bounds the scaled gradient
  and needs its own tuning. See :class:`~.estimators.ScaleThenPrivatize`.
  """


@_register
class NoiselessPreconditionerAdam(estimators.NoiselessPreconditioner,
                                  adaptive.AdamFamily):
  """NOT PRIVATE research baseline: Adam with noisy m and a clean v.

  m is built from the private ḡ, v from the un-noised mean of the clipped
  gradients. Warns at construction; ``dp_event`` and the privacy statements
  refuse to give it an ε.
  """
