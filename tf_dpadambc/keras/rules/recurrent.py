"""Recurrent layers (LSTM, GRU, SimpleRNN): an exact rule through the cell.

The layer's own call runs a while loop whose TensorList ``vectorized_map``
cannot vectorize. The rule's :meth:`Recurrent.forward` replaces it, while a
unit is evaluated, with a Python loop over the (static) T time steps of the
same cell math (Keras 3's ``LSTMCell``, ``GRUCell``, ``SimpleRNNCell``:
gate order, biases, activations), which vectorizes. Each step's
pre-activation is a linear form,

    z_t = x_t W + h_{t-1} U + b,

so with δ_t = ∂ℓ_u/∂z_t: ∇W = Σ_t x_tᵀ δ_t, ∇U = Σ_t h_{t-1}ᵀ δ_t,
∇b = Σ_t δ_t — Dense-like with T positions (``core.ghost``). The recorded z
is x W (+ input bias) for all steps at once, [n, T, G·units] (G gates), and
the recorded inputs are x, the previous states h_{t-1} and, for GRU, the
reset gate r_t:

* GRU ``reset_after=True``: the candidate is act(x W_h + b_h + r ⊙ (h U_h +
  b'_h)); the recurrent form h U + b' has δ' = δ on the z, r columns and
  δ ⊙ r on the candidate's; bias [2, 3·units] = (Σδ, Σδ').
* GRU ``reset_after=False``: act(x W_h + b_h + (r ⊙ h) U_h): U's candidate
  columns have input r ⊙ h_{t-1}, the others h_{t-1}.

Configurations outside the rule (dropout, stateful, go_backwards, unroll,
return_state, a mask or an initial state, another cell) keep the layer's
own call: the whole model then uses the per-unit loop
(``core.per_example.sequential_units``).
"""
import keras
import tensorflow as tf

from tf_dpadambc.core import ghost
from tf_dpadambc.keras.rules import base
from tf_dpadambc.keras.rules import linear
from tf_dpadambc.keras.rules import registry

_CELLS = {keras.layers.LSTM: (keras.layers.LSTMCell, "lstm", 4),
          keras.layers.GRU: (keras.layers.GRUCell, "gru", 3),
          keras.layers.SimpleRNN: (keras.layers.SimpleRNNCell, "simple", 1)}


def supported(layer):
  """True if the layer's configuration is the one the rule computes."""
  entry = _CELLS.get(type(layer))
  if entry is None or type(layer.cell) is not entry[0]:  # pylint: disable=unidiomatic-typecheck
    return False
  cell = layer.cell
  return (not layer.stateful and not layer.go_backwards and not layer.unroll
          and not layer.return_state
          and not getattr(cell, "dropout", 0.0)
          and not getattr(cell, "recurrent_dropout", 0.0)
          and getattr(cell, "kernel", None) is not None
          and getattr(cell, "recurrent_kernel", None) is not None)


def _positions(t):
  """[U, n, T, f] -> [U, n·T, f] (n·T static where known)."""
  middle = t.shape[1:-1]
  n = base.product(middle) if middle.is_fully_defined() else -1
  return tf.reshape(t, [-1, n, t.shape[-1]])


