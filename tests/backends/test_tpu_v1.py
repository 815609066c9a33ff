"""The V1 path (tpu_embedding.backends.TpuV1Backend) on TF's real `TPUEmbedding` class.

The strategy is `tpu_harness.StandInTPUStrategy` and the TPU runtime is stubbed (see
tests/support/tpu_harness.py); the config proto, the variables and the enqueue / receive / send
graph are
built by TF's own code. Steps are traced, never run: nothing here executes on a TPU.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.core.protobuf.tpu import optimization_parameters_pb2

from tpu_embedding import hardware
from tpu_embedding.layer import TPUEmbedding

import tpu_harness

emb = tf.tpu.experimental.embedding
BATCH = 4
PACKING = optimization_parameters_pb2.LowDimensionalPackingStatus.Status


@pytest.fixture
def v1(monkeypatch):
  """(strategy, recorded) of a one-core TPU with the V1 embedding engine."""
  return tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1)


def _config(sequence_length=0):
  video, user = tpu_harness.video_and_user_tables()
  return {
    "watched": emb.FeatureConfig(video, name="watched"),
    "friends": emb.FeatureConfig(user, name="friends", max_sequence_length=sequence_length),
  }


def _ragged(values, lengths, dtype=tf.int32):
  return tf.RaggedTensor.from_row_lengths(tf.constant(values, dtype), lengths)


INPUTS = {
  "dense": lambda: {"watched": tf.constant([0, 1, 1, 0]), "friends": tf.constant([3, 0, 2, 1])},
  "ragged": lambda: {
    "watched": _ragged([0, 0, 1, 0, 1, 1], [1, 2, 2, 1]),
    "friends": _ragged([3, 0, 1, 2, 3, 0, 1, 2], [1, 3, 1, 3]),
  },
  "sparse": lambda: {
    "watched": tf.sparse.from_dense(tf.constant([[1, 0], [0, 1], [1, 1], [0, 0]])),
    "friends": tf.sparse.from_dense(tf.constant([[3, 1], [1, 0], [2, 0], [1, 2]])),
  },
}


def _specs(inputs):
  return tf.nest.map_structure(tf.type_spec_from_value, inputs)


def _traced_training_step(layer, inputs, weights=None):
  """The concrete graph of one training step (embedding lookup, loss, gradients)."""

  @tf.function
  def step(inputs, weights):
    with tf.GradientTape() as tape:
      activations = layer(inputs, weights)
      loss = tf.add_n([tf.reduce_sum(a) for a in activations.values()])
    return tape.gradient(loss, layer.trainable_variables)

  return step.get_concrete_function(_specs(inputs), _specs(weights)).graph


def _ops(graph, op_type):
  return [op for op in graph.get_operations() if op.type == op_type]


def test_build_writes_a_config_proto_protobuf_accepts(v1):
  """Failure 1: TF's V1 class wrote a bool into an enum field, so build() raised TypeError."""
  strategy, recorded = v1
  user_sgd = emb.SGD(learning_rate=0.25)
  with strategy.scope():
    layer = TPUEmbedding(_config(), optimizer=user_sgd)
    layer.build({"watched": tf.TensorShape([BATCH]), "friends": tf.TensorShape([BATCH])})
  (proto,) = recorded.config_protos
  assert recorded.loads == 1  # the tables were loaded once (traced, not run)
  assert [(t.name, t.vocabulary_size, t.dimension) for t in proto.table_descriptor] == [
    ("user", 4, 2),
    ("video", 2, 4),
  ]  # order of first use in flatten order
  for table in proto.table_descriptor:
    parameters = table.optimization_parameters
    assert parameters.WhichOneof("parameters") == "stochastic_gradient_descent"
    assert parameters.learning_rate.constant == pytest.approx(0.25)
    assert parameters.low_dimensional_packing_status == PACKING.UNSPECIFIED
  assert [(f.name, f.table_id, list(f.input_shape)) for f in proto.feature_descriptor] == [
    ("friends", 0, [BATCH]),
    ("watched", 1, [BATCH]),
  ]
  assert proto.num_tensor_cores == 1 and proto.num_hosts == 1
  assert user_sgd.low_dimensional_packing_status is False  # the user's optimizer is untouched


def test_a_requested_packing_keeps_its_meaning(v1):
  strategy, recorded = v1
  with strategy.scope():
    layer = TPUEmbedding(_config(), optimizer=emb.Adagrad(0.1, low_dimensional_packing_status=True))
    layer.build({"watched": tf.TensorShape([BATCH]), "friends": tf.TensorShape([BATCH])})
  (proto,) = recorded.config_protos
  assert {
    t.optimization_parameters.low_dimensional_packing_status for t in proto.table_descriptor
  } == {PACKING.ENABLED}


@pytest.mark.parametrize("kind", sorted(INPUTS))
def test_a_training_step_enqueues_receives_and_sends_once_under_one_name(v1, kind):
  strategy, recorded = v1
  inputs = INPUTS[kind]()
  with strategy.scope():
    layer = TPUEmbedding(_config(), optimizer="adagrad")
    graph = _traced_training_step(layer, inputs)
  (enqueue,) = _ops(graph, "EnqueueTPUEmbeddingArbitraryTensorBatch")
  (receive,) = _ops(graph, "RecvTPUEmbeddingActivations")
  (send,) = _ops(graph, "SendTPUEmbeddingGradients")
  names = {op.get_attr("_tpu_embedding_layer") for op in (enqueue, receive, send)}
  assert len(names) == 1
  assert enqueue.get_attr("device_ordinal") == 0
  assert len(receive.outputs) == 2
  # Flatten order: friends (dim 2), watched (dim 4).
  assert [o.shape.as_list() for o in receive.outputs] == [[BATCH, 2], [BATCH, 4]]
  # The gradients sent back are the activations' gradients, one [B, D] per feature.
  assert [t.shape.as_list() for t in send.inputs[:2]] == [[BATCH, 2], [BATCH, 4]]
  (proto,) = recorded.config_protos
  assert [list(f.input_shape) for f in proto.feature_descriptor] == [[BATCH], [BATCH]]


