"""A private train step for custom Keras 3 loops under tf.distribute.

Keras 3's ``fit`` does not run under ``MultiWorkerMirroredStrategy`` with
several workers (keras-team/keras#20585, tensorflow/tensorflow#72388), so
multi-worker training of a Keras 3 model uses a custom loop; the step is the
one ``make_private``'s ``fit`` runs::

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
      model = keras.Sequential([...])
      model.compile(optimizer=tf_dpadambc.DPAdamBC(1.0, 1.1),
                    loss="sparse_categorical_crossentropy")

    @tf.function
    def train_step(batch):
      losses = strategy.run(private_step, args=(model, batch))
      return strategy.reduce("MEAN", losses, axis=None)

    for batch in strategy.experimental_distribute_dataset(dataset):
      train_step(batch)

(examples/multi_worker.py is complete). ``dataset`` yields each worker's
share of the global batch (``experimental_distribute_dataset`` splits a
dataset batched by the global batch size).
"""
import keras
import tensorflow as tf

from tf_dpadambc.accounting import ledger
from tf_dpadambc.core import graph
from tf_dpadambc.keras import replicas
from tf_dpadambc.keras import training
from tf_dpadambc.keras import validation
from tf_dpadambc.keras.optimizers import base


def _check_no_batch_in_model(model, data):
  """Raises ValueError if the traced loop wrote the batch into one of the
  model's variables before this step (a memory bank, a batch context):
  every unit's evaluation reads it, so one example reaches all units (a
  review: 11 C/B for a bound of 2 C/B). Only what the trace shows; a write
  made eagerly, or in an earlier step, is the loop's own responsibility."""
  if tf.executing_eagerly():
    return
  # Not the trainable ones: an earlier step in the same trace updates them.
  handles = [getattr(v.value, "handle", None)
             for v in model.non_trainable_variables]
  writes = graph.written_from_data(
      [], graph.ops_before(tf.compat.v1.get_default_graph()),
      tf.nest.flatten(data), handles=[h for h in handles if h is not None])
  if writes:
    raise ValueError(
        f"The loop wrote the batch into a variable of '{model.name}' before "
        f"private_step ({', '.join(writes[:3])}): each example's evaluation "
        "reads it, so one example reaches every unit's gradient, beyond what "
        "clipping bounds. Pass per-batch context as input features of each "
        "example instead.")


def register_dataset(optimizer, dataset):
  """Says which batches a custom loop feeds ``optimizer``; returns
  ``dataset``. What ``fit`` checks of its ``x``: a Poisson optimizer
  (``expected_batch_size`` B) takes the dataset of
  ``data.poisson_batches(..., expected_batch_size=B)`` as returned (else
  ``ValueError``), and its ledger records the N the batches are sampled
  from (``dp_event`` then refuses a larger ``num_examples``). Call it before
  the loop (on the dataset before ``experimental_distribute_dataset``);
  :func:`private_step` (and ``train_on_batch``) refuse a Poisson optimizer
  without it (``accounting.ledger.require_poisson_dataset``). ::

      batches = tf_dpadambc.data.poisson_batches(x, y, expected_batch_size=B)
      register_dataset(model.optimizer, batches)
      for batch in batches:
        step(batch)
  """
  ledger.declare_poisson_dataset(optimizer, dataset)
  return dataset


@tf.autograph.experimental.do_not_convert
def private_step(model, data, optimizer=None):
  """One differentially private step of a compiled Keras 3 model; returns
  this replica's mean loss.

  Call it in replica context (inside ``strategy.run``; also without any
  strategy, on one device). Each replica clips the units (examples, or its
  share of ``num_microbatches``) of its own batch ``data`` = ``(x, y)`` or
  ``(x, y, sample_weight)`` exactly as ``fit`` does
  (:func:`~tf_dpadambc.keras.training.private_gradient_sum`, ghost clipping
  where possible); the replicas' clipped sums and counts are summed, and the
  optimizer releases once per global step:

      ḡ = (Σ_r Σ_{u ∈ r} clip_C(g_u) + N(0, σ²C² I)) / B,  B = Σ_r B_r

  — total noise std σC drawn once (one seed, agreed across workers), not σC
  per replica (Abadi et al. 2016, Alg. 1). The optimizer's counters
  (``steps_taken``, ``logical_batch_size``, ``dp_event``) therefore describe
  the global steps and batches, as on one device.

  ``optimizer``: the model's compiled optimizer by default (a tf_dpadambc
  Keras 3 optimizer); the loss is the compiled loss. Build the model and
  compile it in ``strategy.scope()``; an optimizer constructed outside the
  scope is built here, in the scope, on the first step (building it before,
  ``optimizer.build(model.trainable_variables)`` in the scope, spares the
  second trace a ``tf.function`` makes when its first trace creates
  variables). Unlike ``fit``, the step does not compare the batched and
  per-example forward passes on the first step
  (``tf_dpadambc.keras.training.examples_independent`` does it on demand);
  per-example evaluation keeps the step private either way.
  On one device every optimizer works as under ``fit`` (a DPQuery clips and
  releases through its own ``preprocess_record``). Refused
  (``NotImplementedError``) under several replicas: DPQueries, public
  preconditioners, correlated (DP-MF) noise, and non-synchronous strategies.
  """
  optimizer = optimizer if optimizer is not None else model.optimizer
  if not isinstance(optimizer, base.DPOptimizer):
    raise TypeError(
        "private_step needs a tf_dpadambc Keras 3 optimizer (DPSGD, "
        f"DPAdamBC, ...); got {type(optimizer).__name__}. Compile the model "
        "with one, or pass optimizer=.")
  if tf.distribute.in_cross_replica_context() and (
      tf.distribute.get_strategy().num_replicas_in_sync > 1):
    raise RuntimeError("private_step runs in replica context: call it "
                       "inside strategy.run(private_step, args=(model, "
                       "batch)).")
  strategy = tf.distribute.get_strategy()
  replicated = training._check_strategy(strategy, optimizer)  # pylint: disable=protected-access
  validation.check_model(model)
  training.check_overrides(model)  # the compiled loss is what runs here
  _check_no_batch_in_model(model, data)
  x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  poisson = optimizer.expected_batch_size is not None
  if poisson and sample_weight is None:
    raise ValueError(
        f"{optimizer.name} has expected_batch_size="
        f"{optimizer.expected_batch_size}: its batches must be Poisson "
        "samples with weight 0 on the padding (pass (x, y, sample_weight)).")
  if poisson:
    ledger.require_poisson_dataset(optimizer)
  variables = model.trainable_variables
  if not optimizer.built:
    replicas.build(optimizer, variables)
  optimizer.before_step(model)  # public work only (AdaDPS' refresh)
  # The stages of fit's step (training._private_stage): clip, then one
  # release (across replicas when replicated). No first-step check here.
  batch_size = training._batch_size(x)  # pylint: disable=protected-access
  _, unit_losses, _ = training._private_stage(  # pylint: disable=protected-access
      model, optimizer, x, y, sample_weight, batch_size, tf.constant(True),
      replicated)
  training._advance_seed_generators(model)  # pylint: disable=protected-access
  if not poisson:
    return tf.reduce_mean(unit_losses)
  real = tf.not_equal(training._per_example_weights(sample_weight,  # pylint: disable=protected-access
                                                    batch_size), 0)
  counted = tf.maximum(tf.reduce_sum(tf.cast(real, unit_losses.dtype)), 1)
  return tf.reduce_sum(unit_losses) / counted
