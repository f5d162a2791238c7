"""Linear layers: z = a K (+ b) at T positions (Dense, EinsumDense,
convolutions), and their LoRA-enabled forms (Keras ``enable_lora``)."""
import string

import keras
import tensorflow as tf

from tf_dpadambc.core import ghost
from tf_dpadambc.keras.rules import base
from tf_dpadambc.keras.rules import registry


class Linear(base.Rule):
  """z = a K (+ b) at T positions: Dense, EinsumDense, convolutions."""

  def __init__(self, layer):
    super().__init__(layer)
    self.variables = [layer.kernel] + (
        [layer.bias] if base.has_bias(layer) else [])
    self._cache = None
    # Set by keras.ghost.clipped_sum where the units were clipped for the
    # chunked float32 sum: a boolean tensor (None for float64), and the
    # model's float32 unit limit L the clip shrink was computed for.
    self.float32_sum = None
    self.float32_units = None

  def float32_max_units(self):
    """The most units for which the kernel's sum may be book-kept in
    float32 chunks (``ghost.float32_max_units``, of the kernel's shape and
    dtype alone; 0: never)."""
    p, d = self.flat_kernel(self.layer.kernel).shape
    return ghost.float32_max_units(p, d, tf.as_dtype(self.layer.kernel.dtype))

  def float32_usable(self, deltas):
    """Whether this trace's calls may take the float32 sum: T = 1 (a Dense
    on vectors), float32 records."""
    a, _, shared = self._shared(deltas)
    return a.shape[1] == 1 and a.dtype == tf.float32 and shared is None

  def features(self, inputs, delta):
    """(a [N, T, p], δ [N, T, d]) of one call's merged rows: the two sides
    of its linear form."""
    raise NotImplementedError

  def _ad(self, deltas):
    pairs = [(call.rows, self.features(call.merged(call.inputs),
                                       call.merged(delta)))
             for call, delta in zip(self.calls, deltas)]
    a = tf.concat([base.group(a, rows) for rows, (a, _) in pairs], 1)
    d = tf.concat([base.group(d, rows) for rows, (_, d) in pairs], 1)
    return a, d

  def _unit_bias_grads(self, deltas):
    shape = list(self.layer.bias.shape)
    return tf.add_n([base.per_unit_sum(ghost.broadcast_grads(
        call.merged(d), shape), call.rows)
                     for call, d in zip(self.calls, deltas)])

  def kernel_shape_grad(self, grad, shape=None):
    return tf.reshape(grad, self.layer.kernel.shape if shape is None
                      else shape)

  def flat_kernel(self, t):
    return tf.reshape(t, [-1, t.shape[-1]])

  def _shared(self, deltas):
    """(a, δ, ĝ): ĝ the float32 per-unit kernel gradients where the norms
    and the sums both materialize them (``ghost.materializes_both``), else
    None. One tensor per step for the norms and the sums: ghost.
    shared_unit_grads explains why float32 is then private."""
    if self._cache is None or self._cache[0] is not deltas:
      a, d = self._ad(deltas)
      grads = (self._unit_grads(a, d, deltas) if ghost.materializes_both(
          a.shape[1], a.shape[2], d.shape[2]) else None)
      self._cache = deltas, a, d, grads
    return self._cache[1:]

  def _unit_grads(self, a, d, deltas):
    """ĝ [U, p, d] for :meth:`_shared`, from the linear form (a, δ)."""
    del deltas
    return ghost.shared_unit_grads(a, d)

  def sq_norms(self, deltas, scales):
    a, d, shared = self._shared(deltas)
    scale = None if scales[0] is None else self.flat_kernel(scales[0])
    norms = [ghost.linear_sq_norms(a, d, scale) if shared is None
             else ghost.shared_sq_norms(shared, scale)]
    if len(self.variables) > 1:
      g = self._unit_bias_grads(deltas)
      if scales[1] is not None:
        g *= tf.cast(scales[1], g.dtype)
      norms.append(ghost.sum_squares(g))
    return norms

  def kernel_sum(self, deltas, weights):
    """Σ_u w_u ∇K_u, book-kept from (a, δ) or from the shared ĝ."""
    a, d, shared = self._shared(deltas)
    if shared is not None:
      return self.kernel_shape_grad(ghost.shared_grad(shared, weights))
    if self.float32_sum is not None:
      return self.kernel_shape_grad(tf.cond(
          self.float32_sum,
          lambda: tf.cast(ghost.chunked_linear_grad(
              a, d, weights, self.float32_units), tf.float64),
          lambda: ghost.linear_grad(a, d, weights)))
    return self.kernel_shape_grad(ghost.linear_grad(a, d, weights))

  def grads(self, deltas, weights):
    grads = [self.kernel_sum(deltas, weights[0])]
    if len(self.variables) > 1:
      grads.append(ghost.weighted_sum(self._unit_bias_grads(deltas),
                                      weights[1]))
    return grads

  def square_sums(self, deltas, weights):
    a, d, shared = self._shared(deltas)
    squares = [self.kernel_shape_grad(
        ghost.linear_square_sum(a, d, weights[0]) if shared is None
        else ghost.shared_square_sum(shared, weights[0]))]
    if len(self.variables) > 1:
      squares.append(ghost.weighted_sum(tf.square(
          self._unit_bias_grads(deltas)), tf.square(weights[1])))
    return squares

  def plan(self):
    a, _ = self._ad([c.z for c in self.calls])
    p, d = self.flat_kernel(self.layer.kernel).shape
    if ghost.materializes_both(a.shape[1], p, d) and ghost.prefer_ghost(
        a.shape[1], p, d):
      return (f"materialized per unit (T={a.shape[1]}: pd={p * d} ≤ "
              f"2T(p+d)={2 * a.shape[1] * (p + d)}, float32)")
    return describe(a.shape[1], p, d)


