"""Guards of per-unit evaluation: what a traced computation does that
``tf.vectorized_map`` cannot keep apart per unit.

A write to a variable inside a unit's forward pass escapes the unit: under
``vectorized_map`` one unit's write is read by the others, and between steps
the variable carries data into later steps without noise. Inside a Keras 3
``StatelessScope`` writes to Keras variables are captured (no op is
emitted); any write *op* in such a trace is a raw ``tf.Variable`` write.
These functions find them in a graph, including the functions its nodes call
(calls, loop bodies, branches).
"""
_WRITES = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ResourceStridedSliceAssign", "Assign", "AssignAdd", "AssignSub",
    "ScatterUpdate", "ScatterAdd", "ScatterSub", "ScatterMul", "ScatterDiv",
    "ScatterMin", "ScatterMax", "ScatterNdUpdate", "ScatterNdAdd",
    "ScatterNdSub", "ScatterNdMin", "ScatterNdMax"})
# Ops that draw random numbers (stateful, stateless, generator-based).
_RANDOM_MARKS = ("Random", "Rng", "Multinomial", "TruncatedNormal",
                 "StatefulUniform", "StatefulStandardNormal")


def _writes_variable(op_type):
  """True for an op type that writes a variable (or a function this graph
  cannot look into: "<unknown>", counted as one)."""
  return op_type in _WRITES or op_type == "<unknown>" or op_type.startswith(
      ("ResourceScatter", "ResourceApply", "ResourceSparseApply"))


def _called_functions(attrs):
  """Names of the functions a node's attributes name (calls, loop bodies,
  branches)."""
  names = []
  for value in attrs.values():
    if value.HasField("func"):
      names.append(value.func.name)
    elif value.HasField("list"):
      names += [f.name for f in value.list.func]
  return names


def _function_ops(graph, attrs):
  """Op types inside the functions a node calls, recursively (from their
  FunctionDefs); "<unknown>" for a function this graph cannot find."""
  names, seen, types = _called_functions(attrs), set(), []
  while names:
    name = names.pop()
    if name in seen:
      continue
    seen.add(name)
    function, g = None, graph
    while g is not None and function is None:
      function = g._get_function(name)  # pylint: disable=protected-access
      g = getattr(g, "outer_graph", None)
    definition = getattr(function, "cached_definition",
                         getattr(function, "definition", None))
    if definition is None:
      types.append("<unknown>")
      continue
    for node in definition.node_def:
      types.append(node.op)
      names += _called_functions(node.attr)
  return types


def draws_random(ops):
  """True if ``ops`` (or the functions they call) draw random numbers."""
  for op in ops:
    for op_type in [op.type] + _function_ops(op.graph, op.node_def.attr):
      if any(mark in op_type for mark in _RANDOM_MARKS):
        return True
  return False




def variable_writes(ops, allowed=lambda op: False):
  """Names of the ops among ``ops`` (and the functions they call) that write
  a variable, except those ``allowed(op)`` accepts."""
  found = []
  for op in ops:
    if _writes_variable(op.type):
      if not allowed(op):
        found.append(op.name)
    elif any(_writes_variable(t) for t in _function_ops(op.graph,
                                                        op.node_def.attr)):
      found.append(op.name)
  return found


_PYTHON_OPS = ("EagerPyFunc", "PyFunc", "PyFuncStateless")


def python_calls(ops):
  """Names of the ops among ``ops`` (and the functions they call) that run
  Python (``tf.py_function``, ``tf.numpy_function``): in a loop over units
  their Python state could carry one unit's data to the next."""
  return [op.name for op in ops
          if op.type in _PYTHON_OPS or any(
              t in _PYTHON_OPS for t in _function_ops(op.graph,
                                                      op.node_def.attr))]
