"""KerasHub backbones (built from config, nothing downloaded), LoRA, tied
ReversibleEmbedding: ghost clipping equals the per-unit reference and uses
no fallback."""
import keras
import numpy as np
import pytest

import tf_dpadambc as dp
from tf_dpadambc.core import clipping

from tests.test_ghost import LOSS, assert_same, ghost_sum, reference

keras_hub = pytest.importorskip("keras_hub")

SEQ, VOCAB = 8, 50


class _Classifier(keras.Model):
  """backbone(token ids) -> first position -> Dense(3); one int input (the
  reference and the battery feed one array), padding mask all ones."""

  def __init__(self, backbone, bert=False, **kwargs):
    ids = keras.Input((SEQ,), dtype="int32")
    inputs = {"token_ids": ids,
              "padding_mask": keras.ops.ones_like(ids)}
    if bert:
      inputs["segment_ids"] = keras.ops.zeros_like(ids)
      h = backbone(inputs)["pooled_output"]
    else:
      h = backbone(inputs)[:, 0]
    super().__init__(ids, keras.layers.Dense(3)(h), **kwargs)


def gemma(lora=False):
  keras.utils.set_random_seed(7)
  backbone = keras_hub.models.GemmaBackbone(
      vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
      num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8,
      dropout=0.0)
  return _finish(backbone, lora, bert=False)


def bert(lora=False):
  keras.utils.set_random_seed(8)
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
      intermediate_dim=32, max_sequence_length=16, dropout=0.0)
  return _finish(backbone, lora, bert=True)


def _finish(backbone, lora, bert):
  if lora:
    backbone.enable_lora(4)
    rng = np.random.default_rng(3)
    for v in backbone.trainable_variables:  # B is zero-initialized
      if "lora_kernel_b" in v.path:
        v.assign(rng.normal(size=v.shape).astype("float32"))
  model = _Classifier(backbone, bert=bert)
  # Gemma's scales start at 0 (×(1 + s)): make every weight matter.
  rng = np.random.default_rng(4)
  for v in model.trainable_variables:
    if "scale" in v.path or "gamma" in v.path:
      v.assign(rng.uniform(-0.5, 0.5, v.shape).astype("float32"))
  return model


def _ids(rng, batch=6):
  x = rng.integers(1, VOCAB, (batch, SEQ)).astype("int32")
  return x, rng.integers(0, 3, batch).astype("int32")


@pytest.mark.parametrize("build", [gemma, bert])
@pytest.mark.parametrize("lora", [False, True])
def test_backbones_clip_exactly_on_the_ghost_path(build, lora):
  model = build(lora)
  x, y = _ids(np.random.default_rng(1))
  spec = clipping.ClipSpec(0.05)
  result = ghost_sum(model, x, y, None, spec, None)
  assert_same(result, reference(model, x, y, None, spec, None), rtol=1e-4)
  plan = dp.clipping_plan(model)
  assert plan.fallback is None, plan
  assert not plan.per_layer_fallbacks, plan
  if lora:
    names = {v.path.split("/")[-1] for v in model.trainable_variables}
    assert names <= {"lora_kernel_a", "lora_kernel_b", "kernel", "bias"}
    assert sum(e.method.startswith("LoRA r=4") for e in plan.entries) == 4


def test_microbatches_and_square_sums_on_a_lora_backbone():
  model = gemma(lora=True)
  x, y = _ids(np.random.default_rng(2), batch=4)
  spec = clipping.ClipSpec(0.05, square_sum=True)
  assert_same(ghost_sum(model, x, y, None, spec, 2),
              reference(model, x, y, None, spec, 2), rtol=1e-4)


def _reversible(tied=True, soft_cap=None):
  """ids -> E -> Dense -> logits h Eᵀ (the same E: tied) -> mean over T."""
  keras.utils.set_random_seed(9)
  ids = keras.Input((SEQ,), dtype="int32")
  embedding = keras.layers.ReversibleEmbedding(
      12, 6, tie_weights=tied, logit_soft_cap=soft_cap)
  h = keras.layers.Dense(6, activation="tanh")(embedding(ids))
  logits = embedding(h, reverse=True)
  out = keras.layers.GlobalAveragePooling1D()(logits)
  return keras.Model(ids, out)


@pytest.mark.parametrize("tied,soft_cap,microbatches", [
    (True, None, None), (True, 2.0, 2), (False, None, None)])
def test_reversible_embedding_input_and_output_uses(tied, soft_cap,
                                                    microbatches):
  model = _reversible(tied, soft_cap)
  rng = np.random.default_rng(5)
  x = rng.integers(0, 12, (6, SEQ)).astype("int32")
  x[:, 1] = x[:, 0]  # repeated ids within a unit
  y = rng.integers(0, 12, 6).astype("int32")
  for spec in (clipping.ClipSpec(0.05), clipping.ClipSpec(
      0.05, scale=[rng.uniform(0.5, 2.0, v.shape).astype("float32")
                   for v in model.trainable_variables], square_sum=True)):
    assert_same(ghost_sum(model, x, y, None, spec, microbatches),
                reference(model, x, y, None, spec, microbatches), rtol=1e-4)
  plan = dp.clipping_plan(model)
  assert plan.fallback is None and not plan.per_layer_fallbacks, plan
  if tied:
    assert "cross term" in str(plan)


@pytest.mark.slow
def test_keras_hub_backbone_trains_privately():
  model = dp.make_private(gemma(lora=True))
  model.compile(optimizer=dp.DPAdamBC(1.0, 1.0, learning_rate=1e-2),
                loss=LOSS, jit_compile=True)
  x, y = _ids(np.random.default_rng(6), batch=8)
  history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
  assert np.isfinite(history.history["loss"][0])
  assert dp.clipping_plan(model).fallback is None


def test_lora_on_a_reversible_embedding_takes_the_exact_per_layer_fallback():
  model = _reversible(tied=True)
  embedding = [l for l in model.layers
               if isinstance(l, keras.layers.ReversibleEmbedding)][0]
  embedding.enable_lora(2)
  embedding.lora_embeddings_b.assign(np.full(
      embedding.lora_embeddings_b.shape, 0.3, "float32"))
  rng = np.random.default_rng(6)
  x = rng.integers(0, 12, (4, SEQ)).astype("int32")
  y = rng.integers(0, 12, 4).astype("int32")
  spec = clipping.ClipSpec(0.05)
  assert_same(ghost_sum(model, x, y, None, spec, None),
              reference(model, x, y, None, spec, None), rtol=1e-4)
  plan = dp.clipping_plan(model)
  assert [e.kind for e in plan.per_layer_fallbacks] == ["ReversibleEmbedding"]
