"""Ghost clipping with book-keeping for Keras 3 models (the fast path).

Every unit (example or microbatch) is evaluated on its own, inside
``tf.vectorized_map``: its forward pass records, for every layer that owns
trainable weights, what its weight gradients are made of (the layer's input
``a`` and its pre-activation output ``z``), and its own backward pass gives
δ_u = ∂ℓ_u/∂z. Then, per layer (``core.ghost``):

=================================  ===========================================
Dense, EinsumDense                 ‖A_uᵀΔ_u‖: ghost norm or materialized,
                                   whichever is cheaper for the shapes
Conv1D, Conv2D (channels last)     the same on the input patches
Embedding                          per-unit row sums of δ (sorted ids)
LayerNormalization,                per-unit Σ_t δ_t⊙x̂_t and Σ_t δ_t (x̂ from
GroupNormalization                 the layer's own call with γ = 1, β = 0)
any other layer with weights       per-unit gradients of that layer alone,
                                   vectorized over units (its weights only)
=================================  ===========================================

and the clipped sum Σ_u c_u ∇W_u from the same a and δ (book-keeping: no
second backward pass). MultiHeadAttention is covered by its EinsumDense
projections.

Why privacy holds for any model (not only for models whose axis 0 is "one row
per example"): every recorded tensor of unit u comes out of unit u's own
evaluation under ``vectorized_map``, whose semantics are those of a loop over
units — no other example can reach it, whatever the model does with its axes
(folding the batch into positions, concatenating two inputs along axis 0,
shifting, gathering or averaging over axis 0). Unit u's clip factor is
computed from exactly the tensors its contribution to the sum is built from,
so each unit adds at most C. Nothing here assumes that the model keeps the
batch axis; a model that mixes examples is merely evaluated per unit (and
refused by the train step's batch-consistency check, see ``training``).

The forward pass runs in a Keras ``StatelessScope`` that sees every read of a
trainable variable: a weight read outside its own layer's call (tied
weights, a weight used directly in ``Model.call``) would make the recorded
gradients incomplete (a utility problem: the norm and the sum would both miss
it), so the whole model then uses the vectorized path, and so do models whose
layers cannot be recorded (several tensor inputs of one layer with weights,
randomness in such a layer, quantized or LoRA layers).
What each layer used is kept in a :class:`ClippingPlan`.
"""
import collections
import string

import keras
import tensorflow as tf

from tf_dpadambc.core import clipping
from tf_dpadambc.core import ghost
from tf_dpadambc.core import per_example
from tf_dpadambc.keras import _compat


class Unsupported(Exception):
  """The model cannot use ghost clipping; the message says why."""


PlanEntry = collections.namedtuple("PlanEntry", ["layer", "kind", "method"])


class ClippingPlan:
  """How a private train step computes per-unit norms and the clipped sum.

  ``entries``: one :data:`PlanEntry` per layer with trainable weights (empty
  when the whole model uses the vectorized path); ``fallback``: None, or the
  reason the whole model uses vectorized per-unit gradients.
  """

  def __init__(self, entries=(), fallback=None):
    self.entries = list(entries)
    self.fallback = fallback

  @property
  def per_layer_fallbacks(self):
    return [e for e in self.entries if e.method.startswith("per-layer")]

  def __str__(self):
    if self.fallback:
      return ("Per-unit clipping: vectorized per-unit gradients of the whole "
              f"model, because {self.fallback}")
    width = max([len(e.layer) for e in self.entries] + [5])
    lines = ["Per-unit clipping: ghost norms with book-keeping",
             f"{'layer':<{width}}  {'type':<20} method"]
    lines += [f"{e.layer:<{width}}  {e.kind:<20} {e.method}"
              for e in self.entries]
    return "\n".join(lines)

  __repr__ = __str__


class _Call(collections.namedtuple("_Call", ["inputs", "kwargs", "z"])):
  """One recorded call, stacked over units: ``inputs`` [U, *a_u] (the
  layer's input in unit u's own evaluation), ``z`` [U, *z_u] (its output, or
  after the backward pass δ), and the call's other, non-tensor arguments."""

  @property
  def rows(self):
    """How many leading rows one unit owns in :meth:`merged` tensors."""
    return _rows(self.inputs)

  def merged(self, t):
    """[U, n, ...] -> [U·n, ...]: unit u's rows n·u … n·u + n − 1, the layout
    Keras layers expect (a unit tensor without a row axis is kept as is)."""
    if self.inputs.shape.rank < 3:
      return t
    return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))


