"""A plain-Python reading of SparseCore's routing and counting, written from TF 2.21's
`TPUEmbeddingV2` and its preprocessing kernels, independently of `tpu_embedding.preflight`:
loops and sets, and the table layouts read from TF's real `TPUEmbeddingV2` built under the
stand-in TPU strategy (its public `embedding_layouts`), not from the stacker the package calls.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tpu_harness

emb = tf.tpu.experimental.embedding


def layouts(feature_config, num_chips: int, cores: int, stacking: bool, samples: dict) -> dict:
  """{table name: its SparseCoreTableLayout}, from TF's own constructor on `num_chips` replicas
  of `cores` SparseCores. `samples`: {feature path: samples per chip} (the output shapes)."""
  strategy = tpu_harness.StandInTPUStrategy(
    tf.tpu.experimental.HardwareFeature.EmbeddingFeature.V2, num_chips, cores
  )
  shaped = {
    path: emb.FeatureConfig(feature.table, output_shape=[samples[path]])
    for path, feature in feature_config.items()
  }
  with strategy.scope():
    mid_level = emb.TPUEmbeddingV2(
      shaped,
      emb.Adagrad(0.1),
      sparse_core_embedding_config=emb.SparseCoreEmbeddingConfig(
        disable_table_stacking=not stacking
      ),
    )
  return dict(mid_level.embedding_layouts)


def id_lists(value) -> list[list[int]]:
  """The ids of each sample: a dense tensor's elements each a sample, a ragged/sparse row."""
  if isinstance(value, tf.RaggedTensor):
    return [list(row) for row in value.to_list()]
  if isinstance(value, tf.SparseTensor):
    rows = [[] for _ in range(int(value.dense_shape[0]))]
    for (row, _), id_ in zip(value.indices.numpy(), value.values.numpy()):
      rows[row].append(int(id_))
    return rows
  return [[int(v)] for v in np.asarray(value).reshape(-1)]


def _core_counts(feature_config, read, table_layouts, num_chips, cores, chip, core):
  """{(stack, partition): (distinct (feature, sample, id) triples, distinct (table, id) pairs)}
  of one SparseCore's slice of the global batch."""
  n = num_chips * cores
  pairs, columns = {}, {}
  for path in sorted(feature_config):  # tf.nest's order for a dict
    layout = table_layouts[feature_config[path].table.name]
    samples = read[path]
    per_chip = len(samples) // num_chips
    per_core = per_chip // cores
    start = chip * per_chip + core * per_core
    for sample in range(start, start + per_core):
      for id_ in samples[sample]:
        partition = (id_ + layout.sparse_core_shard_rotation) % n
        key = (layout.stacked_table_name, partition)
        pairs.setdefault(key, set()).add((path, sample, id_))
        columns.setdefault(key, set()).add((layout.table_name, id_))
  return {key: (found, columns[key]) for key, found in pairs.items()}


def _needed_per_chip(counts, num_chips):
  """The buffer one stack needs on each chip: ids packed SparseCore by SparseCore in partition
  order, each partition's block padded to a multiple of 8."""
  needed = [0] * num_chips
  for chip in range(num_chips):
    position = 0
    for count in counts[chip].reshape(-1):
      if count:
        needed[chip] = position + count
        position += -(-count // 8) * 8
  return needed


def batch_counts(feature_config, batch, table_layouts, num_chips, cores):
  """{stack: (ids[chip][core][partition], unique[chip][core][partition])} and
  {stack: [buffer needed per chip]} for one global batch."""
  n = num_chips * cores
  stacks = {layout.stacked_table_name for layout in table_layouts.values()}
  ids = {stack: np.zeros((num_chips, cores, n), int) for stack in stacks}
  unique = {stack: np.zeros((num_chips, cores, n), int) for stack in stacks}
  read = {path: id_lists(batch[path]) for path in feature_config}
  for chip in range(num_chips):
    for core in range(cores):
      found = _core_counts(feature_config, read, table_layouts, num_chips, cores, chip, core)
      for (stack, partition), (triples, columns) in found.items():
        ids[stack][chip, core, partition] = len(triples)
        unique[stack][chip, core, partition] = len(columns)
  needed = {stack: _needed_per_chip(ids[stack], num_chips) for stack in ids}
  return ids, unique, needed


def stats(feature_config, batches, num_chips, cores=4, stacking=True) -> dict:
  """What `sparse_core_stats` must return, by brute force."""
  batches = list(batches)
  samples = {path: len(id_lists(batches[0][path])) // num_chips for path in feature_config}
  table_layouts = layouts(feature_config, num_chips, cores, stacking, samples)
  result, needed = {}, {}
  for batch in batches:
    ids, unique, need = batch_counts(feature_config, batch, table_layouts, num_chips, cores)
    for stack in ids:
      old = result.get(stack, {"max_ids_per_partition": 0, "max_unique_ids_per_partition": 0})
      result[stack] = {
        "max_ids_per_partition": max(old["max_ids_per_partition"], int(ids[stack].max())),
        "max_unique_ids_per_partition": max(
          old["max_unique_ids_per_partition"], int(unique[stack].max())
        ),
      }
      needed[stack] = max(needed.get(stack, 0), max(need[stack]))
  stack_samples = {
    stack: sum(
      samples[path]
      for path, feature in feature_config.items()
      if table_layouts[feature.table.name].stacked_table_name == stack
    )
    for stack in needed
  }
  x = 1
  while any(x * s < needed[k] or (x * s) % 8 for k, s in stack_samples.items()):
    x += 1
  result["max_ids_per_chip_per_sample"] = x
  return result


def dropped_ids(feature_config, batch, table_layouts, num_chips, cores, per_sample) -> set:
  """{(feature path, sample, id)} TF's buffer drops with allow_id_dropping, by replaying its
  packing loop: per chip, SparseCore by SparseCore and partition by partition, each partition's
  ids in column order (then feature, then sample), each run padded to 8."""
  n = num_chips * cores
  paths = sorted(feature_config)
  lost = set()
  for chip in range(num_chips):
    runs = {}  # (stack, core, partition) -> [(column, feature order, sample, id)]
    for order, path in enumerate(paths):
      layout = table_layouts[feature_config[path].table.name]
      samples = id_lists(batch[path])
      per_chip = len(samples) // num_chips
      for sample in range(chip * per_chip, (chip + 1) * per_chip):
        core = (sample - chip * per_chip) // (per_chip // cores)
        for id_ in set(samples[sample]):
          rotated = ((id_ + layout.sparse_core_shard_rotation) % n) + (id_ // n) * n
          column = rotated + layout.sparse_core_shard_row_offset * n
          key = (layout.stacked_table_name, core, column % n)
          runs.setdefault(key, []).append((column, order, sample, id_, path))
    for stack in {key[0] for key in runs}:
      stack_samples = sum(
        len(id_lists(batch[p])) // num_chips
        for p in paths
        if table_layouts[feature_config[p].table.name].stacked_table_name == stack
      )
      buffer, position = per_sample * stack_samples, 0
      for core in range(cores):
        for partition in range(n):
          run = sorted(runs.get((stack, core, partition), []))
          if position + len(run) > buffer:
            keep = max(buffer - position, 0)
            lost.update((path, sample, id_) for _, _, sample, id_, path in run[keep:])
            position = buffer
          else:
            position += len(run)
            position = -(-position // 8) * 8
  return lost
