"""Managed ids: embedding tables that take raw keys and give rows to them (docs/managed-ids.md).

`ManagedIds` describes one table's map; `IdMap` is that map (TF hash tables and variables) and
`ShardedIdMap` that map split with the table's row blocks over parameter servers, both
`KeyRowMap`s; `ManagedTables` applies a layer's maps to its feature nest and returns the rows
given to new keys; `row_resets.Writer` is what each path gives to write them; `attach` and
`checkpoint` are how a layer holds them.
"""

from tpu_embedding.managed_ids.attach import CHECKPOINT_KEY, create, specs, table_names
from tpu_embedding.managed_ids.checkpoint import validate_checkpoint
from tpu_embedding.managed_ids.id_map import IdMap
from tpu_embedding.managed_ids.key_row_map import KeyRowMap
from tpu_embedding.managed_ids.layer_mixin import ManagedIdsMixin
from tpu_embedding.managed_ids.row_resets import Writer
from tpu_embedding.managed_ids.spec import ManagedIds
from tpu_embedding.managed_ids.tables import ManagedTables

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
  "table_names",
  "validate_checkpoint",
]
