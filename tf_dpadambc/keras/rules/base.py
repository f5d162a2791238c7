"""What a ghost-clipping rule works on, and the two kinds of rules.

A rule turns one layer's recorded calls — its inputs ``a`` and output
gradients δ, per unit — into per-unit squared norms and the clipped sum of
the layer's trainable weights.

* :class:`GhostRule` (public): the rule says, for ONE unit, what each weight's
  gradient is made of (:func:`linear_term` or :func:`gradient_term`); the
  library evaluates it per unit (``tf.vectorized_map``: the rule never sees
  two units at once) and computes each unit's norm and its share of the sum
  from the same terms. A wrong rule gives wrong gradients (utility), never a
  unit that adds more than C or one unit's data in another's row (privacy).
* :class:`Rule` (the library's own, on stacked [U, ...] tensors): built-ins
  that use batched numerics (sorted segment sums, convolution filter
  gradients, float64 guards). Only the library registers these.
"""
import collections

import keras
import tensorflow as tf

from tf_dpadambc.core import ghost
from tf_dpadambc.core import per_example


class Call(collections.namedtuple("Call", ["inputs", "kwargs", "z"])):
  """One recorded call, stacked over units: ``inputs`` [U, *a_u] (the
  layer's input in unit u's own evaluation), ``z`` [U, *z_u] (its output, or
  after the backward pass δ), and the call's other, non-tensor arguments."""

  @property
  def rows(self):
    """How many leading rows one unit owns in :meth:`merged` tensors."""
    return rows_of(self.inputs)

  def merged(self, t):
    """[U, n, ...] -> [U·n, ...]: unit u's rows n·u … n·u + n − 1, the layout
    Keras layers expect (a unit tensor without a row axis is kept as is)."""
    if self.inputs.shape.rank < 3:
      return t
    return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))


def rows_of(stacked):
  """n: rows per unit of a stacked [U, n, ...] tensor (1 for [U] or [U, p])."""
  if stacked.shape.rank < 3:
    return 1
  return stacked.shape[1] if stacked.shape[1] is not None else tf.shape(
      stacked)[1]


def group(t, rows):
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


def per_unit_sum(t, rows):
  """[U·n, ...] per-row values -> [U, ...] per-unit sums."""
  if isinstance(rows, int) and rows == 1:
    return t
  return tf.reduce_sum(tf.reshape(t, tf.concat([[-1, rows], tf.shape(t)[1:]],
                                               0)), axis=1)


def flatten_positions(t, features=None):
  """[B, ...positions, features] -> [B, T, features], T static where known."""
  features = t.shape[-1] if features is None else features
  positions = (product(t.shape[1:]) // features
               if t.shape[1:].is_fully_defined() else -1)
  return tf.reshape(t, [tf.shape(t)[0], positions, features])


def product(dims):
  n = 1
  for dim in dims:
    n *= dim
  return n


def has_bias(layer):
  return getattr(layer, "bias", None) is not None


def forward_without_activation(rule, original, x, kwargs):
  """(z, output): z before the layer's ``activation`` when the rule asks."""
  layer = rule.layer
  activation = getattr(layer, "activation", None)
  if not (rule.pre_activation and activation is not None):
    z = original(x, **kwargs)
    return z, z
  object.__setattr__(layer, "activation", None)
  try:
    z = original(x, **kwargs)
  finally:
    object.__setattr__(layer, "activation", activation)
  return z, activation(z)


class Declined(Exception):
  """Raised by :meth:`Rule.forward` for a call the rule cannot compute (e.g.
  a recurrent layer given a mask): the model then leaves the ghost path."""


