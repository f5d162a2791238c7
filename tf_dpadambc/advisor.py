"""Which private Adam variant suits a (B, σ, C, m)? A verdict from the papers.

    advice = tf_dpadambc.advisor.advise(batch_size=256, noise_multiplier=0.4,
                                        l2_norm_clip=0.1, model=model)
    print(advice)

The verdict follows Ganesh, McMahan & Thakurta (2025), §4.4: estimators of
Adam's second moment that are unbiased — bias correction (DPAdamBC) and
independent moment estimation (DPAdamIME) — produce many negative estimates
v̂ − Φ once the model dimension m is large compared with B/σ, and then either
take huge steps or need a floor γ' so large that it undoes the correction.
The regimes come from their Eqs. 2 and 3 (general β2: Appendix C, Eqs. 6–7):

    optimistic  (per-example gradients aligned, ‖ḡ‖₂ ≈ C):       B/σ ≥ c·√m
    pessimistic (per-example gradients orthogonal, ‖ḡ‖₂ ≈ C/√B): √B/σ ≥ c·√m
    c = ((1-β2)² / (1-β2²))^{1/4} = ((1-β2)/(1+β2))^{1/4}   (≈ 0.15, β2 = 0.999)

"≳" in the paper is read here as "≥": the regime boundaries are exactly these
inequalities (our choice; the paper gives orders of magnitude, not sharp
thresholds).
"""
import dataclasses
import math

import numpy as np

from tf_dpadambc import theory
from tf_dpadambc._checks import check_count
from tf_dpadambc._checks import check_decay
from tf_dpadambc._checks import check_positive

LOW_DIMENSIONAL = "low-dimensional"
INTERMEDIATE = "intermediate"
HIGH_DIMENSIONAL = "high-dimensional"

# (B, C, σ, γ') of Tang et al.'s (AAAI 2024, Appendix A) tuned DP-AdamBC
# runs whose Φ follows from the reported hyper-parameters (not ogbn-arxiv:
# its GNN sensitivity depends on a degree bound). γ'/Φ spans ≈ 4e-3 … 0.84;
# we suggest that span scaled by the user's Φ.
TANG_TUNED_GAMMA_PRIME = {
    "CIFAR10": (8192, 1.0, 2.0, 5e-8),
    "SNLI": (256, 0.1, 0.4, 1e-10),
    "QNLI": (256, 0.1, 0.4, 3e-9),
}


def _tuned_ratios():
  ratios = [gamma / theory.phi(b, c, s)
            for b, c, s, gamma in TANG_TUNED_GAMMA_PRIME.values()]
  return min(ratios), max(ratios)


GAMMA_PRIME_TO_PHI_RANGE = _tuned_ratios()


def regime_constant(beta_2=0.999):
  """c = ((1-β2)²/(1-β2²))^{1/4} of Ganesh et al. (2025), Appendix C, Eq. 6.

  The "0.15" of their §4.4.1 Eqs. 2–3 is c at β2 = 0.999 (1/1999^{1/4}).
  """
  beta_2 = check_decay("beta_2", beta_2)
  return ((1.0 - beta_2) / (1.0 + beta_2)) ** 0.25


