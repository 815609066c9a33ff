"""Which side of `PartialTPUEmbedding` each table goes to, and what that costs per device.

The decision is made once, from each table's size and the hardware, before any variable exists;
`Placement` reports it. Keeping it apart from the layer (as TorchRec keeps its planner and its
stats apart from the modules) lets it be read and tested on its own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware

REPLICATED = "replicated"
SHARDED = "sharded"

_FLOAT32_BYTES = 4


def check_threshold(size_threshold: Any) -> None:
  if size_threshold is not None and (
    isinstance(size_threshold, bool) or not isinstance(size_threshold, int) or size_threshold < 0
  ):
    raise ValueError(
      f"size_threshold={size_threshold!r}; expected an int >= 0 (0 shards "
      "every table) or None (replicates every table)."
    )


def sides(config: config_lib.EmbeddingConfig, size_threshold: Optional[int]) -> dict[str, str]:
  """{table name: side}: sharded when `vocabulary_size > size_threshold`, else replicated."""
  check_threshold(size_threshold)
  return {
    table.name: SHARDED
    if size_threshold is not None and table.vocabulary_size > size_threshold
    else REPLICATED
    for table in config.tables
  }


def sharded_path(
  strategy: tf.distribute.Strategy, sharded_features: list[str]
) -> hardware.ExecutionPath:
  """The execution path of the sharded side under `strategy`, asked of the hardware once.

  On a TPU without embedding hardware TF replicates every table and trains it with the Keras
  optimizer (path V0), so the sharded side could not train as the replicated side does: refused.
  """
  path = hardware.choose_path(strategy)
  if path is hardware.ExecutionPath.TPU_V0:
    raise ValueError(
      f"Features {sharded_features} would be sharded, but this TPU has no embedding hardware "
      "(embedding feature UNSUPPORTED): there is nothing to shard onto. Pass "
      "size_threshold=None to replicate every table (trained by the layer's optimizer), or use "
      "TPUEmbedding."
    )
  return path


@dataclasses.dataclass(frozen=True)
class TablePlacement:
  """Where one table lives and what it costs.

  Attributes:
    table: the table's name.
    side: `"replicated"` or `"sharded"`.
    vocabulary_size, dim: the table's shape.
    slots: the optimizer's slot variable names (none for SGD or no optimizer).
    features: the feature paths served by the table.
    bytes: float32 bytes of the whole table plus its slots.
    bytes_per_device: the most bytes any one device holds: replicated, the whole `bytes`;
      sharded over n devices, `ceil(vocabulary_size / n)` rows of table and slots.
  """

  table: str
  side: str
  vocabulary_size: int
  dim: int
  slots: tuple[str, ...]
  features: tuple[str, ...]
  bytes: int
  bytes_per_device: int


@dataclasses.dataclass(frozen=True)
class Placement:
  """`PartialTPUEmbedding.placement()`: every table's side and memory; `str()` prints a table."""

  size_threshold: Optional[int]
  num_replicas: int
  tables: tuple[TablePlacement, ...]

  def __getitem__(self, table_name: str) -> TablePlacement:
    for entry in self.tables:
      if entry.table == table_name:
        return entry
    raise KeyError(f"No table named {table_name!r}; tables: {[t.table for t in self.tables]}.")

  def bytes_per_device(self, side: Optional[str] = None) -> int:
    """Bytes each device holds for one side, or for both when `side` is None."""
    return sum(t.bytes_per_device for t in self.tables if side in (None, t.side))

  def __str__(self) -> str:
    header = ("table", "side", "rows", "dim", "slots", "bytes", "bytes/device")
    rows = [
      (
        t.table,
        t.side,
        f"{t.vocabulary_size:,}",
        str(t.dim),
        ",".join(t.slots) or "-",
        f"{t.bytes:,}",
        f"{t.bytes_per_device:,}",
      )
      for t in self.tables
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = {2, 3, 5, 6}

    def line(cells):
      return "  ".join(
        c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
      ).rstrip()

    title = (
      f"PartialTPUEmbedding placement: size_threshold={self.size_threshold}, "
      f"{self.num_replicas} replica(s), float32 table + optimizer slots"
    )
    footer = (
      f"per device: replicated {self.bytes_per_device(REPLICATED):,} B + sharded "
      f"{self.bytes_per_device(SHARDED):,} B = {self.bytes_per_device():,} B"
    )
    return "\n".join([title, line(header), *map(line, rows), footer])


def report(
  config: config_lib.EmbeddingConfig,
  side_of: dict[str, str],
  size_threshold: Optional[int],
  num_replicas: int,
) -> Placement:
  """Each table's side and float32 bytes (table + slots), in total and per device.

  A replicated table is whole on each of the `num_replicas` devices; a sharded one is split by
  rows, so the fullest device holds `ceil(vocabulary_size / num_replicas)` rows of the table
  and of each slot. (SparseCore pads rows and columns further; that is not counted.)
  """
  if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
    raise ValueError(f"num_replicas={num_replicas!r}; expected an int >= 1.")
  entries = []
  for table in config.tables:
    slots = [(name, math.prod(shape[1:])) for name, shape in config_lib.slot_shapes(table)]
    row_bytes = _FLOAT32_BYTES * (table.dim + sum(width for _, width in slots))
    side = side_of[table.name]
    rows_per_device = (
      table.vocabulary_size
      if side == REPLICATED
      else math.ceil(table.vocabulary_size / num_replicas)
    )
    entries.append(
      TablePlacement(
        table=table.name,
        side=side,
        vocabulary_size=table.vocabulary_size,
        dim=table.dim,
        slots=tuple(name for name, _ in slots),
        features=tuple(f.path for f in config.features_of(table)),
        bytes=table.vocabulary_size * row_bytes,
        bytes_per_device=rows_per_device * row_bytes,
      )
    )
  return Placement(size_threshold, num_replicas, tuple(entries))
