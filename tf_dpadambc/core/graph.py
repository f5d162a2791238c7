"""Guards of per-unit evaluation: what a traced computation does that
``tf.vectorized_map`` cannot keep apart per unit.

A write to a variable inside a unit's forward pass escapes the unit: under
``vectorized_map`` one unit's write is read by the others, and between steps
the variable carries data into later steps without noise. Inside a Keras 3
``StatelessScope`` writes to Keras variables are captured (no op is
emitted); any write *op* in such a trace is a raw ``tf.Variable`` write.
Variables are not the only state: a hash table insert, a random generator's
skip, a queue, a TensorArray, a summary or Python (``tf.py_function``) carry
data as well, so :func:`state_effects` refuses every stateful op but a short
list of reads and state-free ones (an allowlist, not a list of writes).
These functions find them in a graph, including the functions its nodes call
(calls, loop bodies, branches).
"""
import collections.abc

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

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
  return _ops_of_functions(graph, _called_functions(attrs))


def _ops_of_functions(graph, names):
  """Op types inside the functions ``names``, recursively."""
  names, seen, types = list(names), set(), []
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
      if op_def_registry.get(node.op) is None:
        names.append(node.op)  # a direct call of a function of the graph
      else:
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


_PYTHON_OPS = ("EagerPyFunc", "PyFunc", "PyFuncStateless")


def python_calls(ops):
  """Names of the ops among ``ops`` (and the functions they call) that run
  Python (``tf.py_function``, ``tf.numpy_function``): in a loop over units
  their Python state could carry one unit's data to the next."""
  return [op.name for op in ops
          if op.type in _PYTHON_OPS or any(
              t in _PYTHON_OPS for t in _function_ops(op.graph,
                                                      op.node_def.attr))]


# Stateful ops (op_def.is_stateful) whose state carries nothing from one
# unit, or one step, to another: reads, assertions and printing, table
# handles created without data, and calls and control flow (whose bodies are
# looked into). Not the stateful random kernels (tf.random.uniform, ...):
# their position in their stream advances with every draw, so a loop or a
# branch driven by the data moves it, and later draws (other units, later
# steps) depend on the data (a review: 1.6C). Keras' random ops with a
# SeedGenerator are stateless kernels.
_STATE_FREE = frozenset({
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "VarHandleOp", "LookupTableFindV2",
    "LookupTableSizeV2", "HashTableV2", "MutableHashTableV2",
    "MutableHashTableOfTensorsV2", "MutableDenseHashTableV2", "Assert",
    "Print", "PrintV2", "StatefulPartitionedCall", "While", "If", "Case"})
# Not marked stateful, yet they share state across calls.
_SHARED = frozenset({"Batch", "BatchFunction", "Unbatch", "UnbatchGrad"})


def _carries_state(op_type):
  """True for an op type whose effect beyond its outputs could carry data:
  a variable write, any other stateful op not in ``_STATE_FREE``, or one
  this process does not know ("<unknown>" functions included)."""
  if op_type == "<unknown>" or _writes_variable(op_type) or op_type in _SHARED:
    return True
  if op_type in _STATE_FREE:
    return False
  definition = op_def_registry.get(op_type)
  return definition is None or definition.is_stateful


def _op_types(op):
  """The op's type and those of every op in the functions it calls (a type
  that names a function of the graph is a call of it)."""
  if op_def_registry.get(op.type) is None:
    return _ops_of_functions(op.graph, [op.type])  # "<unknown>" if none
  return [op.type] + _function_ops(op.graph, op.node_def.attr)


# Stateful random kernels whose position advances by the number of values
# drawn, and nothing else: allowed where that number is fixed (below).
_RANDOM_KERNELS = frozenset({"RandomUniform", "RandomUniformInt",
                             "RandomStandardNormal", "TruncatedNormal"})
# Ops through which a shape stays a function of shapes alone.
_SHAPE_SOURCES = frozenset({"Const", "Shape", "ShapeN", "Size", "Rank"})
_SHAPE_ARITHMETIC = frozenset({
    "Identity", "Cast", "StridedSlice", "Slice", "Pack", "Unpack",
    "ConcatV2", "Squeeze", "ExpandDims", "Add", "AddV2", "Sub", "Mul",
    "FloorDiv", "Maximum", "Minimum", "Prod", "BroadcastArgs"})


def _shape_only(tensor):
  """True if ``tensor`` is computed from constants and the shapes (not the
  values) of other tensors."""
  stack, seen = [tensor.op], set()
  while stack:
    op = stack.pop()
    if op.name in seen or op.type in _SHAPE_SOURCES:
      continue
    seen.add(op.name)
    if op.type not in _SHAPE_ARITHMETIC:
      return False
    stack.extend(t.op for t in op.inputs)
  return True


def _fixed_draws(op):
  """A stateful random kernel run outside any loop or branch (an op of the
  traced function itself), whose shape does not depend on the data: it
  draws the same number of values whatever the data (tf_keras' Dropout and
  GaussianNoise), so its stream's position carries nothing."""
  return op.type in _RANDOM_KERNELS and bool(op.inputs) and _shape_only(
      op.inputs[0])


