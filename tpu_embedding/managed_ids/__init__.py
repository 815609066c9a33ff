"""Managed ids: embedding tables that take raw keys and give rows to them (docs/managed-ids.md).

`ManagedIds` describes one table's map; `IdMap` is that map (TF hash tables and variables) and
`ShardedIdMap` that map split with the table's row blocks over parameter servers, both
`KeyRowMap`s (`spec`); `ManagedTables` applies a layer's maps to its feature nest and returns
the rows given to new keys; `row_resets.Writer` is what each path gives to write them; `tables`
and `checkpoint` are how a layer holds them, `layer_mixin` what it adds to a layer.
"""

from tpu_embedding.managed_ids.checkpoint import validate_checkpoint
from tpu_embedding.managed_ids.id_map import IdMap
from tpu_embedding.managed_ids.layer_mixin import ManagedIdsMixin
from tpu_embedding.managed_ids.row_resets import Writer
from tpu_embedding.managed_ids.sharded_map import splits_maps
from tpu_embedding.managed_ids.spec import KeyRowMap, ManagedIds
from tpu_embedding.managed_ids.tables import (
  CHECKPOINT_KEY,
  ManagedTables,
  create,
  specs,
  table_names,
)

__all__ = [
  "CHECKPOINT_KEY",
  "IdMap",
  "KeyRowMap",
  "ManagedIds",
  "ManagedIdsMixin",
  "ManagedTables",
  "Writer",
  "create",
  "specs",
  "splits_maps",
  "table_names",
  "validate_checkpoint",
]