def describe(positions, p, d):
  """The method linear_sq_norms picks for T positions of a [p, d] weight."""
  if positions == 1:
    return "ghost norm ‖a‖·‖δ‖ (T=1)"
  if positions is None:
    return "materialized per unit (T unknown when traced)"
  if ghost.prefer_ghost(positions, p, d):
    return f"ghost norm (T={positions}: 2T²={2 * positions**2} < pd={p * d})"
  return (f"materialized per unit (T={positions}: 2T²={2 * positions**2} "
          f"≥ pd={p * d})")


class Dense(Linear):

  def features(self, inputs, delta):
    return inputs, delta


class Conv(Linear):

  def float32_max_units(self):
    return 0  # T ≥ 1 output positions: the float64 sums

  def features(self, inputs, delta):
    layer = self.layer
    a = ghost.conv_patches(inputs, layer.kernel_size, layer.strides,
                           layer.padding, layer.dilation_rate)
    return a, base.flatten_positions(delta)

  def _single_channel(self):
    layer = self.layer
    return all(ghost.single_channel_conv_applies(
        c.merged(c.inputs).shape, layer.kernel.shape, layer.dilation_rate)
               for c in self.calls)

  def _unit_grads(self, a, d, deltas):
    """One input channel: by a depthwise convolution over the rows
    (``ghost.single_channel_conv_unit_grads``), summed over a unit's rows
    and the layer's calls; the patches (a) are then only read for their
    shape, and pruned from the step."""
    if not self._single_channel():
      return super()._unit_grads(a, d, deltas)
    layer = self.layer
    return tf.add_n([base.per_unit_sum(ghost.single_channel_conv_unit_grads(
        c.merged(c.inputs), c.merged(dc), layer.kernel_size, layer.strides,
        layer.padding), c.rows) for c, dc in zip(self.calls, deltas)])

  def plan(self):
    text = super().plan()
    if text.startswith("materialized per unit (T=") and (
        self._single_channel()):
      text += " by a depthwise convolution over the rows (one channel)"
    return text

  def kernel_sum(self, deltas, weights):
    # Book-kept from the patches (ghost.conv_grad); or the shared per-unit
    # gradients where the norms materialized them. A unit's weight is
    # repeated for each of its rows.
    _, _, shared = self._shared(deltas)
    if shared is not None:
      return super().kernel_sum(deltas, weights)
    layer = self.layer
    return tf.add_n([ghost.conv_grad(
        c.merged(c.inputs), c.merged(d),
        weights if isinstance(c.rows, int) and c.rows == 1 else tf.repeat(
            weights, c.rows),
        layer.kernel.shape, layer.strides, layer.padding, layer.dilation_rate)
                     for c, d in zip(self.calls, deltas)])