@dataclasses.dataclass(frozen=True)
class Advice:
  """The quantities behind the verdict; ``str(advice)`` is the verdict.

  Attributes:
    batch_size: B, the logical batch size (physical × accumulation steps).
    gradient_accumulation_steps: k, physical batches per private step.
    noise_multiplier: σ.
    l2_norm_clip: C.
    num_parameters: m, trainable parameters.
    beta_1, beta_2: Adam's decays used below.
    phi: Φ = (σC/B)², the DP bias of v̂ (Tang et al. 2024, Eq. 2).
    b_over_sigma: B/σ.
    sqrt_b_over_sigma: √B/σ.
    regime_constant: c(β2) (≈ 0.15 at β2 = 0.999).
    threshold: c·√m, the right-hand side of Ganesh et al.'s Eqs. 2 and 3.
    optimistic_condition: B/σ ≥ c·√m (Ganesh et al. Eq. 2).
    pessimistic_condition: √B/σ ≥ c·√m (Ganesh et al. Eq. 3).
    regime: ``"low-dimensional"`` (both hold), ``"intermediate"`` (Eq. 2
      only) or ``"high-dimensional"`` (neither; Eq. 3 implies Eq. 2).
    min_batch_size_optimistic: c·√m·σ, the smallest B satisfying Eq. 2.
    min_batch_size_pessimistic: (c·√m·σ)², the smallest B satisfying Eq. 3.
    dpsgdm_learning_rate_factor: (1-β1)/√Φ: DP-Adam at rate η behaves like
      DP-SGD with momentum β1 at rate η × this (Tang et al. Eq. 3, t → ∞).
    gamma_prime_range: Φ × ``GAMMA_PRIME_TO_PHI_RANGE``: the γ'/Φ ratios of
      Tang et al.'s tuned DP-AdamBC runs, scaled to this Φ (a search range
      for DPAdamBC's ``gamma_prime``, not a guarantee).
  """
  batch_size: float
  gradient_accumulation_steps: int
  noise_multiplier: float
  l2_norm_clip: float
  num_parameters: int
  beta_1: float
  beta_2: float
  phi: float
  b_over_sigma: float
  sqrt_b_over_sigma: float
  regime_constant: float
  threshold: float
  optimistic_condition: bool
  pessimistic_condition: bool
  regime: str
  min_batch_size_optimistic: float
  min_batch_size_pessimistic: float
  dpsgdm_learning_rate_factor: float
  gamma_prime_range: tuple

  def __str__(self):
    lo, hi = self.gamma_prime_range
    c = self.regime_constant
    lines = [
        f"DP-Adam advice: B = {self.batch_size:g} (logical batch), "
        f"σ = {self.noise_multiplier:g}, C = {self.l2_norm_clip:g}, "
        f"m = {self.num_parameters:,} parameters, β2 = {self.beta_2:g}.",
        f"  Φ = (σC/B)² = {self.phi:.4g}: the bias of DP-Adam's v̂; "
        "DPAdamBC subtracts it.",
        f"  B/σ = {self.b_over_sigma:.4g}, √B/σ = {self.sqrt_b_over_sigma:.4g}"
        f"; threshold {c:.3g}·√m = {self.threshold:.4g} "
        "(Ganesh et al. 2025, §4.4.1).",
        f"  Optimistic condition B/σ ≥ {c:.3g}·√m (their Eq. 2): "
        f"{_verdict(self.optimistic_condition)}. Pessimistic condition "
        f"√B/σ ≥ {c:.3g}·√m (their Eq. 3): "
        f"{_verdict(self.pessimistic_condition)}.",
        f"Regime: {self.regime}.",
    ]
    lines += [f"  - {line}" for line in self._recommendations(lo, hi)]
    lines.append(
        "  Caveat: §4.4.1 assumes gradient magnitudes roughly uniform across "
        "coordinates. In Ganesh et al.'s TinyBERT run (m ≈ 4.4M, B = 2048, "
        "σ ≈ 0.134) both conditions hold, yet 45–50% of the coordinates of "
        "v̂ − Φ were negative: failing a condition predicts trouble, passing "
        "it does not rule it out. Watch the fraction of coordinates with "
        "v̂ − Φ < γ' during training.")
    return "\n".join(lines)

  def _recommendations(self, lo, hi):
    sgdm = (f"DPAdam (no correction) behaves like DP-SGD with momentum "
            f"β1 = {self.beta_1:g} at learning rate η × "
            f"{self.dpsgdm_learning_rate_factor:.4g} (Tang et al. 2024, "
            "Eq. 3): a safe baseline, but not adaptive.")
    gamma = (f"gamma_prime γ' in [{lo:.2g}, {hi:.2g}] (Φ × "
             f"[{GAMMA_PRIME_TO_PHI_RANGE[0]:.2g}, "
             f"{GAMMA_PRIME_TO_PHI_RANGE[1]:.2g}], the γ'/Φ of Tang et al.'s "
             "tuned runs)")
    if self.regime == LOW_DIMENSIONAL:
      return [
          "DPAdamBC (bias correction): this is the regime where it can "
          "help: even with orthogonal per-example gradients, v̂ − Φ is not "
          f"expected to be negative in many coordinates. Tune {gamma} "
          "together with the learning rate.",
          "DPAdamIME (independent moment estimation): also viable (it does "
          "well in low dimension), but its second moment is noisier than "
          "DPAdamBC's, so these conditions are optimistic for it.",
          "DPAdamSTP (scale-then-privatize): still worth trying: in Ganesh "
          "et al.'s TinyBERT run in this regime (σ ≈ 0.134) it beat "
          "bias correction, which beat DPAdam only slightly. Re-tune C for "
          "the scaled gradients.",
          sgdm,
      ]
    if self.regime == INTERMEDIATE:
      return [
          "DPAdamBC (bias correction): works only if per-example gradients "
          "are well aligned (‖ḡ‖₂ close to C); if they are closer to "
          "orthogonal (‖ḡ‖₂ ≈ C/√B) many coordinates of v̂ − Φ turn "
          f"negative. Try it with {gamma}, and fall back if many "
          "coordinates sit at the floor.",
          "DPAdamIME (independent moment estimation): riskier than "
          "DPAdamBC; its second moment is noisier.",
          "DPAdamSTP (scale-then-privatize): the safer adaptive choice; "
          "re-tune C. (Ganesh et al.'s TinyBERT run with independent "
          "noise and σ = 1 is in this regime: bias correction did worse "
          "than DPAdam there, scale-then-privatize best.)",
          "To reach the low-dimensional regime at this σ: "
          f"{self._batch_target(self.min_batch_size_pessimistic)}, or fewer "
          f"parameters. {_RECHECK}",
          sgdm,
      ]
    return [
        "DPAdamBC (bias correction) and DPAdamIME (independent moment "
        "estimation): not recommended. Expect many negative v̂ − Φ: a small "
        "γ' gives huge steps η·m̂/√γ' in those coordinates, and a γ' near Φ "
        f"(the top of [{lo:.2g}, {hi:.2g}]) that keeps steps bounded undoes "
        "the correction (Ganesh et al. §4.4.2).",
        "DPAdamSTP (scale-then-privatize): the recommended adaptive variant "
        "here (the best variant in Ganesh et al.'s high-dimensional TinyBERT "
        "experiment); re-tune C for the scaled gradients.",
        sgdm,
        "To leave this regime at this σ: "
        f"{self._batch_target(self.min_batch_size_optimistic)} satisfies "
        "the optimistic condition; "
        f"{self._batch_target(self.min_batch_size_pessimistic)} the "
        f"pessimistic one. {_RECHECK}",
    ]

  def _batch_target(self, min_batch):
    physical = self.batch_size / self.gradient_accumulation_steps
    steps = math.ceil(min_batch / physical)
    return (f"a logical batch B ≥ {math.ceil(min_batch):,} "
            f"(gradient_accumulation_steps ≥ {steps:,} at {physical:g} "
            "examples per batch)")


