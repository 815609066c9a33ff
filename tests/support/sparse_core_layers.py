"""The layer the SparseCore tests share (tests/backends/test_tpu_v2.py, tests/test_sparse_core.py):
two tables of dims 4 and 2 on TF's real `TPUEmbeddingV2` under `tpu_harness.StandInTPUStrategy`,
or on the CPU path."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import hardware, tf_internals
from tpu_embedding.layer import TPUEmbedding

import tpu_harness
from tpu_harness import pattern

emb = tf.tpu.experimental.embedding
HAS_SPARSE_CORE = tf_internals.SPARSE_CORE_CHECKPOINTS is not None
# Both files' `pytestmark`: TF before 2.17 has no SparseCore checkpoint adapter.
NEEDS_SPARSE_CORE = pytest.mark.skipif(
  not HAS_SPARSE_CORE, reason=f"no SparseCore on TF {tf.__version__}"
)
BATCH = 4
SIZES = {"video": (16, 4, 0.0), "user": (32, 2, 10000.0)}  # vocabulary, dim, value offset


def feature_config():
  """Features x (table video, 16 x 4) and y (table user, 32 x 2), BATCH samples each."""
  tables = {
    name: emb.TableConfig(vocabulary, dim, name=name, initializer=pattern(offset))
    for name, (vocabulary, dim, offset) in SIZES.items()
  }
  return {
    "x": emb.FeatureConfig(tables["video"], output_shape=[BATCH]),
    "y": emb.FeatureConfig(tables["user"], output_shape=[BATCH]),
  }


def sparse_core_layer(strategy, stacking=True):
  """The layer on SparseCore under `strategy`, built, its tables stacked unless `stacking` is
  False."""
  sc_config = emb.SparseCoreEmbeddingConfig(disable_table_stacking=not stacking)
  with strategy.scope():
    layer = TPUEmbedding(
      feature_config(), optimizer="adagrad", sparse_core_embedding_config=sc_config
    )
    layer.build({"x": tf.TensorShape([BATCH]), "y": tf.TensorShape([BATCH])})
  return layer


def cpu_layer():
  """The same layer on the CPU path, built."""
  layer = TPUEmbedding(feature_config(), optimizer="adagrad")
  layer.build({"x": tf.TensorShape([BATCH]), "y": tf.TensorShape([BATCH])})
  return layer


def tables_by_name(tables):
  """{table name: value} of a layer's `embedding_tables`."""
  return {t.name: np.asarray(v) for t, v in tables.items()}


def written_layer(monkeypatch, tmp_path, seed):
  """(strategy, a built stacked layer whose stack holds seeded values, the checkpoint it wrote)."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  layer = sparse_core_layer(strategy)
  tpu_harness.fill_shards(layer.variables_by_table["user_video"].values(), seed)
  return strategy, layer, tf.train.Checkpoint(layer=layer).write(str(tmp_path / "sc"))
