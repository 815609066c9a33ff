"""`layer.sparse_core_stats()`: the statistics a CPU layer collects while a tf-keras model
trains equal `preflight.sparse_core_stats` on the same batches (itself tested against a
brute-force reading of TF's routing in test_input_stats.py)."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tpu_embedding import preflight, tf_internals
from tpu_embedding.layer import TPUEmbedding

emb = tf.tpu.experimental.embedding
pytestmark = pytest.mark.skipif(
  tf_internals.SPARSE_CORE_CONFIG is None, reason=f"no SparseCore limits on TF {tf.__version__}"
)
BATCH = 32


def _config():
  video = emb.TableConfig(200, 4, name="video", combiner="sum")
  user = emb.TableConfig(50, 4, name="user")
  return {"watched": emb.FeatureConfig(video), "user": emb.FeatureConfig(user)}


def _data(rows):
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 5, rows)
  watched = np.minimum(rng.zipf(1.3, int(lengths.sum())) - 1, 199)
  features = {
    "watched": tf.RaggedTensor.from_row_lengths(watched, lengths),
    "user": np.minimum(rng.zipf(1.3, rows) - 1, 49),
  }
  return features, rng.normal(size=(rows, 1)).astype(np.float32)


def _model(layer):
  inputs = {
    "watched": tf_keras.Input(shape=(None,), ragged=True, dtype=tf.int64, name="watched"),
    "user": tf_keras.Input(shape=(), dtype=tf.int64, name="user"),
  }
  activations = layer(inputs)
  joined = tf_keras.layers.Concatenate()([activations["watched"], activations["user"]])
  model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(joined))
  model.compile(loss="mse", optimizer="sgd")
  return model


def test_stats_collected_while_training_equal_the_preflight_function():
  """Three full batches of 32 and a last one of 4 (skipped: a TPU needs equal batches)."""
  layer = TPUEmbedding(_config(), optimizer=emb.SGD(0.1))
  layer.collect_sparse_core_stats(num_chips=2)
  model = _model(layer)
  features, labels = _data(3 * BATCH + 4)
  model.fit(features, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
  full = [
    {name: value[i * BATCH : (i + 1) * BATCH] for name, value in features.items()} for i in range(3)
  ]
  want = preflight.sparse_core_stats(_config(), full, num_chips=2, optimizer=emb.SGD(0.1))
  assert layer.sparse_core_stats() == want
  assert set(want) == {"user_video", "max_ids_per_chip_per_sample"}


def test_off_by_default_and_refused_under_xla():
  layer = TPUEmbedding(_config(), optimizer=emb.SGD(0.1))
  with pytest.raises(ValueError, match=r"collect_sparse_core_stats\(num_chips=...\) before"):
    layer.sparse_core_stats()
  with pytest.raises(ValueError, match="num_chips must be a whole number >= 1; got 0"):
    layer.collect_sparse_core_stats(num_chips=0)
  layer.collect_sparse_core_stats(num_chips=1)
  with pytest.raises(ValueError, match="No batch has been recorded yet"):
    layer.sparse_core_stats()
  features = {"watched": tf.ragged.constant([[1, 2]] * 4, tf.int64), "user": tf.zeros(4, tf.int64)}
  with pytest.raises(ValueError, match="cannot be compiled by XLA"):
    tf.function(layer, jit_compile=True)(features)
