"""All-or-nothing restores of managed-id maps, checked before TF binds any of the layer's state.

Runs from the layer's `_checkpoint_adapter` (see `tpu_embedding.checkpoints` for why raising
there changes nothing): every map must be in the checkpoint, with this capacity and key dtype.

A string-key map holds its strings' int64 fingerprints, tracked as `fingerprints`. Checkpoints
written before held the strings themselves, under `keys`, which TF cannot read into an int64
variable: once every check has passed, such a map is read here, its keys and waiting keys
fingerprinted and assigned, and its entries unlinked from TF's restore (`_convert_strings`).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tpu_embedding import tf_restore
from tpu_embedding.managed_ids.id_map import FINGERPRINTS, IdMap, keys_name
from tpu_embedding.managed_ids.sharded_map import ShardedIdMap
from tpu_embedding.managed_ids.spec import fingerprint
from tpu_embedding.managed_ids.tables import CHECKPOINT_KEY, ManagedTables

_VARIABLE_VALUE = "VARIABLE_VALUE"
# A hash table's entries in a checkpoint: its attribute's key with these suffixes.
_TABLE_KEYS, _TABLE_VALUES = "-keys", "-values"
# The variables and tables of an `IdMap` in a checkpoint, besides its keys.
_MAP_PARTS = ("counts", "last_seen", "step", "rows_of_keys", "candidates")


def validate_checkpoint(layer: Any, managed: ManagedTables, path: str) -> None:
  """Raises ValueError, naming each table, unless the checkpoint holds a matching map for each."""
  restore = tf_restore.restore_of(layer)
  maps = _child(restore, _child(restore, restore.node, CHECKPOINT_KEY), "maps")
  reader = tf.train.load_checkpoint(path)
  dtypes = reader.get_variable_to_dtype_map()
  problems, conversions = [], []
  for name, id_map in managed.maps.items():
    node = _child(restore, maps, name)
    held = [_child(restore, node, n) for n in ("keys", FINGERPRINTS, "shards")]
    if all(child is None for child in held):
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
      found, converts = _part_problems(restore, where, part, reader, dtypes)
      problems += [f"table {name!r}: its managed-id map{label} {p}" for p in found]
      conversions += [(where, part)] if converts else []
  if problems:
    restore.forget_pending_restores()
    raise ValueError(
      f"Cannot restore the checkpoint {path!r} into the layer {layer.name!r}:\n  - "
      + "\n  - ".join(problems)
      + "\nNothing was changed (no table, slot or map)."
    )
  for where, part in conversions:
    _convert_strings(restore, where, part, reader)


def _part_problems(
  restore: tf_restore.Restore, where: Any, part: IdMap, reader: Any, dtypes: dict[str, tf.DType]
) -> tuple[list[str], bool]:
  """(what keeps the checkpoint's map at `where` from restoring into `part`, each said after the
  map's name; whether it holds string keys as strings, to convert)."""
  problems = []
  keys, dtype = _stored_keys(restore, where, dtypes)
  shape = restore.stored_shape(keys)
  matches = shape == [part.capacity] and dtype == part.key_dtype
  if not matches:
    problems.append(
      f"has capacity {part.capacity} and key dtype {part.key_dtype.name} in this layer, but "
      f"{shape[0] if shape else None} and {getattr(dtype, 'name', None)} in the checkpoint"
    )
  twice = _keys_given_two_rows(restore, where, keys, reader) if matches else []
  if twice:
    problems.append(
      f"in the checkpoint gives keys {twice} two rows or more each (a damaged or hand-edited "
      "checkpoint); each key has one row"
    )
  strings = matches and not twice and dtypes.get(_checkpoint_key(keys)) == tf.string
  shared = _shared_fingerprints(restore, where, keys, reader) if strings else []
  if shared:
    problems.append(
      f"in the checkpoint holds string keys (written before such maps held fingerprints) of "
      f"which {shared} share one 64-bit fingerprint (odds about n**2 / 2**65 for n keys), so "
      "they cannot keep rows of their own: this version cannot convert it"
    )
  stale = _stale_dtypes(restore, where, part, dtypes)
  if stale:
    problems.append(
      f"stores {' and '.join(stale)} as int64 in the checkpoint (written by a tpu_embedding "
      "from before they became int32) but as int32 in this layer; this version cannot read "
      "such a map"
    )
  return problems, strings and not problems


def _stored_keys(
  restore: tf_restore.Restore, where: Any, dtypes: dict[str, tf.DType]
) -> tuple[Any, Optional[tf.DType]]:
  """(the checkpoint node of a map's keys, the key dtype of the map that wrote it): `fingerprints`
  were a string-key map's; `keys` an int64 one's, or a string one's that held the strings."""
  fingerprints = _child(restore, where, FINGERPRINTS)
  if fingerprints is not None:
    return fingerprints, tf.string
  keys = _child(restore, where, "keys")
  return keys, None if keys is None else dtypes.get(_checkpoint_key(keys))


def _shared_fingerprints(
  restore: tf_restore.Restore, where: Any, keys: Any, reader: Any
) -> list[str]:
  """Up to 5 of the string keys held in the checkpoint's map whose fingerprints collide."""
  held = _held_keys(restore, where, keys, reader)
  prints = fingerprint(held).numpy() if held.size else np.zeros([0], np.int64)
  values, counts = np.unique(prints, return_counts=True)
  return [k.decode(errors="replace") for k in held[np.isin(prints, values[counts > 1])][:5]]


def _convert_strings(restore: tf_restore.Restore, where: Any, part: IdMap, reader: Any) -> None:
  """Fills `part` from the checkpoint's map that held its string keys as strings (fingerprinted
  now), and leaves TF nothing of that map to read: its nodes keep no value, and the one of its
  keys is renamed as this map tracks them, so TF binds every object of the map (to no value)."""
  nodes = {n: _child(restore, where, n) for n in ("keys", *_MAP_PARTS)}
  keys, counts, last_seen, step = (
    reader.get_tensor(_checkpoint_key(nodes[n])) for n in ("keys", "counts", "last_seen", "step")
  )
  candidates = None
  if nodes["candidates"] is not None and nodes["candidates"].attributes:
    table = nodes["candidates"].attributes[0].checkpoint_key
    waiting = reader.get_tensor(table + _TABLE_KEYS)
    candidates = (fingerprint(waiting), reader.get_tensor(table + _TABLE_VALUES))
  with tf.init_scope():
    part.assign(fingerprint(keys), counts, last_seen, step, candidates)
  for node in nodes.values():
    if node is not None:
      del node.attributes[:]
  for reference in where.children:
    if reference.local_name == "keys":
      reference.local_name = keys_name(part.spec)


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


def _keys_given_two_rows(
  restore: tf_restore.Restore, where: Any, keys: Any, reader: Any
) -> list[Any]:
  """Up to 5 keys that the checkpoint's map gives several rows."""
  held = _held_keys(restore, where, keys, reader)
  values, counts = np.unique(held, return_counts=True)
  return [v.decode() if isinstance(v, bytes) else int(v) for v in values[counts > 1][:5]]


def _held_keys(restore: tf_restore.Restore, where: Any, keys: Any, reader: Any) -> np.ndarray:
  """The keys of the checkpoint's map (node `keys`) that hold rows (rows above 0 seen at some
  step)."""
  last_seen = _child(restore, where, "last_seen")
  if keys is None or last_seen is None:
    return np.zeros([0], np.int64)
  stored, seen = (reader.get_tensor(_checkpoint_key(node)) for node in (keys, last_seen))
  return stored[1:][seen[1:] >= 0]


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
