"""tpu_embedding.backends through the layer: which mid-level class each path builds, and the
refusals shared by every path.

TPU paths use TF's real classes under `tpu_harness.StandInTPUStrategy` with the TPU runtime
stubbed (tests/support/tpu_harness.py); nothing here runs on a TPU. Path-specific behaviour is
tested in
tests/backends/test_tpu_v0.py, tests/backends/test_tpu_v1.py and tests/backends/test_tpu_v2.py.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tpu_embedding import serving
from tpu_embedding.config import prepare
from tpu_embedding.engine import EmbeddingEngine
from tpu_embedding.hardware import EmbeddingFeature, ExecutionPath
from tpu_embedding.layer import TPUEmbedding
from tpu_embedding.partial import PartialTPUEmbedding

import tpu_harness

emb = tf.tpu.experimental.embedding
BATCH = 4

CLASS_OF = {
  ExecutionPath.TPU_V0: emb.TPUEmbeddingV0,
  ExecutionPath.TPU_V1: emb.TPUEmbedding,
  ExecutionPath.TPU_V2: emb.TPUEmbeddingV2,
}
FEATURE_OF = {
  ExecutionPath.TPU_V0: EmbeddingFeature.UNSUPPORTED,
  ExecutionPath.TPU_V1: EmbeddingFeature.V1,
  ExecutionPath.TPU_V2: EmbeddingFeature.V2,
}


@pytest.fixture
def tpu(monkeypatch):
  """`tpu(path)`: (stand-in TPU strategy reporting that path's feature, what the stubs saw)."""
  return lambda path: tpu_harness.tpu_strategy(monkeypatch, FEATURE_OF[path])


def tables():
  return tpu_harness.video_and_user_tables("video_table", "user_table")


def feature_config(output_shape=None):
  video, user = tables()
  return {
    "watched": emb.FeatureConfig(table=video, name="watched", output_shape=output_shape),
    "favorited": emb.FeatureConfig(table=video, name="favorited", output_shape=output_shape),
    "friends": emb.FeatureConfig(table=user, name="friends", output_shape=output_shape),
  }


def features():
  ragged = lambda values, lengths: tf.RaggedTensor.from_row_lengths(
    tf.constant(values, tf.int32), lengths
  )
  return {
    "watched": ragged([0, 0, 1, 0, 1, 1], [1, 2, 2, 1]),
    "favorited": ragged([0, 1, 1, 0, 0, 1], [2, 1, 1, 2]),
    "friends": ragged([3, 0, 1, 2, 3, 0, 1, 2], [1, 3, 1, 3]),
  }


def make_layer(path, **kwargs):
  kwargs.setdefault("optimizer", tf_keras.optimizers.legacy.SGD(learning_rate=0.1))
  # SC-API requires output_shape (SPEC §3.6); the others derive it from the inputs.
  config = feature_config([BATCH] if path is ExecutionPath.TPU_V2 else None)
  return TPUEmbedding(config, **kwargs), config


# --------------------------------------------------------------------------------------------
# Construction: which class, from which config


@pytest.mark.parametrize("path", [ExecutionPath.TPU_V0, ExecutionPath.TPU_V1, ExecutionPath.TPU_V2])
def test_each_tpu_path_builds_tfs_own_class_from_the_cloned_config(tpu, path):
  strategy, _ = tpu(path)
  with strategy.scope():
    layer, user_config = make_layer(path)
  assert layer.execution_path is path
  assert type(layer.engine) is CLASS_OF[path]
  given = layer.embedding_config.feature_config
  for key in user_config:
    assert given[key] is not user_config[key]
    assert given[key].table is not user_config[key].table
    assert given[key].table.name == user_config[key].table.name
  assert given["watched"].table is given["favorited"].table
  assert user_config["watched"].table.optimizer is None  # the user's config is untouched


def test_the_cpu_path_builds_the_engine_and_no_mid_level_object():
  layer, _ = make_layer(ExecutionPath.CPU)
  assert layer.execution_path is ExecutionPath.CPU
  assert isinstance(layer.engine, EmbeddingEngine)


def test_forcing_unsupported_on_a_v1_tpu_builds_v0(tpu):
  strategy, _ = tpu(ExecutionPath.TPU_V1)
  with strategy.scope():
    layer, _ = make_layer(ExecutionPath.TPU_V1, embedding_feature=EmbeddingFeature.UNSUPPORTED)
  assert layer.execution_path is ExecutionPath.TPU_V0
  assert type(layer.engine) is emb.TPUEmbeddingV0


@pytest.mark.parametrize("pipelining", [False, True])
def test_v1_writes_the_pipelining_flag_into_its_config(tpu, pipelining):
  strategy, recorded = tpu(ExecutionPath.TPU_V1)
  with strategy.scope():
    layer, _ = make_layer(ExecutionPath.TPU_V1, pipeline_execution_with_tensor_core=pipelining)
    layer.build({k: tf.TensorShape([BATCH, None]) for k in feature_config()})
  (proto,) = recorded.config_protos
  assert proto.pipeline_execution_with_tensor_core is pipelining


# --------------------------------------------------------------------------------------------
# Created under one strategy, called under another


def _mirrored():
  return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def _one_device():
  return tf.distribute.OneDeviceStrategy("/cpu:0")


@pytest.mark.parametrize(
  "create,call",
  [(_one_device, _mirrored), (_mirrored, _one_device)],
  ids=["one_device_then_mirrored", "mirrored_then_one_device"],
)
def test_cpu_layer_called_under_another_strategy_is_refused(create, call):
  """CPU path, real strategies: the refusal names both strategies."""
  created_under, called_under = create(), call()
  with created_under.scope():
    layer, _ = make_layer(ExecutionPath.CPU)
  with called_under.scope():
    with pytest.raises(RuntimeError) as error:
      layer(features())
  message = str(error.value)
  assert type(created_under).__name__ in message
  assert type(called_under).__name__ in message


def test_cpu_layer_created_under_a_strategy_may_be_called_outside_any():
  """CPU path, real strategies: plain eager use after creating in a scope."""
  with _one_device().scope():
    layer, _ = make_layer(ExecutionPath.CPU)
  assert layer(features())["watched"].shape == [BATCH, 4]


def test_tpu_layer_called_under_a_different_strategy_is_refused(tpu):
  strategy, _ = tpu(ExecutionPath.TPU_V1)
  with strategy.scope():
    layer, _ = make_layer(ExecutionPath.TPU_V1)
  with _one_device().scope():
    with pytest.raises(RuntimeError) as error:
      layer(features())
  message = str(error.value)
  assert "StandInTPUStrategy" in message and "OneDeviceStrategy" in message


@pytest.mark.parametrize("path", [ExecutionPath.TPU_V0, ExecutionPath.TPU_V1, ExecutionPath.TPU_V2])
def test_tpu_layer_called_outside_its_strategy_is_refused_before_building(tpu, path):
  """A refused call must not initialise the TPU nor create tables."""
  strategy, recorded = tpu(path)
  with strategy.scope():
    layer, _ = make_layer(path)
  with pytest.raises(RuntimeError) as error:
    layer(features())
  message = str(error.value)
  assert "StandInTPUStrategy" in message and "Default" in message
  assert not layer.built and recorded.config_protos == [] and recorded.loads == 0


@pytest.mark.parametrize("path", [ExecutionPath.TPU_V1, ExecutionPath.TPU_V2])
def test_no_optimizer_is_refused_on_the_embedding_engines(tpu, path):
  """Failure 7: optimizer=None (serving-only layers) has no meaning where the TPU trains."""
  strategy, _ = tpu(path)
  with strategy.scope():
    with pytest.raises(ValueError, match=rf"(?s)'video_table'.*{path.name}.*optimizer"):
      make_layer(path, optimizer=None)


def test_sparse_core_needs_every_output_shape(tpu):
  """Failure 7: TPUEmbeddingV2 cannot derive output shapes from the inputs."""
  strategy, _ = tpu(ExecutionPath.TPU_V2)
  config = feature_config([BATCH])
  config["friends"].output_shape = tf.TensorShape(None)
  with strategy.scope():
    with pytest.raises(ValueError, match=r"(?s)'friends'.*output_shape.*TPU_V2"):
      TPUEmbedding(config, optimizer="sgd")


@pytest.mark.parametrize("path", [ExecutionPath.TPU_V0, ExecutionPath.TPU_V1])
def test_a_tpu_layer_exports_for_serving(tpu, path, tmp_path):
  """Failure 3: export read attributes TF's real V0/V1 classes do not have."""
  strategy, _ = tpu(path)
  with strategy.scope():
    layer, _ = make_layer(path)
    layer.build({k: tf.TensorShape([BATCH, None]) for k in feature_config()})
  video, _ = tables()
  serving_config = {"watched": emb.FeatureConfig(video, name="watched")}

  @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int32)])
  def serve(ids):
    return layer({"watched": ids}, serving_config=serving_config)["watched"]

  exported = serving.export_for_serving(layer, str(tmp_path / "export"), serve)
  loaded = tf.saved_model.load(exported)
  (out,) = loaded.signatures["serving_default"](
    ids=tf.constant([1, 0, 1]), ids_1=tf.constant([0, 2, 3], tf.int64)
  ).values()
  np.testing.assert_array_equal(out.numpy(), [[4.0, 6.0, 8.0, 10.0], [4.0, 5.0, 6.0, 7.0]])
  assert sorted(loaded.embedding_tables) == ["video_table"]
  np.testing.assert_array_equal(
    loaded.embedding_tables["video_table"].numpy(), np.arange(8.0).reshape(2, 4)
  )


