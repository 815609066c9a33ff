"""One backend per execution path; the layer holds exactly one and never re-tests the hardware.

Each backend owns the path's `engine`, the object holding the tables: our `EmbeddingEngine` off
TPU, TF's mid-level object on TPU. The layer saves it under `_tpu_embedding` (the checkpoint key
tf-recommenders uses), so a table's checkpoint key is the same on the CPU, V0 and V1 paths;
SparseCore saves stacked tables instead (see `tpu_embedding.sparse_core`).
One module per path (`cpu`, `tpu_v0`, `tpu_v1`, `tpu_v2`) over the interface in `base`; what a
path refuses or needs in another form is in `conversion`, which returns new configurations and
never edits the layer's. The TPU backends drive TF's mid-level classes as their documentation
prescribes; their tests run those real classes with only the TPU runtime stubbed
(tests/support/tpu_harness.py).
"""

from __future__ import annotations

from typing import Any, Optional

from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding.backends.base import Backend
from tpu_embedding.backends.conversion import TABLE_UPDATES, check_layer_options
from tpu_embedding.backends.cpu import CpuBackend
from tpu_embedding.backends.tpu_v0 import TpuV0Backend
from tpu_embedding.backends.tpu_v1 import TpuV1Backend
from tpu_embedding.backends.tpu_v2 import TpuV2Backend

__all__ = ["Backend", "TABLE_UPDATES", "check_layer_options", "create"]


def create(
  path: hardware.ExecutionPath,
  config: config_lib.EmbeddingConfig,
  *,
  pipelining: bool,
  batch_size: Optional[int],
  sparse_core_embedding_config,
  table_updates: str,
  user_optimizer: Any = None,
  check_finite: bool = False,
) -> Backend:
  """The backend for `path`, with the arguments that path takes; `config` is left unchanged."""
  check_layer_options(path, table_updates, check_finite, batch_size)
  if path is hardware.ExecutionPath.CPU:
    return CpuBackend(
      config,
      pipelining=pipelining,
      table_updates=table_updates,
      check_finite=check_finite,
      user_optimizer=user_optimizer,
    )
  if path is hardware.ExecutionPath.TPU_V0:
    return TpuV0Backend(config, user_optimizer)
  if path is hardware.ExecutionPath.TPU_V1:
    return TpuV1Backend(config, pipelining=pipelining, batch_size=batch_size)
  return TpuV2Backend(
    config, pipelining=pipelining, sparse_core_embedding_config=sparse_core_embedding_config
  )
