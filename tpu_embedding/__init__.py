"""tpu_embedding: one Keras layer for large embedding tables on CPU, GPU and TPU.

`tpu_embedding.TPUEmbedding` is the tf-keras layer (tf-recommenders users);
`tpu_embedding.keras.TPUEmbedding` is the same layer for Keras 3. This module is the package's
public surface: every name a user needs is here (or in `tpu_embedding.keras`), so the modules
behind them may move. The names are imported on first use, so importing one flavour never loads
the other Keras.
"""

import importlib
import warnings
from typing import Any

# {public name: "module" (defining the same name) or "module:name"}.
_MODULE_OF = {
  "EmbeddingFeature": "tpu_embedding.hardware",
  "ExecutionPath": "tpu_embedding.hardware",
  "ManagedIds": "tpu_embedding.managed_ids",
  "NotAnOptimizerError": "tpu_embedding.optimizers",
  "PartialTPUEmbedding": "tpu_embedding.partial",
  "Placement": "tpu_embedding.placement",
  "ReplicatedTable": "tpu_embedding.partial_core",
  "TPUEmbedding": "tpu_embedding.layer",
  "TablePlacement": "tpu_embedding.placement",
  "export_for_serving": "tpu_embedding.serving",
  "restore_checkpoint": "tpu_embedding.restoring",
  "restore_sparse_core_checkpoint": "tpu_embedding.sparse_core:restore_from_checkpoint",
  "serving_error_by_dtype": "tpu_embedding.serving_error",
  "translate_keras_optimizer": "tpu_embedding.optimizers",
}

# Old names kept for code written against them: {old name: current name}.
_RENAMED = {"Path": "ExecutionPath"}  # `Path` read like a feature's path in the nest

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
  if name in _RENAMED:
    warnings.warn(
      f"tpu_embedding.{name} is deprecated; use tpu_embedding.{_RENAMED[name]}.",
      DeprecationWarning,
      stacklevel=2,
    )
    name = _RENAMED[name]
  if name not in _MODULE_OF:
    raise AttributeError(f"module 'tpu_embedding' has no attribute {name!r}")
  module, _, defined_as = _MODULE_OF[name].partition(":")
  return getattr(importlib.import_module(module), defined_as or name)


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
