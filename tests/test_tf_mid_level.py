"""tpu_embedding.tf_mid_level on TF's real mid-level classes, with only the TPU runtime stubbed
(tests/support/tpu_harness.py): a TF upgrade that moves what the adapter reads fails here, by
name."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf.tpu import optimization_parameters_pb2

from tpu_embedding import tf_mid_level, tf_versions
from tpu_embedding.hardware import EmbeddingFeature

import tpu_harness

emb = tf.tpu.experimental.embedding
BATCH = 2
# Protobuf >= 5 refuses TF's default packing status (the bool False) in V1's config proto.
UNSPECIFIED_PACKING = optimization_parameters_pb2.LowDimensionalPackingStatus.Status.UNSPECIFIED


def test_checked_tf_version_is_the_installed_one():
  assert tf_versions.minor_version(tf.__version__) in tf_mid_level.CHECKED_AGAINST, (
    f"tpu_embedding.tf_mid_level was checked against TF {tf_mid_level.CHECKED_AGAINST}, this "
    f"is {tf.__version__}: re-check the two members it reads, then add the version."
  )


def built(monkeypatch, feature):
  """A built V0 (no optimizer, as the V0 backend builds it) or V1 (Adagrad) object."""
  strategy, recorded = tpu_harness.tpu_strategy(monkeypatch, feature)
  video, user = tpu_harness.video_and_user_tables()
  config = {"watched": emb.FeatureConfig(table=video), "friends": emb.FeatureConfig(table=user)}
  with strategy.scope():
    if feature is EmbeddingFeature.UNSUPPORTED:
      mid_level = emb.TPUEmbeddingV0(config, None)
      mid_level.build()
    else:
      mid_level = emb.TPUEmbedding(
        config,
        emb.Adagrad(
          0.1, initial_accumulator_value=0.5, low_dimensional_packing_status=UNSPECIFIED_PACKING
        ),
      )
      mid_level.build(per_replica_batch_size=BATCH)
  return mid_level, recorded


@pytest.mark.parametrize("feature", [EmbeddingFeature.UNSUPPORTED, EmbeddingFeature.V1])
def test_variables_by_table_is_the_dict_the_object_looks_up_from(monkeypatch, feature):
  mid_level, _ = built(monkeypatch, feature)
  variables = tf_mid_level.variables_by_table(mid_level)
  slots = [] if feature is EmbeddingFeature.UNSUPPORTED else ["accumulators"]
  assert {name: sorted(v) for name, v in variables.items()} == {
    "video": sorted(["parameters", *slots]),
    "user": sorted(["parameters", *slots]),
  }
  table = variables["video"]["parameters"]
  value = table.variables[0] if feature is EmbeddingFeature.V1 else table  # V1: one host shard
  np.testing.assert_array_equal(value.numpy(), np.arange(8.0).reshape(2, 4))
  if slots:
    accumulators = variables["user"]["accumulators"].variables[0].numpy()
    np.testing.assert_array_equal(accumulators, np.full((4, 2), 0.5))
  else:  # V0 reads its tables from this dict: a replaced entry is what it looks up
    replacement = tf.Variable(np.full((2, 4), 7.0, np.float32))
    variables["video"]["parameters"] = replacement
    looked_up = mid_level({"watched": tf.constant([1]), "friends": tf.constant([0])})
    np.testing.assert_array_equal(looked_up["watched"].numpy(), np.full((1, 4), 7.0))


def test_retrieve_from_tpu_runs_tfs_retrieval_of_every_table(monkeypatch):
  mid_level, recorded = built(monkeypatch, EmbeddingFeature.V1)
  before = recorded.retrieves
  tf_mid_level.retrieve_from_tpu(mid_level)
  assert recorded.retrieves == before + 1


def test_load_into_tpu_runs_tfs_load_of_every_table(monkeypatch):
  """Managed ids reset rows in V1's host copies and load them: TF's own load, traced here."""
  mid_level, recorded = built(monkeypatch, EmbeddingFeature.V1)
  before = recorded.loads
  tf_mid_level.load_into_tpu(mid_level)
  assert recorded.loads == before + 1


@pytest.mark.parametrize("feature", [EmbeddingFeature.UNSUPPORTED, EmbeddingFeature.V1])
def test_plain_variables_are_v1s_host_shards_and_any_other_variable_itself(monkeypatch, feature):
  mid_level, _ = built(monkeypatch, feature)
  table = tf_mid_level.variables_by_table(mid_level)["video"]["parameters"]
  pieces = tf_mid_level.plain_variables(table)
  assert all(type(piece) is type(pieces[0]) for piece in pieces)
  assert isinstance(pieces[0], tf.Variable)
  if feature is EmbeddingFeature.V1:  # one host: one shard, the whole table
    assert [piece.name for piece in pieces] == ["video_0:0"]
  else:
    assert pieces == [table]
  np.testing.assert_array_equal(pieces[0].numpy(), np.arange(8.0).reshape(2, 4))


@pytest.mark.skipif(not hasattr(emb, "TPUEmbeddingV2"), reason="TF 2.15 has no SparseCore")
def test_plain_variables_are_sparse_cores_per_device_shards(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, EmbeddingFeature.V2, replicas=2)
  table = emb.TableConfig(8, 4, name="video", initializer=tpu_harness.pattern(0.0))
  with strategy.scope():
    features = {"watched": emb.FeatureConfig(table, output_shape=[BATCH])}
    mid_level = emb.TPUEmbeddingV2(features, emb.Adagrad(0.1))
    mid_level.build()
  stacked = mid_level.variables["video"]["parameters"]
  pieces = tf_mid_level.plain_variables(stacked)
  assert [type(piece).__name__ for piece in pieces] == ["ResourceVariable"] * 2
  assert [piece.name for piece in pieces] == ["video/0:0", "video/1:0"]  # one per device, in order
  assert [piece.shape[0] for piece in pieces] == [stacked.shape[0] // 2] * 2
  np.testing.assert_array_equal(
    np.concatenate([piece.numpy() for piece in pieces]), tpu_harness.stacked_by_hand(stacked)
  )
