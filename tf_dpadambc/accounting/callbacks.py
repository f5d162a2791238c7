"""Keras callbacks: ε as training goes (and a budget), and TensorBoard."""
import math

import keras
import tensorflow as tf

from tf_dpadambc.accounting import epsilon as epsilon_lib
from tf_dpadambc.accounting import ledger as ledger_lib


def run_sampling(optimizer, sampling=None):
  """The sampling whose ε holds for the run of ``optimizer``.

  ``"poisson"`` when it was built with ``expected_batch_size`` (batches from
  ``data.poisson_batches``), else ``"shuffle"`` (fixed-size batches, each
  example once per epoch). An explicit ``sampling`` must agree: the Poisson ε
  of a run on fixed-size batches, or the once-per-epoch ε of a Poisson run,
  would not be that run's guarantee (ValueError). Other values (``"cyclic"``
  with correlated noise) pass through to ``dp_event``.
  """
  inner = getattr(optimizer, "keras_optimizer", optimizer)  # (tf_keras)
  poisson = getattr(inner, "expected_batch_size", None) is not None
  if poisson and getattr(inner, "is_correlated", False):
    # Banded DP-MF on Poisson batches: only the amplified (cyclic Poisson)
    # ε can hold, and dp_event gives it only where the ledger verified it.
    if sampling not in (None, "cyclic_poisson"):
      raise ValueError(
          f"sampling={sampling!r}, but {optimizer.name} takes cyclic Poisson "
          "batches (correlated noise with expected_batch_size): only "
          "sampling='cyclic_poisson' can hold. Leave it None.")
    return "cyclic_poisson"
  if sampling is None:
    return "poisson" if poisson else "shuffle"
  if poisson and sampling != "poisson":
    raise ValueError(
        f"sampling={sampling!r}, but {optimizer.name} takes Poisson-sampled "
        "batches (expected_batch_size): an example can be in several steps "
        "of an epoch, so only the Poisson ε holds. Use sampling='poisson' "
        "or leave it None.")
  if not poisson and sampling == "poisson":
    raise ValueError(
        f"sampling='poisson', but {optimizer.name} has no "
        "expected_batch_size: its batches are fixed-size (model.fit's "
        "batch_size), for which the Poisson ε does not hold. Train on "
        "tf_dpadambc.data.poisson_batches(x, y, expected_batch_size=B) with "
        "the optimizer's expected_batch_size=B, or report "
        "sampling='shuffle' (the default).")
  return sampling


class _EpsilonCallback(keras.callbacks.Callback):
  """ε of the optimizer's own DpEvent, for the sampling the run used."""

  def __init__(self, num_examples, delta, accountant, sampling):
    super().__init__()
    self.num_examples = num_examples
    self.delta = delta
    self.accountant = accountant
    self.sampling = sampling
    self.run_sampling = None  # resolved from the optimizer at train begin

  def on_train_begin(self, logs=None):
    # Fail before the first step if the requested figure is not the run's.
    self.run_sampling = run_sampling(self.model.optimizer, self.sampling)

  # The epochs go to the optimizer's ledger (what the once-per-epoch ε
  # composes). make_private's fit records them itself; elsewhere (tf_keras)
  # these callbacks do: as passes over the data where the fit's data makes
  # them passes (tf_keras' guard classifies it with ledger.fit_data, as
  # make_private's fit does), else as batches that may hold any example.
  def _ledger(self):
    return ledger_lib.ledger_of(self.model.optimizer)

  def on_epoch_begin(self, epoch, logs=None):
    ledger = self._ledger()
    if ledger is None:
      return
    self._position_at_epoch_start = ledger.position()
    if not ledger_lib.is_recording(self.model.optimizer):
      ledger.callback_epoch_begin()

  def _record_epoch_end(self):
    ledger = self._ledger()
    if ledger is not None and not ledger_lib.is_recording(
        self.model.optimizer):
      ledger.callback_epoch_end()

  def _epoch_batches(self):
    """Physical batches of the epoch that just ended."""
    ledger = self._ledger()
    start = getattr(self, "_position_at_epoch_start", None)
    if ledger is None or start is None:
      return 0
    return max(0, ledger.position() - start)

  def _epsilon(self, optimizer, extra_epoch_batches=0):
    self.run_sampling = run_sampling(optimizer, self.sampling)
    event = optimizer.dp_event(self.num_examples, sampling=self.run_sampling,
                               extra_epoch_batches=extra_epoch_batches)
    return epsilon_lib.epsilon_of_event(event, self.delta, self.accountant)


