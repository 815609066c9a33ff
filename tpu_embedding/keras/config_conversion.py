"""keras-rs `TableConfig`/`FeatureConfig` -> `tf.tpu.experimental.embedding` configs.

keras-rs users describe tables with `keras_rs.layers.TableConfig` (`embedding_dim`, a Keras
initializer and optimizer, a `placement`) and features with global-batch `input_shape` and
`output_shape`. The layer runs on the mid-level configs, so each keras-rs config is turned into
one here, once, with every table shared by the same features as in the user's nest. keras-rs
is optional and never imported here: if the user has not imported it, no keras-rs config exists.
"""

from __future__ import annotations

import sys
from typing import Any

import keras
import tensorflow as tf

from tpu_embedding import optimizers
from tpu_embedding import tf_internals

MidLevelFeatureConfig = tf.tpu.experimental.embedding.FeatureConfig
MidLevelTableConfig = tf.tpu.experimental.embedding.TableConfig

# keras-rs placements that put a table in the embedding engine (TPU) or leave it to us (CPU).
_ENGINE_PLACEMENTS = ("auto", "sparsecore")


def is_keras_rs_feature(leaf: Any) -> bool:
  """Whether `leaf` is a `keras_rs.layers.FeatureConfig`."""
  keras_rs = sys.modules.get("keras_rs")
  layers = getattr(keras_rs, "layers", None)
  return layers is not None and isinstance(leaf, layers.FeatureConfig)


def to_mid_level(feature_config: Any, num_replicas: int = 1) -> Any:
  """The same nest with every keras-rs `FeatureConfig` replaced by a mid-level one.

  Mid-level configs in the nest are kept as they are. Features sharing one keras-rs table
  share one mid-level table. `num_replicas` turns keras-rs's global batch sizes into the
  mid-level API's per-replica ones.
  """
  tables: dict[int, MidLevelTableConfig] = {}

  def convert(path: str, leaf: Any) -> Any:
    if not is_keras_rs_feature(leaf):
      return leaf
    if id(leaf.table) not in tables:
      tables[id(leaf.table)] = to_mid_level_table(leaf.table)
    return to_mid_level_feature(leaf, tables[id(leaf.table)], num_replicas, path)

  return tf.nest.pack_sequence_as(
    feature_config,
    [convert(path, leaf) for path, leaf in tf_internals.flatten_with_paths(feature_config)],
  )


def to_mid_level_table(table: Any) -> MidLevelTableConfig:
  """One keras-rs `TableConfig` as a mid-level one (strings name Keras objects, as in keras-rs)."""
  where = f"keras-rs TableConfig {table.name!r}"
  if table.placement not in _ENGINE_PLACEMENTS:
    raise ValueError(
      f"{where} has placement={table.placement!r}; TPUEmbedding puts every table in the "
      f"embedding engine ({' or '.join(map(repr, _ENGINE_PLACEMENTS))}). For tables kept on "
      "the TensorCore use tpu_embedding.keras.PartialTPUEmbedding, whose size_threshold "
      "decides each table's side."
    )
  initializer = table.initializer
  if isinstance(initializer, (str, dict)):
    initializer = keras.initializers.get(initializer)
  optimizer = table.optimizer
  if isinstance(optimizer, (str, dict)):
    optimizer = keras.optimizers.get(optimizer)
  return MidLevelTableConfig(
    vocabulary_size=table.vocabulary_size,
    dim=table.embedding_dim,
    initializer=initializer,
    optimizer=optimizers.normalize_optimizer(optimizer, where=f"{where}.optimizer"),
    combiner=table.combiner,
    name=table.name,
  )


def to_mid_level_feature(
  feature: Any, table: MidLevelTableConfig, num_replicas: int, path: str = ""
) -> MidLevelFeatureConfig:
  """One keras-rs `FeatureConfig` over its converted `table`.

  keras-rs gives the global-batch activation shape with the embedding dimension last; the
  mid-level API wants it per replica and without that dimension. A shape that is only
  (batch, dim) says what the input's own shape gives anyway, so it is not fixed: the layer
  then takes any batch size (e.g. in `predict`), as the mid-level API does by default.
  """
  where = f"keras-rs FeatureConfig {feature.name!r} (feature {path or '<root>'!r})"
  output_shape = list(feature.output_shape)
  if len(output_shape) < 2 or output_shape[-1] != table.dim:
    raise ValueError(
      f"{where} has output_shape={tuple(feature.output_shape)}; expected (batch, ..., "
      f"{table.dim}): a batch dimension first and the table's embedding_dim last."
    )
  batch = output_shape[0]
  if batch is not None and batch % num_replicas:
    raise ValueError(
      f"{where}: batch size {batch} of output_shape is not a multiple of the "
      f"{num_replicas} replicas in sync."
    )
  per_replica = None
  if len(output_shape) > 2 and None not in output_shape:
    per_replica = [batch // num_replicas, *output_shape[1:-1]]
  return MidLevelFeatureConfig(table=table, output_shape=per_replica, name=feature.name)
