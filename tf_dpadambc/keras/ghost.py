"""Ghost clipping with book-keeping for Keras 3 models (the fast path).

Every unit (example or microbatch) is evaluated on its own, inside
``tf.vectorized_map``: its forward pass records, for every layer that owns
trainable weights, what its weight gradients are made of (the layer's input
``a`` and its pre-activation output ``z``), and its own backward pass gives
δ_u = ∂ℓ_u/∂z. Then, per layer (``core.ghost``):

=================================  ===========================================
Dense, EinsumDense                 ‖A_uᵀΔ_u‖: ghost norm or materialized,
                                   whichever is cheaper for the shapes
LoRA-enabled Dense, EinsumDense    the same for the factors: (a, δBᵀ) and
                                   (aA, δ), base kernel frozen
Conv1D, Conv2D (channels last)     the same on the input patches
Embedding (+ LoRA)                 per-unit row sums of δ (sorted ids)
ReversibleEmbedding (tied)         row sums + logits' ghost norm + cross term
PositionEmbedding (KerasHub)       δ summed per position, materialized
LSTM, GRU, SimpleRNN (no dropout,  the cell unrolled over the static T steps
mask; see rules.recurrent)         (the rule's ``forward``), each step's
                                   x_tW + h_{t-1}U + b Dense-like over T
LayerNormalization, Group-,        per-unit Σ_t δ_t⊙J_t, J recomputed by the
RMSNormalization (Keras, Gemma)    layer's own call with neutral weights
a rule registered by the user      ``register_ghost_rule`` (rules.registry)
any other layer with weights       per-unit gradients of that layer alone,
                                   vectorized over units (its weights only)
=================================  ===========================================

Rules come from a registry (``rules.registry``, exact layer type), one
module per family in ``rules/``.
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
randomness in such a layer, quantized layers).
What each layer used is kept in a :class:`ClippingPlan`.

A rule may run the layer's forward computation itself (``Rule.forward``):
the recurrent rule replaces the layer's while loop (whose TensorList
``vectorized_map`` cannot vectorize) by the unrolled cell, and records the
states it computes. Recurrent layers without a rule
(:func:`unsupported_recurrent_layers`) make the whole model use the per-unit
``tf.map_fn`` loop instead (``training``).
"""
import collections

import keras
import tensorflow as tf

from tf_dpadambc.core import clipping
from tf_dpadambc.core import ghost as core_ghost
from tf_dpadambc.core import per_example
from tf_dpadambc.keras import _compat
from tf_dpadambc.keras import rules  # noqa: F401  (built-in rules register)
from tf_dpadambc.keras.rules import base
from tf_dpadambc.keras.rules import per_layer
from tf_dpadambc.keras.rules import registry


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


_Call = base.Call


def _rule_for(layer, original_call, values):
  """The layer's rule from the registry (``rules.registry``), or the
  per-layer fallback; raises Unsupported."""
  if layer.dtype_policy.quantization_mode is not None:
    raise Unsupported(f"layer '{layer.name}' is quantized")
  rule = registry.make_rule(layer, original_call, values)
  if rule is not None:
    return rule
  if _compat.seed_generators(layer):
    raise Unsupported(f"layer '{layer.name}' has weights and draws random "
                      "numbers")
  if any(_compat.own_trainable_variables(sub) for sub in
         _compat.flatten_layers(layer)[1:]):
    raise Unsupported(f"layer '{layer.name}' has weights of its own and "
                      "sublayers with weights")
  return per_layer.PerLayer(layer, original_call, values, [
      v for v in _compat.own_trainable_variables(layer) if id(v) in values])


def _covering_rule(layer, original_call, values):
  """The rule of a layer without weights of its own that covers its
  sublayers' (``Rule.covers_sublayers``: LSTM, GRU, SimpleRNN), or None."""
  if registry.lookup(layer) is None or (
      layer.dtype_policy.quantization_mode is not None):
    return None
  rule = registry.make_rule(layer, original_call, values)
  if rule is None or not getattr(rule, "covers_sublayers", False):
    return None
  return rule