class PrivacyBudget(_EpsilonCallback):
  """Logs ε (``logs['epsilon']``) after every epoch; stops before a budget.

  ε is computed from the optimizer's own DpEvent (the steps it actually took,
  the epochs it ran with their real numbers of batches, its σ, its logical
  batch size) for the sampling the run used
  (``run_sampling`` after training starts; see :func:`run_sampling`). With
  ``target_epsilon``, training stops at the end of the first epoch after
  which one more epoch (of as many batches as the last) would exceed the
  budget. The check runs between epochs: if a single epoch already exceeds
  the budget, it stops after that epoch, over budget — check
  ``compute_epsilon`` before training.

  Args:
    num_examples: N, training set size.
    delta: δ.
    target_epsilon: optional budget.
    accountant: ``"rdp"`` or ``"pld"``.
    sampling: None (default): the run's own — ``"poisson"`` if the
      optimizer has ``expected_batch_size`` (``data.poisson_batches``),
      else ``"shuffle"`` (each example once per epoch: fixed-size batches,
      what ``model.fit(..., batch_size=B)`` does). An explicit value must
      agree with the run (ValueError otherwise); ``"cyclic"`` for
      correlated noise with ``data.cyclic_batches``.
  """

  def __init__(self, num_examples, delta, target_epsilon=None,
               accountant="rdp", sampling=None, verbose=1):
    super().__init__(num_examples, delta, accountant, sampling)
    self.target_epsilon = target_epsilon
    self.verbose = verbose
    self.history = []

  def on_train_begin(self, logs=None):
    super().on_train_begin(logs)
    if self.verbose:
      print(f"PrivacyBudget: ε (δ = {self.delta:g}) for "
            f"{_SAMPLING_TEXT.get(self.run_sampling, self.run_sampling)}.")

  def on_epoch_end(self, epoch, logs=None):
    self._record_epoch_end()
    optimizer = self.model.optimizer
    if not optimizer.logical_batch_size:
      return
    eps = self._epsilon(optimizer)
    self.history.append(eps)
    if logs is not None:
      logs["epsilon"] = eps
    if self.target_epsilon is None:
      return
    # Another epoch like this one (its real number of batches).
    next_eps = self._epsilon(optimizer,
                             extra_epoch_batches=self._epoch_batches())
    if eps > self.target_epsilon or next_eps > self.target_epsilon:
      self.model.stop_training = True
      if self.verbose:
        print(f"\nPrivacyBudget: ε = {eps:.3f} ({self.run_sampling} "
              f"sampling) after epoch {epoch + 1}; "
              f"another epoch would reach ε = {next_eps:.3f} > budget "
              f"{self.target_epsilon:g}. Stopping.")
    if math.isinf(eps) and self.verbose:
      print("\nPrivacyBudget: training is NOT private (ε = ∞).")


_SAMPLING_TEXT = {
    "poisson": "Poisson-sampled batches (data.poisson_batches; q = B/N)",
    "shuffle": "fixed-size batches, each example once per epoch (no "
               "amplification by sampling)",
    "cyclic": "the same batches in the same order every epoch (cyclic)",
    "cyclic_poisson": "cyclic Poisson batches (data.cyclic_poisson_batches; "
                      "amplified BandMF)",
}


def _metadata(description=""):
  # TensorBoard's scalar plugin tag: tf.summary.scalar itself needs the
  # tensorboard package, tf.summary.write with this metadata does not.
  return tf.compat.v1.SummaryMetadata(
      summary_description=description,
      plugin_data=tf.compat.v1.SummaryMetadata.PluginData(
          plugin_name="scalars"))


_SCALAR = _metadata()


def _scalar(tag, value, metadata=_SCALAR):
  tf.summary.write(tag, tf.constant(value, tf.float32), metadata=metadata)


class PrivacyTensorBoard(_EpsilonCallback):
  """Writes ε and the DP optimizer's diagnostics to TensorBoard.

  Scalars, under ``log_dir`` (next to Keras' own ``TensorBoard`` logs if
  the same directory is used):

  * ``privacy/epsilon`` after every epoch: ε at ``delta`` from the
    optimizer's DpEvent for the run's sampling (as :class:`PrivacyBudget`;
    the scalar's description names the sampling);
  * ``privacy/noise_variance``: Φ of the last step's noise, (σC/B)² (times
    the correlated noise's row norm under DP-MF);
  * ``dp/<name>`` for every diagnostic of the optimizer (``dp_v_over_phi``,
    ``dp_clamped_fraction``, ``dp_negative_v_fraction``), at the last step
    of each epoch, or every ``update_freq`` batches if an integer.

  Steps are the optimizer's logical steps (``optimizer.iterations``). The
  event files are TensorBoard's; writing them does not need the tensorboard
  package (viewing them does).
  """

  def __init__(self, log_dir, num_examples, delta, accountant="rdp",
               sampling=None, update_freq="epoch"):
    if update_freq != "epoch" and not (isinstance(update_freq, int)
                                       and update_freq > 0):
      raise ValueError('update_freq must be "epoch" or a positive integer; '
                       f"got {update_freq!r}.")
    super().__init__(num_examples, delta, accountant, sampling)
    self.log_dir = log_dir
    self.update_freq = update_freq
    self._writer = None
    self._batches = 0

  def _summary_writer(self):
    if self._writer is None:
      self._writer = tf.summary.create_file_writer(self.log_dir)
    return self._writer

  def _write_diagnostics(self, optimizer):
    step = int(optimizer.iterations.numpy())
    with self._summary_writer().as_default(step=step):
      _scalar("privacy/noise_variance",
              float(optimizer.noise_variance.numpy()))
      for name, value in optimizer.diagnostics().items():
        _scalar(f"dp/{name}", float(value.numpy()))

  def on_train_batch_end(self, batch, logs=None):
    self._batches += 1
    optimizer = self.model.optimizer
    if (self.update_freq != "epoch" and optimizer.built
        and self._batches % self.update_freq == 0):
      self._write_diagnostics(optimizer)

  def on_epoch_end(self, epoch, logs=None):
    self._record_epoch_end()
    optimizer = self.model.optimizer
    if not optimizer.logical_batch_size:
      return
    self._write_diagnostics(optimizer)
    eps = self._epsilon(optimizer)
    with self._summary_writer().as_default(
        step=int(optimizer.iterations.numpy())):
      _scalar("privacy/epsilon", eps, _metadata(
          f"ε at δ = {self.delta:g} for "
          f"{_SAMPLING_TEXT.get(self.run_sampling, self.run_sampling)}"))
    self._writer.flush()

  def on_train_end(self, logs=None):
    if self._writer is not None:
      self._writer.close()
      self._writer = None