_RECHECK = ("A larger batch at the same σ changes ε (with Poisson sampling "
            "it raises it): re-check it with compute_epsilon, or recalibrate "
            "σ with compute_noise_multiplier.")


def _verdict(holds):
  return "holds" if holds else "fails"


def _count_parameters(model):
  weights = getattr(model, "trainable_weights", None)
  if weights is None:
    raise ValueError(f"model must be a Keras model; got {model!r}.")
  count = sum(int(np.prod(w.shape)) for w in weights)
  if count == 0:
    raise ValueError("model has no trainable parameters; build it first "
                     "(e.g. start it with keras.Input).")
  return count


def advise(batch_size, noise_multiplier, l2_norm_clip, num_parameters=None,
           *, model=None, gradient_accumulation_steps=1, beta_1=0.9,
           beta_2=0.999):
  """Places (B, σ, m) in Ganesh et al.'s regimes and says what it implies.

  Ganesh, McMahan & Thakurta (2025), "On Design Principles for Private
  Adaptive Optimizers", §4.4.1 (Eqs. 2–3; Appendix C, Eqs. 6–7 for general
  β2): bias correction and independent moment estimation avoid many
  negative second-moment estimates when B/σ ≳ c√m (per-example gradients
  aligned: optimistic) or √B/σ ≳ c√m (orthogonal: pessimistic), with
  c = ((1-β2)/(1+β2))^{1/4} ≈ 0.15.
  §4.4.2: otherwise they either take huge steps or need γ' ≈ Φ, which
  undoes the correction. Φ and the DP-SGDM equivalence are Tang et al.
  (AAAI 2024), Eqs. 2–3; the γ' range is their tuned γ'/Φ ratios scaled to
  this Φ. Our choices, not the papers': "≳" read as "≥", and the three
  regime names. The paper's worked example (B = 2048, σ = 1: m ≲ 10⁶ by
  Eq. 2, m ≲ 2·10⁴ by Eq. 3) does not follow from its equations, which give
  m ≤ 1.9·10⁸ and m ≤ 9.2·10⁴; we implement the equations.

  Args:
    batch_size: examples (clipped units) per physical batch; the logical
      batch is ``batch_size × gradient_accumulation_steps`` (with Poisson
      sampling, its expected size).
    noise_multiplier: σ > 0 (with σ = 0 there is no DP noise to advise on).
    l2_norm_clip: C > 0.
    num_parameters: m, trainable parameters; or pass ``model`` instead.
    model: a built Keras model whose trainable parameters are counted.
    gradient_accumulation_steps: k ≥ 1 physical batches per private step.
    beta_1: Adam's β1 (for the DP-SGDM learning-rate factor).
    beta_2: Adam's β2 (enters c).

  Returns:
    An :class:`Advice`; print it for the verdict.
  """
  if (num_parameters is None) == (model is None):
    raise ValueError("Pass exactly one of num_parameters and model.")
  if model is not None:
    num_parameters = _count_parameters(model)
  num_parameters = check_count("num_parameters", num_parameters, allow_none=False)
  accumulation = check_count("gradient_accumulation_steps",
                              gradient_accumulation_steps, allow_none=False)
  batch = check_positive("batch_size", batch_size) * accumulation
  if batch < 1:
    raise ValueError(f"The logical batch size must be ≥ 1; got {batch:g}.")
  sigma = check_positive("noise_multiplier", noise_multiplier)
  beta_1 = check_decay("beta_1", beta_1)
  constant = regime_constant(beta_2)
  noise_variance = theory.phi(batch, l2_norm_clip, sigma)

  threshold = constant * math.sqrt(num_parameters)
  optimistic = batch / sigma >= threshold
  pessimistic = math.sqrt(batch) / sigma >= threshold
  if pessimistic and optimistic:
    regime = LOW_DIMENSIONAL
  elif optimistic:
    regime = INTERMEDIATE
  else:
    regime = HIGH_DIMENSIONAL
  lo, hi = GAMMA_PRIME_TO_PHI_RANGE
  return Advice(
      batch_size=batch, gradient_accumulation_steps=accumulation,
      noise_multiplier=sigma,
      l2_norm_clip=float(l2_norm_clip), num_parameters=num_parameters,
      beta_1=beta_1, beta_2=float(beta_2), phi=noise_variance,
      b_over_sigma=batch / sigma,
      sqrt_b_over_sigma=math.sqrt(batch) / sigma,
      regime_constant=constant, threshold=threshold,
      optimistic_condition=optimistic, pessimistic_condition=pessimistic,
      regime=regime,
      min_batch_size_optimistic=threshold * sigma,
      min_batch_size_pessimistic=(threshold * sigma) ** 2,
      dpsgdm_learning_rate_factor=theory.dpsgdm_equivalent_learning_rate(
          1.0, batch, l2_norm_clip, sigma, beta_1),
      gamma_prime_range=(lo * noise_variance, hi * noise_variance))
