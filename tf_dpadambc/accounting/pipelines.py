"""Can one iteration of a ``tf.data`` pipeline emit an element twice?

An epoch of ``fit`` counts as a pass over the data (each example in at most
one of its batches, as the once-per-epoch ε assumes) only where the data
says so; counts alone do not (a review: ``take(N/2).repeat(2).batch(B)``
reported ε 9.01 for 13.78). :func:`repeats` reads the pipeline's graph
(``DatasetToGraphV2``): every dataset op must be on an allowlist of
transformations that emit each element of their input at most once, and
map and filter functions must act on the element alone
(``accounting.ledger.fit_data`` decides with it).
"""
import tensorflow as tf


# Is an epoch of fit a pass over the data (each example in at most one of its
# batches)? Decided from the data fit is given, never from counts alone: a
# pipeline can emit an example twice in an epoch of the right length (a
# review: take(N/2).repeat(2).batch(B) reported ε 9.01 for 13.78).
#
# tf.data: the pipeline's graph (DatasetToGraphV2) is read, and every dataset
# op in it must be one that emits each element of its input at most once.
_SOURCE_OPS = frozenset([
    "TensorSliceDataset", "TensorDataset", "RangeDataset",
    "SparseTensorSliceDataset"])
# Ops that keep each element where it is (elements stay aligned by index:
# what a Zip's inputs must be made of, so that one example's parts are not
# spread over several zipped elements).
_ALIGNED_OPS = _SOURCE_OPS | frozenset([
    "MapDataset", "ParallelMapDataset", "ParallelMapDatasetV2",
    "PrefetchDataset", "CacheDataset", "CacheDatasetV2", "OptionsDataset",
    "ModelDataset", "MaxIntraOpParallelismDataset",
    "ExperimentalMaxIntraOpParallelismDataset", "PrivateThreadPoolDataset",
    "ExperimentalPrivateThreadPoolDataset", "AssertCardinalityDataset",
    "AssertNextDataset", "OptimizeDataset", "OptimizeDatasetV2"])
PASS_OPS = _ALIGNED_OPS | frozenset([
    # reorder (a buffer: each element out once; reshuffling or not)
    "ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
    # drop elements
    "FilterDataset", "ParallelFilterDataset", "TakeDataset", "SkipDataset",
    "ShardDataset", "TakeWhileDataset", "IgnoreErrorsDataset",
    "AutoShardDataset", "ExperimentalAutoShardDataset",
    # regroup (each element in exactly one group)
    "BatchDataset", "BatchDatasetV2", "PaddedBatchDataset",
    "PaddedBatchDatasetV2", "ParallelBatchDataset", "MapAndBatchDataset",
    "RebatchDataset", "RebatchDatasetV2",
    # (not Unbatch: a map before it can stack an element several times, and
    # each copy comes out as an element of its own: a review, ε 9.01 for
    # 21.4)
    # pairs aligned elements (see _ALIGNED_OPS)
    "ZipDataset",
    # with a count of 1 only (see repeats)
    "RepeatDataset", "ShuffleAndRepeatDataset"])
