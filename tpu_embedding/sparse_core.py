"""SparseCore (TPUEmbeddingV2) tables: from TF's stacked, padded, sharded layout to the logical
table a user configured.

TF stacks tables that share an optimizer and quantization into one variable, pads each table's
width (to a multiple of 8) and rows (per SparseCore), deals the rows out round-robin over every
SparseCore and rotates each table's shards. `embedding_layouts` records where each table went;
TF's own `tpu_embedding_v3_utils` functions undo it, the same ones its checkpoint adapter and
`TPUEmbeddingForServing` use, so this module reads tables exactly as TF restores them.
"""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from tpu_embedding import checkpoint_names, tf_internals, tf_mid_level

TableConfig = tf.tpu.experimental.embedding.TableConfig


def stacked_value(variable: Any) -> tf.Tensor:
  """The whole stacked variable: its per-device shards in device order, one after another."""
  return tf.concat(
    [tf.convert_to_tensor(shard) for shard in tf_mid_level.plain_variables(variable)], axis=0
  )


def logical_table(stacked: tf.Tensor, layout: Any) -> tf.Tensor:
  """The [vocabulary_size, dim] table that `layout` (a SparseCoreTableLayout) places in
  `stacked`: rows un-dealt and un-rotated, padding dropped."""
  padded = tf_internals.unshuffle_from_sparse_cores(
    stacked,
    num_sparse_cores=layout.num_sparse_cores,
    offset_in_shard=layout.sparse_core_shard_row_offset,
    size_in_shard=layout.unsharded_padded_shape[0] // layout.num_sparse_cores,
    shard_rotation=layout.sparse_core_shard_rotation,
  )
  return tf_internals.remove_sparse_core_padding(padded, tuple(layout.unsharded_shape))


def write_logical_rows(
  variables: Mapping[str, Any], layout: Any, rows: tf.Tensor, values: Mapping[str, tf.Tensor]
) -> None:
  """Writes each `values[name]` ([len(rows), dim]) into logical `rows` of the table `layout`
  places in the stacked `variables[name]` (the table and its slots), shard by shard, leaving
  the padding columns as they are. Where the rows land is worked out once for all of them."""
  placements: dict[tuple[int, ...], list[tuple[tf.Tensor, tf.Tensor]]] = {}
  dim = int(layout.unsharded_shape[1])
  for name, value in values.items():
    shards = tf_mid_level.plain_variables(variables[name])
    sizes = tuple(int(shard.shape[0]) for shard in shards)
    if sizes not in placements:
      placements[sizes] = row_placement(layout, rows, sizes)
    for shard, (mine, local) in zip(shards, placements[sizes]):
      padding = tf.gather(shard, local)[:, dim:]
      shard.scatter_update(tf.IndexedSlices(tf.concat([tf.gather(value, mine), padding], 1), local))


