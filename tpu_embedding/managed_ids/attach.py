"""How a layer takes managed ids: on which paths, under which name in its checkpoints."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding.managed_ids.spec import ManagedIds
from tpu_embedding.managed_ids.tables import ManagedTables, VariablesByTable

# The layer tracks its maps under this name: `<layer>/managed_ids/maps/<table>/...`.
CHECKPOINT_KEY = "managed_ids"


def create(
  managed_ids: Optional[Mapping[Any, Any]],
  config: config_lib.EmbeddingConfig,
  path: hardware.ExecutionPath,
  pipelining: bool,
  variables_by_table: VariablesByTable,
) -> Optional[ManagedTables]:
  """The layer's maps, or None without `managed_ids`; refuses the paths and options that cannot
  reset rows given to new keys exactly. `variables_by_table`: the layer's tables (under
  parameter servers, the maps are split with the tables' row blocks)."""
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