class Rule:
  """The library's rules, on stacked tensors (see the module docstring).

  ``variables``: the layer's trainable variables in the order the rule
  returns norms and gradients. ``calls``: the layer's recorded calls, stacked
  over units (:class:`Call`); ``deltas``: one δ per call, stacked alike.
  ``covers_sublayers``: True for a rule whose variables belong to the
  layer's sublayers (a recurrent layer's cell): the recorder then wraps this
  layer's call and not the sublayers'.
  """
  pre_activation = True  # z is the output before the layer's activation
  covers_sublayers = False

  def __init__(self, layer):
    self.layer = layer
    self.calls = []

  def forward(self, original, x, kwargs):
    """Runs the layer's forward computation for one unit, in its place.

    Returns ``(z, output)``: z, the tensor whose gradient δ the rule needs
    (recorded, with the input x), and what the call returns; or
    ``(z, output, record)`` to record ``record`` (a tuple of tensors, e.g.
    states computed inside the forward) as the call's ``inputs`` instead of
    x. z must lie upstream of the output (δ = ∂ℓ_u/∂z). The computation may
    differ from ``original`` (a recurrent layer's unrolled cell), never its
    result. Raise :class:`Declined` for a call the rule cannot compute.
    """
    return forward_without_activation(self, original, x, kwargs)

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


class Materialized(Rule):
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


# ------------------------------------------------------------ public rules

LinearTerm = collections.namedtuple("LinearTerm", ["a", "delta"])
GradientTerm = collections.namedtuple("GradientTerm", ["grad"])
UnitCall = collections.namedtuple("UnitCall", ["inputs", "kwargs", "delta"])


def linear_term(a, delta):
  """One unit's gradient aᵀδ: a [T, p], δ [T, q] (T positions; p·q = the
  variable's size, the [p, q] product reshaped row-major to its shape).
  Norm by the ghost trick or materialized, whichever is cheaper."""
  return LinearTerm(a, delta)


def gradient_term(grad):
  """One unit's gradient itself (any shape with the variable's size)."""
  return GradientTerm(grad)


class RuleContext:
  """What a :class:`GhostRule` may use besides the recorded tensors:
  ``value(v)``, the value of a weight in this step, and ``call(x, kwargs,
  overrides)``, the layer's own call (not recorded) on x with some weights
  replaced ({variable: value})."""

  def __init__(self, layer, original_call, values):
    self.layer = layer
    self._original = original_call
    self._values = values

  def value(self, variable):
    if id(variable) in self._values:
      return self._values[id(variable)]
    return variable.value

  def call(self, x, kwargs=None, overrides=None):
    mapping = [(v, value) for v, value in (overrides or {}).items()]
    if not mapping:
      return self._original(x, **(kwargs or {}))
    with keras.StatelessScope(mapping, initialize_variables=False):
      return self._original(x, **(kwargs or {}))


class GhostRule:
  """Base class of a user rule (register it with
  :func:`tf_dpadambc.register_ghost_rule`).

  Override :meth:`unit_terms` (and :meth:`plan`). ``variables`` defaults to
  the layer's own trainable weights; ``pre_activation = True`` records the
  output before ``layer.activation`` (δ is then the gradient there).

  The ≤ C bound holds whatever a rule computes from its arguments; it does
  not cover a rule that reaches around them (writes a variable, runs Python
  through ``tf.py_function``, reads tensors kept from elsewhere), which can
  carry one unit's data into another's terms.
  """
  pre_activation = False

  def __init__(self, layer):
    self.layer = layer

  @property
  def variables(self):
    return [v for v in self.layer._trainable_variables if v.trainable]  # pylint: disable=protected-access

  def unit_terms(self, calls, context):
    """What each variable's gradient is made of, for ONE unit.

    Args:
      calls: list of :data:`UnitCall` ``(inputs, kwargs, delta)``, the
        layer's calls in this unit's own evaluation: ``inputs`` as the layer
        received them, ``delta`` = ∂ℓ_u/∂(output), shaped like the output.
      context: a :class:`RuleContext`.

    Returns:
      One entry per variable (in ``variables`` order): a term
      (:func:`linear_term`, :func:`gradient_term`) or a list of terms whose
      gradients add up.
    """
    raise NotImplementedError

  def plan(self):
    return f"user rule {type(self).__name__}"