def _rows(stacked):
  """n: rows per unit of a stacked [U, n, ...] tensor (1 for [U] or [U, p])."""
  if stacked.shape.rank < 3:
    return 1
  return stacked.shape[1] if stacked.shape[1] is not None else tf.shape(
      stacked)[1]


def _group(t, rows):
  """[U·n, ...middle, last] (n = ``rows``) -> [U, T, last], a unit's positions
  side by side; T = n·middle, static where the shapes are. Rank 1 (token ids
  [U·n]) becomes [U, n]."""
  if t.shape.rank == 1:
    return tf.reshape(t, [-1, rows] if isinstance(rows, int) else tf.stack(
        [-1, rows]))
  middle = t.shape[1:-1]
  last = t.shape[-1] if t.shape[-1] is not None else tf.shape(t)[-1]
  if isinstance(rows, int) and middle.is_fully_defined():
    return tf.reshape(t, [-1, rows * middle.num_elements(), last])
  per_unit = rows * tf.reduce_prod(tf.shape(t)[1:-1])
  return tf.reshape(t, tf.stack([-1, per_unit, last]))


def _per_unit_sum(t, rows):
  """[U·n, ...] per-row values -> [U, ...] per-unit sums."""
  if isinstance(rows, int) and rows == 1:
    return t
  return tf.reduce_sum(tf.reshape(t, tf.concat([[-1, rows], tf.shape(t)[1:]],
                                               0)), axis=1)


class _Rule:
  """How one layer's per-unit norms and clipped sums are formed from (a, δ).

  ``variables``: the layer's trainable variables in the order the rule
  returns norms and gradients. ``calls``: the layer's recorded calls, stacked
  over units (:class:`_Call`); ``deltas``: one δ per call, stacked alike.
  """
  pre_activation = True  # z is the output before the layer's activation

  def __init__(self, layer):
    self.layer = layer
    self.calls = []

  def plan(self):
    raise NotImplementedError

  def sq_norms(self, deltas, scales):
    """[U] squared norms per variable (``scales``: None or one s per variable)."""
    raise NotImplementedError

  def grads(self, deltas, weights):
    """Σ_u w_u ∇_v ℓ_u per variable (``weights``: one [U] per variable)."""
    raise NotImplementedError

  def square_sums(self, deltas, weights):
    """Σ_u w_u² ∇_v ℓ_u ⊙ ∇_v ℓ_u per variable (joint moment estimation)."""
    raise NotImplementedError


