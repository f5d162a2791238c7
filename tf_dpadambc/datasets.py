"""Small classification data sets for the demo job and the examples.

* :func:`load_mnist1d` generates MNIST-1D (Greydanus 2020) locally with the
  ``mnist1d`` package: 4,000 train / 1,000 test signals of 40 features, 10
  classes. Nothing is downloaded (``mnist1d.data.get_dataset`` would).
* :func:`load_digits` uses scikit-learn's bundled 8x8 digits (1,797 images).
* :func:`load_mnist` is full MNIST through ``keras.datasets`` (downloads).
* :func:`load_synthetic_text` generates a topic-classification task (token
  ids, Zipfian vocabulary, class-indicative words): the main job's first
  task, on which DPAdamBC, DPAdam and DPSGD tie.
* :func:`load_synthetic_sentiment` generates a sentiment task (token ids,
  Zipfian vocabulary, every word a polarity that grows as the word gets
  rarer): the main job's second task, on which DPAdamBC and DPAdam tie.
* :func:`load_synthetic_negation` generates a negation task (token ids;
  a negator anywhere in the sentence flips the sentiment words) and
  :func:`negation_embeddings` its frozen "pretrained" word vectors: the main
  job's task.

Every loader returns a :class:`Dataset` with float32 ``x`` and int32 ``y``.
"""
import collections

import numpy as np

Dataset = collections.namedtuple(
    "Dataset", ["x_train", "y_train", "x_test", "y_test", "name"])

_EXTRAS_HINT = ('Install the optional dependencies of the examples with: '
                'pip install "tf-dpadambc[examples]"')


def _as_dataset(x_train, y_train, x_test, y_test, name):
  return Dataset(np.ascontiguousarray(x_train, dtype=np.float32),
                 np.ascontiguousarray(y_train, dtype=np.int32),
                 np.ascontiguousarray(x_test, dtype=np.float32),
                 np.ascontiguousarray(y_test, dtype=np.int32), name)


def load_mnist1d(seed=42):
  """MNIST-1D, generated locally (about 4 s): 4,000 train / 1,000 test.

  ``x`` has shape ``[N, 40]`` (standardized signals), ``y`` labels in 0..9.
  ``seed=42`` gives the data set of the MNIST-1D paper. Generation seeds
  NumPy's global random state (``mnist1d`` calls ``np.random.seed``); the
  previous state is restored afterwards.
  """
  try:  # optional dependency, imported only when needed
    from mnist1d.data import get_dataset_args
    from mnist1d.data import make_dataset
  except ImportError as e:
    raise ImportError("load_mnist1d needs the 'mnist1d' package. "
                      + _EXTRAS_HINT) from e
  args = get_dataset_args()
  args.seed = int(seed)
  state = np.random.get_state()
  try:
    data = make_dataset(args)  # never get_dataset: it downloads
  finally:
    np.random.set_state(state)
  return _as_dataset(data["x"], data["y"], data["x_test"], data["y_test"],
                     "mnist1d")


def load_digits(seed=0, test_fraction=0.25):
  """scikit-learn's bundled 8x8 digits, flattened to 64 features in [0, 1].

  A stratified train/test split with a fixed ``seed``: 1,347 train / 450 test
  with the defaults.
  """
  try:  # optional dependency, imported only when needed
    from sklearn import datasets as sk_datasets
    from sklearn import model_selection
  except ImportError as e:
    raise ImportError("load_digits needs scikit-learn. " + _EXTRAS_HINT) from e
  digits = sk_datasets.load_digits()
  x = digits.data / 16.0  # pixel intensities are 0..16
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      x, digits.target, test_size=test_fraction, random_state=seed,
      stratify=digits.target)
  return _as_dataset(x_train, y_train, x_test, y_test, "digits")