# Attributes naming the functions a dataset op applies to each element.
_FUNCTION_ATTRS = ("f", "predicate")
# Inside a map or filter function every value is tainted by what it is
# computed from: the element (ELEMENT); small values from outside it (SMALL:
# captured constants and variables of at most _SMALL_ELEMENTS entries, the
# parameters of a transformation such as a normalization's mean and
# variance); and large or opaque ones (LARGE: bigger captures, variables of
# unknown size, lookup tables, large constants, files it does not name,
# anything made without inputs but a small constant). SMALL values may only
# pass through element-wise arithmetic (and seed random ops); LARGE ones may
# not reach the function's result at all. A lookup — by index, by a shift
# (tf.roll), in a hash table, by a one-hot selector times a table, by a
# pooling — is then refused whatever op it takes (reviews: indices drawn with
# replacement, a one-hot selector, a roll and a hash table keyed by index
# each reported ε 9.01 for 13.78–21.4): an allowlist, never a denylist of
# lookup ops.
_SMALL_ELEMENTS = 1024
_SMALL_BYTES = 8192
# Constants inside a function of at most this many entries are an op's
# parameters (an axis, a shape, slice bounds, a one-hot depth); larger ones
# are data, SMALL or LARGE like captures.
_PARAMETER_ELEMENTS = 16
_PARAMETER_BYTES = 160
# Ops computing each output entry from the same entry of their inputs (with
# broadcasting), or moving whole values without choosing among them by
# another value.
_ELEMENTWISE_OPS = frozenset([
    "Identity", "IdentityN", "Cast", "Bitcast", "Neg", "Abs", "Sign",
    "Square", "Sqrt", "Rsqrt", "Exp", "Expm1", "Log", "Log1p", "Sin", "Cos",
    "Tan", "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "Softplus",
    "Floor", "Ceil", "Round", "Rint", "Reciprocal", "Inv", "IsFinite",
    "IsNan", "IsInf", "LogicalNot", "Add", "AddV2", "Sub", "Mul", "MulNoNan",
    "Div", "DivNoNan", "RealDiv", "FloorDiv", "FloorMod", "TruncateDiv",
    "TruncateMod", "Mod", "Pow", "Maximum", "Minimum", "SquaredDifference",
    "BiasAdd", "ClipByValue", "Equal", "NotEqual", "Less", "LessEqual",
    "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "Select",
    "SelectV2", "Reshape", "ExpandDims", "Squeeze", "BroadcastTo",
    "StopGradient", "PreventGradient", "EnsureShape", "CheckNumerics",
    "NoOp", "ReadVariableOp", "Pack", "ConcatV2", "Tile", "Fill",
    "ZerosLike", "OnesLike"])
# Random ops: their outputs are noise, a function of a seed (which may be a
# small variable: a Keras SeedGenerator) and of a shape, not a choice among
# their inputs' values. (Not shuffles or crops: those choose.)
_RANDOM_PREFIXES = ("StatelessRandom", "RandomUniform", "RandomStandardNormal",
                    "TruncatedNormal", "StatelessTruncatedNormal",
                    "StatelessParameterizedTruncatedNormal", "RandomGamma",
                    "RandomPoisson", "StatelessMultinomial", "Multinomial",
                    "RngReadAndSkip", "RngSkip", "StatefulUniform",
                    "StatefulStandardNormal", "StatefulTruncatedNormal",
                    "StatefulRandomBinomial", "StatelessRandomGetKeyCounter")
# A map on batches (no batching op after it: fit takes its results as they
# are) sees every example of a batch at once and can mix them across rows
# (a MixUp of each row with another, a concatenation of the batch with
# itself: each example in two rows, sensitivity 2C). Without shapes in the
# graph, row locality holds for these only: restructuring and casts, unary
# arithmetic, arithmetic with a scalar constant, a one-hot of the last axis.
_BATCH_MAP_UNARY_OPS = frozenset([
    "Identity", "IdentityN", "NoOp", "Cast", "EnsureShape", "CheckNumerics",
    "StopGradient", "Neg", "Abs", "Sign", "Square", "Sqrt", "Rsqrt", "Exp",
    "Expm1", "Log", "Log1p", "Tanh", "Sigmoid", "Relu", "Floor", "Ceil",
    "Round", "Rint", "Reciprocal", "IsFinite", "IsNan", "IsInf",
    "LogicalNot"])
_BATCH_MAP_SCALAR_OPS = frozenset([
    "Add", "AddV2", "Sub", "Mul", "Div", "DivNoNan", "RealDiv", "FloorDiv",
    "FloorMod", "Pow", "Maximum", "Minimum", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "ClipByValue"])
_BATCHING_OPS = frozenset([
    "BatchDataset", "BatchDatasetV2", "PaddedBatchDataset",
    "PaddedBatchDatasetV2", "ParallelBatchDataset", "MapAndBatchDataset"])
# Dataset ops whose function (attribute "f") is applied to batches when no
# batching op follows them.
_MAP_OPS = frozenset(["MapDataset", "ParallelMapDataset",
                      "ParallelMapDatasetV2"])
# Dataset ops that drop elements by their values: on batches, a batch.
_DROP_OPS = frozenset(["FilterDataset", "ParallelFilterDataset",
                       "IgnoreErrorsDataset"])
