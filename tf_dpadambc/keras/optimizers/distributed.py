"""A Keras 3 optimizer that can also update from the cross-replica context.

Under a tf.distribute strategy the private release runs once, in the
cross-replica context (``keras.training`` merges the replicas' clipped sums
first), so that the noise is drawn once for the global batch. Keras' TF
optimizer assumes a replica context there (its ``maybe_merge_call`` and
gradient all-reduce); in cross-replica context the gradients are already
global, so the mirrored variables are updated directly. In a replica context
(or without a strategy) Keras' own path runs unchanged.
"""
import keras
import tensorflow as tf


class CrossReplicaOptimizer(keras.optimizers.Optimizer):
  """``keras.optimizers.Optimizer`` whose update also runs cross-replica."""

  def _backend_update_step(self, grads, trainable_variables, learning_rate):
    if tf.distribute.get_replica_context() is not None:
      return super()._backend_update_step(grads, trainable_variables,
                                          learning_rate)
    variables = [v.value if isinstance(v, keras.Variable) else v
                 for v in trainable_variables]
    return self._distributed_tf_update_step(
        tf.distribute.get_strategy(), list(zip(grads, variables)),
        learning_rate)

  def _apply_weight_decay(self, variables):
    if (self.weight_decay is None
        or tf.distribute.get_replica_context() is not None):
      return super()._apply_weight_decay(variables)
    def decay(v):
      v.assign_sub(v * tf.cast(self.weight_decay, v.dtype)
                   * tf.cast(self.learning_rate, v.dtype))
    for variable in variables:
      if self._use_weight_decay(variable):
        tf.distribute.get_strategy().extended.update(
            variable.value if isinstance(variable, keras.Variable)
            else variable, decay, group=False)