class _Linear(_Rule):
  """z = a K (+ b) at T positions: Dense, EinsumDense, convolutions."""

  def __init__(self, layer):
    super().__init__(layer)
    self.variables = [layer.kernel] + ([layer.bias] if _has_bias(layer) else [])

  def features(self, inputs, delta):
    """(a [N, T, p], δ [N, T, d]) of one call's merged rows: the two sides
    of its linear form."""
    raise NotImplementedError

  def _ad(self, deltas):
    pairs = [(call.rows, self.features(call.merged(call.inputs),
                                       call.merged(delta)))
             for call, delta in zip(self.calls, deltas)]
    a = tf.concat([_group(a, rows) for rows, (a, _) in pairs], 1)
    d = tf.concat([_group(d, rows) for rows, (_, d) in pairs], 1)
    return a, d

  def _unit_bias_grads(self, deltas):
    shape = list(self.layer.bias.shape)
    return tf.add_n([_per_unit_sum(ghost.broadcast_grads(call.merged(d),
                                                         shape), call.rows)
                     for call, d in zip(self.calls, deltas)])

  def kernel_shape_grad(self, grad):
    return tf.reshape(grad, self.layer.kernel.shape)

  def flat_kernel(self, t):
    return tf.reshape(t, [-1, t.shape[-1]])

  def sq_norms(self, deltas, scales):
    a, d = self._ad(deltas)
    scale = None if scales[0] is None else self.flat_kernel(scales[0])
    norms = [ghost.linear_sq_norms(a, d, scale)]
    if len(self.variables) > 1:
      g = self._unit_bias_grads(deltas)
      if scales[1] is not None:
        g *= tf.cast(scales[1], g.dtype)
      norms.append(ghost.sum_squares(g))
    return norms

  def kernel_sum(self, deltas, weights):
    """Σ_u w_u ∇K_u, book-kept from (a, δ)."""
    a, d = self._ad(deltas)
    return self.kernel_shape_grad(ghost.linear_grad(a, d, weights))

  def grads(self, deltas, weights):
    grads = [self.kernel_sum(deltas, weights[0])]
    if len(self.variables) > 1:
      grads.append(ghost.weighted_sum(self._unit_bias_grads(deltas),
                                      weights[1]))
    return grads

  def square_sums(self, deltas, weights):
    a, d = self._ad(deltas)
    squares = [self.kernel_shape_grad(
        ghost.linear_square_sum(a, d, weights[0]))]
    if len(self.variables) > 1:
      squares.append(ghost.weighted_sum(tf.square(
          self._unit_bias_grads(deltas)), tf.square(weights[1])))
    return squares

  def plan(self):
    a, _ = self._ad([c.z for c in self.calls])
    positions = a.shape[1]
    p, d = self.flat_kernel(self.layer.kernel).shape
    if positions == 1:
      return "ghost norm ‖a‖·‖δ‖ (T=1)"
    if positions is None:
      return "materialized per unit (T unknown when traced)"
    if ghost.prefer_ghost(positions, p, d):
      return f"ghost norm (T={positions}: 2T²={2 * positions**2} < pd={p * d})"
    return (f"materialized per unit (T={positions}: 2T²={2 * positions**2} "
            f"≥ pd={p * d})")


class _Dense(_Linear):

  def features(self, inputs, delta):
    return inputs, delta


class _Conv(_Linear):

  def features(self, inputs, delta):
    layer = self.layer
    a = ghost.conv_patches(inputs, layer.kernel_size, layer.strides,
                           layer.padding, layer.dilation_rate)
    return a, _flatten_positions(delta)

  def kernel_sum(self, deltas, weights):
    # By the convolution's own filter-gradient op: no patches. A unit's
    # weight is repeated for each of its rows.
    layer = self.layer
    return tf.add_n([ghost.conv_grad(
        c.merged(c.inputs), c.merged(d),
        weights if isinstance(c.rows, int) and c.rows == 1 else tf.repeat(
            weights, c.rows),
        layer.kernel.shape, layer.strides, layer.padding, layer.dilation_rate)
                     for c, d in zip(self.calls, deltas)])


class _EinsumDense(_Linear):
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
    return (_flatten_positions(a, _product(a.shape[n:])),
            _flatten_positions(d, _product(d.shape[n:])))

  def _kernel_order(self):
    kernel = self.terms[1]
    return [kernel.index(c) for c in self.contracted + self.out]

  def flat_kernel(self, t):
    t = tf.transpose(t, self._kernel_order())
    return tf.reshape(t, [_product(t.shape[:len(self.contracted)]), -1])

  def kernel_shape_grad(self, grad):
    order = self._kernel_order()
    shape = self.layer.kernel.shape
    grad = tf.reshape(grad, [shape[i] for i in order])
    inverse = [order.index(i) for i in range(len(order))]
    return tf.transpose(grad, inverse)


def _flatten_positions(t, features=None):
  """[B, ...positions, features] -> [B, T, features], T static where known."""
  features = t.shape[-1] if features is None else features
  positions = _product(t.shape[1:]) // features if t.shape[1:].is_fully_defined() else -1
  return tf.reshape(t, [tf.shape(t)[0], positions, features])


def _product(dims):
  n = 1
  for dim in dims:
    n *= dim
  return n


