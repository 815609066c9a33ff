"""TorchRec's managed-collision module (`MCHManagedCollisionModule`, torchrec/modules/mc_modules.py)
choosing rows for key streams, run in its own virtual environment (PyTorch and TensorFlow do not
share one here).

The parent side (`torchrec_python`, `remap`, `rows_of`) needs only the standard library and
NumPy; run under the TorchRec environment (`python -m benchmarks.torchrec_mch DIR`), this module
steps one module per table and stream over the batches the parent wrote and writes back what it
chose. `make torchrec-env`
builds that environment (.venv-torchrec); the variable TORCHREC_PYTHON names another interpreter.

Per step, as TorchRec's sharded managed-collision collection runs it: the module's forward in
training mode (`profile`: the batch joins its history, coalesced and evicted every
`eviction_interval` steps; then `remap`: each key's slot, or the default slot `zch_size - 1` for a
key without one), then `evict()` (the rows whose keys it just replaced, which TorchRec resets to
their initial values and optimizer state before the lookup). Held-out keys go through the
module's forward in eval mode (`remap` only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Optional, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVIRONMENT_VARIABLE = "TORCHREC_PYTHON"
POLICIES = ("lru", "lfu", "distance_lfu")  # LRU_, LFU_ and DistanceLFU_EvictionPolicy


def torchrec_python() -> Optional[str]:
  """The interpreter of the TorchRec environment, or None when there is none."""
  candidates = [
    os.environ.get(ENVIRONMENT_VARIABLE),
    os.path.join(ROOT, ".venv-torchrec/bin/python"),
  ]
  return next((c for c in candidates if c and os.path.exists(c)), None)


@dataclasses.dataclass
class Stream:
  """One table's keys: a list of training batches (int64 keys) and, optionally, held-out keys."""

  capacity: int
  train: list
  test: Optional[np.ndarray] = None


@dataclasses.dataclass
class Chosen:
  """What TorchRec's module chose for one stream: its output ids for each training batch, the
  ids it evicted (to be reset) at each step, its ids for the held-out keys, seconds per step."""

  ids: list
  evicted: list
  test_ids: Optional[np.ndarray]
  seconds: np.ndarray


def rows_of(ids: np.ndarray, capacity: int) -> np.ndarray:
  """Our table's rows for TorchRec's output ids over `capacity` slots: TorchRec's default slot
  `capacity - 1` (keys without a slot) becomes our out-of-vocabulary row 0, slot i row i + 1. A
  bijection, so a table of `capacity` rows holds TorchRec's choice exactly."""
  return (np.asarray(ids, np.int64) + 1) % capacity


def remap(
  streams: dict[str, Stream], configs: Sequence[tuple[str, int]], threads: int = 1
) -> tuple[dict[str, dict[tuple[str, int], Chosen]], dict]:
  """Each stream stepped through a fresh module per config (policy, eviction interval):
  ({stream: {config: Chosen}}, {"versions": ..., "threads": ...}). `threads`: PyTorch's
  (`torch.set_num_threads`); one by default: on two loaded cores, two threads cost its small
  steps 10-40 ms each in OpenMP waits against 0.1-0.5 ms with one (measured here)."""
  python = torchrec_python()
  if python is None:
    raise FileNotFoundError(
      f"No TorchRec environment: run `make torchrec-env` or set {ENVIRONMENT_VARIABLE}."
    )
  unknown = sorted({p for p, _ in configs} - set(POLICIES))
  if unknown:
    raise ValueError(f"Unknown TorchRec eviction policies {unknown}; expected some of {POLICIES}.")
  with tempfile.TemporaryDirectory() as folder:
    arrays = {}
    for s, stream in enumerate(streams.values()):
      arrays[f"s{s}/train"] = np.concatenate(stream.train).astype(np.int64)
      arrays[f"s{s}/lengths"] = np.array([len(b) for b in stream.train], np.int64)
      if stream.test is not None:
        arrays[f"s{s}/test"] = np.asarray(stream.test, np.int64)
    np.savez(os.path.join(folder, "streams.npz"), **arrays)
    spec = {
      "capacities": [stream.capacity for stream in streams.values()],
      "configs": [list(c) for c in configs],
      "threads": threads,
    }
    from benchmarks import harness  # the parent's only: the child needs NumPy and TorchRec

    what = "TorchRec's managed-collision run"
    info = harness.run_in_environment(python, __name__, folder, spec, what, 3600)
    out = np.load(os.path.join(folder, "chosen.npz"))
    chosen = {}
    for s, name in enumerate(streams):
      chosen[name] = {}
      for c, config in enumerate(configs):
        at = f"s{s}/c{c}"
        steps = np.cumsum(arrays[f"s{s}/lengths"])
        evicted_at = np.cumsum(out[f"{at}/evicted_lengths"])[:-1]
        chosen[name][tuple(config)] = Chosen(
          ids=np.split(out[f"{at}/ids"], steps[:-1]),
          evicted=np.split(out[f"{at}/evicted"], evicted_at),
          test_ids=out[f"{at}/test_ids"] if f"{at}/test_ids" in out else None,
          seconds=out[f"{at}/seconds"],
        )
  return chosen, info


