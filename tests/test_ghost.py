"""Ghost norms and book-keeping (keras.ghost, core.ghost) against a loop reference.

The reference computes every unit's gradient with its own GradientTape on
that unit's examples alone (no vectorization, no ghost trick), then clips
them with ``core.clipping.materialized_clipped_sum``.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc.core import clipping
from tf_dpadambc.core import ghost
from tf_dpadambc.core import unit_chunks
from tf_dpadambc.keras import training

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference(model, x, y, sample_weight, spec, num_microbatches):
  """Σ_u clip(g_u) from per-unit tapes, and the unit norms (NumPy)."""
  batch = len(y)
  size = 1 if num_microbatches is None else batch // num_microbatches
  weights = np.ones(batch, "float32") if sample_weight is None else (
      np.asarray(sample_weight, "float32"))
  per_unit = []
  for start in range(0, batch, size):
    part = slice(start, start + size)
    with tf.GradientTape() as tape:
      values = LOSS.call(y[part], model(x[part], training=True))
      loss = tf.reduce_mean(values * weights[part])
    per_unit.append(tape.gradient(
        loss, model.trainable_variables,
        unconnected_gradients=tf.UnconnectedGradients.ZERO))
  stacked = [tf.stack(g) for g in zip(*per_unit)]
  return clipping.materialized_clipped_sum(stacked, spec)


def ghost_sum(model, x, y, sample_weight, spec, num_microbatches, jit=True,
              method="ghost"):
  model.compile(loss=LOSS)
  fn = tf.function(lambda: training.private_gradient_sum(
      model, x, y, sample_weight, spec, num_microbatches, method),
      jit_compile=jit)
  return fn()[0]


def assert_same(result, expected, rtol=2e-5):
  np.testing.assert_allclose(result.norms, expected.norms, rtol=rtol)
  assert int(result.num_clipped) == int(expected.num_clipped)
  assert not bool(result.mismatch)
  # Relative to the largest entry: some entries are 0 up to rounding (the
  # key bias of attention gets no gradient: softmax is shift invariant).
  scale = max(np.max(np.abs(w)) for w in expected.grads) + 1e-6
  for got, want in zip(result.grads, expected.grads):
    np.testing.assert_allclose(np.asarray(got) / scale,
                               np.asarray(want) / scale, atol=rtol * 10)
  if expected.square_grads is not None:
    scale = max(np.max(w) for w in expected.square_grads) + 1e-12
    for got, want in zip(result.square_grads, expected.square_grads):
      np.testing.assert_allclose(np.asarray(got) / scale,
                                 np.asarray(want) / scale, atol=rtol * 10)


def _mlp():
  return keras.Sequential([keras.Input((7,)),
                           keras.layers.Dense(6, activation="tanh"),
                           keras.layers.Dense(3)])


def _sequence_dense():  # Dense on [B, T, p]: ghost norm (pd > 2T², 2T(p+d))
  return keras.Sequential([keras.Input((2, 16)),
                           keras.layers.Dense(16, activation="relu"),
                           keras.layers.Flatten(), keras.layers.Dense(3)])


def _embedding():  # padded ids, masked mean
  return keras.Sequential([
      keras.Input((6,), dtype="int32"),
      keras.layers.Embedding(20, 4, mask_zero=True),
      keras.layers.Dense(5, activation="relu"),
      keras.layers.GlobalAveragePooling1D(),
      keras.layers.LayerNormalization(), keras.layers.Dense(3)])


def _conv2d():
  return keras.Sequential([
      keras.Input((10, 10, 2)),
      keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu"),
      keras.layers.GroupNormalization(2),
      keras.layers.Conv2D(3, 2, padding="valid", dilation_rate=2),
      keras.layers.Flatten(), keras.layers.Dense(3)])


def _conv1d():
  return keras.Sequential([
      keras.Input((10, 3)),
      keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2),
      keras.layers.Conv1D(4, 3, strides=2, padding="same", activation="relu"),
      keras.layers.Flatten(), keras.layers.Dense(3)])


def _conv2d_one_channel():  # per-unit gradients by a depthwise convolution
  return keras.Sequential([
      keras.Input((9, 9, 1)),
      keras.layers.Conv2D(4, (3, 2), strides=2, padding="same",
                          activation="relu"),
      keras.layers.Flatten(), keras.layers.Dense(3)])


def _conv1d_one_channel():
  return keras.Sequential([
      keras.Input((12, 1)),
      keras.layers.Conv1D(3, 4, strides=2, padding="causal",
                          activation="relu"),
      keras.layers.Flatten(), keras.layers.Dense(3)])


def _einsum():
  return keras.Sequential([
      keras.Input((5, 6)),
      keras.layers.EinsumDense("abc,cde->abde", (5, 2, 3), bias_axes="de"),
      keras.layers.EinsumDense("abcd,cde->abe", (5, 4), bias_axes="e",
                               activation="relu"),
      keras.layers.Flatten(), keras.layers.Dense(3)])


def _attention():
  inputs = keras.Input((5, 8))
  h = keras.layers.MultiHeadAttention(2, 4)(inputs, inputs)
  h = keras.layers.LayerNormalization()(h + inputs)
  h = keras.layers.GlobalAveragePooling1D()(h)
  return keras.Model(inputs, keras.layers.Dense(3)(h))


def _data(model, rng, batch=8):
  shape = model.inputs[0].shape[1:]
  if model.inputs[0].dtype.startswith("int"):
    x = rng.integers(1, 20, (batch,) + tuple(shape)).astype("int32")
    x[: batch // 2, 4:] = 0  # padding
  else:
    x = rng.normal(size=(batch,) + tuple(shape)).astype("float32")
  return x, rng.integers(0, 3, batch).astype("int32")


MODELS = {"dense": _mlp, "dense_sequence": _sequence_dense,
          "embedding_layernorm": _embedding, "conv2d": _conv2d,
          "conv1d": _conv1d, "conv2d_one_channel": _conv2d_one_channel,
          "conv1d_one_channel": _conv1d_one_channel, "einsum_dense": _einsum,
          "multi_head_attention": _attention}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("microbatches,weighted,clip", [
    (None, True, 0.3), (4, True, 0.3)])
def test_fast_norms_and_sum_equal_the_per_unit_reference(
    name, microbatches, weighted, clip):
  rng = np.random.default_rng(0)
  model = MODELS[name]()
  x, y = _data(model, rng)
  weights = rng.uniform(0.2, 2.0, len(y)).astype("float32") if weighted else None
  spec = clipping.ClipSpec(clip)
  result = ghost_sum(model, x, y, weights, spec, microbatches)
  assert_same(result, reference(model, x, y, weights, spec, microbatches))
  plan = dp.clipping_plan(model)
  assert plan.fallback is None, plan


@pytest.mark.parametrize("name", ["conv2d", "conv2d_one_channel",
                                  "embedding_layernorm",
                                  "multi_head_attention"])
def test_identical_with_and_without_jit_compile(name):
  rng = np.random.default_rng(1)
  model = MODELS[name]()
  x, y = _data(model, rng)
  spec = clipping.ClipSpec(0.2)
  eager = ghost_sum(model, x, y, None, spec, 2, jit=False)
  assert_same(eager, reference(model, x, y, None, spec, 2))
  assert_same(ghost_sum(model, x, y, None, spec, 2, jit=True), eager)


@pytest.mark.parametrize("name", ["dense", "dense_sequence", "embedding_layernorm",
                                  "conv1d", "einsum_dense"])
def test_scaled_norms_for_scale_then_privatize(name):
  rng = np.random.default_rng(2)
  model = MODELS[name]()
  x, y = _data(model, rng)
  scale = [rng.uniform(0.3, 3.0, v.shape).astype("float32")
           for v in model.trainable_variables]
  spec = clipping.ClipSpec(0.5, scale=scale)
  assert_same(ghost_sum(model, x, y, None, spec, None),
              reference(model, x, y, None, spec, None))


def test_per_layer_clipping_and_automatic_clipping():
  rng = np.random.default_rng(3)
  model = _embedding()
  x, y = _data(model, rng)
  n = len(model.trainable_variables)
  for spec in (clipping.ClipSpec(None, [0.05 * (k + 1) for k in range(n)]),
               clipping.ClipSpec(0.5, automatic_gamma=0.01)):
    assert_same(ghost_sum(model, x, y, None, spec, 2),
                reference(model, x, y, None, spec, 2))


@pytest.mark.parametrize("name,microbatches", [
    ("dense", None), ("dense_sequence", 2), ("embedding_layernorm", None),
    ("conv1d", 4), ("conv1d_one_channel", 4)])
def test_sum_of_squares_for_joint_moment_estimation(name, microbatches):
  rng = np.random.default_rng(14)
  model = MODELS[name]()
  x, y = _data(model, rng)
  spec = clipping.ClipSpec(0.3, square_sum=True)
  result = ghost_sum(model, x, y, None, spec, microbatches)
  assert result.square_grads is not None
  assert_same(result, reference(model, x, y, None, spec, microbatches))


def test_plan_picks_the_cheaper_method_per_layer():
  rng = np.random.default_rng(4)
  model = keras.Sequential([
      keras.Input((28, 28, 1)),
      keras.layers.Conv2D(16, 8, strides=2, padding="same"),   # T=196, pd=1024
      keras.layers.Conv2D(32, 4, strides=2, padding="valid"),  # T=36, pd=8192
      keras.layers.Conv2D(64, 2, strides=2, padding="valid"),  # T=9, pd=8192
      keras.layers.Flatten(), keras.layers.Dense(10)])
  x, y = _data(model, rng, batch=4)
  ghost_sum(model, x, y, None, clipping.ClipSpec(1.0), None)
  methods = [e.method for e in dp.clipping_plan(model).entries]
  assert methods[0].startswith("materialized per unit (T=196: 2T²"), methods
  assert methods[0].endswith("depthwise convolution over the rows (one "
                             "channel)"), methods
  # 2T² < pd, but the per-unit gradients take less memory than 2T(p + d).
  assert methods[1].startswith(
      "materialized per unit (T=36: pd=8192 ≤ 2T(p+d)=20736"), methods
  assert methods[2].startswith("ghost norm (T=9"), methods
  assert methods[3].startswith("ghost norm ‖a‖·‖δ‖"), methods
  assert "materialized" in str(dp.clipping_plan(model))


class Scale(keras.layers.Layer):
  """A layer with weights and no ghost rule: y = x ⊙ w."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=input_shape[-1:], initializer="ones")

  def call(self, inputs):
    return inputs * self.w