class _Embedding(_Rule):
  pre_activation = False

  def __init__(self, layer):
    super().__init__(layer)
    self.variables = [layer.embeddings]

  def _ids_deltas(self, deltas):
    ids = tf.concat([tf.reshape(tf.cast(c.inputs, tf.int64),
                                [tf.shape(c.inputs)[0], -1])
                     for c in self.calls], 1)
    d = tf.concat([_group(c.merged(delta), c.rows)
                   for c, delta in zip(self.calls, deltas)], 1)
    return ids, d

  def sq_norms(self, deltas, scales):
    ids, d = self._ids_deltas(deltas)
    return [ghost.embedding_sq_norms(ids, d, self.layer.embeddings.shape[0],
                                     scales[0])]

  def grads(self, deltas, weights):
    ids, d = self._ids_deltas(deltas)
    return [ghost.embedding_grad(ids, d, weights[0],
                                 self.layer.embeddings.shape[0])]

  def square_sums(self, deltas, weights):
    ids, d = self._ids_deltas(deltas)
    return [ghost.embedding_square_sum(ids, d, weights[0],
                                       self.layer.embeddings.shape[0])]

  def plan(self):
    return "row sums of δ per unit (sorted ids)"


class _Materialized(_Rule):
  """A rule that materializes per-unit gradients of the layer's weights."""

  _cache = None

  def _unit_grads(self, deltas):
    """One [U, *v.shape] tensor per variable."""
    raise NotImplementedError

  def _per_unit(self, deltas):
    # Norms and sums use the same per-unit gradients: build them once.
    if self._cache is None or self._cache[0] is not deltas:
      self._cache = deltas, self._unit_grads(deltas)
    return self._cache[1]

  def sq_norms(self, deltas, scales):
    return [ghost.sum_squares(g if s is None else g * tf.cast(s, g.dtype)[None])
            for g, s in zip(self._per_unit(deltas), scales)]

  def grads(self, deltas, weights):
    return [ghost.weighted_sum(g, w) for g, w in
            zip(self._per_unit(deltas), weights)]

  def square_sums(self, deltas, weights):
    return [ghost.weighted_sum(tf.square(g), tf.square(w)) for g, w in
            zip(self._per_unit(deltas), weights)]


class _Normalization(_Materialized):
  """z = x̂ ⊙ γ + β (LayerNormalization, GroupNormalization, trailing axes).

  x̂ does not depend on γ, β: it is recomputed by the layer's own call with
  γ = 1, β = 0 (row by row: these layers normalize within a row), and the
  per-unit gradients Σ_t δ_t ⊙ x̂_t and Σ_t δ_t are materialized (2d numbers
  per unit).
  """
  pre_activation = False

  def __init__(self, layer, original_call):
    super().__init__(layer)
    self.original_call = original_call
    self.variables = [v for v in (layer.gamma, layer.beta) if v is not None]

  @staticmethod
  def supported(layer):
    """True if γ and β apply to trailing axes (broadcast like a bias)."""
    try:
      rank = len(layer.input.shape)
    except (AttributeError, ValueError):  # never called symbolically
      return False
    if isinstance(layer, keras.layers.GroupNormalization):
      return layer.axis in (-1, rank - 1)
    axes = sorted(a % rank for a in (
        layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]))
    return axes == list(range(rank - len(axes), rank))

  def _unit_grads(self, deltas):
    layer = self.layer
    neutral = [(v, (tf.ones if v is layer.gamma else tf.zeros)(v.shape, v.dtype))
               for v in self.variables]
    total = None
    for call, delta in zip(self.calls, deltas):
      with keras.StatelessScope(neutral, initialize_variables=False):
        normalized = self.original_call(call.merged(call.inputs),
                                        **call.kwargs)
      delta = call.merged(delta)
      normalized = tf.cast(normalized, delta.dtype)  # (mixed precision)
      grads = [_per_unit_sum(ghost.broadcast_grads(
          delta * normalized if v is layer.gamma else delta, v.shape),
                             call.rows) for v in self.variables]
      total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total

  def plan(self):
    return "materialized per unit (x̂ recomputed; 2d numbers per unit)"