def test_weighted_and_sequence_features_reach_the_enqueue(v1):
  strategy, recorded = v1
  inputs = INPUTS["sparse"]()
  weights = {
    "watched": tf.SparseTensor(
      inputs["watched"].indices,
      tf.ones_like(inputs["watched"].values, tf.float32),
      inputs["watched"].dense_shape,
    ),
    "friends": None,
  }
  with strategy.scope():
    layer = TPUEmbedding(_config(sequence_length=2), optimizer="sgd")
    graph = _traced_training_step(layer, inputs, weights)
  assert len(_ops(graph, "EnqueueTPUEmbeddingArbitraryTensorBatch")) == 1
  (receive,) = _ops(graph, "RecvTPUEmbeddingActivations")
  assert [o.shape.as_list() for o in receive.outputs] == [[BATCH, 2, 2], [BATCH, 4]]
  (proto,) = recorded.config_protos
  assert [list(f.input_shape) for f in proto.feature_descriptor] == [[BATCH, 2], [BATCH]]
  assert len(_ops(graph, "SendTPUEmbeddingGradients")) == 1


def test_two_replicas_enqueue_once_per_core(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1, replicas=2)
  with strategy.scope():
    layer = TPUEmbedding(_config(), optimizer="sgd")
    graph = _traced_training_step(layer, INPUTS["dense"]())
  enqueues = _ops(graph, "EnqueueTPUEmbeddingArbitraryTensorBatch")
  assert sorted(op.get_attr("device_ordinal") for op in enqueues) == [0, 1]
  assert len(_ops(graph, "RecvTPUEmbeddingActivations")) == 1


def _built_layer(strategy):
  with strategy.scope():
    layer = TPUEmbedding(_config(), optimizer=tf_keras.optimizers.legacy.SGD(0.1))
    layer.build({"watched": tf.TensorShape([BATCH]), "friends": tf.TensorShape([BATCH])})
  return layer


def test_embedding_tables_are_readable_under_the_tpu_strategy(v1):
  """Failure 2: TF's class refuses embedding_tables under a TPUStrategy outside a save."""
  strategy, recorded = v1
  layer = _built_layer(strategy)
  retrieves = recorded.retrieves
  tables = {t.name: v for t, v in layer.embedding_tables.items()}
  assert recorded.retrieves == retrieves + 1  # fetched from the TPU first
  np.testing.assert_array_equal(tables["video"].numpy(), np.arange(8.0).reshape(2, 4))
  np.testing.assert_array_equal(tables["user"].numpy(), np.arange(8.0).reshape(4, 2))


def test_a_serving_lookup_reads_the_tpu_tables(v1):
  strategy, _ = v1
  layer = _built_layer(strategy)
  video, _ = tpu_harness.video_and_user_tables()
  serving = {"watched": emb.FeatureConfig(video, name="watched")}
  with strategy.scope():
    out = layer({"watched": _ragged([1, 0, 1], [2, 1])}, serving_config=serving)
  np.testing.assert_array_equal(
    out["watched"].numpy(), [[4.0, 6.0, 8.0, 10.0], [4.0, 5.0, 6.0, 7.0]]
  )


def test_wide_dense_ids_of_a_non_sequence_feature_are_refused_by_name(v1):
  """Failure 7: dense [B, L>1] ids are L samples per row on CPU; V1 cannot take them."""
  strategy, _ = v1
  inputs = {
    "watched": tf.constant([[0, 1], [1, 0], [1, 1], [0, 0]]),
    "friends": tf.constant([3, 0, 2, 1]),
  }
  with strategy.scope():
    layer = TPUEmbedding(_config(), optimizer="sgd")
    with pytest.raises(ValueError, match=r"'watched'.*\[4, 2\].*max_sequence_length") as error:
      _traced_training_step(layer, inputs)
  assert "TPU_V1" in str(error.value)


def test_features_of_one_call_may_have_different_batch_sizes_as_on_tf_s_class(v1):
  """TF's V1 class takes one input shape per feature (its config proto's feature descriptors),
  so features of one call with 4 and 3 samples are accepted, each giving [its batch, dim]; the
  CPU path gives the same shapes and the rows NumPy reads (not refused: TPU-identical)."""
  strategy, recorded = v1
  inputs = {"watched": tf.constant([0, 1, 1, 0]), "friends": tf.constant([3, 0, 2])}
  with strategy.scope():
    layer = TPUEmbedding(_config(), optimizer="sgd")
    graph = _traced_training_step(layer, inputs)
  (receive,) = _ops(graph, "RecvTPUEmbeddingActivations")
  assert [o.shape.as_list() for o in receive.outputs] == [[3, 2], [4, 4]]
  (proto,) = recorded.config_protos
  assert [list(f.input_shape) for f in proto.feature_descriptor] == [[3], [4]]
  cpu = TPUEmbedding(_config(), optimizer=emb.SGD(0.5))
  out = cpu(inputs)
  video, user = (np.arange(8.0).reshape(2, 4), np.arange(8.0).reshape(4, 2))
  np.testing.assert_array_equal(out["watched"].numpy(), video[[0, 1, 1, 0]])
  np.testing.assert_array_equal(out["friends"].numpy(), user[[3, 0, 2]])