def test_layer_without_rule_falls_back_per_layer(caplog):
  rng = np.random.default_rng(5)
  model = keras.Sequential([keras.Input((7,)), Scale(),
                            keras.layers.Dense(4, activation="tanh"),
                            keras.layers.Dense(3)])
  model.layers[0].w.assign(rng.uniform(0.5, 1.5, 7).astype("float32"))
  x, y = _data(model, rng)
  spec = clipping.ClipSpec(0.3)
  with caplog.at_level("WARNING"):
    result = ghost_sum(model, x, y, None, spec, 2)
  assert_same(result, reference(model, x, y, None, spec, 2))
  plan = dp.clipping_plan(model)
  assert [e.kind for e in plan.per_layer_fallbacks] == ["Scale"]
  assert "per-layer vectorized" in str(plan)
  assert "no ghost-norm rule" in caplog.text and "Scale" in caplog.text


class TiedOutput(keras.layers.Layer):
  """Logits from another layer's embedding matrix: tied weights."""

  def __init__(self, embedding, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding

  def call(self, inputs):
    return tf.matmul(inputs, self.embedding.embeddings, transpose_b=True)


def _tied():
  inputs = keras.Input((5,), dtype="int32")
  embedding = keras.layers.Embedding(3, 4)
  h = keras.layers.GlobalAveragePooling1D()(embedding(inputs))
  return keras.Model(inputs, TiedOutput(embedding)(h))


def test_tied_weights_fall_back_to_the_vectorized_path(caplog):
  rng = np.random.default_rng(6)
  model = _tied()
  x = rng.integers(0, 3, (8, 5)).astype("int32")
  y = rng.integers(0, 3, 8).astype("int32")
  spec = clipping.ClipSpec(0.3)
  with caplog.at_level("WARNING"):
    result = ghost_sum(model, x, y, None, spec, None, method="auto")
  assert_same(result, reference(model, x, y, None, spec, None))
  plan = dp.clipping_plan(model)
  assert "tied or shared weights" in plan.fallback
  assert "no ghost clipping" in caplog.text
  with pytest.raises(ValueError, match="clipping='ghost' is not possible"):
    ghost_sum(model, x, y, None, spec, None, method="ghost")


class PositionIds(keras.layers.Layer):
  """Adds embeddings of the positions 0..T-1 (no batch axis): not per example."""

  def __init__(self, length, dim, **kwargs):
    super().__init__(**kwargs)
    self.table = keras.layers.Embedding(length, dim)

  def call(self, inputs):
    return inputs + self.table(tf.range(tf.shape(inputs)[1]))


def test_layer_called_without_the_batch_axis_is_exact():
  # Position ids from a range are the same tensor for every unit; evaluated
  # per unit, their embedding's gradient is still each unit's own.
  rng = np.random.default_rng(15)
  model = keras.Sequential([keras.Input((8, 4)), PositionIds(8, 4),
                            keras.layers.Flatten(), keras.layers.Dense(3)])
  x, y = _data(model, rng, batch=8)
  spec = clipping.ClipSpec(0.2)
  result = ghost_sum(model, x, y, None, spec, None, method="ghost")
  assert dp.clipping_plan(model).fallback is None
  assert_same(result, reference(model, x, y, None, spec, None))


def test_shared_layer_called_twice_sums_both_calls():
  rng = np.random.default_rng(7)
  inputs = keras.Input((6,))
  dense = keras.layers.Dense(6, activation="tanh")
  out = keras.layers.Dense(3)(dense(dense(inputs)))
  model = keras.Model(inputs, out)
  x, y = _data(model, rng)
  spec = clipping.ClipSpec(0.3)
  assert_same(ghost_sum(model, x, y, None, spec, None),
              reference(model, x, y, None, spec, None))


class BatchCentering(keras.layers.Layer):
  """Mixes examples: subtracts the batch mean."""

  def call(self, inputs):
    return inputs - tf.reduce_mean(inputs, axis=0, keepdims=True)


def test_layers_that_mix_examples_are_evaluated_per_unit():
  # Each unit is evaluated alone: the batch mean is the unit's own, so the
  # sum is the per-unit reference's (bounded), never a mixed gradient.
  rng = np.random.default_rng(8)
  model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(5),
                            BatchCentering(), keras.layers.Dense(3)])
  x, y = _data(model, rng)
  spec = clipping.ClipSpec(1.0)
  assert_same(ghost_sum(model, x, y, None, spec, None),
              reference(model, x, y, None, spec, None))


@pytest.mark.parametrize("bad", [0, 3, 7])
def test_nonfinite_unit_adds_exactly_zero(bad):
  rng = np.random.default_rng(9)
  model = _mlp()
  x, y = _data(model, rng)
  x[bad, 2] = np.inf
  spec = clipping.ClipSpec(0.5)
  result = ghost_sum(model, x, y, None, spec, None)
  assert int(result.num_nonfinite) == 1
  assert not bool(result.mismatch)
  keep = np.arange(len(y)) != bad
  expected = reference(model, x[keep], y[keep], None, spec, None)
  for got, want in zip(result.grads, expected.grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_dropout_models_use_ghost_clipping():
  model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(16),
                            keras.layers.Dropout(0.5), keras.layers.Dense(3)])
  x, y = _data(model, np.random.default_rng(10))
  result = ghost_sum(model, x, y, None, clipping.ClipSpec(1.0), None)
  assert not bool(result.mismatch)
  assert dp.clipping_plan(model).fallback is None


def test_core_rules_against_numpy():
  rng = np.random.default_rng(11)
  a = rng.normal(size=(3, 5, 4)).astype("float32")
  d = rng.normal(size=(3, 5, 2)).astype("float32")
  per_unit = np.einsum("utp,utd->upd", a, d)
  want = np.sum(per_unit**2, axis=(1, 2))
  # Both methods: ghost (T=5: 50 > 8 -> materialized) and forced ghost.
  np.testing.assert_allclose(ghost.linear_sq_norms(a, d), want, rtol=1e-5)
  big = np.repeat(a, 10, axis=2)  # p·d = 80 > 2T² = 50: ghost norm
  np.testing.assert_allclose(
      ghost.linear_sq_norms(big, d),
      np.sum(np.einsum("utp,utd->upd", big, d)**2, axis=(1, 2)), rtol=1e-5)
  w = np.array([0.5, 0.0, 2.0], "float32")
  np.testing.assert_allclose(ghost.linear_grad(a, d, w),
                             np.einsum("u,upd->pd", w, per_unit), rtol=1e-5)
  ids = np.array([[1, 1, 4], [2, 0, 2]])
  dd = rng.normal(size=(2, 3, 2)).astype("float32")
  rows = np.zeros((2, 5, 2), "float32")
  for u in range(2):
    for t in range(3):
      rows[u, ids[u, t]] += dd[u, t]
  np.testing.assert_allclose(ghost.embedding_sq_norms(ids, dd, 5),
                             np.sum(rows**2, axis=(1, 2)), rtol=1e-5)
  np.testing.assert_allclose(ghost.embedding_grad(ids, dd, np.ones(2, "float32"), 5),
                             rows.sum(0), rtol=1e-5)