def load_mnist():
  """Full MNIST through ``keras.datasets.mnist`` (downloads ~11 MB once).

  ``x`` has shape ``[N, 28, 28]`` scaled to [0, 1]: 60,000 train / 10,000
  test. Not used by default.
  """
  import keras
  (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
  return _as_dataset(x_train / 255.0, y_train, x_test / 255.0, y_test,
                     "mnist")


def load_synthetic_text(seed=0, num_train=20_000, num_test=5_000,
                        vocab_size=1_000, length=10, num_classes=4,
                        words_per_class=150, zipf=1.1, class_zipf=1.0):
  """A synthetic text-classification task, generated locally in NumPy.

  Each document is ``length`` token ids. Background words follow a Zipfian
  law over ``vocab_size`` words (rank r has probability ∝ 1/r^zipf), as
  words do in text. Each class owns ``words_per_class`` indicative words,
  drawn from ranks 50 … vocab_size (no class owns the 50 most frequent,
  "stop words"); one position of every document holds one of its class's
  words, chosen Zipfian within the class (rank k ∝ 1/k^class_zipf): a few
  frequent cue words and a long tail of rare ones, as in topic or sentiment
  classification. The label is recoverable only from that word, which can
  also occur at random as background. ``x``: int32 ``[N, length]``.
  """
  rng = np.random.default_rng(seed)
  background = 1.0 / np.arange(1, vocab_size + 1) ** zipf
  background /= background.sum()
  cues = rng.permutation(np.arange(50, vocab_size))[
      :num_classes * words_per_class].reshape(num_classes, words_per_class)
  within = 1.0 / np.arange(1, words_per_class + 1) ** class_zipf
  within /= within.sum()

  def documents(n):
    y = rng.integers(0, num_classes, n)
    x = rng.choice(vocab_size, size=(n, length), p=background)
    x[np.arange(n), rng.integers(0, length, n)] = cues[
        y, rng.choice(words_per_class, n, p=within)]
    return x, y

  x_train, y_train = documents(num_train)
  x_test, y_test = documents(num_test)
  return Dataset(x_train.astype(np.int32), y_train.astype(np.int32),
                 x_test.astype(np.int32), y_test.astype(np.int32),
                 "synthetic-text")


def load_synthetic_sentiment(seed=0, num_train=50_000, num_test=10_000,
                             vocab_size=1_000, length=20, zipf=1.2,
                             weight_power=0.25, label_scale=8.0):
  """A synthetic sentiment task, generated locally in NumPy.

  Each document is ``length`` token ids drawn from a Zipfian law over
  ``vocab_size`` words (rank r has probability p_r ∝ 1/r^zipf). Word r has
  a polarity ±p_r^(−weight_power) (random sign): rare words are stronger
  cues than frequent ones, as in sentiment, where "the" says nothing and
  "abysmal" a lot. A document's score z is the sum of its words'
  polarities, standardized on the training set; its label is 1 with
  probability sigmoid(label_scale · z) (label noise: the best possible
  accuracy is about 93% with the defaults).

  What makes it a test of adaptivity: the mean gradient of word r's
  embedding scales with its frequency p_r, which spans three decades, while
  the rare words matter for the label — the ill-conditioning that Adam's
  per-coordinate scaling removes and SGD's single learning rate does not
  (heavy-tailed frequencies; Kunstner et al. 2024 make the same point for
  heavy-tailed classes in language models). ``x``: int32 ``[N, length]``,
  ``y`` in {0, 1}.
  """
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, vocab_size + 1) ** zipf
  p /= p.sum()
  polarity = p ** -weight_power * rng.choice([-1.0, 1.0], vocab_size)

  def documents(n):
    x = rng.choice(vocab_size, size=(n, length), p=p)
    return x, polarity[x].sum(axis=1)

  x_train, z_train = documents(num_train)
  x_test, z_test = documents(num_test)
  mean, std = z_train.mean(), z_train.std()

  def labels(z):
    logits = label_scale * (z - mean) / std
    return rng.random(len(z)) < 1.0 / (1.0 + np.exp(-logits))

  y_train, y_test = labels(z_train), labels(z_test)
  return Dataset(x_train.astype(np.int32), y_train.astype(np.int32),
                 x_test.astype(np.int32), y_test.astype(np.int32),
                 "synthetic-sentiment")


def _negation_vocabulary(seed, num_filler, num_sentiment):
  """(polarity of each sentiment word, Zipfian word probabilities of the
  filler and of the sentiment words): the vocabulary both the documents and
  the embeddings of the negation task derive from."""
  rng = np.random.default_rng([seed, 1])
  polarity = np.where(rng.permutation(num_sentiment) % 2 == 0, 1.0, -1.0)
  def zipf(n):
    p = 1.0 / np.arange(1, n + 1)
    return p / p.sum()
  return polarity, zipf(num_filler), zipf(num_sentiment)


