"""jax-tpu-embedding's host preprocessing (its SparseCore input statistics) on the same batches,
run in its own virtual environment (JAX and TensorFlow do not share one here).

The parent side (`jax_python`, `run`) needs only the standard library and NumPy; run under the JAX
environment (`python -m benchmarks.jax_sparse_core DIR`), this module preprocesses the batches the
parent wrote and writes what jax-tpu-embedding counted. `make jax-env` builds that environment
(.venv-jax); the variable JAX_TPU_EMBEDDING_PYTHON names another interpreter.

Batches travel as per-sample id lists (ragged): feature f of batch b is `b{b}/{f}/values` and
`b{b}/{f}/lengths` in an .npz. Tables are not stacked (each its own stack, rotation 0, as TF
lays out a table with stacking disabled).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import numpy as np

from benchmarks import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVIRONMENT_VARIABLE = "JAX_TPU_EMBEDDING_PYTHON"


def jax_python() -> Optional[str]:
  """The interpreter of the jax-tpu-embedding environment, or None when there is none."""
  candidates = [os.environ.get(ENVIRONMENT_VARIABLE), os.path.join(ROOT, ".venv-jax/bin/python")]
  return next((c for c in candidates if c and os.path.exists(c)), None)


def run(
  batches: Sequence[dict[str, tuple[np.ndarray, np.ndarray]]],
  tables: dict[str, int],
  feature_tables: dict[str, str],
  *,
  num_chips: int,
  sparse_cores_per_chip: int,
  limit: Optional[int] = None,
  allow_id_dropping: bool = False,
  repeats: int = 1,
) -> dict[str, Any]:
  """jax-tpu-embedding's counts for `batches` ({feature: (values, row lengths)}, each the global
  batch), tables {name: vocabulary size}, features {name: table}, every table limited to `limit`
  ids and unique ids per partition (default: a batch's ids, so no limit binds; JAX sizes its
  buffers by the limits, so they cannot be unbounded): {"tables": {table: {"max_ids_per_partition",
  "max_unique_ids_per_partition", "dropped"}}, "seconds": [per repeat over all batches]}."""
  python = jax_python()
  if python is None:
    raise FileNotFoundError(
      f"No jax-tpu-embedding environment: run `make jax-env` or set {ENVIRONMENT_VARIABLE}."
    )
  with tempfile.TemporaryDirectory() as folder:
    arrays = {}
    for b, batch in enumerate(batches):
      for feature, (values, lengths) in batch.items():
        arrays[f"b{b}/{feature}/values"] = values
        arrays[f"b{b}/{feature}/lengths"] = lengths
    np.savez(os.path.join(folder, "batches.npz"), **arrays)
    if limit is None:
      limit = max(sum(int(v.size) for v, _ in batch.values()) for batch in batches) + 8
    spec = {
      "batches": len(batches),
      "tables": tables,
      "features": feature_tables,
      "num_chips": num_chips,
      "sparse_cores_per_chip": sparse_cores_per_chip,
      "limit": limit,
      "allow_id_dropping": allow_id_dropping,
      "repeats": repeats,
    }
    what = "jax-tpu-embedding's preprocessing"
    return harness.run_in_environment(python, __name__, folder, spec, what, 1800)


def _child(folder: str) -> None:
  """Under the JAX environment: preprocess the batches in `folder`, write result.json."""
  from jax_tpu_embedding.sparsecore.lib.nn import embedding
  from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as es

  with open(os.path.join(folder, "spec.json"), encoding="utf-8") as f:
    spec = json.load(f)
  data = np.load(os.path.join(folder, "batches.npz"))
  chips, cores = spec["num_chips"], spec["sparse_cores_per_chip"]
  batches = []
  for b in range(spec["batches"]):
    batch = {}
    for feature in spec["features"]:
      values = data[f"b{b}/{feature}/values"].astype(np.int32)
      lengths = data[f"b{b}/{feature}/lengths"]
      rows = np.empty(len(lengths), dtype=object)
      rows[:] = np.split(values, np.cumsum(lengths)[:-1])
      batch[feature] = rows
    batches.append(batch)
  samples = {f: len(batches[0][f]) for f in spec["features"]}
  table_specs = {
    name: es.TableSpec(
      vocabulary_size=vocabulary,
      embedding_dim=8,
      initializer=None,
      optimizer=es.SGDOptimizerSpec(),
      combiner="sum",
      name=name,
      max_ids_per_partition=spec["limit"],
      max_unique_ids_per_partition=spec["limit"],
    )
    for name, vocabulary in spec["tables"].items()
  }
  feature_specs = {
    feature: es.FeatureSpec(
      name=feature,
      table_spec=table_specs[table],
      input_shape=[samples[feature], 1],
      output_shape=[samples[feature], 8],
    )
    for feature, table in spec["features"].items()
  }
  embedding.prepare_feature_specs_for_training(feature_specs, chips, cores)
  result: dict[str, Any] = {"tables": {}, "seconds": []}
  for _ in range(spec["repeats"]):
    start = time.perf_counter()
    all_stats = [
      embedding.preprocess_sparse_dense_matmul_input(
        batch,
        None,
        feature_specs,
        chips,
        chips,
        num_sc_per_device=cores,
        allow_id_dropping=spec["allow_id_dropping"],
      )[1]
      for batch in batches
    ]
    result["seconds"].append(time.perf_counter() - start)
  for name in spec["tables"]:
    result["tables"][name] = {
      "max_ids_per_partition": max(int(np.max(s.max_ids_per_partition[name])) for s in all_stats),
      "max_unique_ids_per_partition": max(
        int(np.max(s.max_unique_ids_per_partition[name])) for s in all_stats
      ),
      "dropped": sum(int(s.id_drop_counters.get(name, 0)) for s in all_stats),
    }
  with open(os.path.join(folder, "result.json"), "w", encoding="utf-8") as f:
    json.dump(result, f)


if __name__ == "__main__":
  _child(sys.argv[1])