# Ops whose output carries only shapes, never values.
_SHAPE_OPS = frozenset(["Shape", "ShapeN", "Size", "Rank"])
# Ops that read data that is not their inputs' (a file by name).
_READER_OPS = frozenset(["ReadFile", "MatchingFiles", "ImmutableConst",
                         "RestoreV2", "Restore", "RestoreSlice"])
# Arbitrary Python: can return anything.
_OPAQUE_OPS = frozenset(["PyFunc", "PyFuncStateless", "EagerPyFunc"])
# Non-dataset nodes of a pipeline's graph: its parameters (the counts, sizes
# and seeds of its ops; the variables and lookup tables a function uses).
_PARAMETER_OPS = frozenset([
    "Const", "_Retval", "Identity", "NoOp", "VarHandleOp", "HashTableV2",
    "MutableHashTableV2", "MutableHashTableOfTensorsV2",
    "MutableDenseHashTableV2", "InitializeTableV2",
    "InitializeTableFromTensorV2", "LookupTableImportV2", "AssignVariableOp"])
_CALL_OPS = frozenset(["PartitionedCall", "StatefulPartitionedCall"])
_BRANCH_OPS = frozenset(["If", "StatelessIf", "Case", "StatelessCase"])
_LOOP_OPS = frozenset(["While", "StatelessWhile"])
ELEMENT, SMALL, LARGE = "element", "small", "large"
_OPAQUE_PROBLEM = "a map function runs Python"


def _source(ref):
  """The node (or function argument) a GraphDef/FunctionDef input names,
  None for a control input."""
  if ref.startswith("^"):
    return None
  return ref.split(":")[0]


def _parameter_const(node):
  """A constant that is an op's parameter, not data: a few entries and
  bytes (a string scalar can hold a serialized table: a review)."""
  return (_elements(node) <= _PARAMETER_ELEMENTS
          and node.attr["value"].tensor.ByteSize() <= _PARAMETER_BYTES)


def _small_const(node):
  return (node.op == "Const" and _elements(node) <= _SMALL_ELEMENTS
          and node.attr["value"].tensor.ByteSize() <= _SMALL_BYTES)


def _writes_state(op):
  """Ops that write a resource (a variable, a table): what one element
  writes, a later one can read."""
  return (op.startswith(("Assign", "ResourceScatter", "ResourceApply",
                         "ResourceSparseApply", "LookupTableInsert",
                         "LookupTableRemove", "LookupTableImport",
                         "ScatterNd", "ResourceStridedSliceAssign", "Write",
                         "Save", "QueueEnqueue"))
          and op != "ScatterNd")


def _capture_taint(nodes, ref):
  """SMALL or LARGE: what a captured argument of a dataset op's function
  is, from the pipeline graph's node that feeds it."""
  node = nodes.get(_source(ref))
  while node is not None and node.op == "Identity" and node.input:
    node = nodes.get(_source(node.input[0]))
  if node is None:
    return LARGE
  if _small_const(node):
    return SMALL
  if node.op == "VarHandleOp":
    dims = node.attr["shape"].shape.dim
    count = 1
    for dim in dims:
      count *= dim.size if dim.size >= 0 else _SMALL_ELEMENTS + 1
    if not node.attr["shape"].shape.unknown_rank and count <= _SMALL_ELEMENTS:
      return SMALL
  return LARGE


