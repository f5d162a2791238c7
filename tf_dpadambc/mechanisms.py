"""Noise mechanisms: what a private step adds to its clipped sum (stage 3).

Every optimizer takes ``noise=`` (default :class:`IndependentNoise`):

======================================  =================================  =========================
mechanism                               added to the clipped sum at step t  accounting
======================================  =================================  =========================
``IndependentNoise()``                  σΔ·z_t (DP-SGD)                     per step, amplified by
                                                                            Poisson sampling
``CorrelatedNoise(strategy, steps,      σΔ·sens(C)·(C⁻¹z)_t (DP-MF)         one Gaussian mechanism
participations, min_separation)``                                           (σ) for the whole run
======================================  =================================  =========================

with Δ the clipping's sensitivity and z_t ~ N(0, I). The optimizers use
:meth:`sample` (deterministic counter-based seeds, state kept in unsaved
optimizer variables, so a run continues its stream across ``fit`` calls);
the adaptive variants scale their noise bias Φ_t by
:meth:`variance_factor` = sens(C)²·‖row_t(C⁻¹)‖².

Each mechanism is also a TF-Privacy ``DPQuery`` (a sum query like
``GaussianSumQuery``) when built with ``l2_norm_clip``, ``noise_multiplier``
and ``record_specs``: ``initial_global_state``, ``derive_sample_params``,
``initial_sample_state``, ``preprocess_record``, ``accumulate_record``,
``merge_sample_states``, ``get_noised_result`` → (result, new global state,
DpEvent), ``derive_metrics``.

Secrecy: the correlated state holds past noise, as secret as the seed.
Neither is ever saved (no optimizer file, checkpoint or SavedModel holds
them), so a DP-MF run cannot resume from a file mid-stream: the optimizer
refuses to train on
(``keras.optimizers.state.PrivateState.stream_error``).
"""
import collections
import math

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_dpadambc import privatizer
from tf_dpadambc._checks import check_count
from tf_dpadambc._checks import check_positive
from tf_dpadambc.accounting import events
from tf_dpadambc.core import correlated_noise
from tf_dpadambc.core import noise as independent
from tf_dpadambc.mf.sensitivity import sensitivity as strategy_sensitivity
from tf_dpadambc.mf import strategies

GlobalState = collections.namedtuple(
    "GlobalState", ["l2_norm_clip", "stddev", "step", "noise_state"])
GlobalState.__doc__ = """The DPQuery global state: clip norm, noise std σC,
the step t and the mechanism's streaming state (one tensor per record part)."""