class EinsumDense(Linear):
  """Any ``input,kernel->output`` equation whose letters each appear in two
  of the three terms, the batch letter first in input and output: the input
  is transposed to [B, free..., contracted...] and δ to [B, free..., out...]."""

  def __init__(self, layer):
    super().__init__(layer)
    inputs, rest = layer.equation.split(",")
    kernel, output = rest.split("->")
    self.terms = inputs, kernel, output
    self.free = [c for c in inputs if c in output]
    self.contracted = [c for c in inputs if c in kernel]
    self.out = [c for c in kernel if c in output]

  @staticmethod
  def supported(layer):
    equation = layer.equation
    if "..." in equation or "->" not in equation or "," not in equation:
      return False
    inputs, rest = equation.split(",")
    kernel, output = rest.split("->")
    letters = set(inputs) | set(kernel) | set(output)
    if not letters <= set(string.ascii_letters):
      return False
    counts = [(c in inputs) + (c in kernel) + (c in output) for c in letters]
    return (all(n == 2 for n in counts) and inputs[0] == output[0]
            and inputs[0] not in kernel
            and len(set(inputs)) == len(inputs)
            and len(set(output)) == len(output))

  def features(self, inputs, delta):
    terms, _, output = self.terms
    a = tf.transpose(inputs, [terms.index(c)
                              for c in self.free + self.contracted])
    d = tf.transpose(delta, [output.index(c) for c in self.free + self.out])
    n = len(self.free)
    return (base.flatten_positions(a, base.product(a.shape[n:])),
            base.flatten_positions(d, base.product(d.shape[n:])))

  def _kernel_order(self):
    kernel = self.terms[1]
    return [kernel.index(c) for c in self.contracted + self.out]

  def flat_kernel(self, t):
    t = tf.transpose(t, self._kernel_order())
    return tf.reshape(t, [base.product(t.shape[:len(self.contracted)]), -1])

  def kernel_shape_grad(self, grad, shape=None):
    order = self._kernel_order()
    shape = self.layer.kernel.shape if shape is None else shape
    grad = tf.reshape(grad, [shape[i] for i in order])
    inverse = [order.index(i) for i in range(len(order))]
    return tf.transpose(grad, inverse)


