"""The benchmarks' DLRM workload for `python -m tpu_embedding.preflight`: its 26 tables
(`cases.dlrm_sizes`, dim 16, `worker.feature_configs`), Adagrad, and Zipf batches of the global
batch size 4096 like the ones its training steps read (`worker.make_id_batches`, three
multi-hot features).

  python -m tpu_embedding.preflight --config benchmarks.preflight_dlrm \\
    --data benchmarks.preflight_dlrm:batches --topology v5p-8 --batch-size 4096
"""

from __future__ import annotations

import tensorflow as tf

from benchmarks import cases, worker

DIM = 16
NUM_BATCHES = 8
optimizer = "adagrad"


def feature_config() -> dict:
  return worker.feature_configs(tf, cases.dlrm_sizes(), DIM)


def batches() -> list[dict]:
  """NUM_BATCHES global batches of {feature: ids}: dense one-hot, ragged multi-hot."""
  raw = worker.make_id_batches(cases.dlrm_sizes(), cases.DLRM_BATCH, NUM_BATCHES, worker.MULTI_HOT)
  return [
    {name: worker.feature_tensor(tf, ids, lengths) for name, (ids, lengths) in batch.items()}
    for batch in raw
  ]