def _function_problem(library, name, arg_taints, seen, top=False):
  """Why the map or filter function ``name`` may not act on its element
  alone (None if it does). ``arg_taints``: for each argument, the set of
  taints it carries (ELEMENT, SMALL, LARGE). ``top``: the dataset op's own
  function, whose result is the element (a called function's result is
  tainted in its caller by all the call's inputs)."""
  function = library.get(name)
  if function is None:
    return f"function {name} not in the graph"
  key = (name, tuple(tuple(sorted(t)) for t in arg_taints))
  if key in seen:
    return None
  seen.add(key)
  nodes = list(function.node_def)
  taints = {}
  for i, arg in enumerate(function.signature.input_arg):
    taints[arg.name] = set(arg_taints[i]) if i < len(arg_taints) else {LARGE}
  for node in nodes:
    data_inputs = [r for r in node.input if not r.startswith("^")]
    if node.op == "Const":  # parameters (axes, shapes, slice bounds), or data
      taints[node.name] = (set() if _parameter_const(node)
                           else {SMALL} if _small_const(node) else {LARGE})
    elif not data_inputs:
      taints[node.name] = {LARGE}  # a handle, a table, a reader's state
  taints = _propagate(nodes, taints)
  for node in nodes:
    op = node.op
    inputs = [r for r in node.input if not r.startswith("^")]
    held = [taints.get(_source(r), set()) for r in inputs]
    union = set().union(*held) if held else set()
    if op in _OPAQUE_OPS:
      return f"{_OPAQUE_PROBLEM} ({op})"
    if "Dataset" in op:
      return f"a map function builds a dataset ({op})"
    if _writes_state(op):
      # What one element writes, a later one can read (a lag feature); a
      # large value written into a small variable would pass as small. A
      # small one (a Keras SeedGenerator's next state) is left to the rule
      # below, applied to the ops that computed it.
      if held[1:] and {ELEMENT, LARGE} & set().union(*held[1:]):
        return (f"a map function writes its element or outside data into "
                f"state ({op}): a later element can read it")
      continue
    if SMALL in union and not (
        op in _ELEMENTWISE_OPS or op in _SHAPE_OPS or _random(op)
        or op in _CALL_OPS or op in _BRANCH_OPS or op in _LOOP_OPS):
      return (f"a map function chooses among values from outside its "
              f"element ({op}: a lookup)")
    called = []  # (function name, [input refs passed as its arguments])
    for attr in node.attr.values():
      if attr.HasField("func"):
        called.append(attr.func.name)
      elif attr.HasField("list") and attr.list.func:
        called.extend(f.name for f in attr.list.func)
    if op in library and not called:
      called.append(op)  # a library function called by name
    for callee in called:
      if op in _CALL_OPS or callee == op:
        passed = held
      elif op in _BRANCH_OPS:
        passed = held[1:]
      else:  # a loop carries any input into any argument; unknown ops too
        passed = [union] * len(held)
      problem = _function_problem(library, callee, passed, seen)
      if problem:
        return problem
  outputs = [taints.get(_source(ref), set()) for ref in function.ret.values()]
  if top and any(LARGE in t for t in outputs):
    return ("a map function's result depends on data from outside its "
            "element (a lookup table, a variable or a tensor of more than "
            f"{_SMALL_ELEMENTS} entries, a file it does not name)")
  return None


def _batch_map_problem(library, name, arg_taints, seen):
  """Why the map function ``name``, applied to whole batches, may mix the
  batch's rows (None if every value computed from the batch is: see
  :data:`_BATCH_MAP_UNARY_OPS`)."""
  function = library.get(name)
  if function is None:
    return f"function {name} not in the graph"
  key = ("rows", name, tuple(tuple(sorted(t)) for t in arg_taints))
  if key in seen:
    return None
  seen.add(key)
  nodes = {node.name: node for node in function.node_def}
  taints = {arg.name: set(arg_taints[i]) if i < len(arg_taints) else set()
            for i, arg in enumerate(function.signature.input_arg)}
  taints = _propagate(list(nodes.values()), taints)
  for node in nodes.values():
    inputs = [r for r in node.input if not r.startswith("^")]
    held = [taints.get(_source(r), set()) for r in inputs]
    from_batch = [ELEMENT in t for t in held]
    if not any(from_batch):
      continue
    op = node.op
    if op in _BATCH_MAP_UNARY_OPS and sum(from_batch) == 1:
      continue
    if op in _BATCH_MAP_SCALAR_OPS and sum(from_batch) == 1 and all(
        batch or _scalar_const(nodes.get(_source(r)))
        for r, batch in zip(inputs, from_batch)):
      continue
    if op == "OneHot" and from_batch == [True, False, False, False] and (
        node.attr["axis"].i == -1):
      continue
    if op in _CALL_OPS:
      problem = _batch_map_problem(library, node.attr["f"].func.name, held,
                                   seen)
      if problem:
        return problem
      continue
    return (f"a map on batches ({op}) can mix the examples of a batch "
            "(map single examples, before .batch())")
  return None


def _scalar_const(node):
  """A constant of rank ≤ 1 (a scale, a per-feature mean): broadcast against
  a batch, it meets each row alone and adds no leading axis."""
  return (node is not None and node.op == "Const"
          and len(node.attr["value"].tensor.tensor_shape.dim) <= 1)


