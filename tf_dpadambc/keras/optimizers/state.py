"""The optimizer's secret and un-noised state, which no file may hold.

:class:`PrivateState` is owned by a :class:`~.base.DPOptimizer` (one object,
``optimizer._private``) and holds everything a saved file must never contain:

* the secret noise seed (and the first step index it has not drawn yet);
* the noise mechanism's streaming state (DP-MF: past noise, as secret as the
  seed), one list per release stream;
* the clipped sums of a pending accumulation step (not noised yet);
* a DPQuery's global state where it is not known to be public.

All of it lives in *unsaved variables*: variables created like Keras'
``add_variable`` but kept in plain attributes of this object, which neither
Keras' tracker (``optimizer.variables``, what the Keras formats save) nor TF's
object graph (tf.train.Checkpoint, SavedModel) sees: by construction, not per
format. Two invariants the optimizer relies on (kept by
``privatizer.release_once``, which reads and advances this state):

* noise is never drawn twice for one step index with one seed (a restore that
  rolls the step counter back gets a fresh seed, derived in the step);
* a secret noise stream never resumes mid-stream (it refuses instead).
"""
import contextlib

import keras
import tensorflow as tf

from tf_dpadambc.core import clipping
from tf_dpadambc.core import noise as core_noise


def keep_unsaved(owner, name, value):
  """Sets an attribute that no serialization sees.

  ``object.__setattr__`` bypasses Keras' tracker and TF's attribute tracking
  (the object graph that tf.train.Checkpoint and SavedModel save).
  """
  object.__setattr__(owner, name, value)


