"""SparseCore (TPUEmbeddingV2) tables: from TF's stacked, padded, sharded layout to the logical
table a user configured.

TF stacks tables that share an optimizer and quantization into one variable, pads each table's
width (to a multiple of 8) and rows (per SparseCore), deals the rows out round-robin over every
SparseCore and rotates each table's shards. `embedding_layouts` records where each table went;
TF's own `tpu_embedding_v3_utils` functions undo it, the same ones its checkpoint adapter and
`TPUEmbeddingForServing` use, so this module reads tables exactly as TF restores them.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.tpu import tpu_embedding_v3_utils

TableConfig = tf.tpu.experimental.embedding.TableConfig


def stacked_value(variable: Any) -> tf.Tensor:
  """The whole stacked variable: its per-device shards in device order, one after another."""
  shards = list(getattr(variable, "values", None) or [variable])
  return tf.concat([tf.convert_to_tensor(shard) for shard in shards], axis=0)


def logical_table(stacked: tf.Tensor, layout: Any) -> tf.Tensor:
  """The [vocabulary_size, dim] table that `layout` (a SparseCoreTableLayout) places in
  `stacked`: rows un-dealt and un-rotated, padding dropped."""
  padded = tpu_embedding_v3_utils.unshuffle_from_sc_to_cpu(
      stacked,
      num_sparse_cores=layout.num_sparse_cores,
      offset_in_shard=layout.sparse_core_shard_row_offset,
      size_in_shard=layout.unsharded_padded_shape[0] // layout.num_sparse_cores,
      shard_rotation=layout.sparse_core_shard_rotation)
  return tpu_embedding_v3_utils.remove_padding_from_sc(padded, tuple(layout.unsharded_shape))


def logical_tables(stacked_variables: dict[str, Any], layouts: dict[str, Any],
                   tables: tuple[TableConfig, ...]) -> dict[TableConfig, tf.Tensor]:
  """{table: its logical value} for `tables`, read from the stacked variables (keyed by stacked
  table name) through each table's layout (keyed by table name)."""
  stacks: dict[str, tf.Tensor] = {}
  result = {}
  for table in tables:
    layout = layouts[table.name]
    name = layout.stacked_table_name
    if name not in stacks:
      stacks[name] = stacked_value(stacked_variables[name])
    result[table] = logical_table(stacks[name], layout)
  return result
