"""The V0 path (replicated tables, tpu_embedding.backends.TpuV0Backend) on TF's real
`TPUEmbeddingV0`, run eagerly on CPU under `tpu_harness.StandInTPUStrategy`.

V0 needs no TPU runtime at all: lookups are plain gathers on replicated variables, so these
tests run TF's class for real and compare it with the CPU engine in its Keras-trained mode
(`table_updates="keras"`), the same contract. Nothing here runs on a TPU.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tpu_embedding import hardware
from tpu_embedding.layer import TPUEmbedding

import tpu_harness

emb = tf.tpu.experimental.embedding
UPSTREAM = {"watched": 3.0, "friends": 5.0, "query": 2.0}


@pytest.fixture
def v0(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.UNSUPPORTED)
  return strategy


def _config():
  video = emb.TableConfig(
    vocabulary_size=3,
    dim=4,
    combiner="sum",
    name="video",
    initializer=tf.constant_initializer(np.arange(12.0) / 10),
  )
  user = emb.TableConfig(
    vocabulary_size=4,
    dim=2,
    combiner="mean",
    name="user",
    initializer=tf.constant_initializer(np.arange(8.0) / 10),
  )
  return {
    "watched": emb.FeatureConfig(video, name="watched"),
    "friends": emb.FeatureConfig(user, name="friends"),
    "query": emb.FeatureConfig(video, name="query"),
  }


def _inputs():
  return {
    "watched": tf.RaggedTensor.from_row_lengths(tf.constant([0, 2, 1, 0, 1, 1]), [1, 2, 2, 1]),
    "friends": tf.sparse.from_dense(tf.constant([[3, 1], [1, 0], [2, 0], [1, 2]])),
    "query": tf.constant([[2], [0], [1], [2]]),  # dense [B, 1]: one id per sample
  }


def _train(layer, learning_rate=0.5):
  """One eager step with a Keras SGD; returns the activations and the tables after it."""
  optimizer = tf_keras.optimizers.legacy.SGD(learning_rate)

  def step():
    with tf.GradientTape() as tape:
      activations = layer(_inputs())
      loss = tf.add_n([UPSTREAM[k] * tf.reduce_sum(a) for k, a in activations.items()])
    variables = layer.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return activations

  strategy = tf.distribute.get_strategy()
  activations = tf.function(lambda: strategy.run(step))()
  tables = {t.name: v.numpy() for t, v in layer.embedding_tables.items()}
  return {k: a.numpy() for k, a in activations.items()}, tables


def test_v0_matches_the_cpu_engine_in_keras_mode(v0):
  """Same activations, [B, D] for [B, 1] ids, and the same tables after one Keras SGD step."""
  with v0.scope():
    layer = TPUEmbedding(_config(), optimizer=tf_keras.optimizers.legacy.SGD(0.5))
    assert layer.execution_path is hardware.ExecutionPath.TPU_V0
    tpu_activations, tpu_tables = _train(layer)
  cpu_activations, cpu_tables = _train(
    TPUEmbedding(_config(), optimizer=tf_keras.optimizers.legacy.SGD(0.5), table_updates="keras")
  )
  assert tpu_activations["query"].shape == (4, 4)
  for key in UPSTREAM:
    np.testing.assert_allclose(tpu_activations[key], cpu_activations[key], rtol=1e-6, err_msg=key)
  for name in ("video", "user"):
    np.testing.assert_allclose(tpu_tables[name], cpu_tables[name], rtol=1e-6, err_msg=name)

  # Independent check of one table: video rows move by lr * (count in watched (sum) * 3 +
  # count in query * 2) in every dim.
  counts = np.zeros(3)
  for row in [0, 2, 1, 0, 1, 1]:
    counts[row] += UPSTREAM["watched"]
  for row in [2, 0, 1, 2]:
    counts[row] += UPSTREAM["query"]
  expected = np.arange(12.0).reshape(3, 4) / 10 - 0.5 * counts[:, None]
  np.testing.assert_allclose(tpu_tables["video"], expected, rtol=1e-6)


def test_v0_tables_are_the_layers_trainable_variables_without_unused_slots(v0):
  with v0.scope():
    layer = TPUEmbedding(_config(), optimizer="adagrad")
    layer(_inputs())
  assert sorted(v.name.split("/")[-1] for v in layer.trainable_variables) == ["user:0", "video:0"]
  assert {name: sorted(slots) for name, slots in layer.variables_by_table.items()} == {
    "video": ["parameters"],
    "user": ["parameters"],
  }


@pytest.mark.parametrize("where", ["layer", "table"])
def test_a_mid_level_optimizer_is_refused_on_v0(v0, where):
  """V0 trains tables with the Keras optimizer the model applies; a mid-level optimizer (whose
  TPU semantics V0 cannot give) is refused, naming the table and the path."""
  config = _config()
  optimizer = emb.Adagrad(0.1)
  if where == "table":
    config["friends"].table.optimizer = optimizer
    optimizer = "sgd"
  with v0.scope():
    with pytest.raises(ValueError, match=r"(?s)TPU_V0|UNSUPPORTED.*Keras") as error:
      TPUEmbedding(config, optimizer=optimizer)
  assert "Adagrad" in str(error.value)
  if where == "table":
    assert "'user'" in str(error.value)


@pytest.mark.parametrize("sequence_kind", ["ragged", "sparse"])
def test_v0_weighted_bags_and_sequences_match_the_cpu_engine(v0, sequence_kind):
  """Forward only: weighted ragged bags (mean) and a sequence feature (padded/truncated to
  max_sequence_length) as the CPU engine computes them. TF's V0 class looks a short sequence's
  padding up as id 0; the layer gives zeros there, as every other path does."""
  user = emb.TableConfig(
    vocabulary_size=4,
    dim=2,
    combiner="mean",
    name="user",
    initializer=tf.constant_initializer(np.arange(8.0) / 10),
  )
  config = lambda: {
    "bags": emb.FeatureConfig(user, name="bags"),
    "seq": emb.FeatureConfig(user, name="seq", max_sequence_length=2),
  }
  ids = {
    "bags": tf.RaggedTensor.from_row_lengths(tf.constant([3, 1, 0, 2, 1]), [2, 1, 2]),
    "seq": tf.RaggedTensor.from_row_lengths(tf.constant([1, 2, 3, 0]), [3, 0, 1]),
  }
  weights = {
    "bags": tf.RaggedTensor.from_row_lengths(tf.constant([1.0, 3.0, 2.0, 0.5, 1.5]), [2, 1, 2]),
    "seq": None,
  }
  if sequence_kind == "sparse":
    ids["seq"] = ids["seq"].to_sparse()
  with v0.scope():
    layer = TPUEmbedding(config(), optimizer="sgd")
    tpu = tf.function(lambda: v0.run(layer, args=(ids, weights)))()
  cpu = TPUEmbedding(config(), optimizer="sgd", table_updates="keras")(ids, weights)
  table = np.arange(8.0).reshape(4, 2) / 10
  np.testing.assert_allclose(tpu["bags"].numpy()[0], (table[3] + 3 * table[1]) / 4, rtol=1e-6)
  np.testing.assert_allclose(tpu["seq"].numpy()[1], np.zeros([2, 2]))
  for key in ("bags", "seq"):
    np.testing.assert_allclose(tpu[key].numpy(), cpu[key].numpy(), rtol=1e-6, err_msg=key)