class PrivateState:
  """The unsaved state of one DP optimizer (see the module docstring).

  Args:
    optimizer: the owning optimizer (for its name scope, distribution
      strategy, step counter and variable indices).
    seed: the user's integer seed, or None for a secret seed from the OS.
  """

  def __init__(self, optimizer, seed):
    self._optimizer = optimizer
    self.seed_pair = (core_noise.random_seed() if seed is None
                      else [int(seed) % (2**62), 0x5EED])
    self.seed_variable = None
    self.traced = False  # set when a step is traced (see restart)
    self.accumulated_sums, self.accumulated_squares = [], []
    self.noise_state = {}
    self.query_variables, self.query_structure = [], None
    self.release_tap = []

  def all_variables(self):
    """Every unsaved variable (for the write guards: no metric or callback
    may write them)."""
    found = [self.seed_variable, *self.accumulated_sums,
             *self.accumulated_squares, *self.query_variables,
             *self.release_tap]
    found += tf.nest.flatten(self.noise_state)
    return [v for v in found if isinstance(v, (tf.Variable, keras.Variable))]

  # --------------------------------------------------------------- build
  def variable(self, shape, name, dtype="int64", initializer="zeros",
               like=None):
    """An unsaved variable (as ``add_variable``, tracked by nobody)."""
    optimizer = self._optimizer
    colocate = contextlib.nullcontext()
    if like is not None:  # as add_variable_from_reference, for tf.distribute
      colocate = optimizer._distribution_strategy.extended.colocate_vars_with(  # pylint: disable=protected-access
          like.value if isinstance(like, keras.Variable) else like)
      prefix = getattr(like, "path", None) or str(like.name).replace(":", "_")
      name = prefix.replace("/", "_") + "_" + name
    # Eagerly, also where build runs in a trace: a step reads these at trace
    # time (check_stream_continues).
    with tf.init_scope(), colocate, keras.name_scope(optimizer.name,
                                                     caller=optimizer):
      return keras.Variable(initializer=keras.initializers.get(initializer),
                            shape=shape, dtype=dtype, trainable=False,
                            name=name)

  def build_accumulation(self, variables, square_sums):
    """The pending logical step's clipped sums and counts (k > 1)."""
    # float64 (clipping.sum_dtype): the sums are not rounded before the noise.
    self.accumulated_sums = [
        self.variable(v.shape, "dp_clipped_sum", clipping.sum_dtype(v.dtype),
                      like=v) for v in variables]
    self.accumulated_squares = [
        self.variable(v.shape, "dp_clipped_square_sum",
                      clipping.sum_dtype(v.dtype), like=v)
        for v in variables] if square_sums else []
    self.accumulated_units = self.variable((), "dp_accumulated_units")
    self.accumulated_examples = self.variable((), "dp_accumulated_examples")
    self.physical_step = self.variable((), "dp_physical_step")
    # Mirrors the saved count of physical batches, so that a step sees when
    # a restore (in this process too) moved it (see accumulate).
    self.live_physical_batches = self.variable((), "dp_live_physical_batches")

  def build_noise(self, variables, mechanism, streams):
    """The mechanism's streaming state per release stream and variable, the
    secret seed and the first step index it has not drawn."""
    self.noise_state = {
        stream: [None if shape is None else self.variable(
            shape, f"dp_noise_state_{stream}_{i}", "float32")
                 for i, shape in enumerate(
                     mechanism.state_shape(v.shape) for v in variables)]
        for stream in streams}

  def build_seed(self):
    # In a variable so that a step can renew it. Each process draws its own
    # OS seed; under several workers every replicated release first agrees
    # on worker 0's (keras.replicas.release), so all workers draw the same
    # once-global noise.
    self.seed_variable = self.variable(
        (2,), "dp_noise_seed", "int64",
        keras.initializers.Constant(self.seed_pair))
    # For a secret stream also its position, which a step must continue.
    self.next_noise_step = self.variable((), "dp_next_noise_step")

  def build_query(self, query, state, add_variable):
    """One variable per tensor of a DPQuery's global state, so that the
    compiled step reads and advances it. Saved (``add_variable``) only where
    the state is known to be public (Gaussian sum queries, adaptive clipping:
    post-processing of released values); otherwise it may hold noise seeds,
    past noise or un-noised sums (tree aggregation) and no file holds it."""
    self.query_structure = state
    with tf.init_scope():  # the state's values, also when built in a trace
      values = [tf.convert_to_tensor(t).numpy()
                for t in tf.nest.flatten(state)]
    variables = []
    for i, (value, shape) in enumerate(zip(values, query.state_shapes)):
      name, init = f"dp_query_state_{i}", keras.initializers.Constant(value)
      if not shape.is_fully_defined():  # tree buffers grow: a plain variable
        with tf.init_scope():
          variables.append(tf.Variable(value, shape=shape, trainable=False,
                                       name=name))
      elif not query.public_state:
        variables.append(self.variable(value.shape, name, value.dtype.name,
                                       init))
      else:
        variables.append(add_variable(value.shape, dtype=value.dtype.name,
                                      name=name, initializer=init))
    self.query_variables = variables

  def tap_releases(self, variables):
    """Unsaved variables that keep each step's release (for auditing)."""
    self.release_tap = [self.variable(v.shape, f"audit_release_{i}",
                                      "float32")
                        for i, v in enumerate(variables)]

  def tap(self, release):
    for tap, value in zip(self.release_tap, release):
      tap.assign(tf.cast(value, tap.dtype))

  # -------------------------------------------------------- the DPQuery
  def query_state(self):
    return tf.nest.pack_sequence_as(
        self.query_structure,
        [tf.convert_to_tensor(v) for v in self.query_variables])

  def assign_query_state(self, new_state):
    for variable, leaf in zip(self.query_variables,
                              tf.nest.flatten(new_state)):
      variable.assign(tf.cast(leaf, variable.dtype))

  # ------------------------------------------------------------ the seed
  def seed(self):
    """The secret seed pair: an unsaved variable once built."""
    if self.seed_variable is not None:
      return self.seed_variable.value
    return self.seed_pair

  def sampler(self, mechanism, step, variables):
    """The step's ``sample(templates, stddev, stream)`` (core.noise) from the
    noise mechanism, and the dict its new streaming states go to."""
    new_states = {}

    def sample(templates, stddev, stream=0):
      def seed_of(j):  # stream 0 draws exactly the independent noise's z
        return core_noise.stream_seed(core_noise.step_seed(self.seed(), j),
                                      stream)
      state = [v.value for v in self.stream_state(stream, variables)] or None
      out, new_states[stream] = mechanism.sample(templates, stddev, seed_of,
                                                 step, state)
      return out
    return sample, new_states

  def stream_state(self, stream, variables):
    """The state variables of one release stream, in the step's order."""
    if stream not in self.noise_state:
      raise ValueError(f"{self._optimizer.__class__.__name__} draws noise "
                       f"stream {stream} but declares "
                       f"{tuple(self.noise_state)}.")
    states, index = self.noise_state[stream], self._optimizer._get_variable_index  # pylint: disable=protected-access
    return [v for v in (states[index(x)] for x in variables) if v is not None]

  def commit_streams(self, new_states, variables):
    for stream, states in new_states.items():
      for variable, state in zip(self.stream_state(stream, variables),
                                 states or []):
        variable.assign(state)

  # ------------------------------------------------------ accumulation
  def accumulation_variables(self):
    if not self.accumulated_sums:
      return []
    return self.accumulated_sums + self.accumulated_squares + [
        self.accumulated_units, self.accumulated_examples, self.physical_step]

  def accumulate(self, physical_batches, clipped_sum, squares, num_units,
                 num_examples, k, release):
    """Adds one physical batch to the pending logical step; at the k-th,
    ``release(sums, squares, units, examples)`` and the sums restart."""
    # A restore moved the saved batch count away from this process's: the
    # pending sums are from another timeline (or were dropped with the
    # file), so the logical step starts afresh (see restart).
    restored = tf.not_equal(physical_batches, self.live_physical_batches)
    for acc in self.accumulation_variables():
      acc.assign(tf.where(restored, tf.zeros_like(acc), acc))
    self.live_physical_batches.assign(physical_batches.assign_add(1))
    for acc, s in zip(self.accumulated_sums + self.accumulated_squares,
                      list(clipped_sum) + (squares or [])):
      acc.assign_add(s)
    units = self.accumulated_units.assign_add(num_units)
    examples = self.accumulated_examples.assign_add(num_examples)
    step = self.physical_step.assign_add(1)

    def release_and_restart():
      release([acc.value for acc in self.accumulated_sums],
              ([acc.value for acc in self.accumulated_squares]
               if squares is not None else None), units, examples)
      for acc in self.accumulation_variables():
        acc.assign(tf.zeros_like(acc))
      return tf.constant(True)

    tf.cond(step >= k, release_and_restart, lambda: tf.constant(False))

  # ------------------------------------------- a secret stream's position
  def check_stream_continues(self):
    with tf.init_scope():
      step = int(self._optimizer.iterations.numpy())
      position = int(self.next_noise_step.numpy())
    if step != position:
      raise ValueError(self.stream_error(step, position))

  def stream_error(self, step, position):
    optimizer = self._optimizer
    what = ("correlated (DP-MF) noise" if optimizer.is_correlated else
            f"DPQuery {type(optimizer.query.query).__name__}")
    return (
        f"{optimizer.name}: its {what} cannot resume mid-stream. Its step "
        f"counter says {step} steps were taken (restored from a file), but "
        f"its noise stream is at step {position}. Each step's noise continues "
        "a secret state (past noise, and with a Dense strategy the seed) that "
        "no file holds, so a restored run cannot continue the mechanism its ε "
        "was computed for. Finish the run in one process (its checkpoints "
        "still restore the weights, e.g. for inference), or train on with a "
        "new optimizer: a new run, whose ε composes with this run's.")

  # ------------------------------------------------------------ restore
  # On restore:
  # * a pending accumulation step restarts: its sums were not saved, and the
  #   physical batches dropped with them were never released (no noise was
  #   drawn for them), so nothing was spent on them and the accounting, which
  #   counts releases, does not under-count;
  # * the seed is new: drawn from the OS by a new optimizer (and, for a
  #   restore into this one, here, or derived in the step when the step
  #   counter went back, see privatizer.release_once);
  # * a secret noise stream (DP-MF) cannot be continued: training refuses
  #   until it is back where it stopped (see stream_error).
  def restart(self, physical_batches, secret_stream, fixed_seed):
    """After a restore into the (live, built) optimizer: the pending logical
    step restarts and the seed is new, as in a new optimizer."""
    for variable in self.accumulation_variables():
      variable.assign(tf.zeros_like(variable))
    if physical_batches is not None:
      self.live_physical_batches.assign(physical_batches)
    if secret_stream:
      step, position = (int(self._optimizer.iterations.numpy()),
                        int(self.next_noise_step.numpy()))
      if step != position and self.traced:
        # The compiled step could only skip (under XLA), not explain.
        raise ValueError(self.stream_error(step, position))
      return  # not traced yet: the first step refuses (or it continues)
    if not fixed_seed:
      self.seed_pair = core_noise.random_seed()
      self.seed_variable.assign(self.seed_pair)
      self.next_noise_step.assign(0)  # the new seed has drawn nothing