def load_synthetic_negation(seed=0, num_train=50_000, num_test=10_000,
                            length=16, num_filler=400, num_sentiment=100,
                            num_negators=4, negation_rate=0.5,
                            label_noise=0.05):
  """A synthetic sentiment task with negation, generated locally in NumPy.

  Vocabulary (token ids in this order): ``num_filler`` neutral words,
  ``num_sentiment`` sentiment words (half positive, half negative), and
  ``num_negators`` negators ("not", "never", ...); filler and sentiment
  words are Zipfian (rank r ∝ 1/r). Each document is ``length`` filler words
  in which 1 or 3 sentiment words are placed at random positions and, with
  probability ``negation_rate``, one negator at another random position.
  Its label is 1 when the majority polarity of its sentiment words is
  positive, flipped when the document holds a negator, then flipped with
  probability ``label_noise`` (the best possible accuracy is 1 −
  ``label_noise``, 95% with the defaults).

  No bag of words solves it: a sentiment word means the opposite in a
  negated document, so the model has to relate each sentiment word to the
  negator elsewhere in the sentence — token interactions, what attention
  does (an SNLI-like task in miniature). Pair it with the frozen word
  vectors of :func:`negation_embeddings` (same ``seed`` and vocabulary
  sizes). ``x``: int32 ``[N, length]``, ``y`` in {0, 1}.
  """
  polarity, p_filler, p_sentiment = _negation_vocabulary(
      seed, num_filler, num_sentiment)
  rng = np.random.default_rng([seed, 2])

  def documents(n):
    x = rng.choice(num_filler, size=(n, length), p=p_filler)
    count = rng.choice([1, 3], size=n)
    positions = np.argsort(rng.random((n, length)), axis=1)
    score = np.zeros(n)
    for j in range(3):
      used = count > j
      word = rng.choice(num_sentiment, size=n, p=p_sentiment)
      x[used, positions[used, j]] = num_filler + word[used]
      score += used * polarity[word]
    negated = rng.random(n) < negation_rate
    x[negated, positions[negated, 3]] = (
        num_filler + num_sentiment
        + rng.integers(0, num_negators, int(negated.sum())))
    y = (score > 0) ^ negated ^ (rng.random(n) < label_noise)
    return x.astype(np.int32), y.astype(np.int32)

  x_train, y_train = documents(num_train)
  x_test, y_test = documents(num_test)
  return Dataset(x_train, y_train, x_test, y_test, "synthetic-negation")


def negation_embeddings(seed=0, dim=32, num_filler=400, num_sentiment=100,
                        num_negators=4, cue_scale=1.0, outlier_dims=2,
                        outlier_scale=3.0):
  """Frozen "pretrained" word vectors for :func:`load_synthetic_negation`:
  float32 ``[vocabulary, dim]``, for a non-trainable Embedding.

  Every word a random vector (N(0, 1/dim) entries); sentiment words also
  ± ``cue_scale`` times a "sentiment" direction (the sign of their
  polarity), negators ``cue_scale`` times a "negation" direction — the
  meaningful directions a pretrained embedding has. The first
  ``outlier_dims`` coordinates are outlier dimensions: about
  ± ``outlier_scale`` for every word (±10%), far above the others (≈
  0.18), as in the hidden states of pretrained transformers (Kovaleva et
  al. 2021, "BERT busters"). They carry no information, but the weights
  that read them get gradients an order of magnitude larger than the
  weights that read the cues: the gradient-scale heterogeneity that Adam's
  per-coordinate scaling removes and SGD's single learning rate does not.
  """
  polarity, _, _ = _negation_vocabulary(seed, num_filler, num_sentiment)
  rng = np.random.default_rng([seed, 3])
  vocab = num_filler + num_sentiment + num_negators
  vectors = rng.normal(0.0, 1.0, (vocab, dim)) / np.sqrt(dim)
  sentiment, negation = rng.normal(0.0, 1.0, (2, dim)) / np.sqrt(dim)
  vectors[num_filler:num_filler + num_sentiment] += (
      cue_scale * polarity[:, None] * sentiment)
  vectors[num_filler + num_sentiment:] += cue_scale * negation
  if outlier_dims:
    signs = rng.choice([-1.0, 1.0], outlier_dims)
    vectors[:, :outlier_dims] = outlier_scale * signs * (
        1.0 + 0.1 * rng.normal(0.0, 1.0, (vocab, outlier_dims)))
  return vectors.astype(np.float32)


LOADERS = {"mnist1d": load_mnist1d, "digits": load_digits}
