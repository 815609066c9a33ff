"""`ManagedTables`: a layer's managed-id maps, applied to its feature nest before the lookup; and
how a layer takes them (`create`: on which paths, under which name in its checkpoints)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding.managed_ids import row_resets, sharded_map
from tpu_embedding.managed_ids.spec import KeyRowMap, ManagedIds, Reset, as_keys


class ManagedTables(tf.Module):
  """{table name: its map} for the tables named in a layer's `managed_ids`.

  Under `ParameterServerStrategy` each map is split with its table's row blocks: the layer
  creates the tables first and gives them (`variables_by_table`: {table name: {"parameters":
  variable, ...}}) where `sharded_map.splits_maps()`.
  """

  def __init__(
    self,
    managed_ids: Mapping[Any, ManagedIds],
    config: config_lib.EmbeddingConfig,
    variables_by_table: Optional[Mapping[str, Mapping[str, Any]]] = None,
  ):
    super().__init__()
    if not isinstance(managed_ids, Mapping):
      raise TypeError(
        f"managed_ids must be a dict {{table name or TableConfig: tpu_embedding.ManagedIds}}, "
        f"got {type(managed_ids).__name__}."
      )
    maps = {}
    for key, spec in managed_ids.items():
      table = config.find_table(key)
      name = key if isinstance(key, str) else getattr(key, "name", key)
      if table is None:
        raise ValueError(
          f"managed_ids names table {name!r}, which no feature of this layer uses; its tables "
          f"are {[t.name for t in config.tables]}."
        )
      if table.name in maps:
        raise ValueError(
          f"managed_ids names table {table.name!r} twice (by name and by its TableConfig?): "
          "give each table one ManagedIds."
        )
      if not isinstance(spec, ManagedIds):
        raise TypeError(
          f"managed_ids[{name!r}] is a {type(spec).__name__}; expected tpu_embedding.ManagedIds."
        )
      maps[table.name] = sharded_map.new_map(
        spec,
        table.name,
        table.vocabulary_size,
        None if variables_by_table is None else variables_by_table[table.name]["parameters"],
      )
    self.maps = maps
    self._tables = {t.name: t for t in config.tables}

  def check_resets_returned(self, layer_name: str) -> None:
    """Refuses a remap returning its resets where each map's step resets its own rows: under
    parameter servers a shard's step writes its rows on its ps task, within that step."""
    if any(isinstance(m, sharded_map.ShardedIdMap) for m in self.maps.values()):
      raise ValueError(
        f"Layer {layer_name!r} has managed ids split over parameter servers, whose shards reset "
        "the rows they give within their own step: remap(..., defer_resets=True) cannot return "
        "them. Call the layer with raw keys inside strategy.run. Nothing was changed."
      )

  def keys_of(self, config: config_lib.EmbeddingConfig, features: Any) -> ManagedKeys:
    """The raw keys of each managed feature of `features`, flat, in the layer's feature order."""
    pairs = config_lib.match_structure(config, features, subset=True)
    managed = [
      (index, feature.table.name, _keys_of(feature, ids, self.maps[feature.table.name]))
      for index, (feature, ids) in enumerate(pairs)
      if feature.table.name in self.maps
    ]
    return ManagedKeys(features, [ids for _, ids in pairs], managed)

  def step(
    self,
    tables: list[str],
    keys: list[tf.Tensor],
    training: bool,
    in_lock: Optional[row_resets.Writer] = None,
  ) -> tuple[list[tf.Tensor], dict[str, tf.Tensor]]:
    """(the rows of `keys`, the flat keys of features of `tables`, one entry each; the rows
    given to new keys, {table name: rows}). All keys of one table, in order, form one stream,
    so this is one step of each table's map. A map split over parameter servers hands its
    given rows to `in_lock` inside its shards' critical sections instead (no other worker may
    read them before they are written), and they are not returned."""
    streams: dict[str, list[int]] = {}
    for position, name in enumerate(tables):
      streams.setdefault(name, []).append(position)
    rows: list[Optional[tf.Tensor]] = [None] * len(keys)
    with tf.control_dependencies(keys):  # every table's keys checked before any map step
      given = self._step_streams(streams, keys, rows, training, in_lock)
    return rows, given

  def _step_streams(
    self,
    streams: Mapping[str, list[int]],
    keys: list[tf.Tensor],
    rows: list[Optional[tf.Tensor]],
    training: bool,
    in_lock: Optional[row_resets.Writer],
  ) -> dict[str, tf.Tensor]:
    """One step of each table's map over its stream of keys; `rows` given their rows."""
    given = {}
    for name, positions in streams.items():
      parts = [keys[p] for p in positions]
      stream = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
      id_map = self.maps[name]
      if isinstance(id_map, sharded_map.ShardedIdMap):
        got, _ = id_map.remap(stream, training, _written_in_lock(in_lock, name))
      else:
        got, given[name] = id_map.remap(stream, training)
      pieces = [got]  # one feature, the usual case: no concat and split around the map
      if len(parts) > 1:
        pieces = tf.split(got, tf.stack([tf.size(k) for k in parts]))
      for position, piece in zip(positions, pieces):
        rows[position] = piece
    return given if training else {}

  def with_row_zero(self, config: config_lib.EmbeddingConfig, features: Any, subset: bool) -> Any:
    """`features` with each managed table's keys replaced by row 0, in their layout: what the
    call's checks of ids, weights and shapes take before any map changes."""
    pairs = config_lib.match_structure(config, features, subset=subset)
    leaves = [
      _with_rows(ids, tf.zeros(tf.shape(flat_values(ids)), tf.int64))
      if feature.table.name in self.maps
      else ids
      for feature, ids in pairs
    ]
    return tf.nest.pack_sequence_as(features, leaves)


