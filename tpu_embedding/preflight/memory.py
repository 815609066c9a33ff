"""Will it fit? HBM per chip for the tables, their optimizer slots and the activations, laid out
as TensorFlow's TPU classes lay them out, and the `PartialTPUEmbedding` threshold to use.

Bytes per chip, by the embedding hardware of the topology (`topologies`):

* V1 (`TPUEmbedding`, v4): the embedding engine deals a table's rows over all chips, row r to
  chip r mod n, so the fullest chip (chip 0) holds ceil(rows / n) rows of every table, of
  width dim, and as many of each slot.
* V2 (`TPUEmbeddingV2`, SparseCore: v5p, v6e): TF pads each table's width to a multiple of 8 and
  its rows to a multiple of 8 per SparseCore of the whole slice (8 * n * SparseCores per chip),
  stacks tables and deals the rows evenly over the SparseCores; each chip holds padded rows / n
  rows at the padded width, and so does each slot. Stacking moves tables within a stack but
  never changes these sums, since each table is padded on its own.
* no embedding hardware (v5e): TF replicates every table (`TPUEmbeddingV0`): all of it, and its
  slots, on every chip.

Variables are float32, as TF's classes create them. Activations and gradients per chip (the
embedding layer's output and the gradient coming back for it, both float32):
`2 * ceil(batch_size / n) * sum over features (outputs per sample * table dim) * 4`, where a
feature's outputs per sample are the product of its `output_shape` past the batch dimension,
or its `max_sequence_length` for a sequence feature, else 1.

The threshold: a `PartialTPUEmbedding` replicates the tables with `vocabulary_size <=
size_threshold` (whole table and slots on every chip, looked up without the embedding engine's
exchange) and shards the rest as above. The plan tries 0 and every distinct table size, and
picks the largest whose total (replicated + sharded + activations + the dense model's budget)
fits the chip's HBM: as many small tables replicated as memory allows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from tpu_embedding import config as config_lib
from tpu_embedding import optimizer_specs, tf_internals
from tpu_embedding.preflight import topologies

FLOAT32_BYTES = 4
# SparseCore pads widths to a multiple of this, and rows to a multiple of it per SparseCore.
SPARSE_CORE_ALIGNMENT = 8
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class TableMemory:
  """One table's bytes per chip.

  Attributes:
    rows_per_chip, width: the block of the table the fullest chip holds on the embedding
      hardware (SparseCore: padded); every slot holds a block of the same shape.
    table_bytes, slot_bytes: the table's and its slots' bytes on the fullest chip, as the
      topology's TPU class places them (on a topology without embedding hardware: all of it).
    replicated_bytes: the whole unpadded table and its slots, as a replicated table costs each
      chip under `PartialTPUEmbedding`.
  """

  vocabulary_size: int
  dim: int
  slots: tuple[str, ...]
  rows_per_chip: int
  width: int
  table_bytes: int
  slot_bytes: int
  replicated_bytes: int

  @property
  def bytes(self) -> int:
    return self.table_bytes + self.slot_bytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """`memory_plan`'s answer; every byte count is the fullest chip's.

  Attributes:
    topology, num_chips, hbm_bytes_per_chip, embedding: the chips planned for and how TF's
      classes lay tables out there (`topologies.V1`, `V2` or `REPLICATED`).
    tables_bytes_per_chip, slots_bytes_per_chip: every table (and its slots) where the topology's
      TPU class puts it (`TPUEmbedding`, or replicated where there is no embedding hardware).
    activations_bytes_per_chip: activations plus their gradients (module docstring).
    dense_bytes_per_chip: the budget kept for the dense model.
    per_table: {table name: its `TableMemory`}.
    fits: whether some `size_threshold` (0 included) fits everything in HBM.
    verdict: one line saying so, or which table needs how much.
    partial_size_threshold: the largest `PartialTPUEmbedding` `size_threshold` that fits; None
      when every table fits replicated (as `size_threshold=None` replicates them all); 0 when
      nothing fits.
    partial_bytes_per_chip: what that threshold uses per chip, all included.
  """

  topology: str
  num_chips: int
  hbm_bytes_per_chip: int
  embedding: str
  tables_bytes_per_chip: int
  slots_bytes_per_chip: int
  activations_bytes_per_chip: int
  dense_bytes_per_chip: int
  per_table: dict[str, TableMemory]
  fits: bool
  verdict: str
  partial_size_threshold: Optional[int]
  partial_bytes_per_chip: int

  @property
  def total_bytes_per_chip(self) -> int:
    """Tables, slots, activations and dense budget as the topology's TPU class lays them out."""
    return (
      self.tables_bytes_per_chip
      + self.slots_bytes_per_chip
      + self.activations_bytes_per_chip
      + self.dense_bytes_per_chip
    )


