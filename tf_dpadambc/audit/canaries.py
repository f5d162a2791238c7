"""Canaries sent through the library's real private training path.

**White-box gradient canaries** ("Dirac" canaries; Nasr et al. 2023, "Tight
auditing of differentially private machine learning", arXiv 2302.07956).
The model is linear with the loss ℓ(x) = ⟨w, x⟩, so an example's gradient is
its input x whatever the weights. Canary i is x_i = 2C·e_i (a coordinate
direction, norm 2C: clipped to exactly C·e_i); background examples live in
the other coordinates with norm C/2. Each canary is in the training set
with probability ½; an absent one is replaced by a null example (x = 0, no
gradient: zero-out adjacency, the sum is as without it), so batches keep
their shape and N. Training runs through ``make_private`` + ``fit`` with the
optimizer under audit (ghost or vectorized clipping, accumulation, Poisson or
shuffled batches), and the auditor sees every release ḡ_t
(``DPOptimizer.tap_releases``). Canary i's score is

    s_i = Σ_{t ∈ T_i} ⟨ḡ_t, e_i⟩

with T_i the steps whose batch holds canary i's slot (shuffled batches: the
once-per-epoch claim lets the adversary know the batches), or every step
(Poisson sampling: the claim is amplified by the adversary not knowing the
batches). For DP-SGD's release, s_i is N(|T_i|·C/B, |T_i|σ²C²/B²) in and
N(0, ·) out, independent across canaries (orthogonal directions, isotropic
noise): this attack is essentially tight, and the audit should approach the
claimed ε.

**Black-box input canaries**: mislabeled training examples, each included
with probability ½, scored by their loss on the final model only (lower
loss: more likely in). Much weaker, but what a user can reproduce.
"""
import dataclasses

import keras
import numpy as np

from tf_dpadambc.accounting import epsilon as epsilon_lib
from tf_dpadambc.keras import training


@dataclasses.dataclass
class CanaryScores:
  """Scores of the canaries of one audit run and the claim it audits.

  in_scores / out_scores: canaries that were / were not in training (higher
  score: more likely in). claimed_epsilon: the optimizer's own accounting
  of the run at ``delta``. steps: logical steps (releases) taken.
  """
  in_scores: np.ndarray
  out_scores: np.ndarray
  claimed_epsilon: float
  delta: float
  steps: int
  description: str = ""

  @property
  def scores(self):
    return np.concatenate([self.in_scores, self.out_scores])

  @property
  def is_in(self):
    return np.concatenate([np.ones(len(self.in_scores), bool),
                           np.zeros(len(self.out_scores), bool)])


def _linear_loss(y_true, y_pred):
  """ℓ = ⟨w, x⟩ per example: its gradient is x, whatever w and y."""
  del y_true
  return y_pred[:, 0]


def _canary_model(dimension, clipping):
  inputs = keras.Input((dimension,))
  outputs = keras.layers.Dense(1, use_bias=False,
                               kernel_initializer="zeros")(inputs)
  return training.make_private(keras.Model(inputs, outputs),
                               clipping=clipping)


class _ReleaseRecorder(keras.callbacks.Callback):
  """Reads the optimizer's release after every logical step."""

  def __init__(self, optimizer, coordinates):
    super().__init__()
    self.optimizer = optimizer
    self.coordinates = coordinates
    self.releases = []  # ⟨ḡ_t, e_i⟩ for the canary coordinates, per step
    self._seen = int(optimizer.iterations.numpy()) if optimizer.built else 0

  def on_train_batch_end(self, batch, logs=None):
    steps = int(self.optimizer.iterations.numpy())
    if steps > self._seen:  # a release happened (accumulation: every k)
      self._seen = steps
      kernel = self.optimizer.last_release[0].reshape(-1)
      self.releases.append(kernel[self.coordinates].copy())