def _child(folder: str) -> None:
  """Under the TorchRec environment: step the streams in `folder`, write chosen.npz."""
  import fbgemm_gpu  # noqa: F401  (TorchRec's import needs its operators)
  import torch
  import torchrec
  from torchrec.modules import mc_modules
  from torchrec.sparse.jagged_tensor import JaggedTensor

  policies = {
    "lru": mc_modules.LRU_EvictionPolicy,
    "lfu": mc_modules.LFU_EvictionPolicy,
    "distance_lfu": mc_modules.DistanceLFU_EvictionPolicy,
  }
  with open(os.path.join(folder, "spec.json"), encoding="utf-8") as f:
    spec = json.load(f)
  data = np.load(os.path.join(folder, "streams.npz"))
  torch.set_num_threads(spec["threads"])

  def features(keys: np.ndarray) -> dict:
    values = torch.from_numpy(np.ascontiguousarray(keys))
    return {"f": JaggedTensor(values=values, lengths=torch.ones(len(keys), dtype=torch.int32))}

  out = {}
  for s, capacity in enumerate(spec["capacities"]):
    keys, lengths = data[f"s{s}/train"], data[f"s{s}/lengths"]
    batches = np.split(keys, np.cumsum(lengths)[:-1])
    for c, (policy, interval) in enumerate(spec["configs"]):
      module = mc_modules.MCHManagedCollisionModule(
        zch_size=capacity,
        device=torch.device("cpu"),
        eviction_policy=policies[policy](),
        eviction_interval=interval,
      )
      module.train()
      ids, evicted, seconds = [], [], []
      for batch in batches:
        inputs = features(batch)
        start = time.perf_counter()
        remapped = module(inputs)["f"].values()
        freed = module.evict()
        seconds.append(time.perf_counter() - start)
        ids.append(remapped.numpy().copy())
        evicted.append(np.zeros(0, np.int64) if freed is None else freed.numpy().astype(np.int64))
      at = f"s{s}/c{c}"
      out[f"{at}/ids"] = np.concatenate(ids)
      out[f"{at}/evicted"] = np.concatenate(evicted)
      out[f"{at}/evicted_lengths"] = np.array([len(e) for e in evicted], np.int64)
      out[f"{at}/seconds"] = np.array(seconds)
      if f"s{s}/test" in data:
        module.eval()
        out[f"{at}/test_ids"] = module(features(data[f"s{s}/test"]))["f"].values().numpy()
  np.savez(os.path.join(folder, "chosen.npz"), **out)
  versions = {"torch": torch.__version__, "fbgemm_gpu": _version("fbgemm_gpu_cpu")}
  versions["torchrec"] = getattr(torchrec, "__version__", None) or _version("torchrec")
  with open(os.path.join(folder, "result.json"), "w", encoding="utf-8") as f:
    json.dump({"versions": versions, "threads": torch.get_num_threads()}, f)


def _version(distribution: str) -> Optional[str]:
  from importlib import metadata

  try:
    return metadata.version(distribution)
  except metadata.PackageNotFoundError:
    return None


if __name__ == "__main__":
  _child(sys.argv[1])
