"""Model builders shared by the timing benchmarks (step_time.py, suite.py).

Each builder takes the Keras module to build with: Keras 3 (``import keras``)
or Keras 2 (``import tf_keras``, for TF-Privacy's optimizers and DPSequential),
so that both sides train the same architecture. Shapes are those of the
performance note (shared/notes/performance.md, "Benchmark shapes"); every
model outputs logits for ``SparseCategoricalCrossentropy(from_logits=True)``.
The Sequential builders take ``sequential=``, a callable ``f(layers=[...])``
used instead of ``k.Sequential`` (e.g. TF-Privacy's DPSequential).

- ``mlp``: 784-128-10.
- ``mnist_cnn``: TF-Privacy's tutorial MNIST CNN (28x28x1; conv 16 8x8/2,
  max-pool 2/1, conv 32 4x4/2, max-pool 2/1, dense 32, dense 10).
- ``cifar_cnn``: the CIFAR-10 5-layer CNN of the DP-AdamBC paper (Tang,
  Shpilevskiy, Lecuyer, AAAI 2024). The paper's text only says "a 5-layered
  CNN model as described in (?)" (the citation is lost in our copy); the
  layers are those of the authors' code (``CNN5`` of the JAX implementation,
  run with ``--activation tanh`` and its default ``--normalization none``):
  conv 32 3x3 valid, max-pool 2; conv 64 3x3 same, max-pool 2; conv 128 3x3
  same, max-pool 2; conv 256 3x3 same; conv 10 3x3 same; global average
  pooling; tanh after the first four convolutions. It has no normalization
  layer at all (so no BatchNormalization to replace); ~0.41M parameters.
- ``embedding_bag``: the IMDB shape of TF-Privacy's reference: vocabulary
  10k, embedding 16, length 256; Embedding -> GlobalAveragePooling1D ->
  Dense(2).
- ``transformer``: vocabulary 10k, sequence 128, d=128, 2 post-LN blocks of
  MultiHeadAttention (4 heads of 32) and a ReLU FFN of width 256, learned
  token and position embeddings, global average pooling, Dense(2); no
  dropout. The position embedding is a (128, d) weight added by a small
  custom layer (``PositionEmbedding``).
- ``lstm_text``: vocabulary 10k, embedding 32, length 64, LSTM 64, Dense(2)
  (issue 15: recurrent models train privately, the LSTM through its
  unrolled-cell ghost rule; run it at a small batch, e.g. ``--batch-sizes 64``).
- ``gemma_lora``, ``bert_lora``: KerasHub backbones built from config (no
  weights downloaded; Keras 3 only; listed when keras-hub is installed):
  vocabulary 1000, sequence 64, hidden 64, 2 layers (Gemma: 4 query heads,
  1 key/value head of 16, FFN 128; BERT: 4 heads, FFN 128), ``enable_lora(4)``
  (query and value adapters), mean pooling, Dense(2). ``gemma_full``: the
  same Gemma-like classifier, every weight trained (full fine-tuning; the
  tied ReversibleEmbedding is used as the input embedding).
"""
import importlib.util

VOCAB = 10_000
TEXT_LEN = 256        # embedding-bag sequence length
SEQ_LEN = 128         # transformer sequence length
D_MODEL = 128
HEADS = 4
FFN = 256
BLOCKS = 2
LSTM_LEN = 64         # LSTM text model sequence length
LSTM_EMBED = 32
LSTM_UNITS = 64


def mlp(k, sequential=None):
  return (sequential or k.Sequential)(layers=[
      k.Input((784,)), k.layers.Dense(128, activation="relu"),
      k.layers.Dense(10)])


def mnist_cnn(k, sequential=None):
  return (sequential or k.Sequential)(layers=[
      k.Input((28, 28, 1)),
      k.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
      k.layers.MaxPool2D(2, 1),
      k.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
      k.layers.MaxPool2D(2, 1),
      k.layers.Flatten(),
      k.layers.Dense(32, activation="relu"),
      k.layers.Dense(10)])


def cifar_cnn(k, sequential=None):
  conv = k.layers.Conv2D
  return (sequential or k.Sequential)(layers=[
      k.Input((32, 32, 3)),
      conv(32, 3, padding="valid", activation="tanh"),
      k.layers.MaxPool2D(2, 2),
      conv(64, 3, padding="same", activation="tanh"),
      k.layers.MaxPool2D(2, 2),
      conv(128, 3, padding="same", activation="tanh"),
      k.layers.MaxPool2D(2, 2),
      conv(256, 3, padding="same", activation="tanh"),
      conv(10, 3, padding="same"),
      k.layers.GlobalAveragePooling2D()])


def embedding_bag(k, sequential=None):
  return (sequential or k.Sequential)(layers=[
      k.Input((TEXT_LEN,), dtype="int32"),
      k.layers.Embedding(VOCAB, 16),
      k.layers.GlobalAveragePooling1D(),
      k.layers.Dense(2)])


