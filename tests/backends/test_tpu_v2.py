"""The SparseCore path (tpu_embedding.backends.TpuV2Backend) on TF's real `TPUEmbeddingV2` under
`tpu_harness.StandInTPUStrategy` (a SparseCore checkpoint read by table name, `sparse_core`'s
own: tests/test_sparse_core.py).

TF's own constructor stacks and pads the tables and creates the variables with its sharded
layout on CPU; nothing here runs on a TPU. TF 2.16 has `TPUEmbeddingV2` but no SparseCore
checkpoint adapter: there the path is refused (tests/test_tf_internals.py) and these do not run.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tpu_embedding import hardware, serving, sparse_core
from tpu_embedding.layer import TPUEmbedding

import tpu_harness
from sparse_core_layers import (
  BATCH,
  NEEDS_SPARSE_CORE,
  SIZES,
  cpu_layer,
  feature_config,
  sparse_core_layer,
  tables_by_name,
  written_layer,
)
from tpu_harness import logical_by_hand, stacked_by_hand

emb = tf.tpu.experimental.embedding
pytestmark = NEEDS_SPARSE_CORE


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("stacking", [True, False], ids=["stacked", "unstacked"])
def test_embedding_tables_are_the_logical_tables(monkeypatch, replicas, stacking):
  """Failure 4: tables of dims 4 and 2 with one optimizer share one padded stack; each table's
  value is read back un-dealt, un-rotated and un-padded."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2, replicas)
  layer = sparse_core_layer(strategy, stacking)
  layouts = layer.engine.embedding_layouts
  stacks = {layouts[name].stacked_table_name for name in SIZES}
  assert stacks == ({"user_video"} if stacking else {"video", "user"})
  assert all(layouts[name].unsharded_padded_shape[1] == 8 for name in SIZES)
  tables = {t.name: np.asarray(v) for t, v in layer.embedding_tables.items()}
  stacked = layer.engine.embedding_tables
  for name, (vocabulary, dim, offset) in SIZES.items():
    want = logical_by_hand(
      stacked_by_hand(stacked[layouts[name].stacked_table_name]), layouts[name]
    )
    np.testing.assert_array_equal(tables[name], want, err_msg=name)
    # Only this table's columns and rows: TF's initializer wrote offset + 100 * row + column.
    np.testing.assert_array_equal(tables[name] % 100, np.tile(np.arange(dim), (vocabulary, 1)))
    assert ((tables[name] >= offset) & (tables[name] < offset + 10000)).all(), name