def state_effects(ops, allowed=lambda op: False):
  """Names of the ops among ``ops`` (and the functions they call) with an
  effect that could carry one unit's data to another unit or a later step
  (see ``_carries_state``), except ops ``allowed(op)`` accepts and random
  kernels with a fixed number of draws (``_fixed_draws``)."""
  found = []
  for op in ops:
    if _fixed_draws(op):
      continue
    if _carries_state(op.type) and op_def_registry.get(op.type) is not None:
      if not allowed(op):
        found.append(f"{op.name} ({op.type})")
    elif any(_carries_state(t) for t in _op_types(op)):
      found.append(f"{op.name} ({op.type})")
  return found


def resolve_handle(tensor):
  """The eager resource handle a captured graph tensor stands for (through
  nested captures), or None."""
  for _ in range(32):
    if not tf.is_symbolic_tensor(tensor):
      return tensor
    external = None
    for ext, internal in tensor.graph.captures:
      if internal is tensor:
        external = ext
        break
    if external is None:
      return None
    tensor = external
  return None


def _is_variable(handle):
  """True if the eager resource ``handle`` is a variable's (not a lookup
  table's or another resource's)."""
  try:
    with tf.init_scope():
      tf.raw_ops.VariableShape(input=handle)
    return True
  except Exception:  # pylint: disable=broad-except
    return False


def foreign_reads(ops, own_handles):
  """Names of the ops among ``ops`` that take a variable that is not among
  ``own_handles`` (a read, or a call, branch or loop that gets it as an
  argument). The model's output may depend on its own weights
  (post-processing of releases) and on its input, nothing else: a variable
  written elsewhere from the data (a metric's total, by the logs) read in
  the forward pass carries it into the gradients without noise (a review:
  1.8C). Handles this cannot resolve (distributed variables) are not
  counted."""
  found = []
  for op in ops:
    for tensor in op.inputs:
      if tensor.dtype != tf.resource:
        continue
      handle = resolve_handle(tensor)
      if (handle is not None and not any(handle is h for h in own_handles)
          and _is_variable(handle)):
        found.append(f"{op.name} ({op.type})")
        break
  return found



def _captures(graph, cache):
  """{id(internal): external} of ``graph``'s captures (placeholders, and
  small eager tensors captured as constants), cached in ``cache``."""
  if id(graph) not in cache:
    cache[id(graph)] = {id(internal): external for external, internal
                        in getattr(graph, "captures", ())}
  return cache[id(graph)]


def _key(tensor):
  return id(tensor.graph), tensor.name


def _outside_source(tensor, data, held, seen, cache):
  """What in ``tensor``'s ancestry (through captures into enclosing graphs)
  is data, or None if it comes from constants, resources (variables) and
  the eager tensors ``held`` (ids) only."""
  stack = [tensor]
  while stack:
    tensor = stack.pop()
    if not tf.is_symbolic_tensor(tensor):  # captured from eager
      if tensor.dtype == tf.resource or held is None or id(tensor) in held:
        continue  # a variable's (or table's) handle, a model's constant
      return (f"a {tensor.dtype.name}{list(tensor.shape)} tensor captured "
              "from eager, not held by the model")
    if _key(tensor) in data:
      return "the batch"
    op = tensor.op
    if id(op) in seen:
      continue
    seen.add(id(op))
    external = _captures(tensor.graph, cache).get(id(tensor))
    if external is not None:
      stack.append(external)
    elif op.type in ("Placeholder", "PlaceholderV2"):
      if tensor.dtype != tf.resource:  # (an iterator is refused where read)
        return "an input of the traced function"
    elif any(_carries_state(t) for t in _op_types(op)):
      # An iterator's next element, a random draw, Python, a queue, ...
      return f"{op.name} ({op.type})"
    else:
      stack.extend(op.inputs)
  return None


def outside_data(ops, own, data, held=()):
  """What the ops ``ops`` (one unit's traced function) read from outside
  themselves that is neither ``own`` (the unit's own tensors) nor computed
  from constants, resources (variables, tables) and the eager tensors
  ``held`` (a model's) alone: ``data`` (the batch's tensors) or what
  derives from it, an input of the traced function (a train step's batch),
  another tensor captured from eager, or a stateful op's output (an
  iterator's next element, a stateful random draw, Python). Followed through
  captures into enclosing graphs, and through the inputs of calls, whose
  functions are looked into. Captures made during the trace (placeholders,
  small eager tensors as constants) are among ``ops`` but come from outside.
  A list of "op reads tensor (source)" (or "capture (source)").

  A NumPy array (or Python value) becomes a constant of the trace: it cannot
  be told apart from the model's constants, and is not found. ``held=None``
  treats every eager tensor the same way (a constant made before the
  trace; where the batch itself is never eager, as in a traced step).
  """
  inside = {id(op) for op in ops}
  own = {_key(t) for t in own}
  data = {_key(t) for t in data}
  held = None if held is None else {id(t) for t in held}
  found, seen, checked, cache = [], set(), set(), {}
  for op in ops:
    reads = [t for t in op.inputs
             if id(t.op) not in inside and _key(t) not in own]
    if op.type in ("Placeholder", "PlaceholderV2", "Const"):
      reads += [t for t in op.outputs
                if op.type != "Const" or id(t) in _captures(t.graph, cache)]
    for tensor in reads:
      if _key(tensor) in checked:
        continue
      checked.add(_key(tensor))
      source = _outside_source(tensor, data, held, seen, cache)
      if source is not None:
        found.append(f"{tensor.name} ({source})" if tensor.op is op else
                     f"{op.name} ({op.type}) reads {tensor.name} ({source})")
  return found