class ManagedKeys:
  """A feature nest's managed keys (`ManagedTables.keys_of`), to put their rows back in."""

  def __init__(self, features: Any, leaves: list[Any], managed: list[tuple[int, str, tf.Tensor]]):
    self._features, self._leaves = features, leaves
    self._indices = [index for index, _, _ in managed]
    self.tables = [name for _, name, _ in managed]  # each managed feature's table
    self.keys = [keys for _, _, keys in managed]

  def with_rows(self, rows: list[tf.Tensor]) -> Any:
    """The features with each managed feature's keys replaced by `rows` (one entry each)."""
    leaves = list(self._leaves)
    for index, piece in zip(self._indices, rows):
      leaves[index] = _with_rows(leaves[index], piece)
    return tf.nest.pack_sequence_as(self._features, leaves)


def _written_in_lock(writer: Optional[row_resets.Writer], name: str) -> Optional[Reset]:
  """What a shard of table `name`'s map calls in its critical section with the rows it gave."""
  if writer is None:
    return None
  return lambda rows, block=None: writer.write({name: rows}, block)


def _keys_of(feature: config_lib.Feature, ids: Any, id_map: KeyRowMap) -> tf.Tensor:
  """The feature's keys, flat, in the map's key dtype; refuses another kind by name."""
  where = f"Feature {feature.name!r}: its table {feature.table.name!r}"
  return as_keys(flat_values(ids), id_map.key_dtype, where)


def flat_values(ids: Any) -> tf.Tensor:
  """The ids of a dense, ragged or sparse feature as one flat tensor, in row-major order."""
  if isinstance(ids, tf.SparseTensor):
    return ids.values
  if isinstance(ids, tf.RaggedTensor):
    return ids.flat_values
  return tf.reshape(ids, [-1])


def _with_rows(ids: Any, rows: tf.Tensor) -> Any:
  if isinstance(ids, tf.SparseTensor):
    return tf.SparseTensor(ids.indices, rows, ids.dense_shape)
  if isinstance(ids, tf.RaggedTensor):
    return ids.with_flat_values(rows)
  return tf.reshape(rows, tf.shape(ids))


# ---------------------------------------------------------------------------------------------
# How a layer takes managed ids: on which paths, under which name in its checkpoints.

# The layer tracks its maps under this name: `<layer>/managed_ids/maps/<table>/...`.
CHECKPOINT_KEY = "managed_ids"


def create(
  managed_ids: Optional[Mapping[Any, Any]],
  config: config_lib.EmbeddingConfig,
  path: hardware.ExecutionPath,
  pipelining: bool,
  variables_by_table: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> Optional[ManagedTables]:
  """The layer's maps, or None without `managed_ids`; refuses the paths and options that cannot
  reset rows given to new keys exactly. `variables_by_table`: the layer's tables, created
  already, where the maps are split with their row blocks (`sharded_map.splits_maps()`)."""
  if managed_ids is None or (isinstance(managed_ids, Mapping) and not managed_ids):
    return None
  if pipelining and path is hardware.ExecutionPath.CPU:
    raise ValueError(
      "managed_ids cannot be combined with pipeline_execution_with_tensor_core=True off TPU: "
      "an update held back one step could land on a row given to another key meanwhile."
    )
  if pipelining and path is hardware.ExecutionPath.TPU_V2:
    raise ValueError(
      "managed_ids cannot be combined with pipeline_execution_with_tensor_core=True on path "
      "TPU_V2: SparseCore rows are reset as soon as they are given to a new key, and a gradient "
      "of the previous key held back one step could land on the fresh row. Pipelining with "
      "managed ids is supported on TPU_V1, whose resets wait a step (docs/managed-ids.md)."
    )
  return ManagedTables(managed_ids, config, variables_by_table)


def table_names(
  managed_ids: Optional[Mapping[Any, Any]], config: config_lib.EmbeddingConfig
) -> list[str]:
  """The names of this layer's tables that `managed_ids` names, read before any map (or, under
  parameter servers, table) is created; what it names wrongly is refused by `create`."""
  if not isinstance(managed_ids, Mapping):
    return []
  tables = [config.find_table(key) for key in managed_ids]
  return [table.name for table in tables if table is not None]


def specs(managed: ManagedTables) -> dict[str, ManagedIds]:
  """{table name: its ManagedIds}, what a backend needs to choose how it resets rows."""
  return {name: id_map.spec for name, id_map in managed.maps.items()}