class LoRA(base.Rule):
  """A LoRA-enabled Dense or EinsumDense (Keras ``enable_lora``): the kernel
  is K + s·A B (s = lora_alpha / lora_rank; A: the kernel's shape with its
  last axis replaced by the rank r, B: [r, last]), K frozen.

  With the layer's linear form (a [T, p], δ [T, q], q = q'·last),
  ∇A_u = s·a_uᵀ (δ_u Bᵀ) and ∇B_u = s·(a_u A)ᵀ δ_u, the positions of the
  second taken over (T, q'): both Dense-like products of recorded tensors,
  ghost norm or materialized as for a Dense, and book-kept sums; no
  per-unit re-run of the layer.
  """

  def __init__(self, layer, linear, values):
    self.linear = linear  # the layer's Linear rule: its features, ordering
    super().__init__(layer)
    self.a_var, self.b_var = layer.lora_kernel_a, layer.lora_kernel_b
    self.values = values
    self.bias = layer.bias if base.has_bias(layer) and (
        layer.bias.trainable) else None
    self.variables = [v for v in (self.a_var, self.b_var, self.bias)
                      if v is not None and v.trainable]
    self.scale = layer.lora_alpha / layer.lora_rank

  @property
  def calls(self):  # recorded on the Linear rule, which reads them
    return self.linear.calls

  @calls.setter
  def calls(self, calls):
    self.linear.calls = calls

  @staticmethod
  def make(layer, linear, values):
    own = {id(v) for v in layer._trainable_variables if v.trainable}  # pylint: disable=protected-access
    rule = LoRA(layer, linear, values)
    if {id(v) for v in rule.variables} != own or not all(
        id(v) in values for v in rule.variables):
      return None
    if isinstance(linear, EinsumDense) and (
        linear.terms[1][-1] not in linear.terms[2]):
      return None  # the kernel's last axis is contracted: no Dense form
    return rule

  def _value(self, v):
    return self.values[id(v)] if id(v) in self.values else v.value

  def _pairs(self, deltas):
    """((a, δBᵀ·s) for A, (a A·s, δ) for B), [U, T·, ·] each."""
    a, d = self.linear._ad(deltas)  # pylint: disable=protected-access
    b = tf.cast(self._value(self.b_var), d.dtype)
    rank, last = b.shape
    q = d.shape[-1] // last
    positions = a.shape[1] if a.shape[1] is not None else -1
    units = tf.shape(a)[0]
    d4 = tf.reshape(d, [units, positions, q, last])
    d_a = tf.reshape(tf.einsum("utkl,rl->utkr", d4, b) * self.scale,
                     [units, positions, q * rank])
    a_flat = tf.cast(self.linear.flat_kernel(self._value(self.a_var)),
                     a.dtype)
    a_b = tf.reshape(tf.matmul(a, a_flat) * self.scale,
                     [units, -1 if positions == -1 else positions * q, rank])
    d_b = tf.reshape(d, [units, -1 if positions == -1 else positions * q,
                         last])
    return (a, d_a), (a_b, d_b)

  def _a_shape_grad(self, g):
    return self.linear.kernel_shape_grad(g, self.a_var.shape)

  def sq_norms(self, deltas, scales):
    (a, d_a), (a_b, d_b) = self._pairs(deltas)
    norms = []
    for v, s in zip(self.variables, scales):
      if v is self.a_var:
        norms.append(ghost.linear_sq_norms(
            a, d_a, None if s is None else self.linear.flat_kernel(s)))
      elif v is self.b_var:
        norms.append(ghost.linear_sq_norms(a_b, d_b, s))
      else:
        g = self.linear._unit_bias_grads(deltas)  # pylint: disable=protected-access
        norms.append(ghost.sum_squares(
            g if s is None else g * tf.cast(s, g.dtype)))
    return norms

  def _collect(self, deltas, weights, linear_fn, bias_fn):
    (a, d_a), (a_b, d_b) = self._pairs(deltas)
    out = []
    for v, w in zip(self.variables, weights):
      if v is self.a_var:
        out.append(self._a_shape_grad(linear_fn(a, d_a, w)))
      elif v is self.b_var:
        out.append(linear_fn(a_b, d_b, w))
      else:
        out.append(bias_fn(self.linear._unit_bias_grads(deltas), w))  # pylint: disable=protected-access
    return out

  def grads(self, deltas, weights):
    return self._collect(deltas, weights, ghost.linear_grad,
                         ghost.weighted_sum)

  def square_sums(self, deltas, weights):
    return self._collect(
        deltas, weights, ghost.linear_square_sum,
        lambda g, w: ghost.weighted_sum(tf.square(g), tf.square(w)))

  def plan(self):
    (a, _), (a_b, _) = self._pairs([c.z for c in self.calls])
    rank, last = self.b_var.shape
    p = a.shape[-1]
    q = base.product(self.a_var.shape) // (p * rank)
    return (f"LoRA r={rank}: A {describe(a.shape[1], p, q * rank)}; "
            f"B {describe(a_b.shape[1], rank, last)}")


def _linear_rule(cls, supported=None):
  def factory(layer, original_call, values):
    del original_call
    if supported is not None and not supported(layer):
      return None
    rule = cls(layer)
    if getattr(layer, "lora_enabled", False):
      # The kernel is frozen; the Linear rule gives the features.
      return LoRA.make(layer, rule, values)
    return rule
  return factory


def _conv_supported(layer):
  return layer.data_format == "channels_last" and layer.groups == 1 and (
      not getattr(layer, "lora_enabled", False))


registry.register_builtin(keras.layers.Dense, _linear_rule(Dense))
registry.register_builtin(keras.layers.EinsumDense, _linear_rule(
    EinsumDense, EinsumDense.supported))
for _conv in (keras.layers.Conv1D, keras.layers.Conv2D):
  registry.register_builtin(_conv, _linear_rule(Conv, _conv_supported))