# --------------------------------------------------------------------------------------------
# The Keras 3 layer drives the same backends


def _keras3_layer(config, **kwargs):
  import keras

  from tpu_embedding.keras import TPUEmbedding as Keras3TPUEmbedding

  return Keras3TPUEmbedding(config, optimizer=keras.optimizers.SGD(0.1), **kwargs)


def test_the_keras3_layer_builds_v1_as_the_tf_keras_layer_and_traces_one_engine_step(tpu):
  """A Keras 3 layer (given Keras 3's tuple shapes) writes the tf-keras layer's V1 config proto,
  and its training step enqueues, receives and sends once under one name, the gradients sent
  being one [batch, dim] tensor per feature (traced by TF's real class, never run)."""
  strategy, recorded = tpu(ExecutionPath.TPU_V1)
  with strategy.scope():
    tf_keras_layer, _ = make_layer(ExecutionPath.TPU_V1)
    tf_keras_layer.build({k: tf.TensorShape([BATCH]) for k in feature_config()})
    layer = _keras3_layer(feature_config())
    layer.build({k: (BATCH,) for k in feature_config()})
  assert layer.execution_path is ExecutionPath.TPU_V1
  assert type(layer.engine) is emb.TPUEmbedding
  reference, proto = recorded.config_protos
  assert proto == reference
  assert [(f.name, list(f.input_shape)) for f in proto.feature_descriptor] == [
    ("favorited", [BATCH]),
    ("friends", [BATCH]),
    ("watched", [BATCH]),
  ]

  @tf.function
  def step(ids):
    with tf.GradientTape() as tape:
      activations = layer(ids)
      loss = tf.add_n([tf.reduce_sum(a) for a in activations.values()])
    return tape.gradient(loss, [v.value for v in layer.trainable_variables])

  ids = {k: tf.constant([0, 1, 1, 0]) for k in feature_config()}
  with strategy.scope():
    graph = step.get_concrete_function(_specs(ids)).graph
  ops = lambda kind: [op for op in graph.get_operations() if op.type == kind]
  (enqueue,) = ops("EnqueueTPUEmbeddingArbitraryTensorBatch")
  (receive,) = ops("RecvTPUEmbeddingActivations")
  (send,) = ops("SendTPUEmbeddingGradients")
  assert len({op.get_attr("_tpu_embedding_layer") for op in (enqueue, receive, send)}) == 1
  # Flatten order: favorited (video, dim 4), friends (user, dim 2), watched (video, dim 4).
  assert [o.shape.as_list() for o in receive.outputs] == [[BATCH, 4], [BATCH, 2], [BATCH, 4]]
  assert [t.shape.as_list() for t in send.inputs[:3]] == [[BATCH, 4], [BATCH, 2], [BATCH, 4]]
  assert len(layer.trainable_variables) == 1  # only the gradient trap