class UserRule(Rule):
  """Runs a :class:`GhostRule` per unit and forms the norms and the sum from
  the same terms (the privacy of the sum does not depend on the rule)."""

  def __init__(self, rule, original_call, values):
    super().__init__(rule.layer)
    self.rule = rule
    self.pre_activation = bool(rule.pre_activation)
    self.variables = list(rule.variables)
    self.context = RuleContext(rule.layer, original_call, values)
    self._cache = None

  def _terms(self, deltas):
    if self._cache is not None and self._cache[0] is deltas:
      return self._cache[1]
    kwargs = [c.kwargs for c in self.calls]
    count = len(self.variables)

    def unit(args):
      inputs, unit_deltas = args
      calls = [UnitCall(x, kw, d) for x, kw, d in
               zip(inputs, kwargs, unit_deltas)]
      out = list(self.rule.unit_terms(calls, self.context))
      if len(out) != count:
        raise ValueError(f"{type(self.rule).__name__}.unit_terms returned "
                         f"{len(out)} entries for {count} variables")
      out = [list(e) if isinstance(e, list) else [e] for e in out]
      for terms in out:
        for term in terms:
          if not isinstance(term, (LinearTerm, GradientTerm)):
            raise ValueError(f"{type(self.rule).__name__}.unit_terms: use "
                             "linear_term(a, delta) or gradient_term(grad)")
      return out
    # vectorized_map has the semantics of a loop over units: the rule sees
    # one unit's tensors at a time, whatever it does with them.
    records = ([c.inputs for c in self.calls], list(deltas))
    unit, check = per_example.unit_local(unit, records)
    terms = tf.vectorized_map(unit, records, fallback_to_while_loop=False)
    check()
    combined = [self._combine(v, t) for v, t in zip(self.variables, terms)]
    self._cache = deltas, combined
    return combined

  @staticmethod
  def _combine(variable, terms):
    """("linear", a [U,T,p], δ [U,T,q]) or ("grad", [U, *v.shape])."""
    size = product(variable.shape)
    linear = [t for t in terms if isinstance(t, LinearTerm)]
    for t in linear:
      if t.a.shape.rank != 3 or t.delta.shape.rank != 3 or (
          t.a.shape[-1] * t.delta.shape[-1] != size):
        raise ValueError(
            f"linear_term for '{variable.path}': a [T, p] and delta [T, q] "
            f"with p·q = {size} are needed, got {t.a.shape[1:]} and "
            f"{t.delta.shape[1:]}")
    if len(linear) == len(terms) and len(
        {(t.a.shape[-1], t.delta.shape[-1]) for t in linear}) == 1:
      return ("linear", tf.concat([t.a for t in linear], 1),
              tf.concat([tf.cast(t.delta, t.a.dtype) for t in linear], 1))
    total = None
    for t in terms:
      g = (tf.einsum("utp,utq->upq", t.a, tf.cast(t.delta, t.a.dtype))
           if isinstance(t, LinearTerm) else t.grad)
      g = tf.reshape(tf.cast(g, variable.dtype), [-1] + list(variable.shape))
      total = g if total is None else total + g
    return ("grad", total)

  @staticmethod
  def _flat(term, t):
    return tf.reshape(t, [term[1].shape[-1], term[2].shape[-1]])

  def sq_norms(self, deltas, scales):
    out = []
    for term, s in zip(self._terms(deltas), scales):
      if term[0] == "linear":
        out.append(ghost.linear_sq_norms(
            term[1], term[2], None if s is None else self._flat(term, s)))
      else:
        g = term[1]
        out.append(ghost.sum_squares(
            g if s is None else g * tf.cast(s, g.dtype)[None]))
    return out

  def grads(self, deltas, weights):
    return [tf.reshape(ghost.linear_grad(term[1], term[2], w), v.shape)
            if term[0] == "linear" else ghost.weighted_sum(term[1], w)
            for v, term, w in zip(self.variables, self._terms(deltas),
                                  weights)]

  def square_sums(self, deltas, weights):
    return [tf.reshape(ghost.linear_square_sum(term[1], term[2], w), v.shape)
            if term[0] == "linear" else ghost.weighted_sum(
                tf.square(term[1]), tf.square(w))
            for v, term, w in zip(self.variables, self._terms(deltas),
                                  weights)]

  def plan(self):
    return self.rule.plan()
