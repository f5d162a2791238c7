"""Input pipelines whose participation pattern the accounting knows.

``model.fit(x, y, shuffle=True)`` (Keras' default) reshuffles every epoch, so
an example can sit in the last batch of one epoch and the first of the next:
with correlated (DP-MF) noise its participations are then only 1 step apart,
which raises the sensitivity of a banded strategy. :func:`cyclic_batches`
shuffles once and repeats the same batches in the same order every epoch:
each example participates once per epoch, exactly ``steps_per_epoch`` steps
apart — the "cyclic" participation ``CorrelatedNoise`` is calibrated for
(Choquette-Choo et al. 2023; ``dp_event(..., sampling="cyclic")``).
"""
import numpy as np
import tensorflow as tf

from tf_dpadambc.accounting import events


def steps_per_epoch(num_examples, batch_size):
  """ceil(N / B): the batches of one epoch (the last may be smaller)."""
  return events.batches_per_epoch(num_examples, batch_size)


def cyclic_batches(x, y=None, batch_size=32, sample_weight=None, *, seed):
  """A ``tf.data.Dataset`` of the same batches, in the same order, every epoch.

  The examples are permuted once by ``seed``, then cut into ceil(N/B)
  batches; iterating the dataset again (the next epoch of ``model.fit``)
  yields the same sequence. Pass it to ``model.fit`` without ``batch_size``.

  The "cyclic" accounting assumes ONE permutation for the whole run: build
  the dataset again only with the same ``seed`` (e.g. when resuming), and
  resume only at an epoch boundary (``model.fit`` restarts the dataset from
  its first batch). The permutation need not be secret.

  Args:
    x, y, sample_weight: NumPy arrays (or nests of them) with N rows.
    batch_size: B.
    seed: the permutation's seed (required, so that a rebuilt dataset keeps
      the same order).
  """
  parts = tuple(p for p in (x, y, sample_weight) if p is not None)
  sizes = {len(a) for a in tf.nest.flatten(parts)}
  if len(sizes) != 1:
    raise ValueError(f"x, y and sample_weight have different lengths {sizes}.")
  n = sizes.pop()
  if seed is None:
    raise ValueError("cyclic_batches needs an explicit seed: the cyclic "
                     "accounting assumes one permutation for the whole run.")
  if not 1 <= batch_size <= n:
    raise ValueError(f"batch_size must be in [1, {n}]; got {batch_size}.")
  rng = np.random.default_rng(seed)
  order = rng.permutation(n)
  permuted = tf.nest.map_structure(lambda a: np.asarray(a)[order], parts)
  dataset = tf.data.Dataset.from_tensor_slices(
      permuted if len(permuted) > 1 else permuted[0])
  return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)