def memory_plan(
  feature_config: Any,
  optimizer: Any = None,
  *,
  topology: Any,
  batch_size: int,
  dense_bytes_per_chip: int = 0,
) -> MemoryPlan:
  """Bytes per chip of the tables, their slots and the activations on `topology`, whether they
  fit, and the `PartialTPUEmbedding` `size_threshold` that replicates as many small tables as
  HBM allows after `dense_bytes_per_chip` (the dense model's budget).

  Args:
    feature_config: a nest of `tf.tpu.experimental.embedding.FeatureConfig`.
    optimizer: for tables without their own optimizer, in any form the layer takes.
    topology: a Cloud TPU name ("v5p-8": Cloud TPU counts TensorCores on v4 and v5p, chips on
      v5e and v6e) or (HBM bytes per chip, chips, SparseCores per chip).
    batch_size: the global batch size (split evenly over the chips).
    dense_bytes_per_chip: bytes per chip to keep free for the dense model.
  """
  chips = topologies.topology(topology)
  topologies.check_int("batch_size", batch_size, 1)
  topologies.check_int("dense_bytes_per_chip", dense_bytes_per_chip, 0)
  config = config_lib.prepare(feature_config, optimizer)
  per_table = {table.name: _table_memory(table, chips) for table in config.tables}
  activations = _activations_bytes(config, chips.num_chips, batch_size)
  fixed = activations + dense_bytes_per_chip
  threshold, used = _threshold(per_table, chips, fixed)
  fits = used <= chips.hbm_bytes_per_chip
  return MemoryPlan(
    topology=chips.name,
    num_chips=chips.num_chips,
    hbm_bytes_per_chip=chips.hbm_bytes_per_chip,
    embedding=chips.embedding,
    tables_bytes_per_chip=sum(t.table_bytes for t in per_table.values()),
    slots_bytes_per_chip=sum(t.slot_bytes for t in per_table.values()),
    activations_bytes_per_chip=activations,
    dense_bytes_per_chip=dense_bytes_per_chip,
    per_table=per_table,
    fits=fits,
    verdict=_verdict(chips, per_table, fixed, threshold, used, fits),
    partial_size_threshold=threshold if fits else 0,
    partial_bytes_per_chip=used,
  )


def _table_memory(table: Any, chips: topologies.Topology) -> TableMemory:
  spec = optimizer_specs.spec_of(table.optimizer)
  if spec is not None and spec.mid_level is tf_internals.CUSTOM_OPTIMIZER:
    raise ValueError(
      f"Table {table.name!r}: memory_plan knows the slots TF's TPU classes create for SGD, "
      "Adagrad, AdagradMomentum, Adam and FTRL, not for a CustomOptimizer's own slots."
    )
  slots = tuple(name for name, _ in config_lib.slot_shapes(table))
  n = chips.num_chips
  if chips.embedding == topologies.V2:
    cores = SPARSE_CORE_ALIGNMENT * n * chips.sparse_cores_per_chip
    rows = _round_up(table.vocabulary_size, cores) // n
    width = _round_up(table.dim, SPARSE_CORE_ALIGNMENT)
  elif chips.embedding == topologies.V1:
    rows, width = math.ceil(table.vocabulary_size / n), table.dim
  else:
    rows, width = table.vocabulary_size, table.dim
  block = rows * width * FLOAT32_BYTES
  return TableMemory(
    vocabulary_size=table.vocabulary_size,
    dim=table.dim,
    slots=slots,
    rows_per_chip=rows,
    width=width,
    table_bytes=block,
    slot_bytes=block * len(slots),
    replicated_bytes=table.vocabulary_size * table.dim * FLOAT32_BYTES * (1 + len(slots)),
  )


def _activations_bytes(config: config_lib.EmbeddingConfig, num_chips: int, batch: int) -> int:
  per_sample = sum(_outputs_per_sample(f.config) * f.table.dim for f in config.features)
  return 2 * math.ceil(batch / num_chips) * per_sample * FLOAT32_BYTES


def _outputs_per_sample(feature: Any) -> int:
  if feature.output_shape:
    return math.prod(int(d) for d in list(feature.output_shape)[1:])
  return max(1, feature.max_sequence_length)


def _threshold(
  per_table: dict[str, TableMemory], chips: topologies.Topology, fixed: int
) -> tuple[Optional[int], int]:
  """(the largest fitting threshold, None for "replicate all"; the bytes per chip it uses). If
  none fits, (0, what sharding everything uses)."""
  sizes = sorted({t.vocabulary_size for t in per_table.values()})
  # Without embedding hardware every table is replicated: there is no side to shard onto.
  candidates = [None] if chips.embedding == topologies.REPLICATED else [0, *sizes[:-1], None]
  best: tuple[Optional[int], int] = (0, bytes_with_threshold(per_table, candidates[0]) + fixed)
  for candidate in candidates:
    used = bytes_with_threshold(per_table, candidate) + fixed
    if used <= chips.hbm_bytes_per_chip:
      best = (candidate, used)
  return best


def bytes_with_threshold(per_table: dict[str, TableMemory], size_threshold: Optional[int]) -> int:
  """Table and slot bytes on the fullest chip under `PartialTPUEmbedding(size_threshold=...)`:
  tables with `vocabulary_size <= size_threshold` replicated, the rest on the embedding
  hardware (`size_threshold=None` replicates every table)."""
  return sum(
    t.replicated_bytes if size_threshold is None or t.vocabulary_size <= size_threshold else t.bytes
    for t in per_table.values()
  )


def _verdict(
  chips: topologies.Topology,
  per_table: dict[str, TableMemory],
  fixed: int,
  threshold: Optional[int],
  used: int,
  fits: bool,
) -> str:
  hbm = chips.hbm_bytes_per_chip
  if not fits:
    name, table = max(per_table.items(), key=lambda item: item[1].bytes)
    return (
      f"does not fit on {chips.name}: table {name!r} needs {gib(table.bytes)} per chip "
      f"({table.bytes:,} B, table + slots), everything {gib(used)}; the chip has {gib(hbm)}"
    )
  setting = "None), every table replicated," if threshold is None else f"{threshold})"
  return (
    f"fits on {chips.name} ({chips.num_chips} chip(s)): PartialTPUEmbedding(size_threshold="
    f"{setting} uses {gib(used)} of {gib(hbm)} per chip"
  )


def gib(count: int) -> str:
  """Bytes as GiB with two decimals ("1.50 GiB")."""
  return f"{count / GIB:.2f} GiB"


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple
