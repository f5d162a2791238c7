"""Embedding lookups: Embedding (and its LoRA form), ReversibleEmbedding
(input and output embedding tied), KerasHub's PositionEmbedding."""
import keras
import tensorflow as tf

from tf_dpadambc.core import ghost
from tf_dpadambc.keras.rules import base
from tf_dpadambc.keras.rules import linear
from tf_dpadambc.keras.rules import registry


def _ids(calls):
  return tf.concat([tf.reshape(tf.cast(c.inputs, tf.int64),
                               [tf.shape(c.inputs)[0], -1]) for c in calls], 1)


def _grouped(calls, deltas):
  return tf.concat([base.group(c.merged(d), c.rows)
                    for c, d in zip(calls, deltas)], 1)


class Embedding(base.Rule):
  pre_activation = False

  def __init__(self, layer):
    super().__init__(layer)
    self.variables = [layer.embeddings]
    # As linear.Linear's: set by keras.ghost.clipped_sum where the units
    # were clipped for a float32 sum (a boolean tensor, None for float64),
    # and the model's float32 unit limit L.
    self.float32_sum = None
    self.float32_units = None
    self._lookup = None

  @property
  def vocab(self):
    return self.layer.embeddings.shape[0]

  def float32_max_units(self):
    """The most units whose pooled sum may be book-kept in float32
    (``ghost.embedding_float32_max_units``: of the table alone)."""
    return ghost.embedding_float32_max_units(
        self.vocab, self.layer.embeddings.shape[1],
        tf.as_dtype(self.layer.embeddings.dtype))

  def float32_usable(self, deltas):
    """Whether this trace may take the float32 sum: the pooled check runs
    (``ghost.pooled_lookup``: U, T and d static); each batch's values
    decide (:meth:`grads`)."""
    return self._pooled(deltas)[2] is not None

  def _ids_deltas(self, deltas):
    return _ids(self.calls), _grouped(self.calls, deltas)

  def _pooled(self, deltas):
    """(ids, δ, ghost.pooled_lookup or None), the lookup made once for the
    norms and the sum of the same deltas."""
    if self._lookup is None or self._lookup[0] is not deltas:
      ids, d = self._ids_deltas(deltas)
      self._lookup = (deltas, (ids, d, ghost.pooled_lookup(ids, d,
                                                           self.vocab)))
    return self._lookup[1]

  def sq_norms(self, deltas, scales):
    if scales[0] is not None:
      ids, d = self._ids_deltas(deltas)
      return [ghost.embedding_sq_norms(ids, d, self.vocab, scales[0])]
    ids, d, lookup = self._pooled(deltas)
    return [ghost.embedding_sq_norms(ids, d, self.vocab, lookup=lookup)]

  def grads(self, deltas, weights):
    ids, d, lookup = self._pooled(deltas)
    if lookup is None:
      return [ghost.embedding_grad(ids, d, weights[0], self.vocab)]
    float64 = lambda: ghost.embedding_grad(ids, lookup.delta, weights[0],
                                           self.vocab)
    # U is static here (pooled_lookup): U ≤ this table's own limit is
    # decided when traced.
    if self.float32_sum is None or ids.shape[0] > self.float32_max_units():
      return [float64()]
    # Both branches end in float32: with U ≤ L the float64 sum's one
    # rounding is within the γ_K·U·C' the clip shrink pays for
    # (ghost.float32_rounding), and a float64 table crossing the
    # conditional was written out as such. Saturated: past float32's range
    # (a clip near 3.4e38, where float32_sum is False) each entry is held
    # at its end, a 1-Lipschitz map of the sum (its sensitivity stays C).
    return [tf.cond(self.float32_sum & lookup.pooled,
                    lambda: ghost.pooled_embedding_grad(
                        ids, lookup.rows, lookup.counts, weights[0],
                        self.vocab, self.float32_units),
                    lambda: ghost.saturated(float64(), tf.float32))]

  def square_sums(self, deltas, weights):
    ids, d = self._ids_deltas(deltas)
    return [ghost.embedding_square_sum(ids, d, weights[0], self.vocab)]

  def plan(self):
    return "row sums of δ per unit (sorted ids)"


class EmbeddingLoRA(base.Rule):
  """A LoRA-enabled Embedding: the table is E + s·A B (A [vocab, r],
  B [r, d], E frozen). ∇A_u = s·Σ_t onehot(id_t) (δ_t Bᵀ): an embedding
  gradient of δBᵀ; ∇B_u = s·Σ_t A[id_t]ᵀ δ_t: a Dense-like product."""
  pre_activation = False

  def __init__(self, layer, values):
    super().__init__(layer)
    self.values = values
    self.a_var, self.b_var = layer.lora_embeddings_a, layer.lora_embeddings_b
    self.variables = [self.a_var, self.b_var]
    self.scale = layer.lora_alpha / layer.lora_rank
    self.vocab = self.a_var.shape[0]

  def _value(self, v):
    return self.values[id(v)] if id(v) in self.values else v.value

  def _parts(self, deltas):
    ids = _ids(self.calls)
    d = _grouped(self.calls, deltas)
    b = tf.cast(self._value(self.b_var), d.dtype)
    d_a = tf.einsum("utd,rd->utr", d, b) * self.scale
    rows = tf.gather(tf.cast(self._value(self.a_var), d.dtype),
                     tf.clip_by_value(ids, 0, self.vocab - 1)) * self.scale
    return ids, d_a, rows, d

  def sq_norms(self, deltas, scales):
    ids, d_a, rows, d = self._parts(deltas)
    return [ghost.embedding_sq_norms(ids, d_a, self.vocab, scales[0]),
            ghost.linear_sq_norms(rows, d, scales[1])]

  def grads(self, deltas, weights):
    ids, d_a, rows, d = self._parts(deltas)
    return [ghost.embedding_grad(ids, d_a, weights[0], self.vocab),
            ghost.linear_grad(rows, d, weights[1])]

  def square_sums(self, deltas, weights):
    ids, d_a, rows, d = self._parts(deltas)
    return [ghost.embedding_square_sum(ids, d_a, weights[0], self.vocab),
            ghost.linear_square_sum(rows, d, weights[1])]

  def plan(self):
    _, _, rows, d = self._parts([c.z for c in self.calls])
    rank, width = self.b_var.shape
    return (f"LoRA r={rank}: A row sums of δBᵀ per unit; "
            f"B {linear.describe(rows.shape[1], rank, width)}")