def unsupported_recurrent_layers(model):
  """The model's recurrent layers (``keras.layers.RNN``) that no ghost rule
  covers: they need the per-unit loop (``per_example.sequential_units``)."""
  values = {id(v): v for v in model.trainable_variables}
  return [layer for layer in _compat.flatten_layers(model)
          if isinstance(layer, keras.layers.RNN)
          and _covering_rule(layer, layer.call, values) is None]


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
    self.graph = None
    self.rules = []
    self._originals = []
    covered = set()  # sublayers whose weights a parent's rule covers
    for layer in _compat.flatten_layers(model):
      if id(layer) in covered:
        continue
      original = layer.call
      own = [v for v in _compat.own_trainable_variables(layer)
             if id(v) in self.values]
      rule = None
      if not own:  # a rule for the weights of its sublayers (an RNN's cell)
        rule = _covering_rule(layer, original, self.values)
        if rule is None:
          continue
        own = list(rule.variables)
        covered.update(id(sub) for sub in _compat.flatten_layers(layer)[1:])
      for v in own:
        if id(v) in self.owner:
          raise Unsupported(f"variable '{v.path}' belongs to two layers")
        self.owner[id(v)] = layer
      if rule is None:
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
        result = rule.forward(original, args[0], kwargs)
      except base.Declined as e:
        self.problem = self.problem or str(e)
        return original(*args, **kwargs)
      finally:
        self.stack.pop()
      z, output = result[:2]
      record = result[2] if len(result) > 2 else args[0]
      if not tf.is_tensor(z):
        self.problem = self.problem or (
            f"layer '{rule.layer.name}' returned several tensors")
        return output
      if any(getattr(t, "graph", self.graph) is not self.graph
             for t in tf.nest.flatten((z, record))):
        # Its records would live in a branch's or a loop body's graph: the
        # unit's backward pass cannot reach them (δ = 0, the layer silently
        # untrained under XLA). The per-unit gradients path is exact.
        self.problem = self.problem or (
            f"layer '{rule.layer.name}' is called inside control flow "
            "(tf.cond, a while loop or a nested tf.function)")
        return output
      self.tape.watch(z)
      rule.calls.append(_Call(record, kwargs, z))
      return output
    return call

  def __enter__(self):
    self.graph = tf.compat.v1.get_default_graph()  # the unit's evaluation
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


