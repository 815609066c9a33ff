"""How a layer takes managed ids: on which paths, under which name in its checkpoints."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding.managed_ids.tables import ManagedTables

# The layer tracks its maps under this name: `<layer>/managed_ids/maps/<table>/...`.
CHECKPOINT_KEY = "managed_ids"


def create(
  managed_ids: Optional[Mapping[Any, Any]],
  config: config_lib.EmbeddingConfig,
  path: hardware.ExecutionPath,
  pipelining: bool,
) -> Optional[ManagedTables]:
  """The layer's maps, or None without `managed_ids`; refuses the paths not supported yet."""
  if managed_ids is None or (isinstance(managed_ids, Mapping) and not managed_ids):
    return None
  if path is not hardware.ExecutionPath.CPU:
    raise ValueError(
      f"managed_ids is not supported on path {path.name} yet (only off TPU: CPU/GPU engine, "
      "MirroredStrategy). Map keys to rows before the TPU step, or use the CPU/GPU path."
    )
  if pipelining:
    raise ValueError(
      "managed_ids cannot be combined with pipeline_execution_with_tensor_core=True off TPU: "
      "an update held back one step could land on a row given to another key meanwhile."
    )
  return ManagedTables(managed_ids, config)
