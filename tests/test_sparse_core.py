"""Tests of `tpu_embedding.sparse_core`: a SparseCore checkpoint read by table name into a layer
off SparseCore (`restore_from_checkpoint`), against TF's own serving class, and refused where it
would be read in silence. The checkpoints come from TF's real `TPUEmbeddingV2` under
`tpu_harness.StandInTPUStrategy`; nothing here runs on a TPU.
"""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import hardware, sparse_core
from tpu_embedding.layer import TPUEmbedding

import sparse_core_layers as layers
import tpu_harness
from tpu_harness import logical_by_hand, stacked_by_hand

emb = tf.tpu.experimental.embedding
pytestmark = layers.NEEDS_SPARSE_CORE


def test_a_sparse_core_checkpoint_restores_into_the_cpu_layer(monkeypatch, tmp_path):
  """Failure 5, V2 -> CPU: stacked, padded, sharded values read back through the layouts,
  tables and Adagrad accumulators."""
  _, layer, path = layers.written_layer(monkeypatch, tmp_path, seed=1)
  stacked = layer.engine.variables["user_video"]
  cpu = layers.cpu_layer()
  sparse_core.restore_from_checkpoint(path, "layer/_tpu_embedding", cpu.variables_by_table)
  layouts = layer.engine.embedding_layouts
  for name, variables in cpu.variables_by_table.items():
    for slot in ("parameters", "accumulators"):
      want = logical_by_hand(stacked_by_hand(stacked[slot]), layouts[name])
      np.testing.assert_array_equal(variables[slot].numpy(), want, err_msg=f"{name} {slot}")


@pytest.mark.parametrize(
  "feature,optimizer",
  [(hardware.EmbeddingFeature.V1, "adagrad"), (hardware.EmbeddingFeature.UNSUPPORTED, "sgd")],
  ids=["V1", "V0"],
)
def test_a_sparse_core_checkpoint_is_refused_on_other_tpu_paths(
  monkeypatch, tmp_path, feature, optimizer
):
  """V1 and V0 keep per-table variables: a SparseCore checkpoint names only its stacks, so
  they would keep their values in silence."""
  _, _, path = layers.written_layer(monkeypatch, tmp_path, seed=6)
  monkeypatch.undo()  # the next stand-in stubs TF's own runtime functions again
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, feature)
  with strategy.scope():
    layer = TPUEmbedding(layers.feature_config(), optimizer=optimizer)
    layer.build({"x": tf.TensorShape([layers.BATCH]), "y": tf.TensorShape([layers.BATCH])})
  before = {
    name: value.copy() for name, value in layers.tables_by_name(layer.embedding_tables).items()
  }
  with pytest.raises(
    ValueError,
    match=r"(?s)\['user', 'video'\] stacked by SparseCore.*"
    r"restore_from_checkpoint.*Nothing",
  ):
    tf.train.Checkpoint(layer=layer).read(path)
  for name, value in layers.tables_by_name(layer.embedding_tables).items():
    np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_a_sparse_core_checkpoint_missing_a_table_changes_nothing(monkeypatch, tmp_path):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  path = tf.train.Checkpoint(layer=layers.sparse_core_layer(strategy)).write(str(tmp_path / "sc"))
  extra = emb.TableConfig(8, 2, name="extra")
  config = dict(layers.feature_config(), z=emb.FeatureConfig(extra))
  cpu = TPUEmbedding(config, optimizer="adagrad")
  cpu.build(
    {
      "x": tf.TensorShape([layers.BATCH]),
      "y": tf.TensorShape([layers.BATCH]),
      "z": tf.TensorShape([layers.BATCH]),
    }
  )
  before = {
    name: {s: v.numpy() for s, v in slots.items()} for name, slots in cpu.variables_by_table.items()
  }
  with pytest.raises(ValueError, match=r"no table \['extra'\]"):
    sparse_core.restore_from_checkpoint(path, "layer/_tpu_embedding", cpu.variables_by_table)
  for name, slots in cpu.variables_by_table.items():
    for slot, variable in slots.items():
      np.testing.assert_array_equal(variable.numpy(), before[name][slot])


def test_tfs_own_serving_class_reads_the_same_tables_from_a_sparse_core_checkpoint(
  monkeypatch, tmp_path
):
  """Cross-check of sparse_core.restore_from_checkpoint with TF's TPUEmbeddingForServing,
  which restores SparseCore checkpoints its own way (a restore issued before it is built)."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  path = tf.train.Checkpoint(layer=layers.sparse_core_layer(strategy)).write(str(tmp_path / "sc"))
  cpu = layers.cpu_layer()
  sparse_core.restore_from_checkpoint(path, "layer/_tpu_embedding", cpu.variables_by_table)
  serving = emb.TPUEmbeddingForServing(layers.feature_config(), emb.Adagrad(0.1))
  holder = tf.train.Checkpoint(_tpu_embedding=serving)  # the path the layer saved under
  tf.train.Checkpoint(layer=holder).read(path).expect_partial()
  serving.build()
  want = layers.tables_by_name(cpu.embedding_tables)
  for name, value in layers.tables_by_name(serving.embedding_tables).items():
    np.testing.assert_array_equal(value, want[name], err_msg=name)