@pytest.mark.slow
def test_training_with_ghost_clipping_equals_vectorized_training():
  rng = np.random.default_rng(12)
  x = rng.integers(1, 20, (64, 6)).astype("int32")
  y = rng.integers(0, 3, 64).astype("int32")
  weights = {}
  for method in ("auto", "vectorized"):
    keras.utils.set_random_seed(3)
    model = dp.make_private(_embedding(), clipping=method)
    model.compile(optimizer=dp.DPAdamBC(0.5, 1.0, learning_rate=1e-2, seed=5),
                  loss=LOSS, jit_compile=True)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    weights[method] = [v.numpy() for v in model.trainable_variables]
  for a, b in zip(weights["auto"], weights["vectorized"]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_clipping_plan_before_training_and_bad_method():
  model = dp.make_private(_mlp())
  model.compile(optimizer=dp.DPAdam(1.0, 1.0), loss=LOSS)
  x, y = _data(model, np.random.default_rng(13))
  plan = dp.clipping_plan(model, x, y)
  assert len(plan.entries) == 2 and plan.fallback is None
  with pytest.raises(ValueError, match="clipping='fast'"):
    dp.make_private(_mlp(), clipping="fast")


@pytest.mark.parametrize("builder", ["einsum", "attention"])
@pytest.mark.parametrize("jit", [False, True])
def test_vectorized_path_is_exact_for_einsum_layers(builder, jit):
  # TensorFlow 2.21's oneDNN broadcasting BatchMatMul gives wrong values (or
  # nan) for a unit-stacked tensor times a kernel; core._pfor_compat makes
  # vectorized_map use a plain MatMul, so EinsumDense and attention are exact.
  model = {"einsum": _einsum, "attention": _attention}[builder]()
  x, y = _data(model, np.random.default_rng(16))
  spec = clipping.ClipSpec(0.05)
  for method in ("vectorized", "ghost"):
    assert_same(ghost_sum(model, x, y, None, spec, None, jit=jit,
                          method=method),
                reference(model, x, y, None, spec, None), rtol=1e-4)


def test_clipping_plan_before_training_traces_the_model():
  model = dp.make_private(_conv1d())
  plan = dp.clipping_plan(model)  # no data, no step yet
  assert plan is not None and plan.fallback is None
  assert [e.kind for e in plan.entries] == ["Conv1D", "Conv1D", "Dense"]
  assert "ghost norm" in str(plan)
  vectorized = dp.make_private(_mlp(), clipping="vectorized")
  assert "was chosen" in dp.clipping_plan(vectorized).fallback


def _lora():
  inputs = keras.Input((5,), dtype="int32")
  embedding = keras.layers.Embedding(20, 8)
  h = embedding(inputs)
  einsum = keras.layers.EinsumDense("abc,cd->abd", (5, 6), bias_axes="d")
  h = einsum(h)
  dense = keras.layers.Dense(4, activation="tanh")
  h = dense(keras.layers.Flatten()(h))
  model = keras.Model(inputs, keras.layers.Dense(3)(h))
  for layer in (embedding, einsum, dense):
    layer.enable_lora(2)
  rng = np.random.default_rng(21)
  for b in (embedding.lora_embeddings_b, einsum.lora_kernel_b,
            dense.lora_kernel_b):  # zero-initialized: make B's role visible
    b.assign(rng.normal(size=b.shape))
  return model


@pytest.mark.parametrize("num_microbatches", [None, 4])
def test_lora_layers_clip_their_factors_exactly(num_microbatches):
  model = _lora()
  names = {v.path.split("/")[-1] for v in model.trainable_variables}
  assert {"lora_kernel_a", "lora_kernel_b", "lora_embeddings_a"} <= names
  assert "embeddings" not in names  # the base weights are frozen
  x, y = _data(model, np.random.default_rng(22))
  spec = clipping.ClipSpec(0.05)
  result = ghost_sum(model, x, y, None, spec, num_microbatches)
  assert_same(result, reference(model, x, y, None, spec, num_microbatches))
  plan = dp.clipping_plan(model)
  assert plan.fallback is None
  # Ghost rules of the factors (no per-unit re-run of the layers).
  assert sum(e.method.startswith("LoRA r=2") for e in plan.entries) == 3
  assert not plan.per_layer_fallbacks, plan


def test_a_backwards_recurrent_layer_is_evaluated_unit_by_unit_exactly():
  # The recurrent ghost rule (the cell unrolled) of LSTM, GRU and SimpleRNN
  # is held to the per-unit reference in test_recurrent.py, with one
  # XLA-compiled fit step of each kind. tf.vectorized_map fails at run time
  # on a recurrent layer's TensorList: a layer without a rule (go_backwards)
  # makes the model evaluate unit by unit (tf.map_fn), exact and slower.
  model = keras.Sequential([keras.Input((6,), dtype="int32"),
                            keras.layers.Embedding(20, 8),
                            keras.layers.LSTM(5, go_backwards=True),
                            keras.layers.Dense(3)])
  x, y = _data(model, np.random.default_rng(23))
  x = np.minimum(x, 19)
  spec = clipping.ClipSpec(0.3)
  with pytest.warns(UserWarning, match="tf.map_fn loop"):
    result = ghost_sum(model, x, y, None, spec, None, method="auto")
  assert_same(result, reference(model, x, y, None, spec, None), rtol=1e-4)
  assert "recurrent" in dp.clipping_plan(model).fallback


def test_a_recurrent_model_running_python_in_its_loop_is_refused():
  # Units evaluated one after another (a recurrent layer without a ghost
  # rule: go_backwards) could pass data through Python state.
  model = keras.Sequential([
      keras.Input((6, 3)), keras.layers.SimpleRNN(4, go_backwards=True),
      keras.layers.Lambda(lambda t: t + tf.ensure_shape(tf.py_function(
          lambda: 0.0, [], tf.float32), [])),
      keras.layers.Dense(3)])
  x = np.random.default_rng(24).normal(size=(8, 6, 3)).astype("float32")
  y = np.zeros(8, "int32")
  # (Refused by the forward pass's check now: Python is state anywhere.)
  with pytest.raises(ValueError, match="Python"):
    ghost_sum(model, x, y, None, clipping.ClipSpec(1.0), None, method="auto")


@pytest.fixture(params=["one pass", "chunks of 4 units"])
def unit_chunking(request, monkeypatch):
  """Runs a test as written and with every per-unit loop of
  ``core.unit_chunks`` forced on static batches of 5 or more units: chunks
  of 4 (the last one filled with copies of the last unit), and one
  float32 table per loop iteration (pooled embedding sums). The forced run
  must take a loop; a test parametrized with static=False skips it (U is
  unknown when traced, no loop runs)."""
  loops = []
  if request.param != "one pass":
    spec = getattr(request.node, "callspec", None)
    if spec is not None and spec.params.get("static") is False:
      pytest.skip("U unknown when traced: no loop")
    monkeypatch.setattr(unit_chunks, "CHUNK_BYTES", 1)
    monkeypatch.setattr(
        unit_chunks, "chunk_size",
        lambda units, bytes_per_unit, shared_bytes=0, budget=None: (
            None if units is None or bytes_per_unit is None or units <= 4
            else 4))
    for name in ("map_chunks", "sum_chunks"):
      original = getattr(unit_chunks, name)
      monkeypatch.setattr(unit_chunks, name,
                          lambda *a, f=original, **k: loops.append(1)
                          or f(*a, **k))
  yield request.param
  # The forced run took a loop (a test that traced none checks nothing new).
  assert request.param == "one pass" or loops


def _embedding_sq_norms_reference(ids, delta, vocab):
  grads = np.zeros((ids.shape[0], vocab, delta.shape[2]))
  for u in range(ids.shape[0]):
    np.add.at(grads[u], ids[u], delta[u].astype(np.float64))
  return np.sum(grads ** 2, axis=(1, 2))


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("padding", [True, False])
@pytest.mark.parametrize("jit", [False, True])
def test_embedding_norms_of_pooled_gradients_by_counting(jit, padding, static,
                                                        unit_chunking):
  """δ rows that are one row per unit (mean pooling; zero rows where padding
  is masked) take the counting shortcut — without padding, after a check
  that all rows are equal; any other δ the sorted row sums. All equal the
  materialized ‖∇E_u‖² (ids repeat: vocabulary 7). A static batch runs the
  shortcut unconditionally (the fallback under a cond), an unknown one
  under conds; in one pass and over chunks of units (``unit_chunking``:
  static batches only, the loops need U)."""
  del unit_chunking
  rng = np.random.default_rng(3)
  units, length, vocab, dim = 5, 12, 7, 3
  ids = rng.integers(0, vocab, (units, length))
  pooled = np.repeat(rng.normal(size=(units, 1, dim)), length, 1)
  if padding:
    pooled[:, 8:] = 0.0  # masked padding
  pooled[1] = 0.0      # a unit with no gradient at all
  general = pooled.copy()
  general[2, 3, 0] *= 1 + 2 ** -20  # one row differs: the sorted path
  # ... in another feature than the first: the first column passes the
  # cheap pre-check, the full comparison sends it to the sorted path.
  later = pooled.copy()
  later[2, 3, 2] *= 1 + 2 ** -20
  signed_zero = pooled.copy()
  signed_zero[3, 9:] = -0.0  # padding rows of -0.0 are zero rows
  partial = pooled.copy()
  partial[4, 5, 1] = 0.0  # a non-zero row with one feature zeroed
  negated = pooled.copy()
  negated[0, 2] *= -1.0  # same magnitudes, another row
  # Non-finite values in an otherwise zero row, or in a row of g_u: the
  # sorted path (norm NaN/inf, the unit is dropped), never the shortcut.
  nan_row, inf_row, nan_in_row = pooled.copy(), pooled.copy(), pooled.copy()
  nan_row[2, 10, 1] = np.nan
  inf_row[3, 10, 2] = np.inf
  nan_in_row[4, 0, 2] = np.nan
  # A feature that is NaN or inf in every row: rows still "equal".
  all_nan, all_inf = pooled.copy(), pooled.copy()
  all_nan[2, :, 0] = np.nan
  all_inf[3, :, 2] = -np.inf
  # Equal finite rows whose sum over T overflows float32: the finiteness
  # check fails and the general path gives the same norms.
  huge = pooled.copy()
  huge[2] = np.sign(huge[2]) * 3e38
  signature = None if static else [
      tf.TensorSpec([None, None], tf.int64),
      tf.TensorSpec([None, None, dim], tf.float32)]
  norms = tf.function(
      lambda i, d: ghost.embedding_sq_norms(i, d, vocab), jit_compile=jit,
      input_signature=signature)
  for delta in (pooled, general, later, signed_zero, partial, negated,
                nan_row, inf_row, nan_in_row, all_nan, all_inf, huge):
    np.testing.assert_allclose(
        norms(tf.constant(ids), tf.constant(delta, tf.float32)).numpy(),
        _embedding_sq_norms_reference(ids, delta.astype(np.float32), vocab),
        rtol=1e-6)
  # No positions at all (a zero-length input): norm 0, on every path.
  np.testing.assert_array_equal(
      norms(tf.zeros([units, 0], tf.int64), tf.zeros([units, 0, dim])).numpy(),
      np.zeros(units))
  # The shortcut counts equal ids: with all ids distinct the norm is smaller.
  distinct = np.tile(np.arange(length), (units, 1)) % vocab
  assert not np.allclose(
      _embedding_sq_norms_reference(ids, pooled, vocab),
      _embedding_sq_norms_reference(distinct, pooled, vocab))


@pytest.mark.parametrize("vocab", [7, 5000])
def test_embedding_norms_count_wherever_the_counters_fit(vocab, monkeypatch):
  """A static batch whose U·vocab counters fit takes the counting shortcut
  (unconditionally where vocab ≤ 4·T·d, under a cond otherwise), never the
  sorted path alone: a large vocabulary once lost the shortcut."""
  calls = []
  pooled_sq_norms = ghost._pooled_sq_norms  # pylint: disable=protected-access
  monkeypatch.setattr(ghost, "_pooled_sq_norms",
                      lambda *a: calls.append(1) or pooled_sq_norms(*a))
  rng = np.random.default_rng(5)
  ids = rng.integers(0, vocab, (4, 6))
  delta = np.repeat(rng.normal(size=(4, 1, 3)), 6, 1).astype(np.float32)
  norms = tf.function(lambda i, d: ghost.embedding_sq_norms(i, d, vocab),
                      jit_compile=True)(tf.constant(ids), tf.constant(delta))
  assert calls
  np.testing.assert_allclose(
      norms.numpy(), _embedding_sq_norms_reference(ids, delta, vocab),
      rtol=1e-6)


@pytest.mark.parametrize("length", [256, 257])
@pytest.mark.parametrize("rows", ["pooled", "pooled, padded", "distinct"])
def test_embedding_counters_at_the_edge_of_their_dtype(length, rows):
  """The U·vocab counters are the narrowest integers that hold the
  positions 0..T − 1 (uint8 up to T = 256, then int16): they hold first
  positions, and the counts (n = 256 for a unit of one token repeated
  T = 256 times, past uint8) are int32. Pooled rows (the counting
  shortcut), pooled rows with padding at position 0 (the masked-rows
  check), and distinct rows (first positions), against the materialized
  norms."""
  assert ghost._counter_dtype(length, -1) == (  # pylint: disable=protected-access
      tf.uint8 if length == 256 else tf.int16)
  rng = np.random.default_rng(23)
  units, vocab, dim = 4, 7, 2
  ids = rng.integers(0, vocab, (units, length))
  ids[0] = 3  # one token, T times
  ids[1, 1:] = ids[1, 0]  # the same, through position 0's own count
  ids[2, ::2] = 5
  if rows == "distinct":
    delta = rng.normal(size=(units, length, dim))
  else:
    delta = np.repeat(rng.normal(size=(units, 1, dim)), length, 1)
  if rows == "pooled, padded":
    delta[:, 0] = 0.0  # position 0 is padding: not counted
    delta[2, 5:9] = 0.0
  delta = delta.astype(np.float32)
  want = _embedding_sq_norms_reference(ids, delta, vocab)
  for jit in (False, True):
    got = tf.function(lambda i, d: ghost.embedding_sq_norms(i, d, vocab),
                      jit_compile=jit)(tf.constant(ids), tf.constant(delta))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    if rows != "distinct":  # the counts themselves: a wrapped count of
      # one repeated token would hide behind guarded's bound, which is
      # exact for such a unit
      nonzero = np.any(delta != 0, axis=2)
      g = delta[np.arange(units), np.argmax(nonzero, axis=1)]
      counted, _ = tf.function(
          lambda i, g, n: ghost._pooled_sq_norms(i, g, n, vocab),  # pylint: disable=protected-access
          jit_compile=jit)(tf.constant(ids), tf.constant(g),
                           tf.constant(nonzero))
      np.testing.assert_allclose(counted.numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("counters", ["fit", "do not fit"])
@pytest.mark.parametrize("static", [True, False])
def test_embedding_row_sums_by_first_position_and_by_sort(counters, static,
                                                          monkeypatch,
                                                          unit_chunking):
  """The per-unit row sums (first position of each id where the U·vocab
  counters fit, a sort otherwise; the batch size static or not) give the
  materialized norms, Σ_u w_u ∇E_u (float64) and Σ_u w_u² ∇E_u⊙∇E_u; ids
  repeat and some are out of range (clamped, as the lookup does under
  XLA). In one pass and over chunks of units (``unit_chunking``: 4 + 2
  units, and 4 + 1 with the last unit's copies in the second chunk): a
  zero-weight unit whose rows are NaN adds nothing either way."""
  del unit_chunking
  if counters == "do not fit":
    monkeypatch.setattr(ghost, "_MAX_COUNTERS", 8)
  rng = np.random.default_rng(11)
  units, length, vocab, dim = 6, 9, 5, 4
  for units in (6, 5):
    ids = rng.integers(0, vocab, (units, length))
    ids[1, 2], ids[2, 0] = vocab + 3, -1
    delta = rng.normal(size=(units, length, dim)).astype(np.float32)
    weights = np.array([1.0, 0.5, 0.0, 2.0, 1.0, 0.25][:units], np.float32)
    clamped = np.clip(ids, 0, vocab - 1)
    grads = np.zeros((units, vocab, dim))
    for u in range(units):
      np.add.at(grads[u], clamped[u], delta[u].astype(np.float64))
    spec = [tf.TensorSpec([None if not static else units, length], tf.int64),
            tf.TensorSpec([None if not static else units, length, dim],
                          tf.float32),
            tf.TensorSpec([None if not static else units], tf.float32)]
    nan_unit = delta.copy()
    nan_unit[2, 1, 0] = np.nan  # weight 0: adds exactly nothing
    for jit in (False, True):
      fn = tf.function(lambda i, d, w: (
          ghost.embedding_sq_norms(i, d, vocab),
          ghost.embedding_square_sum(i, d, w, vocab),
          ghost.embedding_grad(i, d, w, vocab)),
                       input_signature=spec, jit_compile=jit)
      norms, squares, sums = fn(tf.constant(ids), tf.constant(delta),
                                tf.constant(weights))
      np.testing.assert_allclose(norms.numpy(), np.sum(grads ** 2, (1, 2)),
                                 rtol=1e-6)
      np.testing.assert_allclose(
          squares.numpy(), np.einsum("u,uvd->vd", weights ** 2, grads ** 2),
          rtol=1e-5, atol=1e-7)
      np.testing.assert_allclose(
          sums.numpy(), np.einsum("u,uvd->vd", weights, grads), rtol=1e-12,
          atol=1e-12)
      dropped = fn(tf.constant(ids), tf.constant(nan_unit),
                   tf.constant(weights))[2].numpy()
      np.testing.assert_array_equal(dropped, sums.numpy())


@pytest.mark.parametrize("kernel,strides,padding,dilation", [
    ((3, 3), (1, 1), "valid", (1, 1)),
    ((3, 2), (2, 1), "same", (1, 1)),
    ((2, 2), (1, 1), "same", (2, 2)),
    ((3,), (1,), "causal", (2,)),
    ((4,), (2,), "valid", (1,)),
])
def test_conv_grad_by_patches_equals_the_filter_backprop(kernel, strides,
                                                         padding, dilation):
  """The book-kept convolution sum (patches products, reusing per-unit
  gradients where the norms materialize them) equals TensorFlow's filter
  gradient of the batch with output gradient w ⊙ δ; a zero-weight unit with
  non-finite values adds nothing."""
  rng = np.random.default_rng(5)
  spatial = (9, 8)[:len(kernel)]
  x = rng.normal(size=(4, *spatial, 3)).astype("float32")
  kernel_shape = (*kernel, 3, 5)
  probe = tf.nn.convolution(
      ghost._causal(tf.constant(x), kernel, padding, dilation)[0],
      tf.zeros(kernel_shape), strides=list(strides),
      padding=("VALID" if padding == "causal" else padding.upper()),
      dilations=list(dilation))
  delta = rng.normal(size=probe.shape).astype("float32")
  weights = np.array([0.5, 0.0, 1.0, 0.25], "float32")
  x[1, 0] = np.nan  # weight 0: must add exactly 0
  args = (tf.constant(x), tf.constant(delta), tf.constant(weights),
          kernel_shape, strides, padding, dilation)
  x_ref = x.copy()
  x_ref[1] = 0.0
  expected = ghost._conv_grad_by_backprop(tf.constant(x_ref), *args[1:])
  for jit in (False, True):
    got = tf.function(ghost.conv_grad, jit_compile=jit)(*args)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_finite_scaled_down_flags_rows_not_finite_whatever_max_does_with_nan(
    jit):
  """One reduction flags a row with NaN or ±inf anywhere (XLA's CPU maximum
  ignores NaN: the row's NaN is counted as +inf before it), scales rows
  above 2⁶⁴ by 2⁻⁶⁴ and zeroes the non-finite values; a row of no values
  is not flagged."""
  rows = np.array([[1.0, np.nan, 2.0], [np.inf, 2.0, 1.0],
                   [1.0, 2.0, -np.inf], [3e38, 1.0, -2.0], [1.0, -2.0, 0.5]],
                  np.float32)
  fn = tf.function(lambda t: ghost._finite_scaled_down(  # pylint: disable=protected-access
      t, lambda u: u), jit_compile=jit)
  out, exponent, bad = fn(tf.constant(rows))
  np.testing.assert_array_equal(bad.numpy(), [True, True, True, False, False])
  np.testing.assert_array_equal(exponent.numpy()[3:], [64, 0])
  assert np.isfinite(out.numpy()).all()
  np.testing.assert_array_equal(out.numpy()[4], rows[4])
  np.testing.assert_allclose(out.numpy()[3], rows[3] * 2.0 ** -64)
  empty = tf.function(lambda t: ghost._finite_scaled_down(  # pylint: disable=protected-access
      t, lambda u: tf.reshape(u, [3, -1])), jit_compile=jit)
  _, exponent, bad = empty(tf.zeros([3, 0, 4, 1]))
  assert not bad.numpy().any() and not exponent.numpy().any()


@pytest.mark.parametrize("jit", [False, True])
def test_single_channel_conv_unit_grads_are_each_rows_own(jit):
  """single_channel_conv_unit_grads (a depthwise convolution over the rows)
  equals the per-row product of the patches and δ, for 2-D and 1-D
  convolutions, strides, SAME/VALID/causal padding and rectangular
  kernels, rows of magnitude 1e30 included (scaled by powers of two and
  back); a row with NaN or inf in its input or its δ gets a NaN ĝ, and the
  other rows' ĝ are bitwise what they are without it, as with a row of
  3e38; no rows give no gradients."""
  rng = np.random.default_rng(21)
  configs = [((28, 28), (8, 8), (2, 2), "same"), ((9, 8), (3, 2), (2, 1),
                                                 "same"),
             ((9, 8), (4, 3), (1, 2), "valid"), ((11,), (3,), (1,), "causal"),
             ((12,), (4,), (2,), "same"), ((10,), (5,), (3,), "valid")]
  for spatial, kernel, strides, padding in configs:
    x = rng.normal(size=(5, *spatial, 1)).astype("float32")
    x[3] *= 1e30
    kernel_shape = (*kernel, 1, 3)
    causal = ghost._causal(tf.constant(x), kernel, padding, (1,))[0]  # pylint: disable=protected-access
    z = tf.nn.convolution(causal, tf.zeros(kernel_shape), strides=list(strides),
                          padding=("VALID" if padding == "causal"
                                   else padding.upper()))
    delta = rng.normal(size=z.shape).astype("float32")
    delta[4] *= 1e6
    fn = tf.function(lambda a, b: ghost.single_channel_conv_unit_grads(
        a, b, kernel, strides, padding), jit_compile=jit)
    assert ghost.single_channel_conv_applies(tf.TensorShape(x.shape),
                                             kernel_shape, (1,) * len(kernel))
    got = fn(tf.constant(x), tf.constant(delta)).numpy()
    patches = ghost.conv_patches(tf.constant(x), kernel, strides, padding,
                                 (1,) * len(kernel))
    want = ghost.shared_unit_grads(
        patches, tf.reshape(delta, [5, -1, 3])).numpy()
    assert got.shape == want.shape == (5, np.prod(kernel), 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for where, value in ((x, np.nan), (x, np.inf), (delta, -np.inf),
                         (x, 3e38)):
      original = where[2].copy()
      where[2].flat[1] = value
      poisoned = fn(tf.constant(x), tf.constant(delta)).numpy()
      where[2] = original
      if np.isfinite(value):
        assert np.all(np.isfinite(poisoned[2]) | np.isinf(poisoned[2]))
      else:
        assert np.all(np.isnan(poisoned[2]))
      np.testing.assert_array_equal(np.delete(poisoned, 2, 0),
                                    np.delete(got, 2, 0))
    empty = fn(tf.zeros([0, *x.shape[1:]]), tf.zeros([0, *delta.shape[1:]]))
    assert empty.shape == (0, np.prod(kernel), 3)
  # Not taken: several channels (also in groups of one), a dilation, an
  # unknown spatial size.
  assert not ghost.single_channel_conv_applies(
      tf.TensorShape([4, 9, 9, 3]), (3, 3, 3, 8), (1, 1))
  assert not ghost.single_channel_conv_applies(
      tf.TensorShape([4, 9, 9, 4]), (3, 3, 1, 8), (1, 1))
  assert not ghost.single_channel_conv_applies(
      tf.TensorShape([4, 9, 9, 1]), (3, 3, 1, 8), (2, 2))
  assert not ghost.single_channel_conv_applies(
      tf.TensorShape([4, None, 9, 1]), (3, 3, 1, 8), (1, 1))


@pytest.mark.parametrize("jit", [False, True])
def test_conv_patches_by_slices_equal_extract_patches_bitwise(jit):
  """The patches the conv rules use (strided slices; rows then columns for
  few channels) are tf.image.extract_patches' values in its order."""
  rng = np.random.default_rng(8)
  configs = [((28, 28, 1), (8, 8), (2, 2), (1, 1), "same"),
             ((13, 13, 16), (4, 4), (2, 2), (1, 1), "valid"),
             ((15, 15, 32), (3, 3), (1, 1), (1, 1), "same"),
             ((9, 8, 3), (3, 2), (2, 1), (1, 1), "same"),
             ((9, 8, 3), (2, 2), (1, 1), (2, 2), "same"),
             ((9, 8, 20), (3, 3), (1, 1), (2, 1), "valid"),
             ((1, 7, 2), (1, 3), (1, 2), (1, 1), "same"),
             ((4, 4, 2), (5, 5), (1, 1), (1, 1), "same"),
             ((4, 4, 2), (3, 3), (3, 3), (1, 1), "same")]
  for shape, kernel, strides, dilation, padding in configs:
    x = tf.constant(rng.normal(size=(3, *shape)).astype("float32"))
    want = tf.image.extract_patches(
        x, [1, *kernel, 1], [1, *strides, 1], [1, *dilation, 1],
        padding.upper()).numpy()
    got = tf.function(lambda t: ghost._patches_by_slices(  # pylint: disable=protected-access
        t, kernel, strides, padding, dilation), jit_compile=jit)(x).numpy()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("max_units", [1771, 77])
def test_chunked_float32_sum_within_its_rounding_bound(jit, max_units):
  """chunked_linear_grad (float32 chunks of K units, chunks summed in
  float64) differs from the exact Σ_u w_u a_u δ_uᵀ by at most
  γ_K·Σ_u |w_u a_u δ_uᵀ| elementwise (core.ghost.float32_rounding of the
  K float32_chunk picks), on values spanning 30 binades whose units cancel
  each other; one chunk of all 77 units (L = 1771), or 3 chunks of 26, U
  not a multiple of K (L = 77); a zero-weight unit with NaN adds exactly
  0."""
  rng = np.random.default_rng(17)
  units, p, d = 77, 33, 9
  a = rng.normal(size=(units, 1, p)) * 2.0 ** rng.integers(-15, 15, (units, 1, p))
  delta = rng.normal(size=(units, 1, d)) * 2.0 ** rng.integers(-15, 15, (units, 1, d))
  a[1::2] = a[0::2][:units // 2]  # pairs of units that cancel exactly
  delta[1::2] = -delta[0::2][:units // 2]
  a, delta = a.astype(np.float32), delta.astype(np.float32)
  weights = rng.uniform(0.1, 1.0, units).astype(np.float32)
  weights[1::2] = weights[0::2][:units // 2]
  weights[5], a[5, 0, 0] = 0.0, np.nan
  chunk = ghost.float32_chunk(units, max_units)
  assert chunk == {1771: 77, 77: 26}[max_units]
  got = tf.function(lambda *t: ghost.chunked_linear_grad(*t, max_units),
                    jit_compile=jit)(
      tf.constant(a), tf.constant(delta), tf.constant(weights)).numpy()
  w, a64, d64 = (weights.astype(np.float64), a[:, 0].astype(np.float64),
                 delta[:, 0].astype(np.float64))
  w[5], a64[5] = 0.0, 0.0
  terms = np.einsum("u,up,ud->upd", w, a64, d64)
  exact = terms.sum(0)
  bound = ghost.float32_rounding(chunk) * np.abs(terms).sum(0)
  assert np.all(np.abs(got - exact) <= bound)
  # It is a float32 sum: not the float64 one (the bound is not vacuous).
  assert np.any(got != exact.astype(np.float32)) or np.all(bound == 0)


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 3e38])
@pytest.mark.parametrize("max_units", [1771, 77])
def test_chunked_sum_drops_zero_weight_units_whatever_their_inputs(
    max_units, bad, static):
  """chunked_linear_grad masks only w⊙δ, not a: a zero-weight unit whose a
  holds NaN, ±inf or a huge value still adds exactly 0 — a non-finite sum
  is recomputed with a masked (in chunks, in a loop), which stays within
  the rounding bound of the exact sum of the other units. With finite a,
  zeroing the dropped units' a first changes nothing, bit for bit: their
  rows add ±0. One chunk (L = 1771) or three (L = 77), U static or not
  (then chunks of FLOAT32_CHUNK, padded), eagerly and under XLA."""
  rng = np.random.default_rng(29)
  units, p, d = 77, 33, 9
  a = rng.normal(size=(units, 1, p)).astype(np.float32)
  delta = rng.normal(size=(units, 1, d)).astype(np.float32)
  weights = rng.uniform(0.1, 1.0, units).astype(np.float32)
  dropped = [0, 40, 76]  # first, middle and last (padded) chunk
  weights[dropped] = 0.0
  delta[40, 0, 3] = np.nan  # a dropped δ too
  bad_a = a.copy()
  bad_a[dropped, 0, 5] = bad
  clean_a = a.copy()
  clean_a[dropped] = 0.0
  spec = [tf.TensorSpec([units if static else None, 1, p], tf.float32),
          tf.TensorSpec([units if static else None, 1, d], tf.float32),
          tf.TensorSpec([units if static else None], tf.float32)]
  w64 = weights.astype(np.float64)
  terms = np.einsum("u,up,ud->upd", w64, clean_a[:, 0].astype(np.float64),
                    np.nan_to_num(delta[:, 0]).astype(np.float64))
  for jit in (False, True):
    fn = tf.function(lambda *t: ghost.chunked_linear_grad(*t, max_units),
                     input_signature=spec, jit_compile=jit)
    got = fn(bad_a, delta, weights).numpy()
    clean = fn(clean_a, delta, weights).numpy()
    assert np.all(np.isfinite(got)), (jit, bad)
    chunk = ghost.float32_chunk(units if static else None, max_units)
    bound = ghost.float32_rounding(chunk) * np.abs(terms).sum(0)
    assert np.all(np.abs(got - terms.sum(0)) <= bound)
    if np.isfinite(bad):
      np.testing.assert_array_equal(got, clean)


@pytest.mark.parametrize("jit", [False, True])
def test_chunked_sum_recomputes_what_overflows_float32(jit):
  """A clip factor past float32's range (automatic clipping's C/γ for a
  unit whose gradient is 0: 5e39 here) or a w_u·δ_u past it (also with an
  ordinary factor, for an example of zero inputs and a huge output
  gradient) would turn the float32 product into inf or NaN: w⊙δ is formed
  in float64 and saturated to float32's range, and the sum matches the
  float64 reference, instead of a NaN release decided by one unit."""
  rng = np.random.default_rng(31)
  units, p, d = 40, 32, 8
  a = rng.normal(size=(units, 1, p)).astype(np.float32)
  delta = rng.normal(size=(units, 1, d)).astype(np.float32)
  weights = rng.uniform(0.1, 1.0, units)
  weights[3], delta[3] = 5e39, 0.0  # a zero gradient, factor C/γ
  weights[7], a[7], delta[7] = 5e39, 1e-30, 1e-9  # w·δ overflows float32
  # An input of zeros and a huge output gradient (automatic clipping's
  # factor C/(0 + γ) = 1e4): w·δ = 1e42 overflows, 0·inf would be NaN.
  weights[9], a[9], delta[9] = 1e4, 0.0, 1e38
  fn = tf.function(lambda *t: ghost.chunked_linear_grad(*t, 1771),
                   jit_compile=jit)
  got = fn(tf.constant(a), tf.constant(delta),
           tf.constant(weights, tf.float64)).numpy()
  want = np.einsum("u,up,ud->pd", weights, a[:, 0].astype(np.float64),
                   delta[:, 0].astype(np.float64))
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_automatic_clipping_with_a_tiny_gamma_stays_finite():
  """End to end: automatic clipping with γ = 2e-38 (below float32's normal
  range; the optimizers refuse γ < 1e-20, private_gradient_sum takes any
  ClipSpec) and one example of sample weight 0, whose factor C/γ = 5e39:
  the Dense kernel's book-kept sum is finite and equals the sum of the
  per-example gradients clipped at C' (the float32 sums' shrunk C)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 256)).astype(np.float32)
  y = rng.normal(size=(8, 128)).astype(np.float32)
  sw = np.ones(8, np.float32)
  sw[0] = 0.0
  keras.utils.set_random_seed(1)
  model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(128)])
  model.compile(loss="mse")
  spec = clipping.ClipSpec(100.0, automatic_gamma=2e-38)
  result = tf.function(lambda: training.private_gradient_sum(
      model, x, y, sw, spec, None, "ghost"), jit_compile=True)()[0]
  kernel = np.asarray(result.grads[0])
  assert np.all(np.isfinite(kernel))
  per_unit = training.per_unit_gradients(model, x, y, sw)[0]
  norms = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64)),
                             axis=tuple(range(1, np.ndim(g))))
                      for g in per_unit))
  shrink = float(ghost.float32_clip_shrink(ghost.float32_max_units(
      256, 128, tf.float32)))  # the float32 sums clip at C' = C/shrink
  factors = 100.0 / shrink / (norms + 2e-38)
  want = np.einsum("u,upd->pd", factors[1:],
                   np.asarray(per_unit[0], np.float64)[1:])
  np.testing.assert_allclose(kernel, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_units", [1, 2, 37, 1771, 5000])
def test_float32_chunks_stay_within_the_shrinks_rounding(max_units):
  """For every batch of U ≤ L units the chunk K = float32_chunk(U, L)
  rounds by at most what the clip shrink 1 + 2γL pays for (γ_K·U ≤ γL,
  γ of FLOAT32_CHUNK), makes no more partial sums than chunks of
  FLOAT32_CHUNK would (the memory bound of float32_max_units), and pads
  fewer than one unit per chunk; unknown U gets FLOAT32_CHUNK."""
  budget = ghost.float32_rounding() * max_units
  for units in range(1, max_units + 1):
    chunk = ghost.float32_chunk(units, max_units)
    count = -(-units // chunk)
    assert ghost.float32_rounding(chunk) * units <= budget, units
    assert count <= -(-units // ghost.FLOAT32_CHUNK), units
    assert count * chunk - units < count, units
  assert ghost.float32_chunk(256, 1771) == 128  # two chunks, not 8 of 32
  # The library's own L for the MLP's kernel: one chunk for a batch of 256.
  limit = ghost.float32_max_units(784, 128, tf.float32)
  assert limit == 2040 and ghost.float32_chunk(256, limit) == 256
  assert ghost.float32_chunk(272, limit) == 272
  assert ghost.float32_chunk(273, limit) < 273
  assert float(ghost.float32_clip_shrink(limit)) <= 1 + ghost.FLOAT32_MAX_SHRINK
  for units in (None, 0, max_units + 1):  # unknown, empty, float64 sum
    assert ghost.float32_chunk(units, max_units) == ghost.FLOAT32_CHUNK


@pytest.mark.parametrize("units,max_units,chunks", [
    (256, 1771, 2), (1024, 1771, 18), (77, 77, 3), (40, 40, 2), (0, 40, 0)])
def test_chunked_sum_takes_the_chunks_of_its_unit_limit(units, max_units,
                                                        chunks):
  """chunked_linear_grad's float32 partial sums are the ⌈U/K⌉ chunks of
  float32_chunk(U, L) for the L it is given (the rounding test cannot tell
  K from its result)."""
  spec = [tf.TensorSpec([units, 1, 8], tf.float32),
          tf.TensorSpec([units, 1, 3], tf.float32),
          tf.TensorSpec([units], tf.float32)]
  graph = tf.function(lambda *t: ghost.chunked_linear_grad(
      *t, max_units)).get_concrete_function(*spec).graph
  shapes = [op.outputs[0].shape.as_list() for op in graph.get_operations()
            if op.type == "Einsum"]
  assert shapes == [[chunks, 8, 3]]


def _wide_mlp():  # a 256 x 128 kernel: the chunked float32 sum
  return keras.Sequential([keras.Input((256,)),
                           keras.layers.Dense(128, activation="tanh"),
                           keras.layers.Dense(3)])


def _wide_limit():
  """L, the most units the 256 x 128 kernel's float32 sum takes."""
  return ghost.float32_max_units(256, 128, tf.float32)


@pytest.mark.parametrize("case", ["float32", "too many units", "stp"])
def test_float32_sums_clip_at_the_shrunk_norm(case, monkeypatch):
  """Where a model has a T = 1 layer whose sum may be book-kept in float32
  chunks, every unit is clipped at C/(1 + 2γL) (float32_clip_shrink of the
  layer's unit limit L, not of the batch's U), which pays for the rounding:
  the sum equals the per-example reference clipped there, and the clipped
  norms are below it. Above the limit the float64 sums clip at the same
  C/(1 + 2γL); with a scale-then-privatize preconditioner at C."""
  if case == "too many units":
    monkeypatch.setattr(ghost, "FLOAT32_MAX_SHRINK", 2.0 ** -13)
  model = _wide_mlp()
  rng = np.random.default_rng(19)
  units, clip = 40, 0.05
  x = rng.normal(size=(units, 256)).astype(np.float32)
  y = rng.integers(0, 3, units)
  scale = None
  if case == "stp":
    scale = [tf.constant(rng.uniform(0.5, 2.0, v.shape), tf.float32)
             for v in model.trainable_variables]
  limit = _wide_limit()
  assert (limit < units) == (case == "too many units") and limit > 0
  shrink = 1.0 if case == "stp" else float(ghost.float32_clip_shrink(limit))
  assert shrink > 1.0 + 1e-4 or case == "stp"
  result = ghost_sum(model, x, y, None, clipping.ClipSpec(clip, scale=scale),
                     None)
  expected = reference(model, x, y, None,
                       clipping.ClipSpec(clip / shrink, scale=scale), None)
  assert int(expected.num_clipped) == units  # every unit clipped
  assert_same(result, expected)
  # Against the unshrunk clip every entry differs by 1 + 2γL (by 1 with
  # STP): finer than assert_same's tolerance.
  unshrunk = reference(model, x, y, None, clipping.ClipSpec(clip, scale=scale),
                       None)
  for got, want in zip(result.grads, unshrunk.grads):
    ratio = np.asarray(want) / np.asarray(got)
    np.testing.assert_allclose(np.median(ratio), shrink, rtol=2e-6)


def test_float32_shrink_is_the_same_for_neighbouring_batch_sizes(monkeypatch):
  """Regression: the shrink was 1 + 2γU of the batch's own U, and 1 above
  the limit L, so neighbouring batches (U = L in float32, U = L + 1 in
  float64) clipped their common units at different norms, and their sums
  differed by up to ≈ L·C·2γL, not C. Batches of L − 1, L and L + 1 units
  now all clip at C/(1 + 2γL), and adding a unit moves the sum by at most
  C."""
  monkeypatch.setattr(ghost, "FLOAT32_MAX_SHRINK", 2.0 ** -14)
  limit = _wide_limit()
  assert 2 < limit < 30
  model = _wide_mlp()
  rng = np.random.default_rng(23)
  clip = 0.05
  x = np.repeat(rng.normal(size=(1, 256)), limit + 1, 0).astype(np.float32)
  y = np.zeros(limit + 1, np.int64)  # all units alike: their shares add up
  shrink = float(ghost.float32_clip_shrink(limit))
  sums = {}
  for units in (limit - 1, limit, limit + 1):
    result = ghost_sum(model, x[:units], y[:units], None,
                       clipping.ClipSpec(clip), None)
    expected = reference(model, x[:units], y[:units], None,
                         clipping.ClipSpec(clip / shrink), None)
    assert_same(result, expected)
    sums[units] = np.concatenate([np.ravel(np.asarray(g, np.float64))
                                  for g in result.grads])
  for units in (limit, limit + 1):
    step = np.linalg.norm(sums[units] - sums[units - 1])
    assert step <= clip, (units, step / clip)


def _count_at_first(ids, nonzero):
  """NumPy n [U, T]: n_uv at the first counted position of each id in its
  unit, 0 elsewhere."""
  counts = np.zeros(ids.shape, np.int64)
  for u in range(ids.shape[0]):
    first = {}
    for t in range(ids.shape[1]):
      if nonzero[u, t]:
        first.setdefault(ids[u, t], t)
        counts[u, first[ids[u, t]]] += 1
  return counts


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("max_units", [1771, 77])
def test_pooled_embedding_float32_sum_within_its_rounding_bound(
    jit, max_units, unit_chunking):
  """pooled_embedding_grad (one float32 term n_uv·w_u·g_u per unit and id,
  chunks of K units summed in float64) differs from the exact
  Σ_u w_u n_uv g_u by at most γ_K·Σ_u |w_u n_uv g_u| elementwise, K the
  float32_chunk it picks: one chunk of 77 units (L = 1771) or 3 of 26
  (L = 77), on rows spanning 30 binades whose units cancel each other, one
  token in every unit (K terms in its entries), ids repeated in a unit and
  out of range (clamped). The counts at first positions match a count in
  NumPy, with and without padding positions; a zero-weight unit adds 0.
  In one pass and over chunks of units (``unit_chunking``: the counts 4
  units at a time; the sum one table per loop iteration, 26 + 26 + 25
  units at L = 77)."""
  del unit_chunking
  rng = np.random.default_rng(29)
  units, length, vocab, dim = 77, 9, 13, 5
  ids = rng.integers(0, vocab, (units, length))
  ids[:, 4] = 7  # in every unit
  ids[3, :6] = 2  # repeated
  ids[5, 1], ids[6, 2] = vocab + 4, -3  # out of range: clamped
  rows = rng.normal(size=(units, dim)) * 2.0 ** rng.integers(-15, 15,
                                                            (units, dim))
  rows[1::2] = -rows[0::2][:units // 2]  # pairs of units that cancel
  ids[1::2] = ids[0::2][:units // 2]
  rows = rows.astype(np.float32)
  weights = rng.uniform(0.1, 1.0, units)
  weights[1::2] = weights[0::2][:units // 2]
  weights[8] = 0.0
  clamped = np.clip(ids, 0, vocab - 1)
  every = np.ones(ids.shape, bool)
  counts = tf.function(lambda i: ghost._first_counts(i, None, vocab),  # pylint: disable=protected-access
                       jit_compile=jit)(tf.constant(ids)).numpy()
  np.testing.assert_array_equal(counts, _count_at_first(clamped, every))
  padded = rng.uniform(size=ids.shape) < 0.3
  masked_counts = tf.function(
      lambda i, n: ghost._first_counts(i, n, vocab),  # pylint: disable=protected-access
      jit_compile=jit)(tf.constant(ids), tf.constant(~padded)).numpy()
  np.testing.assert_array_equal(masked_counts,
                                _count_at_first(clamped, ~padded))
  chunk = ghost.float32_chunk(units, max_units)
  assert chunk == {1771: 77, 77: 26}[max_units]
  got = tf.function(
      lambda i, g, n, w: ghost.pooled_embedding_grad(i, g, n, w, vocab,
                                                     max_units),
      jit_compile=jit)(tf.constant(ids), tf.constant(rows),
                       tf.constant(counts.astype(np.int32)),
                       tf.constant(weights)).numpy()
  terms = np.zeros((units, vocab, dim))
  for u in range(units):
    np.add.at(terms[u], clamped[u], weights[u] * rows[u].astype(np.float64))
  exact = terms.sum(0)
  bound = ghost.float32_rounding(chunk) * np.abs(terms).sum(0)
  assert np.all(np.abs(got - exact) <= bound)
  assert np.any(got != exact.astype(np.float32))  # a float32 sum


def test_pooled_embedding_float32_terms_saturate():
  """A term past float32's range (a factor C/γ of automatic clipping on a
  huge row) is held at the largest float32, never inf: inf − inf in the
  table would be NaN in every step's release."""
  ids = tf.constant([[1, 1], [1, 2]])
  rows = tf.constant([[3e38, 1.0], [-3e38, 1.0]], tf.float32)
  counts = tf.constant([[2, 0], [1, 1]], tf.int32)
  weights = tf.constant([10.0, 10.0], tf.float64)
  for jit in (False, True):
    got = tf.function(lambda: ghost.pooled_embedding_grad(
        ids, rows, counts, weights, 4, 100), jit_compile=jit)().numpy()
    assert np.all(np.isfinite(got))
    assert got[1, 0] == 0.0  # +max − max: each term only shrank


def _embedding_bag(vocab, masked=False):
  return keras.Sequential([
      keras.Input((40,), dtype="int32"),
      keras.layers.Embedding(vocab, 16, mask_zero=masked),
      keras.layers.GlobalAveragePooling1D(),
      keras.layers.Dense(3)])


@pytest.mark.parametrize("case", ["pooled", "padding mask", "too many units"])
def test_embedding_float32_sum_clips_at_the_shrunk_norm(case, monkeypatch,
                                                       unit_chunking):
  """An embedding whose table may take the float32 sum (2,048 × 16) clips
  every unit at C/(1 + 2γL), L of the table alone, whether the sum takes
  float32 (pooled rows) or float64 (a padding mask makes the rows differ;
  more units than L): the sum equals the per-example reference clipped
  there, and which sum ran is checked. In one pass and over chunks of
  units (``unit_chunking``)."""
  del unit_chunking
  if case == "too many units":
    monkeypatch.setattr(ghost, "FLOAT32_MAX_SHRINK", 2.0 ** -14)
  vocab = 2048
  limit = ghost.embedding_float32_max_units(vocab, 16, tf.float32)
  assert (limit < 40) == (case == "too many units") and limit > 0
  model = _embedding_bag(vocab, masked=case == "padding mask")
  rng = np.random.default_rng(31)
  units, clip = 40, 0.01
  x = rng.integers(1, vocab, (units, 40))  # vocab ≤ 4·T·d: pooled_lookup
  x[:, 3] = 5  # a token in every unit
  x[:, 7:12] = 9  # and repeated
  if case == "padding mask":
    x[:, 30:] = 0
  y = rng.integers(0, 3, units)
  shrink = float(ghost.float32_clip_shrink(limit))
  assert shrink > 1.0 + 1e-5
  result = ghost_sum(model, x, y, None, clipping.ClipSpec(clip), None,
                     jit=False)
  expected = reference(model, x, y, None, clipping.ClipSpec(clip / shrink),
                       None)
  assert int(expected.num_clipped) == units
  assert_same(result, expected)
  # Which sum ran: the float32 one, doubled, doubles the table's sum.
  original = ghost.pooled_embedding_grad
  monkeypatch.setattr(ghost, "pooled_embedding_grad",
                      lambda *a: 2.0 * original(*a))
  doubled = ghost_sum(model, x, y, None, clipping.ClipSpec(clip), None,
                      jit=False)
  ratio = np.asarray(doubled.grads[0]) / np.asarray(result.grads[0])
  want = 2.0 if case == "pooled" else 1.0
  np.testing.assert_allclose(ratio[np.isfinite(ratio)], want)


@pytest.mark.parametrize("length", [1, 2])
def test_float32_shrink_does_not_depend_on_the_sequence_length(length):
  """Regression (review): a Dense on tokens set the model's float32 limit L
  only at T = 1, so sequences padded to the longest one clipped every unit
  at C/(1 + 2γL) in one batch and at C in a neighbouring batch with one
  longer sequence (4.3C apart). L is now of the kernel alone: at T = 1
  (float32 sum) and T = 2 (float64 sum) every unit clips at the same
  C/(1 + 2γL)."""
  model = keras.Sequential([keras.Input((length, 256)),
                            keras.layers.Dense(128, activation="tanh"),
                            keras.layers.GlobalAveragePooling1D(),
                            keras.layers.Dense(3)])
  rng = np.random.default_rng(41)
  units, clip = 24, 0.02
  x = rng.normal(size=(units, length, 256)).astype(np.float32)
  y = rng.integers(0, 3, units)
  shrink = float(ghost.float32_clip_shrink(_wide_limit()))
  result = ghost_sum(model, x, y, None, clipping.ClipSpec(clip), None)
  expected = reference(model, x, y, None, clipping.ClipSpec(clip / shrink),
                       None)
  assert int(expected.num_clipped) == units
  assert_same(result, expected)


def test_float32_sums_never_overflow_near_float32s_range():
  """Regression (review): with a clip near float32's largest value, a
  pooled embedding's float32 table added units' saturated terms up to inf
  (5 units sharing a token at C = 2e38, automatic clipping: every unit
  scaled to about C). Where U·C can pass half of
  float32's range the sums stay float64, and the result is finite."""
  vocab = 2048
  model = _embedding_bag(vocab)
  x = np.full((8, 40), 5)  # alike: their shares of row 5 add up
  y = np.zeros(8, np.int64)
  result = ghost_sum(model, x, y, None,
                     clipping.ClipSpec(2e38, automatic_gamma=0.01), None)
  for g in result.grads:
    assert np.all(np.isfinite(np.asarray(g)))


class _CondDense(keras.layers.Layer):
  """A Dense called inside a tf.cond branch."""

  def __init__(self, **kwargs):
    super().__init__(name="cond_dense", **kwargs)
    self.dense = keras.layers.Dense(5, activation="tanh")

  def build(self, shape):
    self.dense.build(shape)

  def call(self, inputs):
    return tf.cond(tf.constant(True), lambda: self.dense(inputs),
                   lambda: -self.dense(inputs))


def test_a_layer_called_inside_control_flow_takes_the_exact_path():
  # Its records lived in the branch's graph: under XLA the ghost path got
  # δ = 0 for it and left it untrained (|fit − reference| = 1.4C in a
  # review); now the model takes per-unit gradients, as the plan says.
  keras.utils.set_random_seed(3)
  model = keras.Sequential([keras.Input((4,)), _CondDense(),
                            keras.layers.Dense(3)])
  x = np.random.default_rng(5).normal(size=(6, 4)).astype("float32")
  y = np.arange(6) % 3
  spec = clipping.ClipSpec(0.5)
  assert_same(ghost_sum(model, x, y, None, spec, None, method="auto"),
              reference(model, x, y, None, spec, None))
  assert "control flow" in str(dp.clipping_plan(model))
  with pytest.raises(ValueError, match="control flow"):
    ghost_sum(model, x, y, None, spec, None, method="ghost")


def test_embedding_loops_with_every_unit_past_the_budget(monkeypatch):
  """With CHUNK_BYTES below one unit's buffers, every loop takes chunks of
  one unit, and a chunk's own call one pass (a review: the one-unit chunk
  chunked again, without end). Norms, sums and counts equal one pass."""
  rng = np.random.default_rng(13)
  units, length, vocab, dim = 3, 6, 5, 2
  ids = tf.constant(rng.integers(0, vocab, (units, length)))
  delta = tf.constant(rng.normal(size=(units, length, dim)), tf.float32)
  pooled = tf.constant(np.repeat(rng.normal(size=(units, 1, dim)), length, 1),
                       tf.float32)
  weights = tf.constant([1.0, 0.5, 2.0], tf.float32)
  run = tf.function(lambda: [
      ghost.embedding_sq_norms(ids, delta, vocab),
      ghost.embedding_sq_norms(ids, pooled, vocab),
      ghost.embedding_grad(ids, delta, weights, vocab),
      ghost.embedding_square_sum(ids, delta, weights, vocab),
      tf.cast(ghost._first_counts(ids, None, vocab), tf.float64)],  # pylint: disable=protected-access
                    jit_compile=True)
  once = [t.numpy() for t in run()]
  monkeypatch.setattr(unit_chunks, "CHUNK_BYTES", 1)
  looped = [t.numpy() for t in tf.function(run.python_function,
                                           jit_compile=True)()]
  for a, b in zip(looped, once):
    np.testing.assert_allclose(a, b, rtol=1e-12)
