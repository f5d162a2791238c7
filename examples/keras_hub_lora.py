"""DP LoRA fine-tuning of a small KerasHub backbone (built from its config:
nothing is downloaded), DPAdamBC vs DPAdam vs DPSGD at the same ε.

A synthetic text-classification task: token sequences from a small
vocabulary, the label planted as a few "signal" tokens (ids 2–9 for class
0, 10–17 for class 1) among random filler. The backbone (Gemma-like or
BERT-like, two layers) stands in for a pretrained one; ``enable_lora(4)``
freezes it and adds rank-4 adapters to its query and value projections;
a pooled Dense head classifies. Every trainable weight (the LoRA factors,
the head) is clipped per example by ghost rules in one forward and one
backward pass: ``tf_dpadambc.clipping_plan(model)`` shows it.

    pip install "tf-dpadambc[hub]"
    python examples/keras_hub_lora.py            # ≈ a few minutes on a CPU
    python examples/keras_hub_lora.py --tiny     # seconds (a smoke test)

Needs keras-hub (the ``hub`` extra); set KERAS_BACKEND=tensorflow.
"""
import argparse

import keras
import keras_hub
import numpy as np

import tf_dpadambc

VOCAB = 200


def synthetic_text(num, seq_len, rng):
  """(token ids [num, seq_len], labels [num]): 3 signal tokens per example."""
  x = rng.integers(20, VOCAB, (num, seq_len)).astype("int32")
  y = rng.integers(0, 2, num).astype("int32")
  for i in range(num):
    where = rng.choice(seq_len, 3, replace=False)
    x[i, where] = rng.integers(2, 10, 3) + 8 * y[i]
  return x, y


def backbone(kind, seq_len, hidden):
  if kind == "gemma":
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=hidden, intermediate_dim=2 * hidden,
        head_dim=hidden // 2, dropout=0.0)
  return keras_hub.models.BertBackbone(
      vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=hidden,
      intermediate_dim=2 * hidden, max_sequence_length=seq_len, dropout=0.0)


def classifier(kind, seq_len, hidden, rank):
  """token ids -> backbone with LoRA adapters -> mean over tokens -> logits."""
  core = backbone(kind, seq_len, hidden)
  core.enable_lora(rank)  # freezes the backbone, adds A, B to query/value
  ids = keras.Input((seq_len,), dtype="int32")
  inputs = {"token_ids": ids, "padding_mask": keras.ops.ones_like(ids)}
  if kind == "bert":
    inputs["segment_ids"] = keras.ops.zeros_like(ids)
    h = core(inputs)["sequence_output"]
  else:
    h = core(inputs)
  h = keras.layers.GlobalAveragePooling1D()(h)
  return keras.Model(ids, keras.layers.Dense(2)(h))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--backbone", choices=["gemma", "bert"], default=None,
                      help="default gemma (--tiny: bert)")
  parser.add_argument("--examples", type=int, default=2000)
  parser.add_argument("--epochs", type=int, default=4)
  parser.add_argument("--batch-size", type=int, default=100)
  parser.add_argument("--seq-len", type=int, default=16)
  parser.add_argument("--hidden", type=int, default=32)
  parser.add_argument("--rank", type=int, default=4)
  parser.add_argument("--epsilon", type=float, default=8.0)
  parser.add_argument("--tiny", action="store_true",
                      help="seconds: 64 examples, 1 epoch, BERT-like, no XLA")
  args = parser.parse_args(argv)
  jit = True
  if args.tiny:
    args.examples, args.epochs, args.batch_size = 64, 1, 16
    args.seq_len, args.hidden = 8, 16
    args.backbone = args.backbone or "bert"
    # XLA compilation is most of a tiny run; Gemma-like attention needs it
    # (its 6-D per-unit logits exceed the CPU softmax kernel's rank).
    jit = args.backbone == "gemma"
  args.backbone = args.backbone or "gemma"

  rng = np.random.default_rng(0)
  x, y = synthetic_text(args.examples, args.seq_len, rng)
  x_test, y_test = synthetic_text(max(args.examples // 4, 32), args.seq_len,
                                  rng)
  delta = 1.0 / (10 * args.examples)
  # model.fit shuffles fixed-size batches: accounted as such ("shuffle").
  sigma = tf_dpadambc.compute_noise_multiplier(
      args.examples, args.batch_size, args.epochs, args.epsilon, delta,
      sampling="shuffle")
  optimizers = {
      "DPAdamBC": lambda: tf_dpadambc.DPAdamBC(1.0, sigma, 3e-3,
                                               gamma_prime=1e-8),
      "DPAdam": lambda: tf_dpadambc.DPAdam(1.0, sigma, 3e-3),
      "DPSGD": lambda: tf_dpadambc.DPSGD(1.0, sigma, 0.5),
  }
  results = {}
  for name, make in optimizers.items():
    keras.utils.set_random_seed(0)  # the same backbone and adapters each time
    model = tf_dpadambc.make_private(classifier(args.backbone, args.seq_len,
                                                args.hidden, args.rank))
    model.compile(optimizer=make(),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=["accuracy"], jit_compile=jit)
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
              verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    results[name] = accuracy
    print(f"{name:9s} test accuracy {accuracy:.3f} "
          f"(σ = {sigma:.3f}, target ε = {args.epsilon:g})")
  print(tf_dpadambc.clipping_plan(model))
  print(tf_dpadambc.optimizer_privacy_statement(
      model.optimizer, num_examples=args.examples, delta=delta))
  return results


if __name__ == "__main__":
  main()
