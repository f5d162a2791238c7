"""tf_keras versions of the privacy callbacks: each drives the Keras 3 one.

tf_keras' ``CallbackList`` needs ``tf_keras.callbacks.Callback`` objects; the
logic (ε from the optimizer's DpEvent, the budget, TensorBoard scalars) stays
in ``tf_dpadambc.accounting.callbacks``, which reads only
``model.optimizer`` (a :class:`~tf_dpadambc.tf_keras.TFKerasDPOptimizer`
forwards what it needs) and ``model.stop_training``.
"""
import tf_keras

from tf_dpadambc.accounting import callbacks

_HOOKS = tuple(f"on_{stage}_{event}"
               for stage in ("train", "test", "predict", "epoch",
                             "train_batch", "test_batch", "predict_batch")
               for event in ("begin", "end"))


class _Adapter(tf_keras.callbacks.Callback):
  """A tf_keras callback that forwards every hook to a Keras 3 callback."""

  keras3_class = None

  def __init__(self, *args, **kwargs):
    super().__init__()
    self.callback = self.keras3_class(*args, **kwargs)

  def set_model(self, model):
    super().set_model(model)
    self.callback.set_model(model)

  def set_params(self, params):
    super().set_params(params)
    self.callback.set_params(params)


def _hook(name):
  def forward(self, *args, **kwargs):
    return getattr(self.callback, name)(*args, **kwargs)
  forward.__name__ = name
  return forward


for _name in _HOOKS:
  setattr(_Adapter, _name, _hook(_name))


class PrivacyBudget(_Adapter):
  """:class:`tf_dpadambc.PrivacyBudget` for tf_keras ``fit`` (same arguments).

  Logs ``epsilon`` after every epoch and stops before ``target_epsilon``.
  """
  keras3_class = callbacks.PrivacyBudget

  @property
  def history(self):
    """ε after each epoch."""
    return self.callback.history


class PrivacyTensorBoard(_Adapter):
  """:class:`tf_dpadambc.PrivacyTensorBoard` for tf_keras ``fit``."""
  keras3_class = callbacks.PrivacyTensorBoard