def _specs(inputs):
  return tf.nest.map_structure(tf.type_spec_from_value, inputs)


def _sparse_core_config():
  """Tables whose every entry is known (SparseCore asks initializers for padded shapes)."""
  video = emb.TableConfig(16, 4, name="video_table", initializer=tpu_harness.pattern(0.0))
  user = emb.TableConfig(32, 2, name="user_table", initializer=tpu_harness.pattern(10000.0))
  return {
    "watched": emb.FeatureConfig(video, name="watched", output_shape=[BATCH]),
    "favorited": emb.FeatureConfig(video, name="favorited", output_shape=[BATCH]),
    "friends": emb.FeatureConfig(user, name="friends", output_shape=[BATCH]),
  }


def test_the_keras3_layer_holds_the_tf_keras_layers_sparse_core_tables_and_lookup(tpu):
  """On SparseCore (TF's real TPUEmbeddingV2, stacking and padding on CPU) the Keras 3 layer
  holds the same logical tables as the tf-keras layer, and its lookup traces TF's SparseCore
  matmul once per stack with one [batch, dim] activation per feature."""
  strategy, _ = tpu(ExecutionPath.TPU_V2)
  shapes = {k: tf.TensorShape([BATCH]) for k in feature_config()}
  with strategy.scope():
    tf_keras_layer = TPUEmbedding(_sparse_core_config(), optimizer="sgd")
    tf_keras_layer.build(shapes)
    layer = _keras3_layer(_sparse_core_config())
    layer.build({k: (BATCH,) for k in feature_config()})
  assert layer.execution_path is ExecutionPath.TPU_V2
  assert type(layer.engine) is emb.TPUEmbeddingV2
  tables = {t.name: np.asarray(v) for t, v in layer.embedding_tables.items()}
  reference = {t.name: np.asarray(v) for t, v in tf_keras_layer.embedding_tables.items()}
  layouts = layer.engine.embedding_layouts
  stacked = layer.engine.embedding_tables
  assert sorted(tables) == sorted(reference) == ["user_table", "video_table"]
  for name, (dim, offset) in {"video_table": (4, 0.0), "user_table": (2, 10000.0)}.items():
    by_hand = tpu_harness.logical_by_hand(
      tpu_harness.stacked_by_hand(stacked[layouts[name].stacked_table_name]), layouts[name]
    )
    np.testing.assert_array_equal(tables[name], by_hand, err_msg=name)
    np.testing.assert_array_equal(tables[name], reference[name], err_msg=name)
    # Only this table's columns: TF's initializer wrote offset + 100 * row + column.
    np.testing.assert_array_equal(tables[name] % 100, np.tile(np.arange(dim), (len(by_hand), 1)))
    assert ((tables[name] >= offset) & (tables[name] < offset + 10000)).all(), name

  @tf.function
  def step(ids):
    return strategy.run(layer, args=(ids,))

  specs = {k: tf.TensorSpec([BATCH], tf.int32) for k in feature_config()}
  with strategy.scope():
    concrete = step.get_concrete_function(specs)
  kinds = [op.type for op in concrete.graph.get_operations()]
  assert kinds.count("XlaSparseDenseMatmulWithStaticBufferSize") == 1  # one stack: dims 4, 2
  assert {k: v.shape.as_list() for k, v in concrete.structured_outputs.items()} == {
    "watched": [BATCH, 4],
    "favorited": [BATCH, 4],
    "friends": [BATCH, 2],
  }


