"""The DLRM a new user trains with `model.fit`: TF Model Garden's ranking model, in plain Keras.

Shaped as `official/recommendation/ranking` (tf-models-official) trains Criteo: 13 dense features
through a bottom MLP 512-256-16, 26 categorical features (one id each) embedded at dim 16 with
Criteo's vocabularies divided by 200, dot interaction (the pairwise dot products of the 27
vectors, below the diagonal, next to the bottom MLP's output), top MLP 512-256-1, binary
cross-entropy, legacy Adagrad. The same model is built over any Keras module (`tf_keras` or
Keras 3) and any embedding layer, so every implementation runs the same dense work.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

# Model Garden's Criteo vocabulary sizes (`ranking/configs/config.py`).
CRITEO_VOCABULARIES = (
  39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
  11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)  # fmt: skip
DIVISOR = 200
DIM = 16
NUM_DENSE = 13
SIZE_THRESHOLD = 50_000  # PartialTPUEmbedding: tables above are sharded (5 of 26 here)
LEARNING_RATE = 0.01
ZIPF_A = 1.2


def vocabularies() -> list[int]:
  return [math.ceil(v / DIVISOR) for v in CRITEO_VOCABULARIES]


def feature_names() -> list[str]:
  return [f"c{i}" for i in range(len(CRITEO_VOCABULARIES))]


def batches(batch: int, count: int, seed: int = 0) -> list[tuple[dict, np.ndarray, np.ndarray]]:
  """`count` batches of (ids per feature [batch] int64, dense [batch, 13], labels [batch, 1])."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    ids = {
      name: ((rng.zipf(ZIPF_A, batch) - 1) % vocab).astype(np.int64)
      for name, vocab in zip(feature_names(), vocabularies())
    }
    dense = rng.standard_normal((batch, NUM_DENSE)).astype(np.float32)
    labels = rng.integers(0, 2, (batch, 1)).astype(np.float32)
    out.append((ids, dense, labels))
  return out


def dataset(tf: Any, batch: int, count: int = 4) -> Any:
  """A repeating `tf.data.Dataset` of ({"dense": ..., "ids": {...}}, labels) batches."""
  made = batches(batch, count)
  stack = lambda key: np.stack([b[key] for b in made])
  ids = {name: np.stack([b[0][name] for b in made]) for name in feature_names()}
  return (
    tf.data.Dataset.from_tensor_slices(({"dense": stack(1), "ids": ids}, stack(2)))
    .repeat()
    .prefetch(2)
  )


def model_class(keras: Any, tf: Any) -> type:
  """The DLRM `Model` subclass over the given Keras module (tf_keras or Keras 3)."""

  def mlp(units: list[int], last_activation: Any) -> Any:
    layers = [keras.layers.Dense(u, activation="relu") for u in units[:-1]]
    return keras.Sequential(layers + [keras.layers.Dense(units[-1], activation=last_activation)])

  class DLRM(keras.Model):
    def __init__(self, embedding: Any, **kwargs):
      super().__init__(**kwargs)
      self.embedding = embedding
      self.bottom = mlp([512, 256, DIM], "relu")
      self.top = mlp([512, 256, 1], None)

    def call(self, inputs: dict) -> Any:
      activations = self.embedding(inputs["ids"])
      vectors = [self.bottom(inputs["dense"])] + [activations[n] for n in feature_names()]
      return self.top(dot_interaction(tf, vectors))

  return DLRM


def dot_interaction(tf: Any, vectors: list) -> Any:
  """The bottom output next to the pairwise dot products of all vectors, below the diagonal."""
  stacked = tf.stack(vectors, axis=1)  # [B, F, D]
  products = tf.matmul(stacked, stacked, transpose_b=True)  # [B, F, F]
  count = len(vectors)
  below = [i * count + j for i in range(count) for j in range(i)]
  pairs = tf.gather(tf.reshape(products, [-1, count * count]), below, axis=1)
  return tf.concat([vectors[0], pairs], axis=1)


def table_configs(tf: Any) -> list[Any]:
  e = tf.tpu.experimental.embedding
  init = tf.initializers.RandomUniform(-0.05, 0.05)
  return [
    e.TableConfig(vocabulary_size=v, dim=DIM, name=f"t{i}", combiner="sum", initializer=init)
    for i, v in enumerate(vocabularies())
  ]


def feature_configs(tf: Any) -> dict:
  e = tf.tpu.experimental.embedding
  return {n: e.FeatureConfig(table=t, name=n) for n, t in zip(feature_names(), table_configs(tf))}


def embedding_layer(impl: str, layer: str, tf: Any, optimizer: Any, batch: int) -> Any:
  """The embedding layer under test: `layer` is "partial" or "tpu"; `impl` one of IMPLS."""
  if impl == "keras-rs":
    return _keras_rs_layer(batch)
  configs = feature_configs(tf)
  if impl == "tfrs":
    import tensorflow_recommenders as tfrs

    if layer == "partial":
      return tfrs.experimental.layers.embedding.PartialTPUEmbedding(
        configs, optimizer, size_threshold=SIZE_THRESHOLD
      )
    return tfrs.layers.embedding.TPUEmbedding(configs, optimizer)
  if impl == "ours":
    import tpu_embedding

    module = tpu_embedding
  else:  # ours-keras3
    import tpu_embedding.keras

    module = tpu_embedding.keras
  if layer == "partial":
    return module.PartialTPUEmbedding(configs, optimizer, size_threshold=SIZE_THRESHOLD)
  return module.TPUEmbedding(configs, optimizer)


def _keras_rs_layer(batch: int) -> Any:
  """keras-rs's `DistributedEmbedding` over the same tables (off TPU: Keras embeddings that the
  model's optimizer trains)."""
  import keras
  import keras_rs

  configs = {}
  for name, vocab, i in zip(feature_names(), vocabularies(), range(len(feature_names()))):
    table = keras_rs.layers.TableConfig(
      name=f"t{i}",
      vocabulary_size=vocab,
      embedding_dim=DIM,
      initializer=keras.initializers.RandomUniform(-0.05, 0.05),
      optimizer=keras.optimizers.Adagrad(LEARNING_RATE),
      combiner="sum",
    )
    configs[name] = keras_rs.layers.FeatureConfig(
      name=name, table=table, input_shape=(batch,), output_shape=(batch, DIM)
    )
  return keras_rs.layers.DistributedEmbedding(configs)


def build(impl: str, layer: str, tf: Any, keras: Any, batch: int) -> tuple[Any, Any]:
  """(the compiled-for-fit model, its optimizer) for one implementation."""
  legacy = keras.__name__ == "tf_keras"  # Model Garden's legacy Adagrad; Keras 3 has one Adagrad
  optimizer = (keras.optimizers.legacy if legacy else keras.optimizers).Adagrad(LEARNING_RATE)
  model = model_class(keras, tf)(embedding_layer(impl, layer, tf, optimizer, batch))
  model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True))
  return model, optimizer


def custom_step(tf: Any, model: Any, optimizer: Any, loss: Callable) -> Callable:
  """A `tf.function` training step over the model, as a custom training loop writes it."""

  @tf.function
  def step(inputs, labels):
    with tf.GradientTape() as tape:
      value = loss(labels, model(inputs))
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(value, variables), variables))
    return value

  return step