def white_box_scores(make_optimizer, *, num_canaries=1000, num_background=1000,
                     batch_size=200, epochs=4, l2_norm_clip=1.0, delta=1e-5,
                     sampling="shuffle", clipping="auto", seed=0,
                     progress=None):
  """Runs one training with white-box gradient canaries; returns their scores.

  Args:
    make_optimizer: ``(l2_norm_clip) -> DPOptimizer``, the configuration under
      audit (for ``sampling="poisson"`` it must have
      ``expected_batch_size=batch_size``).
    num_canaries: m canaries, each in with probability ½.
    num_background: other examples (gradients orthogonal to every canary).
    batch_size: physical batch size b; N = m + num_background must be a
      multiple of b·k (k: the optimizer's accumulation steps) for shuffled
      batches, so that every release has the same composition.
    epochs: passes over the data.
    sampling: ``"shuffle"`` (fixed batches, a fresh order each epoch),
      ``"cyclic"`` (the same order every epoch: DP-MF's participation) or
      ``"poisson"`` (``data.poisson_batches``).
    clipping: ``make_private``'s method.
    seed: the audit's randomness (inclusion, order). The optimizer's noise
      seed stays its own secret one.
    progress: None, or a callable ``(epoch)`` called after each epoch.

  Returns:
    :class:`CanaryScores`.
  """
  from tf_dpadambc import data  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  m, n = num_canaries, num_canaries + num_background
  dimension = m + 16
  included = rng.random(m) < 0.5
  x = np.zeros((n, dimension), "float32")
  x[np.arange(m)[included], np.arange(m)[included]] = 2.0 * l2_norm_clip
  background = rng.normal(size=(num_background, dimension - m))
  background *= 0.5 * l2_norm_clip / np.linalg.norm(background, axis=1,
                                                    keepdims=True)
  x[m:, m:] = background
  y = np.zeros(n, "float32")
  optimizer = make_optimizer(l2_norm_clip)
  k = optimizer.accumulation_steps
  model = _canary_model(dimension, clipping)
  model.compile(optimizer=optimizer, loss=_linear_loss, jit_compile=True)
  optimizer.build(model.trainable_variables)
  optimizer.tap_releases(model.trainable_variables)
  recorder = _ReleaseRecorder(optimizer, np.arange(m))
  slots = []  # per epoch: the release index holding each canary's slot
  if sampling in ("shuffle", "cyclic"):
    if n % (batch_size * k):
      raise ValueError(f"N = {n} must be a multiple of batch_size·k = "
                       f"{batch_size * k} for fixed-size batches.")
    cyclic_order = rng.permutation(n)
    for epoch in range(epochs):
      order = cyclic_order if sampling == "cyclic" else rng.permutation(n)
      position = np.empty(n, np.int64)
      position[order] = np.arange(n)
      slots.append(len(recorder.releases) + position[:m] // (batch_size * k))
      model.fit(x[order], y[order], batch_size=batch_size, epochs=1,
                shuffle=False, verbose=0, callbacks=[recorder])
      if progress is not None:
        progress(epoch)
  elif sampling == "poisson":
    batches = data.poisson_batches(x, y, expected_batch_size=batch_size)
    for epoch in range(epochs):
      model.fit(batches, epochs=1, verbose=0, callbacks=[recorder])
      if progress is not None:
        progress(epoch)
  else:
    raise ValueError(f"sampling={sampling!r}: use 'shuffle', 'cyclic' or "
                     "'poisson'.")
  releases = np.stack(recorder.releases)  # [steps, m]
  steps = len(releases)
  # Which releases hold each canary's slot: [steps, m] (Poisson: all).
  pattern = np.zeros((steps, m))
  if slots:
    for s in slots:
      pattern[s, np.arange(m)] = 1.0
  else:
    pattern[:] = 1.0
  if optimizer.is_correlated:
    # DP-MF adds σ·(C⁻¹z)_t: C times the releases has independent noise, and
    # canary i's signal there is C p_i. The matched filter ⟨C p_i, (C G)_i⟩
    # / ‖C p_i‖ is the likelihood-ratio test (whitening; summing the raw
    # releases would under-estimate).
    matrix = np.asarray(optimizer.noise.strategy.matrix(steps))
    signal = matrix @ pattern
    scores = np.sum(signal * (matrix @ releases), axis=0) / np.maximum(
        np.linalg.norm(signal, axis=0), 1e-12)
  else:
    scores = np.sum(pattern * releases, axis=0)
  claimed = epsilon_lib.epsilon_of_event(
      optimizer.dp_event(n, sampling=sampling), delta)
  return CanaryScores(scores[included], scores[~included], float(claimed),
                      delta, int(optimizer.steps_taken),
                      f"{type(optimizer).__name__}, white-box gradient "
                      f"canaries, {sampling} batches, m = {m}")


def black_box_scores(make_optimizer, x, y, *, num_canaries=100, num_classes,
                     build_model, batch_size=100, epochs=10,
                     l2_norm_clip=1.0, delta=1e-5, seed=0):
  """One private training run with mislabeled input canaries; their scores.

  Canaries are copies of ``num_canaries`` training examples with a wrong
  label (drawn uniformly among the others), each included with probability
  ½; the score is minus the canary's loss on the final model. ``x, y``: the
  training set (the canaries' sources are taken out of it).
  ``build_model()`` returns an uncompiled Keras model with ``num_classes``
  logits. Fixed-size shuffled batches; the claim is the optimizer's own
  once-per-epoch accounting.
  """
  rng = np.random.default_rng(seed)
  pick = rng.choice(len(x), num_canaries, replace=False)
  rest = np.setdiff1d(np.arange(len(x)), pick)
  wrong = (y[pick] + rng.integers(1, num_classes, num_canaries)) % num_classes
  included = rng.random(num_canaries) < 0.5
  train_x = np.concatenate([x[rest], x[pick][included]])
  train_y = np.concatenate([y[rest], wrong[included]])
  model = training.make_private(build_model())
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  optimizer = make_optimizer(l2_norm_clip)
  model.compile(optimizer=optimizer, loss=loss, jit_compile=True)
  model.fit(train_x, train_y, batch_size=batch_size, epochs=epochs,
            verbose=0)
  logits = model.predict(x[pick], verbose=0)
  scores = -loss.call(wrong, logits).numpy()
  claimed = epsilon_lib.epsilon_of_event(
      optimizer.dp_event(len(train_x), sampling="shuffle"), delta)
  return CanaryScores(scores[included], scores[~included], float(claimed),
                      delta, int(optimizer.steps_taken),
                      f"{type(optimizer).__name__}, black-box mislabeled "
                      f"canaries, m = {num_canaries}")