class _PerLayer(_Materialized):
  """Per-unit gradients of one layer's own weights, vectorized over units.

  Re-runs only this layer on each unit's recorded input, with its output
  gradient δ: ∇_w ⟨layer_w(x_u), δ_u⟩, each unit alone (``vectorized_map``
  over the stacked calls: exact by construction).
  """
  pre_activation = False

  def __init__(self, layer, original_call, values):
    super().__init__(layer)
    self.original_call = original_call
    self.variables = list(_compat.own_trainable_variables(layer))
    self.values = values

  def _unit_grads(self, deltas):
    total = None
    for call, delta in zip(self.calls, deltas):
      values = [self.values[id(v)] for v in self.variables]

      def unit_grads(unit, values=values, kwargs=call.kwargs):
        x, d = unit
        with tf.GradientTape() as tape:
          tape.watch(values)
          with keras.StatelessScope(list(zip(self.variables, values)),
                                    initialize_variables=False):
            y = self.original_call(x, **kwargs)
          inner = tf.reduce_sum(y * tf.cast(d, y.dtype))
        return tape.gradient(inner, values,
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)
      grads = tf.vectorized_map(unit_grads, (call.inputs, delta),
                                fallback_to_while_loop=False)
      total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total

  def plan(self):
    return "per-layer vectorized per-unit gradients (no ghost rule)"


class _LoRA(_PerLayer):
  """A LoRA-enabled layer (Keras ``enable_lora``): kernel K frozen, trainable
  factors A, B of K + (α/r)·AB. Their per-unit gradients (r·(p + d) numbers)
  come from re-running the layer on the unit's recorded input with its δ."""

  def plan(self):
    return ("LoRA factors per unit (rank "
            f"{self.layer.lora_rank}, layer re-run per unit)")


def _has_bias(layer):
  return getattr(layer, "bias", None) is not None


def _rule_for(layer, original_call, values):
  """The rule for a layer with trainable weights, or raise Unsupported."""
  if layer.dtype_policy.quantization_mode is not None:
    raise Unsupported(f"layer '{layer.name}' is quantized")
  if getattr(layer, "lora_enabled", False):
    # Trainable: the LoRA factors (and a bias), a few numbers per unit:
    # materialized per unit by re-running the layer (exact by construction).
    return _LoRA(layer, original_call, values)
  if type(layer) is keras.layers.Dense:  # pylint: disable=unidiomatic-typecheck
    return _Dense(layer)
  if type(layer) is keras.layers.EinsumDense and _EinsumDense.supported(layer):  # pylint: disable=unidiomatic-typecheck
    return _EinsumDense(layer)
  if type(layer) in (keras.layers.Conv1D, keras.layers.Conv2D) and (  # pylint: disable=unidiomatic-typecheck
      layer.data_format == "channels_last" and layer.groups == 1):
    return _Conv(layer)
  if type(layer) is keras.layers.Embedding:  # pylint: disable=unidiomatic-typecheck
    return _Embedding(layer)
  if type(layer) in (keras.layers.LayerNormalization,  # pylint: disable=unidiomatic-typecheck
                     keras.layers.GroupNormalization) and (
                         _Normalization.supported(layer)):
    return _Normalization(layer, original_call)
  if _compat.seed_generators(layer):
    raise Unsupported(f"layer '{layer.name}' has weights and draws random "
                      "numbers")
  if any(_compat.own_trainable_variables(sub) for sub in
         _compat.flatten_layers(layer)[1:]):
    raise Unsupported(f"layer '{layer.name}' has weights of its own and "
                      "sublayers with weights")
  return _PerLayer(layer, original_call, values)


class _TrackingScope(keras.StatelessScope):
  """A StatelessScope that checks who reads each trainable variable."""

  def __init__(self, mapping, on_read):
    super().__init__(mapping, collect_losses=True)
    self._on_read = on_read

  def get_current_value(self, variable):
    self._on_read(variable)
    return super().get_current_value(variable)