class ReversibleEmbedding(base.Rule):
  """Keras/KerasHub ReversibleEmbedding: ``call(ids)`` looks rows up,
  ``call(h, reverse=True)`` computes logits h Eᵀ (or h R, untied).

  Tied, unit u's gradient of E is the sum of both uses:
  G_u = Σ_t onehot(id_t) δ_t + Δ_uᵀ H_u (δ_t: gradient of the looked-up
  rows, Δ_u: of the logits, H_u: the reverse call's input). Its squared norm
  is taken with ghost terms, the cross term included:
  ‖G_u‖² = ‖emb‖² + ⟨H Hᵀ, Δ Δᵀ⟩ + 2 Σ_{t,s} Δ[s, id_t] (δ_t·h_s), never
  forming [vocab, d] per unit (float64, guarded against cancellation). The
  logit soft cap is applied after recording (δ is the gradient of the
  logits before it).
  """
  pre_activation = False

  def __init__(self, layer):
    super().__init__(layer)
    self.tied = layer.tie_weights
    self.vocab = layer.input_dim
    self.variables = [layer.embeddings] + (
        [] if self.tied else [layer.reverse_embeddings])

  @staticmethod
  def make(layer, original_call, values):
    del original_call, values
    if getattr(layer, "lora_enabled", False) or (
        layer.reverse_dtype is not None):
      return None  # the per-layer fallback (exact)
    return ReversibleEmbedding(layer)

  def forward(self, original, x, kwargs):
    cap = self.layer.logit_soft_cap
    if not kwargs.get("reverse", False) or cap is None:
      z = original(x, **kwargs)
      return z, z
    object.__setattr__(self.layer, "logit_soft_cap", None)
    try:
      z = original(x, **kwargs)
    finally:
      object.__setattr__(self.layer, "logit_soft_cap", cap)
    return z, tf.tanh(z / cap) * cap

  def _split(self, deltas):
    """(ids [U, T], δ [U, T, d]) of the lookups and (h [U, S, d],
    Δ [U, S, vocab]) of the reverse calls; None where there are none."""
    fwd = [(c, d) for c, d in zip(self.calls, deltas)
           if not c.kwargs.get("reverse", False)]
    rev = [(c, d) for c, d in zip(self.calls, deltas)
           if c.kwargs.get("reverse", False)]
    emb = lin = None
    if fwd:
      calls, ds = zip(*fwd)
      emb = _ids(calls), _grouped(calls, ds)
    if rev:
      calls, ds = zip(*rev)
      lin = _grouped(calls, [c.inputs for c in calls]), _grouped(calls, ds)
    return emb, lin

  def _unit_grads(self, emb, lin):
    """[U, vocab, d] per-unit gradients of E (tied), materialized."""
    g = 0.0
    if emb is not None:
      ids, d = emb
      units = tf.shape(ids)[0]
      rows = tf.clip_by_value(ids, 0, self.vocab - 1) + tf.range(
          tf.cast(units, tf.int64))[:, None] * self.vocab
      g = tf.reshape(tf.math.unsorted_segment_sum(
          tf.reshape(d, [-1, d.shape[-1]]), tf.reshape(rows, [-1]),
          units * self.vocab), [units, self.vocab, d.shape[-1]])
    if lin is not None:
      h, d = lin
      g = g + tf.einsum("usv,usd->uvd", tf.cast(d, h.dtype), h)
    return g

  def sq_norms(self, deltas, scales):
    emb, lin = self._split(deltas)
    zero = tf.zeros([tf.shape(self.calls[0].inputs)[0]], tf.float64)
    if not self.tied:
      return [zero if emb is None else ghost.embedding_sq_norms(
          emb[0], emb[1], self.vocab, scales[0]),
              zero if lin is None else ghost.linear_sq_norms(
                  lin[0], lin[1], scales[1])]
    if lin is None:
      return [ghost.embedding_sq_norms(emb[0], emb[1], self.vocab, scales[0])]
    if emb is None:  # Δᵀ H: the transpose of a linear gradient
      return [ghost.linear_sq_norms(
          lin[1], lin[0], None if scales[0] is None else scales[0])]
    if scales[0] is not None:
      g = self._unit_grads(emb, lin)
      return [ghost.sum_squares(g * tf.cast(scales[0], g.dtype)[None])]
    ids, d = emb
    h, dr = lin
    ids, d64 = tf.clip_by_value(ids, 0, self.vocab - 1), tf.cast(d, tf.float64)
    h64, dr64 = tf.cast(h, tf.float64), tf.cast(dr, tf.float64)
    sums, _, _ = ghost._segments(ids, d64, self.vocab)  # pylint: disable=protected-access
    emb_sq = tf.reduce_sum(tf.reshape(tf.reduce_sum(tf.square(sums), 1),
                                      tf.shape(ids)[:2]), 1)
    lin_sq = tf.reduce_sum(tf.matmul(h64, h64, transpose_b=True)
                           * tf.matmul(dr64, dr64, transpose_b=True), [1, 2])
    picked = tf.gather(dr64, ids, axis=2, batch_dims=1)  # [U, S, T]
    cross = tf.reduce_sum(picked * tf.matmul(h64, d64, transpose_b=True),
                          [1, 2])
    bound = (tf.reduce_sum(tf.norm(d64, axis=-1), 1)
             + tf.reduce_sum(tf.norm(h64, axis=-1) * tf.norm(dr64, axis=-1),
                             1))
    terms = (ids.shape[1] or 1024) * ((h.shape[1] or 1024) + 1) + (
        h.shape[1] or 1024) ** 2 + self.vocab + d.shape[-1]
    return [ghost.guarded(emb_sq + lin_sq + 2.0 * cross, bound, terms)]

  def grads(self, deltas, weights):
    emb, lin = self._split(deltas)
    out = []
    for i, v in enumerate(self.variables):
      g = tf.zeros(v.shape, tf.float64)  # rounded after the noise
      if emb is not None and i == 0:
        g += ghost.embedding_grad(emb[0], emb[1], weights[i], self.vocab)
      if lin is not None and self.tied:
        g += tf.transpose(ghost.linear_grad(lin[0], lin[1], weights[i]))
      elif lin is not None and i == 1:
        g += ghost.linear_grad(lin[0], lin[1], weights[i])
      out.append(g)
    return out

  def square_sums(self, deltas, weights):
    emb, lin = self._split(deltas)
    if self.tied:
      g = self._unit_grads(emb, lin)
      return [ghost.weighted_sum(tf.square(g), tf.square(weights[0]))]
    out = [tf.zeros(v.shape, tf.float64) for v in self.variables]
    if emb is not None:
      out[0] = ghost.embedding_square_sum(emb[0], emb[1], weights[0],
                                          self.vocab)
    if lin is not None:
      out[1] = ghost.linear_square_sum(lin[0], lin[1], weights[1])
    return out

  def plan(self):
    emb, lin = self._split([c.z for c in self.calls])
    parts = []
    if emb is not None:
      parts.append("row sums of δ per unit (sorted ids)")
    if lin is not None:
      parts.append("logits: " + linear.describe(
          lin[0].shape[1], lin[0].shape[-1], self.vocab))
      if self.tied and emb is not None:
        parts.append("tied: ghost cross term")
    return "; ".join(parts)