_POSITION_CLASSES = {}


def _position_embedding(k):
  """A layer adding a learned (length, d) position embedding (one per Keras)."""
  if k not in _POSITION_CLASSES:

    class PositionEmbedding(k.layers.Layer):

      def build(self, input_shape):
        self.positions = self.add_weight(
            name="positions", shape=tuple(input_shape[-2:]),
            initializer="random_normal", trainable=True)
        self.built = True

      def call(self, x):
        return x + self.positions

    _POSITION_CLASSES[k] = PositionEmbedding
  return _POSITION_CLASSES[k]


def transformer(k):
  tokens = k.Input((SEQ_LEN,), dtype="int32")
  x = k.layers.Embedding(VOCAB, D_MODEL)(tokens)
  x = _position_embedding(k)()(x)
  for _ in range(BLOCKS):
    attention = k.layers.MultiHeadAttention(HEADS, D_MODEL // HEADS)(x, x)
    x = k.layers.LayerNormalization(epsilon=1e-6)(x + attention)
    h = k.layers.Dense(FFN, activation="relu")(x)
    h = k.layers.Dense(D_MODEL)(h)
    x = k.layers.LayerNormalization(epsilon=1e-6)(x + h)
  x = k.layers.GlobalAveragePooling1D()(x)
  return k.Model(tokens, k.layers.Dense(2)(x))


def lstm_text(k, sequential=None):
  return (sequential or k.Sequential)(layers=[
      k.Input((LSTM_LEN,), dtype="int32"),
      k.layers.Embedding(VOCAB, LSTM_EMBED),
      k.layers.LSTM(LSTM_UNITS),
      k.layers.Dense(2)])


HUB_VOCAB, HUB_LEN, HUB_D = 1000, 64, 64


def _hub_classifier(k, kind, lora):
  if getattr(k, "__name__", "") != "keras":
    raise ValueError("KerasHub backbones need Keras 3")
  import keras_hub  # pylint: disable=import-outside-toplevel
  if kind == "gemma":
    core = keras_hub.models.GemmaBackbone(
        vocabulary_size=HUB_VOCAB, num_layers=2, num_query_heads=4,
        num_key_value_heads=1, hidden_dim=HUB_D, intermediate_dim=2 * HUB_D,
        head_dim=HUB_D // 4, dropout=0.0)
  else:
    core = keras_hub.models.BertBackbone(
        vocabulary_size=HUB_VOCAB, num_layers=2, num_heads=4,
        hidden_dim=HUB_D, intermediate_dim=2 * HUB_D,
        max_sequence_length=HUB_LEN, dropout=0.0)
  if lora:
    core.enable_lora(4)
  ids = k.Input((HUB_LEN,), dtype="int32")
  inputs = {"token_ids": ids, "padding_mask": k.ops.ones_like(ids)}
  if kind == "bert":
    inputs["segment_ids"] = k.ops.zeros_like(ids)
    h = core(inputs)["sequence_output"]
  else:
    h = core(inputs)
  h = k.layers.GlobalAveragePooling1D()(h)
  return k.Model(ids, k.layers.Dense(2)(h))


def gemma_lora(k):
  return _hub_classifier(k, "gemma", lora=True)


def bert_lora(k):
  return _hub_classifier(k, "bert", lora=True)


def gemma_full(k):
  return _hub_classifier(k, "gemma", lora=False)


# name -> (builder, input shape, "float" or "int" inputs, number of classes,
#          vocabulary for int inputs)
MODELS = {
    "mlp": (mlp, (784,), "float", 10),
    "mnist_cnn": (mnist_cnn, (28, 28, 1), "float", 10),
    "cifar_cnn": (cifar_cnn, (32, 32, 3), "float", 10),
    "embedding_bag": (embedding_bag, (TEXT_LEN,), "int", 2),
    "transformer": (transformer, (SEQ_LEN,), "int", 2),
    "lstm_text": (lstm_text, (LSTM_LEN,), "int", 2),
}
if importlib.util.find_spec("keras_hub") is not None:
  MODELS.update({
      "gemma_lora": (gemma_lora, (HUB_LEN,), "int", 2),
      "bert_lora": (bert_lora, (HUB_LEN,), "int", 2),
      "gemma_full": (gemma_full, (HUB_LEN,), "int", 2),
  })
VOCABS = {"gemma_lora": HUB_VOCAB, "bert_lora": HUB_VOCAB,
          "gemma_full": HUB_VOCAB}


def synthetic_data(name, n, seed=0):
  """``n`` synthetic examples (x, y) of model ``name``'s input shape."""
  import numpy as np
  _, shape, kind, classes = MODELS[name]
  rng = np.random.default_rng(seed)
  if kind == "int":
    x = rng.integers(0, VOCABS.get(name, VOCAB),
                     size=(n,) + shape).astype("int32")
  else:
    x = rng.normal(size=(n,) + shape).astype("float32")
  y = rng.integers(0, classes, size=n).astype("int32")
  return x, y
