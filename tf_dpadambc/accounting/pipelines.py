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
# Ops of a map function that read data the element does not carry when what
# they read from (input 0) is not derived from the element: a map may
# transform its element, or read the file its element names, but a lookup by
# index into a table (x[i] for an index i, random or not) can return one
# example for several elements (a review: indices drawn with replacement).
_READ_OPS = frozenset([
    "Gather", "GatherV2", "GatherNd", "ResourceGather", "ResourceGatherNd",
    "StridedSlice", "Slice", "ResourceStridedSliceAssign", "TensorListGetItem",
    "TensorListGather", "TensorArrayReadV3", "TensorArrayGatherV3",
    "ReadFile", "BatchGather", "SparseSlice", "EmbeddingLookup"])
# Ops of a map function that combine values across an axis: applied to a
# tensor from outside the element (a capture, a large constant) and to the
# element, a lookup by arithmetic (a one-hot row selector times a table: a
# review, ε 9.01 for 21.4) as much as a gather is.
_COMBINE_OPS = frozenset([
    "Sum", "Prod", "Max", "Min", "Mean", "All", "Any", "ArgMax", "ArgMin",
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "SparseMatMul", "Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2dNative",
    "Cumsum", "Cumprod", "TopKV2", "SegmentSum", "SegmentMax", "SegmentMin",
    "SegmentMean", "SegmentProd", "UnsortedSegmentSum", "UnsortedSegmentMax",
    "UnsortedSegmentMin", "UnsortedSegmentProd", "TensorScatterUpdate",
    "TensorScatterAdd", "ScatterNd", "DynamicStitch", "ParallelDynamicStitch"])
# A constant of more elements than this in a map function is data (a table
# baked into the graph), not a parameter of a transformation.
_LARGE_CONSTANT = 1024
# Arbitrary Python: can return anything.
_OPAQUE_OPS = frozenset(["PyFunc", "PyFuncStateless", "EagerPyFunc"])
# Non-dataset nodes of a pipeline's graph: its parameters (the counts, sizes
# and seeds of its ops; the variables and lookup tables a function uses).
_PARAMETER_OPS = frozenset([
    "Const", "_Retval", "Identity", "NoOp", "VarHandleOp", "HashTableV2",
    "MutableHashTableV2", "MutableHashTableOfTensorsV2",
    "MutableDenseHashTableV2", "InitializeTableV2",
    "InitializeTableFromTensorV2", "LookupTableImportV2"])
_CALL_OPS = frozenset(["PartitionedCall", "StatefulPartitionedCall"])
_BRANCH_OPS = frozenset(["If", "StatelessIf", "Case", "StatelessCase"])
_LOOP_OPS = frozenset(["While", "StatelessWhile"])


def _source(ref):
  """The node (or function argument) a GraphDef/FunctionDef input names,
  None for a control input."""
  if ref.startswith("^"):
    return None
  return ref.split(":")[0]


def _function_problem(library, name, element_args, seen):
  """Why the map function ``name`` may not be element-wise (None if it
  is): ``element_args``, the indices of its arguments that carry the
  element (the others are captured tensors)."""
  function = library.get(name)
  if function is None:
    return f"function {name} not in the graph"
  key = (name, tuple(sorted(element_args)))
  if key in seen:
    return None
  seen.add(key)
  args = [a.name for a in function.signature.input_arg]
  derived = {args[i] for i in element_args if i < len(args)}
  # From outside the element: captured arguments and large constants.
  outside = {a for i, a in enumerate(args) if i not in element_args}
  nodes = list(function.node_def)
  outside |= {node.name for node in nodes
              if node.op == "Const" and _elements(node) > _LARGE_CONSTANT}
  derived, outside = _reached(nodes, derived), _reached(nodes, outside)
  for node in nodes:
    op = node.op
    inputs = [r for r in node.input if not r.startswith("^")]
    if op in _OPAQUE_OPS:
      return f"a map function runs Python ({op})"
    if "Dataset" in op:
      return f"a map function builds a dataset ({op})"
    if op in _READ_OPS and inputs and _source(inputs[0]) not in derived:
      return (f"a map function reads data its element does not carry ({op} "
              "of a tensor outside the element: a lookup by index)")
    if op in _COMBINE_OPS and node.name in derived and any(
        _source(r) in outside for r in inputs):
      return (f"a map function combines its element with a tensor from "
              f"outside it ({op}: a lookup by arithmetic)")
    called = []  # (function name, [input refs passed as its arguments])
    for attr_name, attr in node.attr.items():
      if attr.HasField("func"):
        called.append((attr.func.name, attr_name))
      elif attr.HasField("list") and attr.list.func:
        called.extend((f.name, attr_name) for f in attr.list.func)
    if op in library and not called:
      called.append((op, None))  # a library function called by name
    for callee, attr_name in called:
      if op in _CALL_OPS or callee == op:
        passed = inputs
      elif op in _BRANCH_OPS:
        passed = inputs[1:]
      elif op in _LOOP_OPS:
        passed = inputs
      else:
        passed = []  # unknown: no argument counts as the element
      problem = _function_problem(
          library, callee,
          [i for i, r in enumerate(passed) if _source(r) in derived], seen)
      if problem:
        return problem
  return None


def _reached(nodes, names):
  """``names`` and every node computed from them (a fixed point, in any
  order of the nodes)."""
  reached, changed = set(names), True
  while changed:
    changed = False
    for node in nodes:
      if node.name not in reached and any(
          _source(r) in reached for r in node.input):
        reached.add(node.name)
        changed = True
  return reached


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


def repeats(dataset):
  """Why one iteration of the tf.data ``dataset`` may emit an element more
  than once (a short phrase), or None if every op of its pipeline is one
  that emits each element of its input at most once (:data:`PASS_OPS`, a
  repeat only with count 1, map and filter functions element-wise: see
  :func:`_function_problem`)."""
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
    return f"its pipeline could not be read ({type(e).__name__})"
  nodes = {node.name: node for node in graph.node}
  library = {f.signature.name: f for f in graph.library.function}
  seen = set()
  for node in graph.node:
    op = node.op
    if op in _PARAMETER_OPS:
      continue
    if op not in PASS_OPS:
      return f"its pipeline has {op}"
    inputs = [r for r in node.input if not r.startswith("^")]
    if op in ("RepeatDataset", "ShuffleAndRepeatDataset"):
      # (input, count); (input, buffer_size, seed, seed2, count, ...)
      at = 1 if op == "RepeatDataset" else 4
      count = _const_value(nodes, inputs[at]) if len(inputs) > at else None
      if count is None or int(count) != 1:
        return f"its pipeline repeats ({op}, count {count})"
    if op == "ZipDataset":
      for ref in inputs:
        problem = _unaligned(nodes, _source(ref))
        if problem:
          return problem
    for attr_name in _FUNCTION_ATTRS:
      if attr_name not in node.attr or not node.attr[attr_name].HasField(
          "func"):
        continue
      name = node.attr[attr_name].func.name
      function = library.get(name)
      if function is None:
        return f"its {op} function is not in the graph"
      captured = len(node.attr["Targuments"].list.type) if (
          "Targuments" in node.attr) else 0
      total = len(function.signature.input_arg)
      problem = _function_problem(library, name,
                                  list(range(total - captured)), seen)
      if problem:
        return problem
  return None


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