def held_eager_tensors(roots, not_state=(), depth_limit=3):
  """The eager tensors ``roots`` (a model's layers) hold, directly or
  through containers and the trackables they own (a lookup table's default
  value, normalization statistics given as constants), to ``depth_limit``
  levels: a model's state, like its variables, which its per-unit
  evaluation may read from outside itself (:func:`outside_data`'s
  ``held``). Objects of the types ``not_state`` (variables, layers walked
  already, optimizers, metrics, functions, datasets) are not walked: what
  they hold is not the model's (a traced function's captures could be
  data)."""
  held, seen = [], set()
  stack = [(root, 0) for root in roots]
  while stack:
    value, depth = stack.pop()
    if id(value) in seen:
      continue
    seen.add(id(value))
    if isinstance(value, tf.Tensor) and not tf.is_symbolic_tensor(value):
      held.append(value)
    elif depth == 0 or (depth < depth_limit and
                        not isinstance(value, not_state)):
      if isinstance(value, (list, tuple)):
        children = value
      elif isinstance(value, collections.abc.Mapping):
        children = list(value.values())
      elif isinstance(value, _TRACKABLE):
        children = list(getattr(value, "__dict__", {}).values())
      else:
        continue
      stack += [(child, depth + 1) for child in children]
  return held


_TRACKABLE = tf.__internal__.tracking.Trackable


def _origin(tensor, cache):
  """A key of what ``tensor`` is, followed out through captures: the eager
  tensor (a variable's handle) it was captured from, or the outermost
  graph's tensor. Functions nested in a step capture a variable's handle
  from eager each, so two graphs' handles agree only there."""
  while True:
    if not tf.is_symbolic_tensor(tensor):
      return ("eager", id(tensor))
    external = _captures(tensor.graph, cache).get(id(tensor))
    if external is None:
      return _key(tensor)
    if not tf.is_symbolic_tensor(external):
      return ("eager", id(external))
    tensor = external


def ops_before(trace, count=None):
  """The ops a trace has created so far (its first ``count``), and all
  those of the graphs enclosing it (a function nested in a step: pfor
  under XLA, a map_fn loop body), which were created before it."""
  ops = trace.get_operations()
  ops, outer = ops[:len(ops) if count is None else count], trace
  while getattr(outer, "outer_graph", None) is not None:
    outer = outer.outer_graph
    ops += outer.get_operations()
  return ops


def written_from_data(ops, before, data, held=(), handles=(), trained=(),
                      exclude=None):
  """Writes, among the ops ``before`` (those a traced step created before
  the unit function ``ops``), to a variable the unit function reads (or
  one of ``handles``, variables' resource tensors), of a value computed
  from ``data``, a function input or another stateful op's output
  (:func:`outside_data`'s sources): a train step that assigns the batch to
  a variable its per-unit loss reads hands every unit the other examples
  (a review: 11 C/B for a bound of 2 C/B). A list of op names. The
  ``trained`` variables' handles are left out: an earlier private step in
  the same trace updates them from its (noised) release.

  ``exclude`` (handles) instead of a list of read variables: every write
  but to those (a relay through a variable no one tracks: a review).

  Only what one trace shows: a write made eagerly before the step, or in
  an earlier step, is not seen.
  """
  cache = {}
  read = {_origin(handle, cache) for handle in handles}
  excluded = (None if exclude is None
              else {_origin(handle, cache) for handle in exclude})
  for op in ops:
    for tensor in op.inputs:
      if tensor.dtype == tf.resource:
        read.add(_origin(tensor, cache))
  read -= {_origin(handle, cache) for handle in trained}
  data = {_key(t) for t in data}
  held = None if held is None else {id(t) for t in held}
  found = []
  for op in before:
    if not _writes_variable(op.type) or not op.inputs:
      continue
    handle = op.inputs[0]
    if handle.dtype != tf.resource:
      continue
    origin = _origin(handle, cache)
    if (origin in excluded) if excluded is not None else (origin not in read):
      continue
    for value in op.inputs[1:]:
      if _outside_source(value, data, held, set(), cache) is not None:
        found.append(f"{op.name} ({op.type})")
        break
  return found
