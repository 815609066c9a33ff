"""TPU pre-flight: what a model and its data need from a TPU, computed on the CPU.

Part 1 (SparseCore input limits) and part 2 (memory per chip and the report) live in modules of
their own; their public names are loaded on first use, so `import tpu_embedding.preflight`
stays cheap.
"""

import importlib
from typing import Any

# {public name: "module:name" inside this package}. Filled by the modules as they land.
_MODULE_OF: dict[str, str] = {
  "MemoryPlan": "memory",
  "TableMemory": "memory",
  "Topology": "topologies",
  "memory_plan": "memory",
  "sparse_core_stats": "input_stats",
  "topology": "topologies",
  "sparse_core_config": "limits",
  "preview_limits": "limits",
  "emulate_id_dropping": "limits",
  "LimitsPreview": "limits",
  "Failure": "limits",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
  if name not in _MODULE_OF:
    raise AttributeError(f"module 'tpu_embedding.preflight' has no attribute {name!r}")
  module, _, defined_as = _MODULE_OF[name].partition(":")
  return getattr(importlib.import_module(f"{__name__}.{module}"), defined_as or name)


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