def test_the_keras3_layer_refuses_a_tpu_without_embedding_engine(tpu):
  """On V0 the model's optimizer would have to train the tables, which Keras 3 cannot."""
  strategy, _ = tpu(ExecutionPath.TPU_V0)
  with strategy.scope():
    with pytest.raises(ValueError, match="TPU_V0: these tables would be trained by the model's"):
      _keras3_layer(feature_config())


@pytest.mark.parametrize("batch_size", [-5, 0, 2.5, True, "8"])
def test_a_batch_size_that_is_not_a_positive_int_is_refused(batch_size):
  for make in (TPUEmbedding, PartialTPUEmbedding):
    with pytest.raises(
      ValueError, match=f"batch_size={batch_size!r}; expected a positive int .* or None"
    ):
      make(
        {
          "f": tf.tpu.experimental.embedding.FeatureConfig(
            tf.tpu.experimental.embedding.TableConfig(5, 2, name="t")
          )
        },
        "sgd",
        batch_size=batch_size,
      )


# --------------------------------------------------------------------------------------------
# The layer's prepared configuration is never changed by a path


def _described(config):
  """The values a path could change in a prepared config (a fresh `prepare` gives equal ones)."""

  def optimizer(o):
    if o is None:
      return None
    return (type(o), o.learning_rate, repr(o.low_dimensional_packing_status))

  return (
    [(t.name, t.vocabulary_size, t.dim, t.combiner, optimizer(t.optimizer)) for t in config.tables],
    [
      (f.path, f.config.name, f.table.name, f.config.max_sequence_length, f.config.output_shape)
      for f in config.features
    ],
    optimizer(config.optimizer),
  )