class _Recorder:
  """Installs recording wrappers on the layers' ``call`` while a unit's
  forward pass is traced (inside ``vectorized_map``)."""

  def __init__(self, model, params):
    self.model = model
    self.tape = None
    self.stack = []
    self.problem = None
    trainable = model.trainable_variables
    self.values = {id(v): p for v, p in zip(trainable, params)}
    self.owner = {}
    self.rules = []
    self._originals = []
    for layer in _compat.flatten_layers(model):
      own = [v for v in _compat.own_trainable_variables(layer)
             if id(v) in self.values]
      if not own:
        continue
      for v in own:
        if id(v) in self.owner:
          raise Unsupported(f"variable '{v.path}' belongs to two layers")
        self.owner[id(v)] = layer
      original = layer.call
      rule = _rule_for(layer, original, self.values)
      self.rules.append(rule)
      self._originals.append((layer, original, layer.__dict__.get("call")))
    missing = [v.path for v in trainable if id(v) not in self.owner]
    if missing:
      raise Unsupported(f"variables {missing} belong to no layer")

  def on_read(self, variable):
    owner = self.owner.get(id(variable))
    if owner is None or self.problem:
      return
    if not self.stack or self.stack[-1] is not owner:
      where = f"layer '{self.stack[-1].name}'" if self.stack else "the model"
      self.problem = (f"weight '{variable.path}' of layer '{owner.name}' is "
                      f"used by {where} (tied or shared weights)")

  def _wrap(self, rule, original):
    def call(*args, **kwargs):
      if len(args) != 1 or not tf.is_tensor(args[0]) or any(
          tf.is_tensor(v) for v in kwargs.values()):
        self.problem = self.problem or (
            f"layer '{rule.layer.name}' was called with several tensors")
        return original(*args, **kwargs)
      self.stack.append(rule.layer)
      try:
        layer = rule.layer
        activation = getattr(layer, "activation", None)
        if rule.pre_activation and activation is not None:
          object.__setattr__(layer, "activation", None)
          try:
            z = original(*args, **kwargs)
          finally:
            object.__setattr__(layer, "activation", activation)
        else:
          z = original(*args, **kwargs)
      finally:
        self.stack.pop()
      if not tf.is_tensor(z):
        self.problem = self.problem or (
            f"layer '{rule.layer.name}' returned several tensors")
        return z
      self.tape.watch(z)
      rule.calls.append(_Call(args[0], kwargs, z))
      if rule.pre_activation and activation is not None:
        return activation(z)
      return z
    return call

  def __enter__(self):
    for rule, (layer, original, _) in zip(self.rules, self._originals):
      rule.calls = []
      object.__setattr__(layer, "call", self._wrap(rule, original))
    return self

  def __exit__(self, *exc):
    for layer, _, own in self._originals:  # restore an instance's own call
      if own is None:
        del layer.__dict__["call"]
      else:
        object.__setattr__(layer, "call", own)


