"""The registry of ghost-clipping rules: which rule a layer class uses.

    import tf_dpadambc as dp

    class ScaleRule(dp.GhostRule):          # z = x ⊙ w (w: [d])
      def unit_terms(self, calls, context):
        # ∇w_u = Σ over the unit's positions of δ ⊙ x: materialized (d numbers)
        g = sum(tf.reduce_sum(tf.reshape(c.delta * c.inputs, [-1, c.delta.shape[-1]]), 0)
                for c in calls)
        return [dp.gradient_term(g)]

    dp.register_ghost_rule(Scale, ScaleRule)

The rule contract (:class:`~tf_dpadambc.keras.rules.base.GhostRule`):

* ``variables``: the layer's trainable weights the rule covers (default: all
  its own; they must be exactly the layer's own trainable weights).
* ``unit_terms(calls, context)``: for ONE unit — ``calls`` is that unit's
  list of ``UnitCall(inputs, kwargs, delta)``, the layer's input, non-tensor
  arguments and δ = ∂ℓ_u/∂output for each time the layer was called in that
  unit's own forward pass — return, per variable, a term or a list of terms:
  ``linear_term(a [T, p], delta [T, q])`` for a gradient aᵀδ (the library
  takes the ghost norm or materializes, whichever is cheaper) or
  ``gradient_term(g)`` for the gradient itself. ``context.value(v)`` gives a
  weight's value in this step, ``context.call(x, kwargs, {v: value})`` the
  layer's own call with weights replaced (to recompute e.g. a normalized x̂).
* ``pre_activation``: True to record the output before ``layer.activation``.
* ``plan()``: the text :func:`~tf_dpadambc.clipping_plan` shows.

Privacy does not rest on a rule being right. The library evaluates
``unit_terms`` per unit inside ``tf.vectorized_map`` (the semantics of a loop
over units: the rule never sees another unit's tensors), and forms a unit's
squared norm ‖g_u‖² and its share c_u·g_u of the clipped sum from the same
terms, with c_u = min(1, C/‖g_u‖): every unit adds at most C, and only its
own data, whatever g_u is. A wrong rule gives a wrong gradient (utility), as
:func:`tests.test_registry` shows with a deliberately wrong one. (The
library's built-in rules use batched numerics on stacked tensors —
``rules.base.Rule`` with ``sq_norms``/``grads``/``square_sums`` — and are
checked against per-example gradients; users register ``GhostRule``s. A
built-in rule may also replace the layer's forward computation for the unit
— ``Rule.forward`` returning ``(z, output, record)``, see ``rules.recurrent``
— and cover its sublayers' weights, ``covers_sublayers``.)

Lookup is by exact type by default: a subclass can change ``call``, so it
does not inherit its parent's rule unless registered itself (or the rule was
registered with ``exact_type=False``). A layer without a rule uses the
per-layer fallback (its own weights' per-unit gradients, vectorized: exact,
slower) and the train step logs which layers did.
"""
import importlib
import sys

from tf_dpadambc.keras.rules import base

_EXACT = {}  # class -> (factory, builtin)
_SUBCLASSES = {}  # class -> (factory, builtin), also for subclasses
_LAZY = []  # (module, class name, factory, exact_type): optional packages


def register_ghost_rule(layer_class, factory, *, exact_type=True):
  """Registers the ghost-clipping rule of a layer class.

  Args:
    layer_class: a ``keras.layers.Layer`` subclass.
    factory: a :class:`~tf_dpadambc.GhostRule` subclass, or a callable
      ``factory(layer)`` that returns a ``GhostRule`` or None (None: this
      layer's configuration has no rule; it uses the per-layer fallback).
    exact_type: True (default): only layers whose type is exactly
      ``layer_class``; False: subclasses too (only if they keep the
      computation the rule assumes).

  A later registration of the same class replaces the earlier one (built-in
  rules included).
  """
  _register(layer_class, factory, exact_type, builtin=False)


def _register(layer_class, factory, exact_type, builtin):
  if not isinstance(layer_class, type):
    raise TypeError(f"register_ghost_rule needs a layer class, got "
                    f"{layer_class!r}")
  _EXACT.pop(layer_class, None)
  _SUBCLASSES.pop(layer_class, None)
  (_EXACT if exact_type else _SUBCLASSES)[layer_class] = (factory, builtin)


def register_builtin(layer_class, factory, exact_type=True):
  """The library's rules: ``factory(layer, original_call, values)`` returns
  a :class:`~tf_dpadambc.keras.rules.base.Rule` or None."""
  _register(layer_class, factory, exact_type, builtin=True)


def register_builtin_lazy(module, name, factory, exact_type=True):
  """A built-in rule for a class of an optional package (keras_hub),
  resolved once that package is imported."""
  _LAZY.append((module, name, factory, exact_type))


def _resolve_lazy():
  for entry in list(_LAZY):
    module, name, factory, exact_type = entry
    if module.split(".")[0] in sys.modules:
      try:
        cls = getattr(importlib.import_module(module), name)
      except (ImportError, AttributeError):
        cls = None
      _LAZY.remove(entry)
      if cls is not None and cls not in _EXACT and cls not in _SUBCLASSES:
        register_builtin(cls, factory, exact_type)


def lookup(layer):
  """(factory, builtin) for the layer, or None."""
  if _LAZY:
    _resolve_lazy()
  cls = type(layer)
  if cls in _EXACT:
    return _EXACT[cls]
  for klass in cls.__mro__:
    if klass in _SUBCLASSES:
      return _SUBCLASSES[klass]
  return None


def make_rule(layer, original_call, values):
  """The layer's rule (a base.Rule), or None if no rule is registered or
  the registered one declines this layer's configuration."""
  found = lookup(layer)
  if found is None:
    return None
  factory, builtin = found
  own = {id(v) for v in layer._trainable_variables if v.trainable}  # pylint: disable=protected-access
  if builtin:
    rule = factory(layer, original_call, values)
    if rule is not None and rule.covers_sublayers:
      own = {id(v) for sub in layer._flatten_layers(include_self=True)  # pylint: disable=protected-access
             for v in sub._trainable_variables if v.trainable}  # pylint: disable=protected-access
    if rule is not None and (
        {id(v) for v in rule.variables} != own
        or not all(id(v) in values for v in rule.variables)):
      return None  # e.g. a frozen kernel with a trainable bias
    return rule
  rule = factory(layer)
  if rule is None:
    return None
  if not isinstance(rule, base.GhostRule):
    raise TypeError(f"the rule registered for {type(layer).__name__} "
                    f"returned {type(rule).__name__}, not a GhostRule")
  if {id(v) for v in rule.variables} != own or len(rule.variables) != len(own):
    raise ValueError(f"{type(rule).__name__}.variables must be exactly the "
                     f"trainable weights of layer '{layer.name}'")
  return base.UserRule(rule, original_call, values)