def _objects(config):
  """The objects of a prepared config, which must stay the same objects."""
  return (
    [(id(t), id(t.optimizer)) for t in config.tables],
    [(id(f.config), id(f.config.table), id(f.table)) for f in config.features],
    {id(clone): id(user) for clone, user in config.user_tables.items()},
  )


@pytest.mark.parametrize(
  "path",
  [ExecutionPath.CPU, ExecutionPath.TPU_V0, ExecutionPath.TPU_V1, ExecutionPath.TPU_V2],
)
def test_embedding_config_is_the_same_before_and_after_construction_and_build(tpu, path):
  """V0 once dropped every table's optimizer and V1 swapped them for copies, in the config the
  layer exposes; each path now hands TF its own converted copy."""
  optimizer = emb.Adagrad(learning_rate=0.1)  # packing status False, the bool V1 converts
  if path is ExecutionPath.TPU_V0:
    optimizer = tf_keras.optimizers.legacy.SGD(learning_rate=0.1)  # V0 trains with Keras's
  strategy = tf.distribute.get_strategy() if path is ExecutionPath.CPU else tpu(path)[0]
  table = lambda name, vocabulary: emb.TableConfig(vocabulary, 8, combiner="mean", name=name)
  video, user = table("video", 32), table("user", 16)
  output_shape = [BATCH] if path is ExecutionPath.TPU_V2 else None
  user_config = {
    "watched": emb.FeatureConfig(video, name="watched", output_shape=output_shape),
    "favorited": emb.FeatureConfig(video, name="favorited", output_shape=output_shape),
    "friends": emb.FeatureConfig(user, name="friends", output_shape=output_shape),
  }
  with strategy.scope():
    layer = TPUEmbedding(user_config, optimizer=optimizer)
    objects = _objects(layer.embedding_config)
    layer.build({key: tf.TensorShape([BATCH, None]) for key in user_config})
  assert layer.execution_path is path
  assert _described(layer.embedding_config) == _described(prepare(user_config, optimizer))
  assert _objects(layer.embedding_config) == objects
  assert {type(t.optimizer) for t in layer.embedding_config.tables} == {
    emb.SGD if path is ExecutionPath.TPU_V0 else emb.Adagrad
  }


def test_partial_embedding_config_is_the_same_before_and_after_use():
  user_config = feature_config()
  optimizer = emb.Adagrad(learning_rate=0.1)
  layer = PartialTPUEmbedding(user_config, optimizer=optimizer, size_threshold=2)
  objects = _objects(layer.embedding_config)
  layer(features())
  assert {layer.side(t) for t in ("video_table", "user_table")} == {"replicated", "sharded"}
  assert _described(layer.embedding_config) == _described(prepare(user_config, optimizer))
  assert _objects(layer.embedding_config) == objects
