"""Validation of a DP optimizer's constructor arguments.

Run before Keras' ``__init__`` so that bad input fails first, and before any
state exists: what is refused here (a DPQuery with a variant that privatizes
its own way, Poisson batches where normalising by the expected B would be
unsound) never reaches the release.
"""
import numbers
import warnings

import tensorflow as tf

from tf_dpadambc import mechanisms
from tf_dpadambc import queries
from tf_dpadambc._checks import check_count
from tf_dpadambc._checks import check_positive

# The smallest automatic clipping γ accepted (see validated).
MIN_AUTOMATIC_GAMMA = 1e-20

ARGS_DOC = """  Args:
    l2_norm_clip: C > 0, the L2 bound on each unit's (example's or
      microbatch's) gradient; or a list with one bound C_k per trainable
      variable (per-layer clipping: the noise std is σ·‖(C_k)‖₂, and Φ uses
      it too).
    noise_multiplier: σ ≥ 0; the noise added to the clipped sum has std σC.
      ``0`` is accepted for debugging but the training is then NOT private
      (a warning is issued and the privacy report says so).
    num_microbatches: ``None`` clips every example (the default and the
      tightest accounting). An integer M splits each physical batch into M
      microbatches whose mean gradients are clipped; it must divide the batch
      size. Microbatches of more than one example double the sensitivity
      (add/remove or zero-out), which the accounting takes into account.
    gradient_accumulation_steps: ``None`` or k ≥ 1: one logical private step
      over k physical batches. Clipped sums accumulate, the noise is drawn
      once, and the mean divides by the logical batch's number of units B;
      Φ and the accounting use that logical batch.
    seed: ``None`` (a secret seed from the OS) or an integer that makes the
      noise reproducible. Anyone who knows the seed can remove the noise: use
      it for debugging and tests, and keep it secret. No seed is ever saved,
      not even a given one (``get_config`` says ``seed=None``): pass it again
      to the optimizer that resumes a run.
    clipping: ``"standard"`` (g·min(1, C/‖g‖)) or ``"automatic"``
      (g·C/(‖g‖+γ), Bu et al., NeurIPS 2023: every unit is normalized, so C
      only scales the step; its sensitivity is still C).
    automatic_gamma: γ ≥ 1e-20 of automatic clipping.
    noise: the noise mechanism (``tf_dpadambc.mechanisms``):
      ``IndependentNoise()`` (the default, DP-SGD's) or
      ``CorrelatedNoise(strategy, steps, ...)`` (DP-MF: noise correlated
      across steps, σΔ·sens(C)·(C⁻¹z)_t; Φ follows its per-step variance).
    query: instead of ``l2_norm_clip``/``noise_multiplier``/``noise``, a
      TF-Privacy DPQuery (``tf_dpadambc.tf_privacy.GaussianSumQuery``,
      ``QuantileAdaptiveClipSumQuery``, tree aggregation, ...) that clips and
      noises each step (``tf_dpadambc.queries``): its global state advances
      inside the compiled step, its DpEvent is what ``dp_event`` composes.
      For the variants that release the plain clipped sum
      (``TRAITS.releases_plain_sum``); needs per-unit gradients
      (clipping="vectorized" speed) unless the query clips by L2 norm.
    expected_batch_size: ``None`` (fixed-size batches) or B ≥ 1: every batch
      is a Poisson sample of expected size B (``data.poisson_batches``). The
      mean then divides by B, never by the realized batch size (which is not
      private; as Opacus), Φ = (σC/B)², and ``dp_event`` accounts Poisson
      sampling with q = B/N — only. Not with ``num_microbatches``, gradient
      accumulation, correlated noise, a DPQuery or IME.
    learning_rate, **kwargs: as for ``keras.optimizers.Optimizer``
      (``weight_decay`` gives decoupled weight decay, at no privacy cost).
"""


def check_clip(value):
  """A clip norm C > 0, or a list of per-variable bounds C_k > 0."""
  if isinstance(value, (list, tuple)):
    if not value:
      raise ValueError("l2_norm_clip: an empty list of per-layer clip norms.")
    return [check_positive(f"l2_norm_clip[{i}]", c) for i, c in enumerate(value)]
  return check_positive("l2_norm_clip", value)