# Ops a file name may pass through from the element to a reader: the
# element names its own file (a path from list_files), perhaps joined to a
# directory; any arithmetic on it could name another element's file (a
# review read file i mod 32 from element i: each file twice an epoch).
_NAME_OPS = frozenset(["Identity", "StringJoin", "StaticRegexReplace",
                       "RegexReplace"])


def _names_element(by_name, inputs):
  """True if every input reaches a function argument (the element) through
  _NAME_OPS and constants only."""
  stack, seen = [_source(r) for r in inputs], set()
  reached = False
  while stack:
    name = stack.pop()
    if name in seen:
      continue
    seen.add(name)
    node = by_name.get(name)
    if node is None:  # a function argument
      reached = True
      continue
    if node.op == "Const":
      continue
    if node.op not in _NAME_OPS:
      return False
    stack.extend(_source(r) for r in node.input if not r.startswith("^"))
  return reached


def _random(op):
  return op.startswith(_RANDOM_PREFIXES) and "Shuffle" not in op


def _propagate(nodes, taints):
  """Each node's taints: the union of its data inputs' (shapes carry no
  values; a file read by a name not from the element is LARGE), to a fixed
  point in any order of the nodes."""
  by_name = {node.name: node for node in nodes}
  changed = True
  while changed:
    changed = False
    for node in nodes:
      inputs = [r for r in node.input if not r.startswith("^")]
      if not inputs or node.op == "Const":
        continue
      held = set().union(*[taints.get(_source(r), set()) for r in inputs])
      if node.op in _SHAPE_OPS or _random(node.op):
        # A shape or a draw carries no small parameter's values (a Keras
        # SeedGenerator's state); large data can still be encoded in them
        # (a review: a table's value as tf.size(tf.range(value))).
        held = held & {ELEMENT, LARGE}
      if node.op in _READER_OPS and not _names_element(by_name, inputs):
        held = held | {LARGE}
      if not held <= taints.get(node.name, set()):
        taints[node.name] = taints.get(node.name, set()) | held
        changed = True
  return taints


def _elements(node):
  """The number of elements of a Const node's value."""
  shape = node.attr["value"].tensor.tensor_shape
  count = 1
  for dim in shape.dim:
    count *= max(dim.size, 0)
  return count


def _const_value(nodes, ref):
  node = nodes.get(_source(ref))
  if node is None or node.op != "Const":
    return None
  try:
    return tf.make_ndarray(node.attr["value"].tensor)
  except (TypeError, ValueError):
    return None


REPEATS, MIXES = "repeats", "mixes"


def repeats(dataset):
  """Why one iteration of the tf.data ``dataset`` may emit an element more
  than once, or mix examples (a short phrase), or None: :func:`classify`'s
  reason, whatever its kind."""
  return classify(dataset)[1]