def row_placement(
  layout: Any, rows: tf.Tensor, shard_sizes: tuple[int, ...]
) -> list[tuple[tf.Tensor, tf.Tensor]]:
  """For each per-device shard (of `shard_sizes` rows) of a stacked variable, (positions in
  `rows` of the logical rows it holds, their rows within the shard).

  Logical row r lives on SparseCore (r mod n + rotation) mod n, at row offset + r // n of that
  core's block (the placement `logical_table` undoes); the blocks are the stacked rows split in
  n, and the stacked rows are the per-device shards one after another.
  """
  n = layout.num_sparse_cores
  rows = tf.cast(rows, tf.int64)
  core = (rows % n + layout.sparse_core_shard_rotation) % n
  stacked_row = core * (sum(shard_sizes) // n) + layout.sparse_core_shard_row_offset + rows // n
  starts = tf.constant([sum(shard_sizes[:i]) for i in range(len(shard_sizes))], tf.int64)
  shard_of = tf.cast(tf.searchsorted(starts, stacked_row, side="right") - 1, tf.int32)
  placement = []
  for index in range(len(shard_sizes)):
    mine = tf.where(tf.equal(shard_of, index))[:, 0]
    placement.append((mine, tf.gather(stacked_row, mine) - starts[index]))
  return placement


def logical_tables(
  stacked_variables: dict[str, Any], layouts: dict[str, Any], tables: tuple[TableConfig, ...]
) -> dict[TableConfig, tf.Tensor]:
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


def needs_relayout(path: str, mid_level: tf.Module) -> bool:
  """Whether the checkpoint at `path` holds `mid_level`'s tables in another layout (per table, or
  other SparseCore layouts), which TF's checkpoint adapter converts only while `mid_level`
  creates its variables: a restore into built variables would then silently change nothing."""
  return tf_internals.sparse_core_checkpoint_needs_relayout(path, mid_level)


def stacked_tables_in(path: str) -> set[str]:
  """The names of the tables that the checkpoint at `path` holds stacked by SparseCore.

  Raises `tf_internals.NoSparseCore` under a TF without SparseCore (2.15) if the checkpoint
  holds any: that TF cannot read which tables they are, so a restore must stop."""
  reader = tf.train.load_checkpoint(path)
  found = set()
  for key in reader.get_variable_to_shape_map():
    if key.endswith(_key("", _LAYOUTS)):
      layouts = tf_internals.sparse_core_layouts(reader.get_tensor(key))
      found.update(layout.table_name for layout in layouts.tables)
  return found


def refuse_stacked_tables(
  path: str, table_names: set[str], receiver: str, mid_level_path: str
) -> None:
  """Raises if the checkpoint at `path` holds any of `table_names` stacked by SparseCore.

  Called off SparseCore, from TF's restore hook of `receiver` (before anything is assigned):
  its per-table variables would otherwise silently keep their values, since the checkpoint
  names the stacks, not the tables. `mid_level_path` is where, below the receiver's own
  checkpoint path, the saving layer kept its SparseCore object (for the message).
  """
  stacked = sorted(stacked_tables_in(path) & table_names)
  if stacked:
    raise ValueError(
      f"Cannot restore the checkpoint {path!r} into {receiver}: it holds the tables {stacked} "
      "stacked by SparseCore, which a layer off SparseCore cannot read by table name. Restore "
      "it into the layer built under a SparseCore TPUStrategy, or read those tables with "
      f"tpu_embedding.sparse_core.restore_from_checkpoint(path, '<path to the layer>/"
      f"{mid_level_path}', <per-table variables>). Nothing was changed."
    )


def restore_from_checkpoint(
  path: str, layer_path: str, variables_by_table: dict[str, dict[str, tf.Variable]]
) -> None:
  """Loads the tables and slots a SparseCore layer saved at `path` into unstacked variables.

  A SparseCore checkpoint holds stacked, padded, sharded values under stacked names plus the
  layouts; other paths key each table by its own name, so `tf.train.Checkpoint.restore` cannot
  match them. This reads each table's values through its layout. Everything is read and checked
  first, then assigned: a refused checkpoint changes no variable.

  Args:
    path: the checkpoint (a prefix as `tf.train.Checkpoint.write` returns, or a directory).
    layer_path: where the saved layer's mid-level object sits in the checkpoint, e.g.
      "model/embedding/_tpu_embedding".
    variables_by_table: the receiving layer's `variables_by_table`.
  """
  reader = tf.train.load_checkpoint(path)
  layouts = tf_internals.sparse_core_layouts(reader.get_tensor(_key(layer_path, _LAYOUTS)))
  by_table = {layout.table_name: layout for layout in layouts.tables}
  missing = sorted(set(variables_by_table) - set(by_table))
  if missing:
    raise ValueError(
      f"The SparseCore checkpoint {path} at {layer_path!r} has no table "
      f"{missing}; it holds {sorted(by_table)}."
    )
  values = []
  for table, variables in variables_by_table.items():
    layout = by_table[table]
    for slot, variable in variables.items():
      key = _key(layer_path, checkpoint_names.variable_key(layout.stacked_table_name, slot))
      if not reader.has_tensor(key):
        raise ValueError(
          f"The SparseCore checkpoint {path} has no {slot!r} for table "
          f"{table!r} (looked for {key!r})."
        )
      value = logical_table(tf.constant(reader.get_tensor(key)), layout)
      if value.shape != variable.shape:
        raise ValueError(
          f"Table {table!r} {slot!r}: the checkpoint holds shape {value.shape}, "
          f"the layer {variable.shape}."
        )
      values.append((variable, value))
  for variable, value in values:
    variable.assign(value)


_LAYOUTS = tf_internals.SPARSE_CORE_LAYOUTS_KEY


def _key(layer_path: str, name: str) -> str:
  """The checkpoint key of the variable tracked as `name` (TF escapes '/' and '.' in names)."""
  return f"{layer_path}/{tf_internals.escape_checkpoint_name(name)}/.ATTRIBUTES/VARIABLE_VALUE"