class NoiseMechanism(privatizer.Privatizer):
  """Base: the Gaussian noise of one release, and the DPQuery protocol.

  As the optimizers' :class:`~tf_dpadambc.privatizer.Privatizer` its release
  is DP-SGD's, (S + σΔ·noise)/B, with the noise from :meth:`sample`.
  """

  # Ratio of the noise std to σΔ for z_t; sens(C) for DP-MF.
  sensitivity = 1.0
  regenerates_past_draws = False

  def __init__(self, l2_norm_clip=None, noise_multiplier=None,
               record_specs=None):
    self.l2_norm_clip = (None if l2_norm_clip is None
                         else check_positive("l2_norm_clip", l2_norm_clip))
    self.noise_multiplier = (
        None if noise_multiplier is None else
        check_positive("noise_multiplier", noise_multiplier, allow_zero=True))
    self.record_specs = record_specs

  # --------------------------------------------------- optimizer-facing API
  def release(self, ctx, clipped_sum, num_units):
    return privatizer.gaussian_release(ctx, clipped_sum, num_units)

  def sample(self, templates, stddev, seed_of, step, state):
    """Noise of std ``stddev``·(this mechanism's scale) shaped like ``templates``.

    Args:
      templates: tensors to shape the noise like.
      stddev: σΔ of this release.
      seed_of: step j → the seed of z_j (counter-based, for this release).
      step: the 0-based logical step t.
      state: list of state tensors (:meth:`state_shape`), or None.

    Returns:
      ``(noise, new_state)``.
    """
    raise NotImplementedError

  def accounting_event(self, noise_multiplier, steps, sampling, batch_size,
                       num_examples, steps_per_epoch=None):
    """The DpEvent of ``steps`` releases (see the optimizers' ``dp_event``)."""
    raise NotImplementedError

  # ------------------------------------------------------- DPQuery protocol
  def _query_parameters(self):
    if self.l2_norm_clip is None or self.noise_multiplier is None:
      raise ValueError(
          f"{self.__class__.__name__} is used as a DPQuery: construct it with "
          "l2_norm_clip and noise_multiplier (and record_specs for "
          "correlated noise). The optimizers pass their own instead.")
    return self.l2_norm_clip, self.noise_multiplier

  def _record_shapes(self):
    if self.record_specs is None:
      raise ValueError(f"{self.__class__.__name__} as a DPQuery needs "
                       "record_specs (a nest of tf.TensorSpec of the records).")
    return [tf.TensorShape(s.shape) for s in tf.nest.flatten(self.record_specs)]

  def _fresh_z(self, templates):
    """N(0, 1) draws from a generator seeded by the OS, created with the
    global state: fresh on every call even where a caller fails to thread the
    state (TF-Privacy's Keras optimizers, their #111), and unaffected by
    ``tf.random.set_seed``, so the noise cannot be predicted."""
    if getattr(self, "_generator", None) is None:
      raise ValueError("Call initial_global_state() before get_noised_result.")
    return [tf.cast(self._generator.normal(tf.shape(t)), t.dtype)
            for t in templates]

  def initial_global_state(self):
    clip, sigma = self._query_parameters()
    if getattr(self, "_generator", None) is None:
      self._generator = tf.random.Generator.from_non_deterministic_state()
    if (self.record_specs is None
        and self.state_shape(tf.TensorShape([1])) is not None):
      self._record_shapes()  # raises: the streaming state needs the shapes
    state = []
    if self.record_specs is not None:
      for spec in tf.nest.flatten(self.record_specs):
        shape = self.state_shape(tf.TensorShape(spec.shape))
        if shape is not None:
          state.append(tf.zeros(shape, getattr(spec, "dtype", tf.float32)))
    return GlobalState(tf.constant(clip, tf.float32),
                       tf.constant(clip * sigma, tf.float32),
                       tf.constant(0, tf.int64), state)

  def derive_sample_params(self, global_state):
    return global_state.l2_norm_clip

  def initial_sample_state(self, template=None):
    if template is None:
      template = self.record_specs
    return tf.nest.map_structure(
        lambda s: tf.zeros(s.shape, getattr(s, "dtype", tf.float32)), template)

  def preprocess_record(self, params, record):
    """Clips the record (a nest of tensors) to global L2 norm ``params``."""
    flat = tf.nest.flatten(record)
    clipped, _ = tf.clip_by_global_norm(flat, params)
    return tf.nest.pack_sequence_as(record, clipped)

  def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
    return tf.nest.map_structure(tf.add, sample_state, preprocessed_record)

  def accumulate_record(self, params, sample_state, record):
    return self.accumulate_preprocessed_record(
        sample_state, self.preprocess_record(params, record))

  def merge_sample_states(self, sample_state_1, sample_state_2):
    return tf.nest.map_structure(tf.add, sample_state_1, sample_state_2)

  def get_noised_result(self, sample_state, global_state):
    """(sum + noise, new global state, DpEvent of this release)."""
    flat = tf.nest.flatten(sample_state)
    noise, new_state = self._fresh_sample(flat, global_state)
    result = [s + tf.cast(n, s.dtype) for s, n in zip(flat, noise)]
    return (tf.nest.pack_sequence_as(sample_state, result),
            global_state._replace(step=global_state.step + 1,
                                  noise_state=new_state),
            self._release_event())

  def derive_metrics(self, global_state):
    del global_state
    return collections.OrderedDict()

  def _fresh_sample(self, templates, global_state):
    raise NotImplementedError

  def _release_event(self):
    raise NotImplementedError

  # -------------------------------------------------------------- config
  def get_config(self):
    return {"l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier}


class IndependentNoise(NoiseMechanism):
  """Independent Gaussian noise σΔ·z_t every step: DP-SGD's mechanism.

  As a DPQuery it is TF-Privacy's ``GaussianSumQuery(l2_norm_clip,
  l2_norm_clip·noise_multiplier)``.
  """

  def sample(self, templates, stddev, seed_of, step, state):
    del state
    return independent.gaussian_noise_like(templates, stddev,
                                           seed_of(step)), None

  def accounting_event(self, noise_multiplier, steps, sampling, batch_size,
                       num_examples, steps_per_epoch=None):
    """DP-SGD's event. With independent noise a fixed batch order
    (``"cyclic"``) is accounted as reshuffled epochs (once per epoch, no
    amplification)."""
    if sampling == "cyclic_poisson":
      raise ValueError(
          "cyclic_poisson accounting is for banded correlated noise "
          "(CorrelatedNoise); with independent noise use sampling='poisson' "
          "for Poisson-sampled batches.")
    sampling = {"cyclic": "shuffle"}.get(sampling, sampling)
    return events.dp_sgd_event(noise_multiplier, num_examples, batch_size,
                               steps, sampling, steps_per_epoch)

  def _fresh_sample(self, templates, global_state):
    return [global_state.stddev * z for z in self._fresh_z(templates)], []

  def _release_event(self):
    return dp_accounting.GaussianDpEvent(self._query_parameters()[1])


class CorrelatedNoise(NoiseMechanism):
  """DP-MF correlated noise σΔ·sens(C)·(C⁻¹z)_t for a strategy C.

  Args:
    strategy: a ``tf_dpadambc.mf`` strategy (``Identity``, ``Toeplitz`` /
      ``sqrt_toeplitz`` / ``optimize_banded``, ``BLT`` / ``optimize_blt``,
      ``Dense`` / ``optimize_dense``).
    steps: n, the planned number of logical steps: the noise is calibrated
      for it (the accounting uses the steps, epochs and separation actually
      run: a longer run gets a correspondingly smaller effective σ).
    participations: k, the most steps one example joins (epochs).
    min_separation: s, the fewest steps between two participations of an
      example (steps per epoch with ``tf_dpadambc.data.cyclic_batches``).
      Required when k > 1.
    l2_norm_clip, noise_multiplier, record_specs: only for use as a DPQuery.

  The noise is calibrated to sens(C) for (n, k, s) (``mf.sensitivity``): the
  whole run is then as private as one Gaussian mechanism with multiplier σ.
  Streaming memory: bands − 1 (Toeplitz) or d buffers (BLT) per parameter;
  none for ``Identity``; ``Dense`` regenerates its t past draws each step.
  """

  def __init__(self, strategy, steps, participations=1, min_separation=None,
               l2_norm_clip=None, noise_multiplier=None, record_specs=None):
    if not isinstance(strategy, strategies.Strategy):
      raise TypeError("strategy must be a tf_dpadambc.mf strategy (e.g. "
                      f"mf.optimize_banded(...)); got {strategy!r}.")
    if steps is None:
      raise ValueError("steps (the planned number of logical steps) is "
                       "required.")
    steps = check_count("steps", steps)
    participations = check_count("participations", participations)
    if participations > 1 and min_separation is None:
      raise ValueError(
          "min_separation is required with participations > 1: the fewest "
          "steps between two uses of an example (steps per epoch when "
          "batches repeat in a fixed order, tf_dpadambc.data.cyclic_batches; "
          "1 if the data are reshuffled every epoch).")
    min_separation = (steps if min_separation is None
                      else check_count("min_separation", min_separation))
    super().__init__(l2_norm_clip, noise_multiplier, record_specs)
    self.strategy = strategy
    self.steps = steps
    self.participations = participations
    self.min_separation = min_separation
    self.sensitivity = float(strategy_sensitivity(
        strategy, steps, participations, min_separation))
    # sens²·‖row_t(C⁻¹)‖² for t ≤ n; later steps reuse the last (Toeplitz
    # row norms converge; a Dense C continues as the identity).
    rows = steps + 1
    if isinstance(strategy, strategies.Dense):
      rows = max(rows, strategy.steps + 1)  # its last row is the identity's
    factors = self.sensitivity ** 2 * strategy.inverse_row_norms_squared(rows)
    self._factors = factors.astype(np.float32)

  @classmethod
  def for_cyclic_training(cls, strategy, num_examples, batch_size, epochs):
    """The mechanism for ``epochs`` passes of ``tf_dpadambc.data.cyclic_batches``:

    n = epochs·ceil(N/B) steps, k = epochs participations, ceil(N/B) apart.
    """
    per_epoch = events.batches_per_epoch(num_examples, batch_size)
    return cls(strategy, steps=epochs * per_epoch, participations=epochs,
               min_separation=per_epoch)

  def __repr__(self):
    return (f"CorrelatedNoise({self.strategy!r}, steps={self.steps}, "
            f"participations={self.participations}, "
            f"min_separation={self.min_separation}, "
            f"sensitivity={self.sensitivity:.4g})")

  # --------------------------------------------------- optimizer-facing API
  # Past noise is as secret as the seed and never saved; one stream per
  # process (replicas would need one shared stream).
  secret_stream = True
  replica_refusal = "correlated (DP-MF) noise"

  def check_step_variables(self, indices, num_built):
    if indices != list(range(num_built)):
      raise ValueError(
          "Correlated (DP-MF) noise streams every variable's noise from its "
          "past draws, so every step must update all the variables the "
          f"optimizer was built with, in order ({len(indices)} of "
          f"{num_built} given). Freeze layers before the first step, or use "
          "a new optimizer after freezing.")

  def poisson_refusal(self):
    if self.supports_cyclic_poisson:
      return None
    return ("correlated (DP-MF) noise of a strategy that is not banded (no ε "
            "is known for it with Poisson sampling; a banded one takes cyclic "
            "Poisson batches, data.cyclic_poisson_batches)")

  @property
  def regenerates_past_draws(self):
    """True for a Dense C: step t redraws z_0..z_t from the step seeds, so
    the stream needs the seed it started with (never saved)."""
    return isinstance(self.strategy, strategies.Dense)

  def state_shape(self, shape):
    buffers = self.strategy.buffers
    return (buffers,) + tuple(shape) if buffers else None

  def variance_factor(self, step):
    index = tf.minimum(tf.cast(step, tf.int64), len(self._factors) - 1)
    return tf.gather(tf.constant(self._factors), index)

  def _correlate(self, z, state, step):
    """(x_t, new state) for one tensor, from z_t and the streaming state."""
    s = self.strategy
    if isinstance(s, strategies.Toeplitz):
      return correlated_noise.banded_step(z, state, s.coefficients_, step)
    if isinstance(s, strategies.BLT):
      return correlated_noise.blt_step(z, state, s.theta, s.omega)
    return z, state  # Identity

  def sample(self, templates, stddev, seed_of, step, state):
    scale = tf.cast(stddev, tf.float32) * self.sensitivity
    if isinstance(self.strategy, strategies.Dense):
      x = self._dense(templates, seed_of, step)
      return [tf.cast(scale, t.dtype) * n for t, n in zip(templates, x)], state
    z = independent.gaussian_noise_like(templates, 1.0, seed_of(step))
    return self._stream(templates, z, scale, state, step)

  def _stream(self, templates, z, scale, state, step):
    noise, new_state, states = [], [], iter(state or [])
    for t, zt in zip(templates, z):
      x, new = self._correlate(zt, next(states) if self.strategy.buffers
                               else None, step)
      noise.append(tf.cast(scale, t.dtype) * x)
      if new is not None:
        new_state.append(new)
    return noise, new_state

  def _dense(self, templates, seed_of, step):
    n = self.strategy.steps
    inverse = tf.constant(self.strategy.inverse(n).astype(np.float32))
    draw = lambda j: independent.gaussian_noise_like(templates, 1.0,
                                                     seed_of(j))
    step = tf.cast(step, tf.int64)
    return tf.cond(
        step < n,
        lambda: correlated_noise.dense_step(
            templates, tf.gather(inverse, tf.minimum(step, n - 1)), step,
            draw),
        lambda: draw(step))  # beyond its n steps a Dense C is the identity

  def participation(self, steps, sampling, steps_per_epoch):
    """(k, s) of a run of ``steps`` logical steps under ``sampling``.

    ``"cyclic"``: one permutation, the same batches in the same order every
    epoch (resumed only at epoch boundaries): s = steps per epoch.
    ``"shuffle"``: reshuffled every epoch, so an example can be in the last
    batch of one epoch and the first of the next: s = 1.
    """
    per_epoch = max(1, int(math.floor(steps_per_epoch)))
    k = max(1, int(math.ceil(steps / steps_per_epoch - 1e-9)))
    if sampling == "cyclic":
      return k, per_epoch
    if sampling == "shuffle":
      return k, 1
    raise ValueError(f"Unknown sampling {sampling!r}.")

  @property
  def supports_cyclic_poisson(self):
    """True for a banded strategy (Identity, or a Toeplitz with fewer bands
    than steps): amplified BandMF applies to cyclic Poisson batches."""
    s = self.strategy
    return isinstance(s, strategies.Identity) or (
        isinstance(s, strategies.Toeplitz) and s.bands <= self.steps)

  def accounting_event(self, noise_multiplier, steps, sampling, batch_size,
                       num_examples, steps_per_epoch=None, groups=None):
    """The DpEvent of ``steps`` steps of this mechanism.

    ``sampling``:
    * ``"cyclic"`` / ``"shuffle"``: one Gaussian mechanism with multiplier
      σ·sens_calibrated/sens(C) for the participation actually used (steps
      taken, epochs, separation; see :meth:`participation`).
    * ``"cyclic_poisson"``: amplified BandMF (Choquette-Choo et al. 2023,
      Theorem 4) for a banded C: the N examples split into b groups, step t
      Poisson-samples group t mod b with probability p = B·b/N (expected
      batch size B); b = ``groups`` (≥ the bands; default the bands).
    * ``"poisson"``: refused — plain Poisson sampling has no closed-form
      accounting with correlated noise.
    """
    if sampling == "poisson":
      raise ValueError(
          "Correlated (DP-MF) noise has no closed-form ε under plain Poisson "
          "sampling. Use sampling='cyclic' (fixed batch order, "
          "tf_dpadambc.data.cyclic_batches), 'shuffle' (reshuffled epochs, "
          "no amplification) or 'cyclic_poisson' for a banded strategy.")
    if steps == 0:
      return dp_accounting.NoOpDpEvent()
    if sampling == "cyclic_poisson":
      return self._amplified_event(noise_multiplier, steps, batch_size,
                                   num_examples, groups)
    if steps_per_epoch is None:
      steps_per_epoch = events.batches_per_epoch(num_examples, batch_size)
    k, s = self.participation(steps, sampling, steps_per_epoch)
    actual = strategy_sensitivity(self.strategy, max(steps, 1), k, s)
    return events.correlated_noise_event(noise_multiplier, self.sensitivity,
                                         actual)

  def _amplified_event(self, noise_multiplier, steps, batch_size,
                       num_examples, groups=None):
    s = self.strategy
    if not self.supports_cyclic_poisson:
      raise ValueError(
          "Amplification by cyclic Poisson sampling (Choquette-Choo et al. "
          "2023, Theorem 4) needs a banded strategy (Identity or a Toeplitz "
          f"with fewer bands than steps); got {s!r}.")
    bands = 1 if isinstance(s, strategies.Identity) else s.bands
    if groups is not None and groups < bands:
      raise ValueError(
          f"Cyclic Poisson sampling with b = {groups} groups and a "
          f"{bands}-banded strategy: an example's participations, b steps "
          "apart, would share bands of C (Theorem 4 needs b ≥ the bands). "
          f"Use groups ≥ {bands}.")
    bands = groups or bands
    probability = batch_size * bands / num_examples
    if probability > 1:
      raise ValueError(
          f"Cyclic Poisson sampling with b = {bands} groups of N/b = "
          f"{num_examples / bands:.4g} examples cannot give batches of "
          f"expected size {batch_size}.")
    # Theorem 4 normalizes the columns to norm ≤ 1; ours have norm
    # max column norm, and the noise was calibrated to self.sensitivity.
    column = strategy_sensitivity(s, max(steps, 1), 1, 1)
    return events.amplified_banded_event(
        noise_multiplier * self.sensitivity / column, probability, steps,
        bands)

  # ------------------------------------------------------- DPQuery protocol
  def _fresh_sample(self, templates, global_state):
    if isinstance(self.strategy, strategies.Dense):
      raise ValueError("A Dense strategy regenerates past noise from step "
                       "seeds; use it through the tf_dpadambc optimizers, or "
                       "a Toeplitz/BLT strategy as a DPQuery.")
    # A caller that does not thread the state gets fresh z_t with zero
    # buffers (x_t = z_t: more noise, never repeated noise).
    return self._stream(templates, self._fresh_z(templates),
                        global_state.stddev * self.sensitivity,
                        global_state.noise_state, global_state.step)

  def _release_event(self):
    # A single step of DP-MF has no standalone ε: the run is one Gaussian
    # mechanism (``accounting_event``). As TF-Privacy's tree queries do.
    return dp_accounting.UnsupportedDpEvent()

  def get_config(self):
    config = super().get_config()
    config.update({"strategy": strategies.to_config(self.strategy),
                   "steps": self.steps,
                   "participations": self.participations,
                   "min_separation": self.min_separation})
    return config


_CLASSES = {"IndependentNoise": IndependentNoise,
            "CorrelatedNoise": CorrelatedNoise}


def serialize(mechanism):
  return {"class_name": mechanism.__class__.__name__,
          "config": mechanism.get_config()}


def deserialize(value):
  """A mechanism from :func:`serialize`'s dict (or a mechanism, or None)."""
  if value is None:
    return IndependentNoise()
  if isinstance(value, NoiseMechanism):
    return value
  if isinstance(value, dict) and value.get("class_name") in _CLASSES:
    config = dict(value["config"])
    if "strategy" in config:
      config["strategy"] = strategies.from_config(config["strategy"])
    return _CLASSES[value["class_name"]](**config)
  raise TypeError("noise must be a tf_dpadambc noise mechanism "
                  "(IndependentNoise() or CorrelatedNoise(...)); got "
                  f"{value!r}.")
