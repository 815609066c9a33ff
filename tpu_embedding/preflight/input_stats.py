"""The input statistics SparseCore's limits are set from, computed on the CPU from a model's
batches exactly as TF's host preprocessing counts them (see `routing` for how ids are routed).

Per stacked table, a partition is one SparseCore of one chip; each SparseCore of each chip sends
the ids of its slice of the samples to every partition. TF's `SortListOfSparseCoreCooTensors`
fails the step when one SparseCore sends a partition more ids (distinct (sample, id) pairs) or
more unique ids than the table's `max_ids_per_table` / `max_unique_ids_per_table`; its
`ConvertToSparseCoreCsrWrappedCooTensor` packs, per chip, each (SparseCore, partition) run of
ids padded to a multiple of 8 into a buffer of `max_ids_per_chip_per_sample` * (the stacked
table's samples per chip) ids, which must itself be a multiple of 8. Weights and combiners
change none of these counts (they only scale gains).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

import numpy as np

from tpu_embedding.preflight import routing as routing_lib

PAD = 8  # TF's XLA pad size: the per-chip buffer pads each run of ids to a multiple of it.
IDS = "max_ids_per_partition"
UNIQUE_IDS = "max_unique_ids_per_partition"
PER_CHIP = "max_ids_per_chip_per_sample"


@dataclasses.dataclass(frozen=True)
class BatchCounts:
  """One stacked table's counts in one batch."""

  ids: np.ndarray  # [chips, SparseCores per chip, partitions]: ids one SparseCore sends one
  unique_ids: np.ndarray  # the same, unique ids
  buffer_needed: np.ndarray  # [chips]: the per-chip buffer size the batch needs (ids)


def batch_counts(route: routing_lib.Routing, entries: routing_lib.StackEntries) -> BatchCounts:
  """Counts one stacked table's entries of one batch."""
  n, cores, chips = route.partitions, route.sparse_cores_per_chip, route.num_chips
  cell = entries.block * n + entries.partition
  ids = np.bincount(cell, minlength=chips * cores * n).reshape(chips, cores, n)
  first_of_id = np.ones(cell.shape, bool)
  first_of_id[1:] = (entries.block[1:] != entries.block[:-1]) | (
    entries.column[1:] != entries.column[:-1]
  )
  unique_ids = np.bincount(cell[first_of_id], minlength=chips * cores * n).reshape(chips, cores, n)
  return BatchCounts(ids, unique_ids, buffer_needed(ids.reshape(chips, cores * n)))


def padded(counts: np.ndarray) -> np.ndarray:
  return -(-counts // PAD) * PAD


def buffer_needed(runs: np.ndarray) -> np.ndarray:
  """[chips]: the smallest per-chip buffer that holds each chip's runs ([chips, runs], in TF's
  packing order): a run is refused when the padded runs before it plus its own ids overflow."""
  before = np.cumsum(padded(runs), axis=1) - padded(runs)
  return np.max(np.where(runs > 0, before + runs, 0), axis=1, initial=0)


def per_chip_figure(needed: Mapping[str, int], samples: Mapping[str, int]) -> int:
  """The smallest `max_ids_per_chip_per_sample` x with x * S >= needed for every stacked table
  (S its samples per chip) and x * S a multiple of 8 for all of them, as TF requires."""
  step = 1
  for count in samples.values():
    step = math.lcm(step, PAD // math.gcd(count, PAD))
  least = max([1] + [-(-needed[name] // samples[name]) for name in needed])
  return -(-least // step) * step


class Collector:
  """Running maxima over batches, for one routing (what `sparse_core_stats` returns)."""

  def __init__(self, route: routing_lib.Routing):
    self.route = route
    self._ids = dict.fromkeys(route.stacks, 0)
    self._unique = dict.fromkeys(route.stacks, 0)
    self._needed = dict.fromkeys(route.stacks, 0)

  def add(self, flat_values: list[Any]) -> dict[str, BatchCounts]:
    """Adds one batch (its features in the config's order); returns its counts."""
    counts = {
      name: batch_counts(self.route, entries)
      for name, entries in routing_lib.stack_entries(self.route, flat_values).items()
    }
    for name, count in counts.items():
      self._ids[name] = max(self._ids[name], int(count.ids.max(initial=0)))
      self._unique[name] = max(self._unique[name], int(count.unique_ids.max(initial=0)))
      self._needed[name] = max(self._needed[name], int(count.buffer_needed.max(initial=0)))
    return counts

  def result(self) -> dict[str, Any]:
    stats: dict[str, Any] = {
      name: {IDS: self._ids[name], UNIQUE_IDS: self._unique[name]} for name in sorted(self._ids)
    }
    stats[PER_CHIP] = per_chip_figure(self._needed, self.route.stack_samples_per_chip)
    return stats


def sparse_core_stats(
  feature_config: Any,
  batches: Iterable[Any],
  *,
  num_chips: int,
  sparse_cores_per_chip: int = 4,
  stacking: bool = True,
  optimizer: Any = None,
) -> dict[str, Any]:
  """SparseCore's input statistics for `batches`, as `TPUEmbeddingV2` on `num_chips` chips
  would meet them: the maxima over batches, chips and SparseCores of what TF's preprocessing
  counts, to set `SparseCoreEmbeddingConfig`'s limits from (`sparse_core_config`).

  Args:
    feature_config: the nest of `tf.tpu.experimental.embedding.FeatureConfig` the layer gets.
      A feature's `output_shape` is per chip, as TF reads it; unset, it is taken from the first
      batch (its samples / num_chips).
    batches: an iterable (a one-pass generator will do) of feature nests like the config, each
      the global batch: dense tensors or arrays (every element a sample of its own, as TF reads
      them), `tf.RaggedTensor` (a sample per row) or 2-D `tf.SparseTensor`.
    num_chips: TPU chips (replicas); num_chips * sparse_cores_per_chip must be a power of two.
    sparse_cores_per_chip: 4 on v5p, 2 on v6e (docs/preflight.md).
    stacking: False for a layer built with `disable_table_stacking=True`.
    optimizer: the layer's optimizer, for tables that have none (TF stacks only tables with
      equal optimizers).

  Returns:
    {stacked table name (its tables' names joined by "_", sorted; a table's own name when not
    stacked): {"max_ids_per_partition": int, "max_unique_ids_per_partition": int}, ...,
    "max_ids_per_chip_per_sample": int (the smallest value TF accepts that holds every batch,
    its padding counted)}.

  Raises:
    ValueError: naming the argument or feature, for chip counts TF refuses, batches that do
    not match the config, ids outside their table, or no batches.
  """
  first, everything = routing_lib.peek(batches)
  route = routing_lib.routing(
    feature_config,
    first,
    num_chips=num_chips,
    sparse_cores_per_chip=sparse_cores_per_chip,
    stacking=stacking,
    optimizer=optimizer,
  )
  collector = Collector(route)
  for batch in everything:
    collector.add(routing_lib.flat_batch(feature_config, batch))
  return collector.result()
