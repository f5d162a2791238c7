"""Keras callbacks: ε as training goes (and a budget), and TensorBoard."""
import math

import keras
import tensorflow as tf

from tf_dpadambc.accounting import epsilon as epsilon_lib


class _EpsilonCallback(keras.callbacks.Callback):
  """ε of the optimizer's own DpEvent for one sampling assumption."""

  def __init__(self, num_examples, delta, accountant, sampling):
    super().__init__()
    self.num_examples = num_examples
    self.delta = delta
    self.accountant = accountant
    self.sampling = sampling

  def _epsilon(self, optimizer, extra_steps=0):
    event = optimizer.dp_event(self.num_examples, sampling=self.sampling,
                               steps=optimizer.steps_taken + extra_steps)
    return epsilon_lib.epsilon_of_event(event, self.delta, self.accountant)


class PrivacyBudget(_EpsilonCallback):
  """Logs ε (``logs['epsilon']``) after every epoch; stops before a budget.

  ε is computed from the optimizer's own DpEvent (the steps it actually took,
  its σ, its logical batch size) for the chosen sampling assumption. With
  ``target_epsilon``, training stops at the end of the first epoch after
  which one more epoch would exceed the budget. The check runs between
  epochs: if a single epoch already exceeds the budget, it stops after that
  epoch, over budget — check ``compute_epsilon`` before training.

  Args:
    num_examples: N, training set size.
    delta: δ.
    target_epsilon: optional budget.
    accountant: ``"rdp"`` or ``"pld"``.
    sampling: ``"shuffle"`` (default: each example once per epoch, what
      ``model.fit`` does) or ``"poisson"`` (only if batches are
      Poisson-sampled); see ``dp_sgd_event``.
  """

  def __init__(self, num_examples, delta, target_epsilon=None,
               accountant="rdp", sampling="shuffle", verbose=1):
    super().__init__(num_examples, delta, accountant, sampling)
    self.target_epsilon = target_epsilon
    self.verbose = verbose
    self.history = []

  def on_epoch_begin(self, epoch, logs=None):
    self._steps_at_epoch_start = self.model.optimizer.steps_taken

  def on_epoch_end(self, epoch, logs=None):
    optimizer = self.model.optimizer
    if not optimizer.logical_batch_size:
      return
    eps = self._epsilon(optimizer)
    self.history.append(eps)
    if logs is not None:
      logs["epsilon"] = eps
    if self.target_epsilon is None:
      return
    steps_per_epoch = optimizer.steps_taken - self._steps_at_epoch_start
    next_eps = self._epsilon(optimizer, extra_steps=steps_per_epoch)
    if eps > self.target_epsilon or next_eps > self.target_epsilon:
      self.model.stop_training = True
      if self.verbose:
        print(f"\nPrivacyBudget: ε = {eps:.3f} after epoch {epoch + 1}; "
              f"another epoch would reach ε = {next_eps:.3f} > budget "
              f"{self.target_epsilon:g}. Stopping.")
    if math.isinf(eps) and self.verbose:
      print("\nPrivacyBudget: training is NOT private (ε = ∞).")


# TensorBoard's scalar plugin tag: tf.summary.scalar itself needs the
# tensorboard package, tf.summary.write with this metadata does not.
_SCALAR = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"))


def _scalar(tag, value):
  tf.summary.write(tag, tf.constant(value, tf.float32), metadata=_SCALAR)


class PrivacyTensorBoard(_EpsilonCallback):
  """Writes ε and the DP optimizer's diagnostics to TensorBoard.

  Scalars, under ``log_dir`` (next to Keras' own ``TensorBoard`` logs if
  the same directory is used):

  * ``privacy/epsilon`` after every epoch: ε at ``delta`` from the
    optimizer's DpEvent for ``sampling`` (as :class:`PrivacyBudget`);
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
               sampling="shuffle", update_freq="epoch"):
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
    optimizer = self.model.optimizer
    if not optimizer.logical_batch_size:
      return
    self._write_diagnostics(optimizer)
    eps = self._epsilon(optimizer)
    with self._summary_writer().as_default(
        step=int(optimizer.iterations.numpy())):
      _scalar("privacy/epsilon", eps)
    self._writer.flush()

  def on_train_end(self, logs=None):
    if self._writer is not None:
      self._writer.close()
      self._writer = None
