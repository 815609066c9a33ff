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

from tpu_embedding import optimizers, tf_internals

MidLevelFeatureConfig = tf.tpu.experimental.embedding.FeatureConfig
MidLevelTableConfig = tf.tpu.experimental.embedding.TableConfig

# keras-rs placements that put a table in the embedding engine (TPU) or leave it to us (CPU).
ENGINE_PLACEMENTS = ("auto", "sparsecore")
ALL_PLACEMENTS = (*ENGINE_PLACEMENTS, "default_device")


def is_keras_rs_feature(leaf: Any) -> bool:
  """Whether `leaf` is a `keras_rs.layers.FeatureConfig`."""
  keras_rs = sys.modules.get("keras_rs")
  layers = getattr(keras_rs, "layers", None)
  return layers is not None and isinstance(leaf, layers.FeatureConfig)


def to_mid_level(
  feature_config: Any,
  num_replicas: int = 1,
  placements: tuple[str, ...] = ENGINE_PLACEMENTS,
  fix_batch: bool = False,
) -> Any:
  """The same nest with every keras-rs `FeatureConfig` replaced by a mid-level one.

  Mid-level configs in the nest are kept as they are. Features sharing one keras-rs table
  share one mid-level table. `num_replicas` turns keras-rs's global batch sizes into the
  mid-level API's per-replica ones; `placements` are those the caller can place
  (`to_mid_level_feature` says what `fix_batch` does).
  """
  tables: dict[int, MidLevelTableConfig] = {}

  def convert(path: str, leaf: Any) -> Any:
    if not is_keras_rs_feature(leaf):
      return leaf
    if id(leaf.table) not in tables:
      tables[id(leaf.table)] = to_mid_level_table(leaf.table, placements)
    return to_mid_level_feature(leaf, tables[id(leaf.table)], num_replicas, path, fix_batch)

  return tf.nest.pack_sequence_as(
    feature_config,
    [convert(path, leaf) for path, leaf in tf_internals.flatten_with_paths(feature_config)],
  )


def to_mid_level_table(
  table: Any, placements: tuple[str, ...] = ENGINE_PLACEMENTS
) -> MidLevelTableConfig:
  """One keras-rs `TableConfig` as a mid-level one (strings name Keras objects, as in keras-rs).

  A placement outside `placements` is refused: `TPUEmbedding` and `PartialTPUEmbedding` decide
  each table's side themselves; `DistributedEmbedding` reads it (and passes all three).
  """
  where = f"keras-rs TableConfig {table.name!r}"
  if table.placement not in placements:
    raise ValueError(
      f"{where} has placement={table.placement!r}; this layer takes "
      f"{' or '.join(map(repr, placements))}. {_placement_hint(table.placement, placements)}"
    )
  initializer = _keras_object(keras.initializers, table.initializer, f"{where}.initializer")
  optimizer = _keras_object(keras.optimizers, table.optimizer, f"{where}.optimizer")
  return MidLevelTableConfig(
    vocabulary_size=table.vocabulary_size,
    dim=table.embedding_dim,
    initializer=initializer,
    optimizer=optimizers.normalize_optimizer(optimizer, where=f"{where}.optimizer"),
    combiner=table.combiner,
    name=table.name,
  )


def _placement_hint(placement: Any, placements: tuple[str, ...]) -> str:
  """What to do about a placement this layer does not take."""
  if isinstance(placement, str) and placement.lower() in placements:
    return f"Placements are lower case: placement={placement.lower()!r}."
  if placement in ALL_PLACEMENTS:
    return (
      "For its default_device (replicated) tables use tpu_embedding.keras.DistributedEmbedding."
    )
  return "keras-rs placements are 'auto', 'sparsecore' and 'default_device'."


def _keras_object(module: Any, value: Any, where: str) -> Any:
  """`module.get(value)` for a name or a config (as keras-rs resolves them), refused by `where`
  if Keras knows no such object."""
  if not isinstance(value, (str, dict)):
    return value
  try:
    return module.get(value)
  except (ValueError, TypeError) as error:
    kind = module.__name__.rsplit(".", 1)[-1][:-1]  # "optimizer", "initializer"
    raise ValueError(
      f"{where}={value!r}: Keras has no {kind} of that name ({error}). Pass a Keras {kind} "
      "or the name of one; nothing was built."
    ) from None


def to_mid_level_feature(
  feature: Any,
  table: MidLevelTableConfig,
  num_replicas: int,
  path: str = "",
  fix_batch: bool = False,
) -> MidLevelFeatureConfig:
  """One keras-rs `FeatureConfig` over its converted `table`.

  keras-rs gives the global-batch activation shape with the embedding dimension last; the
  mid-level API wants it per replica and without that dimension. The layers read a shape that
  is only (batch, dim) as what the input's own shape gives anyway, so it is not fixed there
  (`fix_batch=False`): they then take any batch size (e.g. in `predict`), as the mid-level API
  does by default. keras-rs's own conversion fixes it (`fix_batch=True`: `(batch // replicas,)`),
  as `keras_to_tf_tpu_configuration` does.
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
  if (fix_batch or len(output_shape) > 2) and None not in output_shape:
    per_replica = [batch // num_replicas, *output_shape[1:-1]]
  return MidLevelFeatureConfig(table=table, output_shape=per_replica, name=feature.name)


# ---------------------------------------------------------------------------------------------
# keras-rs's own conversion functions (`keras_rs.src.layers.embedding.tensorflow.
# config_conversion`), under their names, so code and tests written against them switch by import


def to_tf_tpu_optimizer(optimizer: Any) -> Any:
  """A Keras optimizer (or its name, or a mid-level one) as a mid-level optimizer."""
  if isinstance(optimizer, (str, dict)):
    optimizer = keras.optimizers.get(optimizer)
  return optimizers.normalize_optimizer(optimizer, where="optimizer")


def keras_to_tf_tpu_table_config(table: Any) -> MidLevelTableConfig:
  """One keras-rs `TableConfig` as a mid-level one, whatever its placement."""
  return to_mid_level_table(table, ALL_PLACEMENTS)


def keras_to_tf_tpu_configuration(
  feature_configs: Any, table_stacking: Any = "auto", num_replicas_in_sync: int = 1
) -> tuple[Any, Any]:
  """keras-rs configs as (mid-level feature nest, `SparseCoreEmbeddingConfig`), converted as
  keras-rs converts them: every output_shape's batch fixed per replica."""
  features = to_mid_level(feature_configs, num_replicas_in_sync, ALL_PLACEMENTS, fix_batch=True)
  return features, sparse_core_config(table_stacking)


def sparse_core_config(table_stacking: Any) -> Any:
  """keras-rs's `table_stacking` as TF's SparseCore config: "auto" stacks, None does not."""
  if table_stacking is not None and table_stacking != "auto":
    raise ValueError(
      f"table_stacking={table_stacking!r}: on TensorFlow only 'auto' (TensorFlow stacks the "
      "tables) or None (no stacking) are supported, as in keras-rs."
    )
  return tf_internals.sparse_core_config(disable_table_stacking=table_stacking is None)