def _float32_sums(rules, deltas, scales, num_units, largest_clip):
  """Switches the layers that may (this trace) and can (this many units)
  to float32 sums (``core.ghost.chunked_linear_grad`` for a Dense on
  vectors, several times faster than the float64 product on the CPU;
  ``core.ghost.pooled_embedding_grad`` for a pooled embedding) and returns
  the clip shrink that pays for their rounding, or None where no layer is
  eligible (and with a scale-then-privatize preconditioner, whose scaled
  norms do not bound the unscaled sum's rounding).

  The shrink is 1 + 2γL (``core.ghost.float32_clip_shrink``) with L the
  largest unit limit among the eligible layers — a constant of the model's
  weights (``float32_max_units()``: kernel and table shapes), not of this
  batch's U, nor of its T, nor of which layers this trace calls. U is the
  realized number of rows, which under add/remove adjacency differs
  between neighbouring batches (unpadded Poisson batches, a last partial
  batch): a shrink of 1 + 2γU would clip every other unit differently in
  the two, and at U = L + 1 (float64, no shrink) against U = L (float32,
  1 + 2γL) it moved the sum by up to L·C·2γL/(1 + 2γL) ≈ 14C. T can be
  data too (sequences padded to the longest one, retraced per length): a
  Dense on tokens set L only at T = 1, and a review moved the sum by 4.3C
  with one added two-token example. With one shrink for every batch, unit
  u changes the computed sum by at most C' plus both batches' rounding,
  each at most γ·L·C' (chunks of ``core.ghost.float32_chunk``: γ_K·U ≤ γL;
  0 where every sum is float64): ≤ C'(1 + 2γL) = C.

  A float32 sum runs only where no entry can overflow: each is at most
  Σ_u ‖x_u‖ ≤ U·C (``largest_clip``: the largest of the clip norms), held
  below half of float32's largest value (a clip near 3.4e38 made a pooled
  embedding's table inf at 5 units)."""
  if scales is not None:
    return None
  limits = {rule: rule.float32_max_units() for rule in rules
            if hasattr(rule, "float32_max_units")}
  limits = {rule: limit for rule, limit in limits.items() if limit > 0}
  if not limits:
    return None
  largest = max(limits.values())
  fits = (tf.cast(num_units, tf.float64) * tf.cast(largest_clip, tf.float64)
          <= tf.float32.max / 2)
  for rule, d in zip(rules, deltas):
    if rule in limits and rule.calls and rule.float32_usable(d):
      rule.float32_sum = (num_units <= limits[rule]) & fits
      rule.float32_units = largest  # chunks budgeted against L
  return core_ghost.float32_clip_shrink(largest)


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

  # The model's code runs here: it may read its unit, its weights and its
  # constants, nothing else (a layer that reaches the batch through the
  # graph gives every unit the other examples: refused when traced).
  evaluate_unit, check = per_example.unit_local(evaluate_unit, units)
  unit_losses, y_pred, inputs, flat_deltas = tf.vectorized_map(
      evaluate_unit, units, fallback_to_while_loop=False)
  check()
  # Mixed precision: float16/bfloat16 records are book-kept in float32 (the
  # norms in float64, core.ghost), δ unscaled exactly before any norm.
  inputs = tf.nest.map_structure(
      lambda a: tf.cast(a, tf.float32) if a.dtype in (
          tf.float16, tf.bfloat16) else a, inputs)
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
  # Clip factors in float64, as the sums they weight (a bfloat16 or float32
  # factor could round up by 2⁻⁸ or 2⁻²⁴).
  weight_dtype = clipping.sum_dtype(unit_losses.dtype)
  shrink = _float32_sums(
      rules, deltas, scales, tf.shape(unit_losses)[0],
      spec.l2_norm_clip if spec.layer_clips is None else tf.reduce_max(
          [tf.cast(c, tf.float64) for c in spec.layer_clips]))
  clip = lambda c: c if shrink is None else tf.cast(c, tf.float64) / shrink
  if spec.layer_clips is None:
    factors = clipping.clip_factors(norms, clip(spec.l2_norm_clip),
                                    spec.automatic_gamma)
    weights = [tf.cast(factors, weight_dtype)] * len(params)
    was_clipped = factors < 1.0
  else:
    if len(spec.layer_clips) != len(params):
      raise ValueError(
          f"{len(spec.layer_clips)} per-layer clip norms for {len(params)} "
          "trainable variables: give one per variable.")
    # A unit is dropped whole if any of its tensors is not finite.
    factors = [tf.where(ok, clipping.clip_factors(tf.sqrt(s), clip(c),
                                                  spec.automatic_gamma),
                        tf.zeros_like(s)) for s, c in zip(sq, spec.layer_clips)]
    weights = [tf.cast(f, weight_dtype) for f in factors]
    was_clipped = tf.reduce_any(tf.stack([f < 1.0 for f in factors]), 0)

  def collect(method):
    # float64 until the noise (clipping.sum_dtype).
    dtypes = [clipping.sum_dtype(p.dtype) for p in params]
    out = [tf.zeros_like(p, dtype=t) for p, t in zip(params, dtypes)]
    for rule, d in zip(rules, deltas):
      if rule.calls:
        positions = [index[id(v)] for v in rule.variables]
        values = getattr(rule, method)(d, [weights[i] for i in positions])
        for i, g in zip(positions, values):
          out[i] = tf.cast(g, dtypes[i])
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
  # The factors clip at C/shrink; with the float32 rounding the shrink pays
  # for, every unit is within the spec's bound C (‖(C_k)‖₂): what it records.
  result = clipping.ClippedSum(
      grads, tf.cast(norms, unit_losses.dtype),
      tf.reduce_sum(tf.cast(ok & was_clipped, tf.int32)),
      tf.reduce_sum(tf.cast(~ok, tf.int32)), tf.constant(False), squares,
      clipping.recorded(spec.sensitivity))
  return result, unit_losses, y_pred, plan