def check_clip_count(l2_norm_clip, variables):
  """Per-layer clip norms: one per trainable variable."""
  if isinstance(l2_norm_clip, list) and len(l2_norm_clip) != len(variables):
    raise ValueError(
        f"{len(l2_norm_clip)} per-layer clip norms for {len(variables)} "
        "trainable variables: give one per variable.")


# The attributes :func:`validated` returns, and what is derived from them:
# set once, when the optimizer is made (base.DPOptimizer.FIXED, which
# subclasses extend with their own).
FIXED = frozenset({
    "l2_norm_clip", "noise_multiplier", "num_microbatches",
    "accumulation_steps", "seed", "clipping", "automatic_gamma", "noise",
    "query", "expected_batch_size", "privatizer"})


def validated(cls, l2_norm_clip, noise_multiplier, num_microbatches,
              gradient_accumulation_steps, seed, clipping, automatic_gamma,
              noise, query, expected_batch_size, kwargs):
  """The checked arguments of ``cls(...)``, as a dict of attributes (the
  query wrapped in a :class:`~tf_dpadambc.queries.QueryRelease`, the noise
  deserialized, ``accumulation_steps`` ≥ 1)."""
  name = cls.__name__
  if query is not None:
    _check_query_use(cls, l2_norm_clip, noise_multiplier, noise, clipping,
                     gradient_accumulation_steps)
    query = queries.QueryRelease(query)
  elif l2_norm_clip is None or noise_multiplier is None:
    raise TypeError(f"{name} needs l2_norm_clip and noise_multiplier (or a "
                    "TF-Privacy DPQuery as query=...).")
  else:
    l2_norm_clip = check_clip(l2_norm_clip)
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier,
                                      allow_zero=True)
  if clipping not in ("standard", "automatic"):
    raise ValueError('clipping must be "standard" or "automatic"; got '
                     f"{clipping!r}.")
  automatic_gamma = check_positive("automatic_gamma", automatic_gamma)
  if automatic_gamma < MIN_AUTOMATIC_GAMMA:
    # C/γ is the factor of an example whose gradient is 0: past float32's
    # range below this (for C up to 1e18), and needlessly extreme anyway.
    raise ValueError(f"automatic_gamma must be ≥ {MIN_AUTOMATIC_GAMMA:g} "
                     f"(Bu et al. use 0.01); got {automatic_gamma!r}.")
  num_microbatches = check_count("num_microbatches", num_microbatches)
  accumulation_steps = check_count(
      "gradient_accumulation_steps", gradient_accumulation_steps) or 1
  if kwargs.get("loss_scale_factor") is not None:
    raise ValueError(
        "loss_scale_factor is not supported by DP optimizers: the private "
        "train step scales each unit's loss itself under mixed_float16 "
        "(static, divided out before clipping: "
        "tf_dpadambc.make_private(model, loss_scale=...)).")
  mechanism = mechanisms.deserialize(noise)
  if (mechanism.l2_norm_clip is not None
      or mechanism.noise_multiplier is not None):
    raise ValueError(
        "The noise mechanism passed to an optimizer takes l2_norm_clip and "
        "noise_multiplier from the optimizer; build it without them (they "
        "are for its use as a TF-Privacy DPQuery).")
  if seed is not None and (isinstance(seed, bool)
                           or not isinstance(seed, numbers.Integral)):
    raise ValueError(f"seed must be None or an integer; got {seed!r}.")
  expected_batch_size = _check_poisson_use(
      cls, expected_batch_size, num_microbatches, accumulation_steps,
      query or mechanism)
  return dict(l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
              num_microbatches=num_microbatches,
              accumulation_steps=accumulation_steps, seed=seed,
              clipping=clipping, automatic_gamma=automatic_gamma,
              noise=mechanism, query=query,
              expected_batch_size=expected_batch_size)


def warn_if_not_private(optimizer):
  """The warnings of a constructed optimizer that is not (verifiably) private."""
  name = optimizer.__class__.__name__
  if optimizer.noise_multiplier == 0:
    warnings.warn(
        f"{name} with noise_multiplier=0 adds no noise: training is NOT "
        "differentially private (gradients are still clipped). Use it only "
        "for debugging.", UserWarning, stacklevel=3)