class PositionEmbedding(base.Materialized):
  """KerasHub PositionEmbedding: output = P[start:start + S] broadcast to
  the input's shape [..., S, d]: unit u's gradient is its δ summed over the
  leading axes, in rows start … start + S − 1 (S·d numbers per unit)."""
  pre_activation = False

  def __init__(self, layer):
    super().__init__(layer)
    self.variables = [layer.position_embeddings]

  @staticmethod
  def make(layer, original_call, values):
    del original_call, values
    return PositionEmbedding(layer)

  def _unit_grads(self, deltas):
    table = self.layer.position_embeddings.shape
    total = None
    for call, d in zip(self.calls, deltas):
      if call.kwargs.get("positions") is not None:
        raise ValueError("PositionEmbedding called with positions")
      start = int(call.kwargs.get("start_index", 0))
      # d: [U, ..., S, dim] (the unit's output); sum all but the last two.
      axes = list(range(1, d.shape.rank - 2))
      g = tf.reduce_sum(d, axes) if axes else d
      length = g.shape[1]
      g = tf.pad(g, [[0, 0], [start, table[0] - start - length], [0, 0]])
      total = g if total is None else total + g
    return [total]

  def plan(self):
    return "materialized per unit (δ summed per position)"


def _embedding_factory(layer, original_call, values):
  del original_call
  if getattr(layer, "lora_enabled", False):
    return EmbeddingLoRA(layer, values)
  return Embedding(layer)


registry.register_builtin(keras.layers.Embedding, _embedding_factory)
registry.register_builtin(keras.layers.ReversibleEmbedding,
                          ReversibleEmbedding.make)
registry.register_builtin_lazy(
    "keras_hub.src.layers.modeling.reversible_embedding",
    "ReversibleEmbedding", ReversibleEmbedding.make)
registry.register_builtin_lazy(
    "keras_hub.src.layers.modeling.position_embedding", "PositionEmbedding",
    PositionEmbedding.make)