def clipped_sum(model, params, non_trainable, units, unit_loss_fn, spec):
  """Σ_u clip(∇ℓ_u) by ghost norms and book-keeping; raises :class:`Unsupported`.

  Args:
    model: a built Keras 3 model.
    params, non_trainable: the values of its trainable and non-trainable
      variables (as for ``model.stateless_call``).
    units: ``(x, y, sample_weight)`` split into units, every tensor with
      leading axis U (``per_example.split_microbatches``).
    unit_loss_fn: ``(y_u, y_pred_u, w_u) -> scalar``, one unit's loss from
      its own predictions (sample weights applied).
    spec: a :class:`~tf_dpadambc.core.clipping.ClipSpec`.

  Returns:
    ``(ClippedSum, unit_losses [U], y_pred [U, ...] stacked over units,
    plan)``.
  """
  if model.dtype_policy.quantization_mode is not None or getattr(
      model, "_remat_mode", None) is not None:
    raise Unsupported("the model is quantized or rematerialized")
  mapping = (list(zip(model.trainable_variables, params))
             + list(zip(model.non_trainable_variables, non_trainable)))
  recorder = _Recorder(model, params)
  rules = recorder.rules

  def evaluate_unit(unit):
    """Unit u alone: its loss, predictions, recorded inputs and δ_u."""
    ux, uy, uw = unit
    with tf.GradientTape() as tape:
      recorder.tape = tape
      with recorder, _TrackingScope(mapping, recorder.on_read) as scope:
        y_pred = model.call(ux, training=True)
        extra = model.losses
      if scope.losses or extra:
        raise Unsupported("the model adds losses (regularizers or add_loss)")
      if recorder.problem:
        raise Unsupported(recorder.problem)
      loss = unit_loss_fn(uy, y_pred, uw)
      scale = per_example.current_loss_scale()  # static (mixed_float16)
      scaled = loss if scale == 1.0 else loss * tf.cast(scale, loss.dtype)
    calls = [c for rule in rules for c in rule.calls]
    deltas = tape.gradient(scaled, [c.z for c in calls],
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return loss, y_pred, [c.inputs for c in calls], deltas

  unit_losses, y_pred, inputs, flat_deltas = tf.vectorized_map(
      evaluate_unit, units, fallback_to_while_loop=False)
  # Mixed precision: float16/bfloat16 records are book-kept in float32 (the
  # norms in float64, core.ghost), δ unscaled exactly before any norm.
  inputs = [tf.cast(a, tf.float32) if a.dtype in (tf.float16, tf.bfloat16)
            else a for a in inputs]
  flat_deltas = [per_example.unscale(d) for d in flat_deltas]
  # Swap each rule's per-unit records for the stacked ones (same order).
  deltas, start = [], 0
  for rule in rules:
    n = len(rule.calls)
    rule.calls = [_Call(a, c.kwargs, None) for a, c in
                  zip(inputs[start:start + n], rule.calls)]
    deltas.append(flat_deltas[start:start + n])
    start += n
  for rule, d in zip(rules, deltas):
    rule.calls = [c._replace(z=delta) for c, delta in zip(rule.calls, d)]

  index = {id(v): i for i, v in enumerate(model.trainable_variables)}
  scales = spec.scale
  sq = [None] * len(params)
  for rule, d in zip(rules, deltas):
    if not rule.calls:
      continue
    rule_scales = [None if scales is None else scales[index[id(v)]]
                   for v in rule.variables]
    for v, s in zip(rule.variables, rule.sq_norms(d, rule_scales)):
      sq[index[id(v)]] = s
  # Norms and factors in float64 (core.ghost computes the squares there):
  # a float32 norm can underflow to 0 and leave a unit unclipped.
  zero = tf.zeros_like(unit_losses, tf.float64)
  sq = [zero if s is None else tf.cast(s, tf.float64) for s in sq]
  norms = tf.sqrt(tf.add_n(sq))
  ok = tf.math.is_finite(norms)
  weight_dtype = unit_losses.dtype
  if spec.layer_clips is None:
    factors = clipping.clip_factors(norms, spec.l2_norm_clip,
                                    spec.automatic_gamma)
    weights = [tf.cast(factors, weight_dtype)] * len(params)
    was_clipped = factors < 1.0
  else:
    if len(spec.layer_clips) != len(params):
      raise ValueError(
          f"{len(spec.layer_clips)} per-layer clip norms for {len(params)} "
          "trainable variables: give one per variable.")
    # A unit is dropped whole if any of its tensors is not finite.
    factors = [tf.where(ok, clipping.clip_factors(tf.sqrt(s), c,
                                                  spec.automatic_gamma),
                        tf.zeros_like(s)) for s, c in zip(sq, spec.layer_clips)]
    weights = [tf.cast(f, weight_dtype) for f in factors]
    was_clipped = tf.reduce_any(tf.stack([f < 1.0 for f in factors]), 0)

  def collect(method):
    out = [tf.zeros_like(p) for p in params]
    for rule, d in zip(rules, deltas):
      if rule.calls:
        positions = [index[id(v)] for v in rule.variables]
        values = getattr(rule, method)(d, [weights[i] for i in positions])
        for i, g in zip(positions, values):
          out[i] = tf.cast(g, params[i].dtype)
    return out
  grads = collect("grads")
  squares = collect("square_sums") if spec.square_sum else None
  if scales is not None:  # Σ_u c_u s⊙g_u = s⊙Σ_u c_u g_u
    scales = [tf.cast(s, g.dtype) for g, s in zip(grads, scales)]
    grads = [g * s for g, s in zip(grads, scales)]
    if squares is not None:
      squares = [q * s * s for q, s in zip(squares, scales)]
  plan = ClippingPlan(
      PlanEntry(rule.layer.name, type(rule.layer).__name__,
                rule.plan() if rule.calls else "not called")
      for rule in rules)
  result = clipping.ClippedSum(
      grads, tf.cast(norms, unit_losses.dtype),
      tf.reduce_sum(tf.cast(ok & was_clipped, tf.int32)),
      tf.reduce_sum(tf.cast(~ok, tf.int32)), tf.constant(False), squares)
  return result, unit_losses, y_pred, plan
