"""tpu_embedding: one Keras layer for large embedding tables on CPU, GPU and TPU.

`tpu_embedding.TPUEmbedding` is the tf-keras layer (tf-recommenders users);
`tpu_embedding.keras.TPUEmbedding` is the same layer for Keras 3. The names below are imported
on first use, so importing one flavour never loads the other Keras.
"""

import importlib
import warnings
from typing import Any

_MODULE_OF = {
  "ExecutionPath": "tpu_embedding.hardware",
  "PartialTPUEmbedding": "tpu_embedding.partial",
  "TPUEmbedding": "tpu_embedding.layer",
  "restore_checkpoint": "tpu_embedding.restoring",
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
  return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