@pytest.mark.parametrize(
  "setting,optimizer",
  [
    ("clipvalue", lambda: emb.SGD(0.1, use_gradient_accumulation=True, clipvalue=1.0)),
    ("clip_weight_min", lambda: emb.Adagrad(0.1, clip_weight_min=-1.0)),
    ("clip_weight_max", lambda: emb.SGD(0.1, clip_weight_max=1.0)),
    ("weight_decay_factor", lambda: emb.Adam(0.1, weight_decay_factor=0.01)),
  ],
)
def test_what_sparse_core_does_not_apply_is_refused_by_table_and_setting(
  monkeypatch, setting, optimizer
):
  """Failure 8: TF's SparseCore update silently skips clipping (and raises NotImplementedError
  deep inside for weight decay)."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  config = feature_config()
  config["y"].table.optimizer = optimizer()
  with strategy.scope():
    with pytest.raises(ValueError, match=rf"(?s)'user'.*{setting}.*TPU_V2"):
      TPUEmbedding(config, optimizer="sgd")


def test_a_keras_clipvalue_is_refused_on_sparse_core(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  with strategy.scope():
    with pytest.raises(ValueError, match=r"(?s)'video'.*clipvalue.*TPU_V2"):
      TPUEmbedding(feature_config(), optimizer=tf_keras.optimizers.legacy.SGD(0.1, clipvalue=0.5))


def test_a_cpu_checkpoint_restores_into_sparse_core_through_tfs_adapter(monkeypatch, tmp_path):
  """Failure 5, CPU -> V2: per-table keys, re-sharded by TF's checkpoint adapter. The restore
  must be issued before the layer is built (TF applies the adapter when it creates the
  variables)."""
  cpu = cpu_layer()
  for variable in cpu.embedding_tables.values():
    variable.assign(variable * 2.0 + 7.0)
  path = tf.train.Checkpoint(layer=cpu).write(str(tmp_path / "cpu"))
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  with strategy.scope():
    layer = TPUEmbedding(feature_config(), optimizer="adagrad")
  tf.train.Checkpoint(layer=layer).read(path)
  with strategy.scope():
    layer.build({"x": tf.TensorShape([BATCH]), "y": tf.TensorShape([BATCH])})
  want = tables_by_name(cpu.embedding_tables)
  for name, value in tables_by_name(layer.embedding_tables).items():
    np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_a_cpu_checkpoint_read_after_build_is_refused_and_changes_nothing(monkeypatch, tmp_path):
  """TF re-shards a per-table checkpoint only while it creates the SparseCore variables; read
  into a built layer it would change nothing in silence. Refused instead, before any value is
  assigned."""
  cpu = cpu_layer()
  for variable in cpu.embedding_tables.values():
    variable.assign(variable * 2.0 + 7.0)
  path = tf.train.Checkpoint(layer=cpu).write(str(tmp_path / "cpu"))
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  layer = sparse_core_layer(strategy)
  before = {
    name: {slot: stacked_by_hand(v) for slot, v in slots.items()}
    for name, slots in layer.variables_by_table.items()
  }
  with pytest.raises(ValueError, match=r"(?s)before the layer is built.*first call"):
    tf.train.Checkpoint(layer=layer).read(path)
  for name, slots in layer.variables_by_table.items():
    for slot, variable in slots.items():
      np.testing.assert_array_equal(stacked_by_hand(variable), before[name][slot])


def test_a_sparse_core_checkpoint_read_after_build_still_restores(monkeypatch, tmp_path):
  """Same layout on both sides: TF restores the stacked variables directly, built or not."""
  strategy, saved, path = written_layer(monkeypatch, tmp_path, seed=2)
  layer = sparse_core_layer(strategy)
  tf.train.Checkpoint(layer=layer).read(path).assert_consumed()
  want = tables_by_name(saved.embedding_tables)
  for name, value in tables_by_name(layer.embedding_tables).items():
    np.testing.assert_array_equal(value, want[name], err_msg=name)


@pytest.mark.parametrize("stacking", [True, False], ids=["stacked", "unstacked"])
def test_a_lookup_traces_one_sparse_core_matmul_per_stack(monkeypatch, stacking):
  """TF's own preprocessing and lookup graph (traced, not run). The backward step is not
  traced: TF reads SparseCore variables only inside a real TPU replica context."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  layer = sparse_core_layer(strategy, stacking)

  @tf.function
  def step(ids):
    return strategy.run(layer, args=(ids,))

  specs = {"x": tf.TensorSpec([BATCH], tf.int32), "y": tf.TensorSpec([BATCH], tf.int32)}
  with strategy.scope():
    concrete = step.get_concrete_function(specs)
  ops = [op.type for op in concrete.graph.get_operations()]
  assert ops.count("XlaSparseDenseMatmulWithStaticBufferSize") == (1 if stacking else 2)
  assert {k: v.shape.as_list() for k, v in concrete.structured_outputs.items()} == {
    "x": [BATCH, 4],
    "y": [BATCH, 2],
  }


def _serving_signature(layer):
  video = feature_config()["x"]

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
  def serve(ids):
    return layer({"x": ids}, serving_config={"x": video})["x"]

  return serve


def test_export_for_serving_of_a_sparse_core_layer_is_refused_and_writes_nothing(
  monkeypatch, tmp_path
):
  """The export would hold TF's stacked, padded variables, not the tables by name (its
  `embedding_tables` and `tables=` are by table name): refused with the way that works."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  layer = sparse_core_layer(strategy)
  with pytest.raises(ValueError, match=r"(?s)SparseCore.*restore_from_checkpoint"):
    serving.export_for_serving(layer, str(tmp_path / "export"), _serving_signature(layer))
  assert list(tmp_path.iterdir()) == []


def test_a_sparse_core_layer_serves_through_its_checkpoint_in_a_cpu_layer(monkeypatch, tmp_path):
  """The documented way to serve a SparseCore layer: restore its checkpoint into a CPU layer,
  export that; lookups give the SparseCore layer's logical rows."""
  _, layer, path = written_layer(monkeypatch, tmp_path, seed=4)
  cpu = cpu_layer()
  sparse_core.restore_from_checkpoint(path, "layer/_tpu_embedding", cpu.variables_by_table)
  exported = serving.export_for_serving(cpu, str(tmp_path / "export"), _serving_signature(cpu))
  loaded = tf.saved_model.load(exported)
  ids = [0, 3, 15, 3]
  (out,) = loaded.signatures["serving_default"](ids=tf.constant(ids)).values()
  video = tables_by_name(layer.embedding_tables)["video"]
  np.testing.assert_array_equal(out.numpy(), video[ids])
  np.testing.assert_array_equal(loaded.embedding_tables["video"].numpy(), video)
