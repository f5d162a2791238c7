"""A Keras callback that reports ε as training goes, and enforces a budget."""
import math

import keras

from tf_dpadambc.accounting import epsilon as epsilon_lib


class PrivacyBudget(keras.callbacks.Callback):
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
    super().__init__()
    self.num_examples = num_examples
    self.delta = delta
    self.target_epsilon = target_epsilon
    self.accountant = accountant
    self.sampling = sampling
    self.verbose = verbose
    self.history = []

  def _epsilon(self, optimizer, extra_steps=0):
    event = optimizer.dp_event(self.num_examples, sampling=self.sampling,
                               steps=optimizer.steps_taken + extra_steps)
    return epsilon_lib.epsilon_of_event(event, self.delta, self.accountant)

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