def check_serializable(optimizer):
  """A DPQuery is no Keras object: an optimizer holding one has no config."""
  if optimizer.query is not None:
    raise NotImplementedError(
        f"{optimizer.name} holds a TF-Privacy DPQuery, which is not a Keras "
        "object and cannot be serialized. Save the weights "
        "(model.save_weights, or model.save(..., include_optimizer=False)) "
        "and build the optimizer again with its query.")


def check_query_state(optimizer, state):
  """Refuses a query whose Φ a bias-correcting variant would need but that
  tf_dpadambc cannot know; warns when the query adds no noise."""
  query = optimizer.query
  if (optimizer.traits.needs_noise_variance
      and query.noise_stddev(state) is None):
    raise ValueError(
        f"{optimizer.__class__.__name__} subtracts the noise variance Φ, but "
        f"the noise std of {type(query.query).__name__} is not known "
        "to tf_dpadambc. Use a Gaussian sum query (GaussianSumQuery, "
        "QuantileAdaptiveClipSumQuery, NormalizedQuery) or a variant "
        "without bias correction (DPAdam, DPSGD).")
  if not query.is_private:
    warnings.warn(
        f"{optimizer.name}: the DPQuery {type(query.query).__name__} adds "
        "no noise (its DpEvent says so): training is NOT differentially "
        "private.", UserWarning, stacklevel=3)


def _check_query_use(cls, l2_norm_clip, noise_multiplier, noise,
                     clipping_mode, accumulation):
  """A DPQuery replaces the Gaussian mechanism of the release; refuse the
  settings and classes it cannot serve soundly."""
  name = cls.__name__
  if l2_norm_clip is not None or noise_multiplier is not None:
    raise ValueError(
        f"{name}: pass either query= or l2_norm_clip/noise_multiplier; the "
        "query does its own clipping and noise.")
  if noise is not None:
    raise ValueError(f"{name}: query= and noise= are exclusive (the query "
                     "is the noise mechanism).")
  if clipping_mode != "standard":
    raise ValueError(f"{name}: clipping={clipping_mode!r} with a query; the "
                     "query's preprocess_record does the clipping.")
  if accumulation not in (None, 1):
    raise ValueError(
        f"{name}: gradient_accumulation_steps with a query is not "
        "supported (the query's sample state would have to persist across "
        "physical batches); use a larger batch.")
  if not cls.TRAITS.releases_plain_sum:
    how = ("sums of squares" if cls.TRAITS.uses_square_sum
           else "its own release or clip spec")
    raise ValueError(
        f"{name} privatizes its own way ({how}), so a DPQuery cannot stand "
        "in for its mechanism. "
        "Queries work with the variants that release the plain clipped "
        "sum: DPSGD, DPAdam, DPAdamBC, DPRMSProp(BC), DPAdagrad(BC), ...")


def _check_poisson_use(cls, expected_batch_size, num_microbatches,
                       accumulation_steps, privatizer):
  """B for Poisson-sampled batches (or None); refuses what would make the
  normalisation by B or the accounting with q = B/N unsound."""
  expected_batch_size = check_count("expected_batch_size",
                                    expected_batch_size)
  if expected_batch_size is None:
    return None
  refused = [
      (num_microbatches is not None, "num_microbatches (microbatches of "
       "a random-size batch have no fixed size or sensitivity)"),
      (accumulation_steps > 1, "gradient_accumulation_steps (k Poisson "
       "batches together are not one Poisson sample of rate kB/N: an "
       "example can be in several); use a larger expected_batch_size"),
      (privatizer.poisson_refusal() is not None,
       privatizer.poisson_refusal()),
      (cls.TRAITS.poisson_unsupported is not None,
       cls.TRAITS.poisson_unsupported)]
  for bad, why in refused:
    if bad:
      raise ValueError(f"{cls.__name__}: expected_batch_size (Poisson-sampled "
                       f"batches) is not supported with {why}.")
  return expected_batch_size