# ---------------------------------------------------------------- saving
def save_variables(variables, store):
  """Writes the saved ``variables`` (Keras formats): nothing secret."""
  for i, variable in enumerate(variables):
    store[str(i)] = variable.numpy()


def load_variables(optimizer, variables, store):
  """Restores ``variables`` from ``store``, then restarts what was not saved
  (the pending step, the seed; see :meth:`PrivateState.restart`)."""
  # Before build an optimizer has the step counter and, unless it is a
  # schedule, the learning rate.
  unbuilt = 1 + isinstance(optimizer._learning_rate, keras.Variable)  # pylint: disable=protected-access
  if len(store.keys()) == unbuilt < len(variables):
    # Saved before the first step (e.g. model.save right after compile):
    # only the step counter and learning rate; the rest starts fresh.
    variables = variables[:unbuilt]
  elif len(store.keys()) != len(variables):
    raise ValueError(
        f"Cannot restore {optimizer.name}: the file holds "
        f"{len(store.keys())} variables, this optimizer has {len(variables)}"
        + ("" if optimizer.built else " (build it first: "
           "optimizer.build(model.trainable_variables))") + ".")
  for i, variable in enumerate(variables):
    variable.assign(store[str(i)])
  if optimizer.built:  # (unbuilt: nothing drawn, nothing pending)
    optimizer._private.restart(  # pylint: disable=protected-access
        optimizer._physical_batches if optimizer.accumulation_steps > 1  # pylint: disable=protected-access
        else None, optimizer.privatizer.secret_stream,
        optimizer.seed is not None)