class Recurrent(base.Rule):
  """LSTM, GRU, SimpleRNN: kernel, recurrent kernel, bias of the cell."""
  covers_sublayers = True  # the weights belong to layer.cell

  def __init__(self, layer):
    super().__init__(layer)
    cell = layer.cell
    self.cell = cell
    _, self.kind, self.gates = _CELLS[type(layer)]
    self.reset_after = self.kind == "gru" and cell.reset_after
    self.variables = [cell.kernel, cell.recurrent_kernel] + (
        [cell.bias] if cell.use_bias else [])

  # ------------------------------------------------------------ forward
  def forward(self, original, x, kwargs):
    del original
    if kwargs.get("mask") is not None or kwargs.get(
        "initial_state") is not None:
      raise base.Declined(f"layer '{self.layer.name}' was called with a "
                          "mask or an initial state")
    steps = x.shape[1]
    if x.shape.rank != 3 or steps is None:
      raise base.Declined(f"layer '{self.layer.name}': the sequence length "
                          "is not known when traced")
    cell, units, dtype = self.cell, self.cell.units, x.dtype
    kernel = tf.cast(cell.kernel.value, dtype)
    recurrent = tf.cast(cell.recurrent_kernel.value, dtype)
    bias = tf.cast(cell.bias.value, dtype) if cell.use_bias else None
    input_bias, recurrent_bias = bias, None
    if self.reset_after and bias is not None:
      input_bias, recurrent_bias = bias[0], bias[1]
    zx = tf.einsum("ntd,dk->ntk", x, kernel)
    if input_bias is not None:
      zx = zx + input_bias
    if self.kind == "gru" and not self.reset_after:
      gates_zr, gate_h = tf.split(recurrent, [2 * units, units], axis=1)
    act, rec_act = cell.activation, getattr(cell, "recurrent_activation",
                                            None)
    h = tf.zeros(tf.stack([tf.shape(x)[0], units]), dtype)
    c = h
    previous, extra, outputs = [], [], []
    # unstack and split, not slices: their gradients are one stack or
    # concat, where a slice's is a zero-padded tensor of the full size (at
    # each of the T steps).
    for z in tf.unstack(zx, num=steps, axis=1):
      previous.append(h)
      if self.kind == "lstm":
        z = z + tf.matmul(h, recurrent)
        i, f, g, o = tf.split(z, 4, axis=-1)
        c = rec_act(f) * c + rec_act(i) * act(g)
        h = rec_act(o) * act(c)
      elif self.kind == "simple":
        h = z + tf.matmul(h, recurrent)
        if act is not None:
          h = act(h)
      elif self.reset_after:
        inner = tf.matmul(h, recurrent)
        if recurrent_bias is not None:
          inner = inner + recurrent_bias
        x_z, x_r, x_h = tf.split(z, 3, axis=-1)
        i_z, i_r, i_h = tf.split(inner, 3, axis=-1)
        update = rec_act(x_z + i_z)
        reset = rec_act(x_r + i_r)
        extra.append(reset)
        candidate = act(x_h + reset * i_h)
        h = update * h + (1 - update) * candidate
      else:
        x_z, x_r, x_h = tf.split(z, 3, axis=-1)
        i_z, i_r = tf.split(tf.matmul(h, gates_zr), 2, axis=-1)
        update = rec_act(x_z + i_z)
        reset = rec_act(x_r + i_r)
        extra.append(reset * h)
        candidate = act(x_h + tf.matmul(reset * h, gate_h))
        h = update * h + (1 - update) * candidate
      outputs.append(h)
    output = tf.stack(outputs, 1) if self.layer.return_sequences else h
    record = (x, tf.stack(previous, 1)) + (
        (tf.stack(extra, 1),) if extra else ())
    return zx, output, record

  # ------------------------------------------------------------ terms
  def _terms(self, deltas):
    """Per variable, a list of (a, δ, column slice or None) linear forms
    and, for the bias, per-unit gradients [U, *bias.shape]."""
    units = self.cell.units
    kernel, rec, bias = [], [], []
    for call, delta in zip(self.calls, deltas):
      x, h = call.inputs[0], call.inputs[1]
      d = _positions(tf.cast(delta, tf.float32))
      x, h = (_positions(tf.cast(t, tf.float32)) for t in (x, h))
      kernel.append((x, d))
      if self.kind == "gru" and self.reset_after:
        r = _positions(tf.cast(call.inputs[2], tf.float32))
        d_rec = tf.concat([d[..., :2 * units], d[..., 2 * units:] * r], -1)
        rec.append((h, d_rec, None))
        bias.append(tf.stack([tf.reduce_sum(d, 1),
                              tf.reduce_sum(d_rec, 1)], 1))
      elif self.kind == "gru":
        rh = _positions(tf.cast(call.inputs[2], tf.float32))
        rec.append((h, d[..., :2 * units], slice(0, 2 * units)))
        rec.append((rh, d[..., 2 * units:], slice(2 * units, None)))
        bias.append(tf.reduce_sum(d, 1))
      else:
        rec.append((h, d, None))
        bias.append(tf.reduce_sum(d, 1))
    # One linear form per (variable, column slice): positions side by side.
    kernel_form = [(tf.concat([a for a, _ in kernel], 1),
                    tf.concat([d for _, d in kernel], 1), None)]
    slices = [None] if self.kind != "gru" or self.reset_after else [
        slice(0, 2 * units), slice(2 * units, None)]
    rec_forms = []
    for i, s in enumerate(slices):
      part = rec[i::len(slices)]
      rec_forms.append((tf.concat([a for a, _, _ in part], 1),
                        tf.concat([d for _, d, _ in part], 1), s))
    return kernel_form, rec_forms, tf.add_n(bias) if bias else None

  @staticmethod
  def _cols(t, s):
    return t if s is None else t[:, s]

  def sq_norms(self, deltas, scales):
    kernel, rec, bias = self._terms(deltas)
    out = []
    for forms, scale in ((kernel, scales[0]), (rec, scales[1])):
      out.append(tf.add_n([ghost.linear_sq_norms(
          a, d, None if scale is None else self._cols(scale, s))
                           for a, d, s in forms]))
    if len(self.variables) > 2:
      g = bias if scales[2] is None else bias * tf.cast(scales[2], bias.dtype)
      out.append(ghost.sum_squares(g))
    return out

  def grads(self, deltas, weights):
    kernel, rec, bias = self._terms(deltas)
    out = [tf.concat([ghost.linear_grad(a, d, w)
                      for a, d, _ in forms], 1)
           for forms, w in ((kernel, weights[0]), (rec, weights[1]))]
    if len(self.variables) > 2:
      out.append(ghost.weighted_sum(bias, weights[2]))
    return out

  def square_sums(self, deltas, weights):
    kernel, rec, bias = self._terms(deltas)
    out = [tf.concat([ghost.linear_square_sum(a, d, w)
                      for a, d, _ in forms], 1)
           for forms, w in ((kernel, weights[0]), (rec, weights[1]))]
    if len(self.variables) > 2:
      out.append(ghost.weighted_sum(tf.square(bias), tf.square(weights[2])))
    return out

  def plan(self):
    x = self.calls[0].inputs[0]
    steps = base.product(x.shape[1:-1]) if x.shape[1:-1].is_fully_defined(
    ) else None
    units = self.cell.units
    return (f"unrolled cell (T={x.shape[-2]}): kernel "
            f"{linear.describe(steps, x.shape[-1], self.gates * units)}; "
            f"recurrent {linear.describe(steps, units, self.gates * units)}")


def _factory(layer, original_call, values):
  del original_call, values
  return Recurrent(layer) if supported(layer) else None


for _layer in _CELLS:
  registry.register_builtin(_layer, _factory)