def classify(dataset):
  """``(kind, reason)`` for the tf.data ``dataset``: ``(None, None)`` if
  every op of its pipeline emits each element of its input at most once
  (:data:`PASS_OPS`, a repeat only with count 1) and every map and filter
  function acts on its element alone (:func:`_function_problem`, and
  :func:`_batch_map_problem` for maps on batches); ``(MIXES, why)`` where an
  element can carry data of other examples (a lookup, a map that mixes a
  batch's rows, zipped parts of different examples): one example can then
  move several units, which no accounting of batches bounds; else
  ``(REPEATS, why)``: an element may be emitted more than once, or the
  pipeline cannot be read."""
  from tensorflow.core.framework import graph_pb2  # pylint: disable=g-import-not-at-top
  try:
    with tf.init_scope():
      serialized = tf.raw_ops.DatasetToGraphV2(
          input_dataset=dataset._variant_tensor,  # pylint: disable=protected-access
          external_state_policy=1,  # ignore: only the ops are read
          strip_device_assignment=True).numpy()
    graph = graph_pb2.GraphDef()
    graph.ParseFromString(serialized)
  except Exception as e:  # pylint: disable=broad-except
    return REPEATS, f"its pipeline could not be read ({type(e).__name__})"
  nodes = {node.name: node for node in graph.node}
  library = {f.signature.name: f for f in graph.library.function}
  on_batches = _on_batches(nodes)
  seen = set()
  for node in graph.node:
    op = node.op
    if op in _PARAMETER_OPS:
      continue
    if op not in PASS_OPS:
      return REPEATS, f"its pipeline has {op}"
    inputs = [r for r in node.input if not r.startswith("^")]
    if op == "TakeWhileDataset":
      return MIXES, ("its pipeline has take_while: one element's value "
                     "decides whether every later element is used")
    if op in _DROP_OPS and node.name in on_batches:
      return MIXES, (f"its pipeline drops whole batches ({op} after batch): "
                     "one example decides whether the others in its batch "
                     "are used")
    if op in ("CacheDataset", "CacheDatasetV2") and len(inputs) > 1 and (
        _const_value(nodes, inputs[1]) not in (None, b"")):
      return REPEATS, ("its pipeline reads a cache file, which may hold "
                       "other data than the pipeline's")
    if op in ("PaddedBatchDataset", "PaddedBatchDatasetV2"):
      count = node.attr["N"].i
      for ref in inputs[2:2 + count]:
        shape = _const_value(nodes, ref)
        if shape is None or (shape < 0).any():
          # Padded to the batch's longest element: every row then carries
          # that length (a review: a mean over time, 14.9C between
          # neighbours).
          return MIXES, ("it pads each batch to its longest element "
                         "(padded_batch without fixed padded_shapes): give "
                         "padded_shapes fixed sizes")
    if op in ("RepeatDataset", "ShuffleAndRepeatDataset"):
      # (input, count); (input, buffer_size, seed, seed2, count, ...)
      at = 1 if op == "RepeatDataset" else 4
      count = _const_value(nodes, inputs[at]) if len(inputs) > at else None
      if count is None or int(count) != 1:
        return REPEATS, f"its pipeline repeats ({op}, count {count})"
    if op == "ZipDataset":
      for ref in inputs:
        problem = _unaligned(nodes, _source(ref))
        if problem:
          return MIXES, problem
    for attr_name in _FUNCTION_ATTRS:
      if attr_name not in node.attr or not node.attr[attr_name].HasField(
          "func"):
        continue
      name = node.attr[attr_name].func.name
      function = library.get(name)
      if function is None:
        return REPEATS, f"its {op} function is not in the graph"
      captured = len(node.attr["Targuments"].list.type) if (
          "Targuments" in node.attr) else 0
      total = len(function.signature.input_arg)
      # inputs: the input dataset, then the captured arguments
      taints = ([{ELEMENT}] * (total - captured)
                + [{_capture_taint(nodes, ref)}
                   for ref in inputs[1:1 + captured]])
      problem = _function_problem(library, name, taints, seen, top=True)
      if not problem and op in _MAP_OPS and node.name in on_batches:
        problem = _batch_map_problem(library, name, taints, seen)
      if problem:
        # Python run per element is opaque, as a generator is: it may
        # repeat; anything else found is data crossing between examples.
        return (REPEATS if problem.startswith(_OPAQUE_PROBLEM) else MIXES,
                problem)
  return None, None


def _on_batches(nodes):
  """The dataset nodes no batching op follows on the way to the pipeline's
  result (what they emit is what fit takes: batches)."""
  ends = [node for node in nodes.values() if node.op == "_Retval"]
  stack = [(_source(r), False) for node in ends for r in node.input
           if not r.startswith("^")]
  found, seen = set(), set()
  while stack:
    name, batched = stack.pop()
    node = nodes.get(name)
    if node is None or (name, batched) in seen:
      continue
    seen.add((name, batched))
    if not batched:
      found.add(name)
    batched = batched or node.op in _BATCHING_OPS
    stack.extend((_source(r), batched) for r in node.input
                 if not r.startswith("^"))
  return found


def _unaligned(nodes, name):
  """Why the zipped input ending at node ``name`` may not keep elements
  aligned by index (None if it does)."""
  stack, seen = [name], set()
  while stack:
    node = nodes.get(stack.pop())
    if node is None or node.name in seen or node.op == "Const":
      continue
    seen.add(node.name)
    if node.op not in _ALIGNED_OPS:
      return (f"it zips datasets one of which has {node.op} (the parts of "
              "one example can land in different elements)")
    stack.extend(_source(r) for r in node.input if not r.startswith("^"))
  return None
