"""tpu_embedding: one Keras layer for large embedding tables on CPU, GPU and TPU.

`tpu_embedding.TPUEmbedding` is the tf-keras layer (tf-recommenders users);
`tpu_embedding.keras.TPUEmbedding` is the same layer for Keras 3. The names below are imported
on first use, so importing one flavour never loads the other Keras.
"""

import importlib
from typing import Any

_MODULE_OF = {
  "PartialTPUEmbedding": "tpu_embedding.partial",
  "Path": "tpu_embedding.hardware",
  "TPUEmbedding": "tpu_embedding.layer",
  "translate_keras_optimizer": "tpu_embedding.optimizers",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
  if name not in _MODULE_OF:
    raise AttributeError(f"module 'tpu_embedding' has no attribute {name!r}")
  return getattr(importlib.import_module(_MODULE_OF[name]), name)


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
