"""All-or-nothing restores of managed-id maps, checked before TF binds any of the layer's state.

Runs from the layer's `_checkpoint_adapter` (see `tpu_embedding.checkpoints` for why raising
there changes nothing): every map must be in the checkpoint, with this capacity and key dtype.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from tpu_embedding import tf_restore
from tpu_embedding.managed_ids.attach import CHECKPOINT_KEY
from tpu_embedding.managed_ids.tables import ManagedTables

_VARIABLE_VALUE = "VARIABLE_VALUE"


def validate_checkpoint(layer: Any, managed: ManagedTables, path: str) -> None:
  """Raises ValueError, naming each table, unless the checkpoint holds a matching map for each."""
  restore = tf_restore.restore_of(layer)
  maps = _child(restore, _child(restore, restore.node, CHECKPOINT_KEY), "maps")
  dtypes = tf.train.load_checkpoint(path).get_variable_to_dtype_map()
  problems = []
  for name, id_map in managed.maps.items():
    keys = _child(restore, _child(restore, maps, name), "keys")
    if keys is None:
      problems.append(
        f"table {name!r} manages its ids, but the checkpoint holds no managed-id map for it "
        "(written by a layer without managed_ids for this table)"
      )
      continue
    shape, dtype = restore.stored_shape(keys), dtypes.get(_checkpoint_key(keys))
    if shape != [id_map.capacity] or dtype != id_map.key_dtype:
      problems.append(
        f"table {name!r}: its managed-id map has capacity {id_map.capacity} and key dtype "
        f"{id_map.key_dtype.name} in this layer, but {shape[0] if shape else None} and "
        f"{getattr(dtype, 'name', None)} in the checkpoint"
      )
  if problems:
    restore.forget_pending_restores()
    raise ValueError(
      f"Cannot restore the checkpoint {path!r} into the layer {layer.name!r}:\n  - "
      + "\n  - ".join(problems)
      + "\nNothing was changed (no table, slot or map)."
    )


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
