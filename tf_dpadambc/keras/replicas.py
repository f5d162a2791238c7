"""One private release for all synchronous replicas (tf.distribute).

Each replica clips its own units; :func:`release` (called in replica
context) sums the replicas' clipped sums and counts and lets the optimizer
add the noise **once**, in cross-replica context: total std σC on the global
clipped sum, normalised by the global batch — the single-device release
(Abadi et al. 2016, "Deep Learning with Differential Privacy", Alg. 1, with
the lot split across replicas).

Under ``MultiWorkerMirroredStrategy`` every worker process runs that
cross-replica code on its own copy of the variables; the workers stay equal
only if they draw the same noise, i.e. hold the same secret seed. Variables
created in the strategy's scope start from worker 0's initial value (a
collective broadcast), but an optimizer built outside the scope, or one whose
seed was renewed after a restore (a fresh OS draw in each process), holds a
different seed in each worker. So every release first agrees on the seed of
replica 0 (worker 0) with an all-reduce in which the other replicas
contribute 0: the seed travels only over the strategy's own collectives, is
never logged nor saved.
"""
import tensorflow as tf

# Strategy classes (by name, in the MRO) that span several worker processes.
_MULTI_WORKER = ("MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy")


def num_workers(strategy=None):
  """Worker processes the strategy spans (1 for single-host strategies)."""
  strategy = strategy or tf.distribute.get_strategy()
  kinds = {c.__name__ for c in type(strategy).__mro__}
  if not kinds & set(_MULTI_WORKER):
    return 1
  resolver = strategy.cluster_resolver
  spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
  return max(1, sum(len(spec.get(job, ())) for job in ("chief", "worker")))


KERAS3_FIT_ERROR = (
    "Model '{name}': Keras 3's fit does not run under "
    "MultiWorkerMirroredStrategy with {workers} workers, even without "
    "privacy (it fails with 'Attempt to convert a value (PerReplica: ...) "
    "with an unsupported type'; keras-team/keras#20585). Train across "
    "workers with a custom loop that calls tf_dpadambc.private_step(model, "
    "batch) inside strategy.run (same clipping, one "
    "noise draw per global step, same accounting; README, 'tf.distribute', "
    "and examples/multi_worker.py), or with a tf_keras model and "
    "tf_dpadambc.tf_keras's optimizers, whose fit supports it.")


def refuse_fit_across_workers(model):
  """Wraps ``model.fit`` so that it raises a clear ``NotImplementedError``
  under several workers, before Keras' own failure (which comes while
  Keras builds the model on a first, distributed batch)."""
  fit = model.fit

  def checked_fit(*args, **kwargs):
    workers = num_workers(model.distribute_strategy)
    if workers > 1:
      raise NotImplementedError(KERAS3_FIT_ERROR.format(name=model.name,
                                                        workers=workers))
    return fit(*args, **kwargs)
  checked_fit.__doc__ = fit.__doc__
  object.__setattr__(model, "fit", checked_fit)


def build(optimizer, variables):
  """Builds the optimizer eagerly, in the current strategy's scope (so each
  of its variables starts from worker 0's value, broadcast), also from a
  traced replica step: through a ``merge_call``, as a replica cannot enter
  the scope itself."""
  def build_in(strategy):
    # Keras' TF optimizer keeps the strategy current at its construction
    # (to colocate its slots): one constructed outside the scope would
    # refuse to build in it.
    if getattr(optimizer, "_distribution_strategy", strategy) is not strategy:
      optimizer._distribution_strategy = strategy  # pylint: disable=protected-access
    with tf.init_scope(), strategy.scope():
      optimizer.build(variables)
  context = tf.distribute.get_replica_context()
  if context is None or tf.distribute.get_strategy().num_replicas_in_sync == 1:
    with tf.init_scope():
      optimizer.build(variables)
  else:
    context.merge_call(build_in)


def release(optimizer, result, num_units, num_examples, variables):
  """In replica context: one private release of all replicas' clipped sums.

  ``result`` is this replica's ``ClippedSum`` (Σ_u clip_C(g_u) over its own
  units), ``num_units``/``num_examples`` its counts. Every replica calls it
  (a ``merge_call``); the optimizer then sees the global sum, U = Σ U_r and
  B = Σ B_r, draws the noise once and updates the (mirrored) variables.
  """
  context = tf.distribute.get_replica_context()
  if not optimizer.built:
    raise RuntimeError(f"{optimizer.name} must be built before a replicated "
                       "release (its seed is agreed across workers).")
  first = tf.equal(context.replica_id_in_sync_group, 0)
  # Only replica 0 contributes its seed; the sum is that seed everywhere.
  seed_share = tf.where(first, optimizer._private.seed_variable.value,  # pylint: disable=protected-access
                        tf.zeros([2], tf.int64))
  context.merge_call(_apply_across_replicas, args=(
      optimizer, result, num_units, num_examples, variables, seed_share))


def _apply_across_replicas(strategy, optimizer, result, num_units,
                           num_examples, variables, seed_share):
  """Cross-replica: Σ over replicas of the clipped sums and counts, then
  one private release (noise drawn once: total std σC, not σC per replica).

  Each replica clipped its own examples, so the reduced sum is exactly the
  single-device Σ_u clip(g_u); the optimizer sees one logical batch.
  """
  def total(value):
    return strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

  # Every worker continues from worker 0's seed (see the module docstring).
  optimizer._private.seed_variable.assign(total(seed_share))  # pylint: disable=protected-access
  optimizer.apply_private(
      result._replace(grads=[total(g) for g in result.grads],
                      square_grads=None if result.square_grads is None else
                      [total(g) for g in result.square_grads]),
      total(num_units), total(num_examples), variables)
