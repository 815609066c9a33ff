"""All-or-nothing restores of managed-id maps, checked before TF binds any of the layer's state.

Runs from the layer's `_checkpoint_adapter` (see `tpu_embedding.checkpoints` for why raising
there changes nothing): every map must be in the checkpoint, with this capacity and key dtype.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tpu_embedding import tf_restore
from tpu_embedding.managed_ids.sharded_map import ShardedIdMap
from tpu_embedding.managed_ids.tables import CHECKPOINT_KEY, ManagedTables

_VARIABLE_VALUE = "VARIABLE_VALUE"


def validate_checkpoint(layer: Any, managed: ManagedTables, path: str) -> None:
  """Raises ValueError, naming each table, unless the checkpoint holds a matching map for each."""
  restore = tf_restore.restore_of(layer)
  maps = _child(restore, _child(restore, restore.node, CHECKPOINT_KEY), "maps")
  reader = tf.train.load_checkpoint(path)
  dtypes = reader.get_variable_to_dtype_map()
  problems = []
  for name, id_map in managed.maps.items():
    node = _child(restore, maps, name)
    if _child(restore, node, "keys") is None and _child(restore, node, "shards") is None:
      problems.append(
        f"table {name!r} manages its ids, but the checkpoint holds no managed-id map for it "
        "(written by a layer without managed_ids for this table)"
      )
      continue
    layout = _layout_problem(restore, node, id_map)
    if layout:
      problems.append(f"table {name!r}: {layout}")
      continue
    for where, part, label in _parts(restore, node, id_map):
      keys = _child(restore, where, "keys")
      shape, dtype = restore.stored_shape(keys), dtypes.get(_checkpoint_key(keys))
      matches = shape == [part.capacity] and dtype == part.key_dtype
      if not matches:
        problems.append(
          f"table {name!r}: its managed-id map{label} has capacity "
          f"{part.capacity} and key dtype {part.key_dtype.name} in this layer, but "
          f"{shape[0] if shape else None} and {getattr(dtype, 'name', None)} in the checkpoint"
        )
      twice = _keys_given_two_rows(restore, where, reader) if matches else []
      if twice:
        problems.append(
          f"table {name!r}: its managed-id map{label} in the checkpoint gives keys {twice} "
          "two rows or more each (a damaged or hand-edited checkpoint); each key has one row"
        )
      stale = _stale_dtypes(restore, where, part, dtypes)
      if stale:
        problems.append(
          f"table {name!r}: its managed-id map{label} stores {' and '.join(stale)} as int64 in "
          "the checkpoint (written by a tpu_embedding from before they became int32) but as "
          "int32 in this layer; this version cannot read such a map"
        )
  if problems:
    restore.forget_pending_restores()
    raise ValueError(
      f"Cannot restore the checkpoint {path!r} into the layer {layer.name!r}:\n  - "
      + "\n  - ".join(problems)
      + "\nNothing was changed (no table, slot or map)."
    )


def _layout_problem(restore: tf_restore.Restore, node: Any, id_map: Any) -> Optional[str]:
  """Why the checkpoint's map is split differently from this layer's, if it is."""
  shards = _child(restore, node, "shards")
  stored = 0 if shards is None else len(shards.children)
  wanted = id_map.num_shards if isinstance(id_map, ShardedIdMap) else 0
  if stored == wanted:
    return None
  if stored and wanted:
    return (
      f"its managed-id map is split into {wanted} parts in this layer but {stored} in the "
      "checkpoint, one per row block of the table (as the strategy's variable_partitioner cut "
      "it). A key's part is its hash modulo the number of parts and each part gives rows of its "
      "own block only, so under another cut the restored keys would belong to parts whose blocks "
      "do not hold their rows. Restore under a partitioner that cuts the table into "
      f"{stored} blocks (e.g. FixedShardsPartitioner({stored})), with any number of ps tasks"
    )

  def split(count: int) -> str:
    return f"split into {count} row blocks" if count else "whole (no parameter servers)"

  return (
    f"its managed-id map is {split(wanted)} in this layer but {split(stored)} in the "
    "checkpoint; restore it under a ParameterServerStrategy exactly when it was written under one"
  )


def _keys_given_two_rows(restore: tf_restore.Restore, where: Any, reader: Any) -> list[Any]:
  """Up to 5 keys that the checkpoint's map gives several rows (rows above 0 seen at some step:
  those holding keys)."""
  nodes = [_child(restore, where, name) for name in ("keys", "last_seen")]
  if any(node is None for node in nodes):
    return []
  keys, last_seen = (reader.get_tensor(_checkpoint_key(node)) for node in nodes)
  held = keys[1:][last_seen[1:] >= 0]
  values, counts = np.unique(held, return_counts=True)
  return [v.decode() if isinstance(v, bytes) else int(v) for v in values[counts > 1][:5]]


def _stale_dtypes(
  restore: tf_restore.Restore, where: Any, part: Any, dtypes: dict[str, tf.DType]
) -> list[str]:
  """The names of the map's int32 variables (counts, last_seen) that the checkpoint holds with
  another dtype (int64, before they were narrowed), on which TF's own restore fails with a bare
  dtype error."""
  stale = []
  for attribute in ("counts", "last_seen"):
    node = _child(restore, where, attribute)
    stored = dtypes.get(_checkpoint_key(node)) if node is not None else None
    if stored is not None and stored != getattr(part, attribute).dtype:
      stale.append(attribute)
  return stale


def _parts(restore: tf_restore.Restore, node: Any, id_map: Any) -> list[tuple[Any, Any, str]]:
  """(checkpoint node, IdMap, how to name it) of the map or of each of its shards."""
  if not isinstance(id_map, ShardedIdMap):
    return [(node, id_map, "")]
  shards, count = _child(restore, node, "shards"), id_map.num_shards
  return [
    (_child(restore, shards, str(k)), part, f" (shard {k} of {count})")
    for k, part in enumerate(id_map.shards)
  ]


def _child(restore: tf_restore.Restore, node: Any, name: str) -> Optional[Any]:
  if node is None:
    return None
  for child in node.children:
    if child.local_name == name:
      return restore.nodes[child.node_id]
  return None


def _checkpoint_key(node: Any) -> Optional[str]:
  for attribute in node.attributes:
    if attribute.name == _VARIABLE_VALUE:
      return attribute.checkpoint_key
  return None
