"""`KeyRowMap`: what callers ask of a managed table's map, whichever kind it is.

Off parameter servers a table has one `IdMap`; under `ParameterServerStrategy` a `ShardedIdMap`
split with the table's row blocks. Both satisfy this protocol, so the layer, serving and the
tests call them alike and never ask which one they hold.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import tensorflow as tf

from tpu_embedding.managed_ids.spec import ManagedIds


class Reset(Protocol):
  """Writes fresh values into the table rows given to new keys, before anything reads them;
  `block`: the table's row block holding all of `rows` (a map split over parameter servers)."""

  def __call__(self, rows: tf.Tensor, block: Optional[int] = None) -> None: ...


class KeyRowMap(Protocol):
  """A table's key -> row map (docs/managed-ids.md); rows are the table's."""

  spec: ManagedIds
  table_name: str
  capacity: int

  @property
  def key_dtype(self) -> tf.DType: ...

  def lookup(self, keys: tf.Tensor) -> tf.Tensor:
    """Rows of `keys` (0 for keys without a row); never admits, evicts or counts."""

  def size(self) -> tf.Tensor:
    """How many keys hold a row."""

  def export(self) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(keys, rows, counts) of every key holding a row, by ascending row."""

  def remap(
    self, keys: tf.Tensor, training: bool, reset: Optional[Reset] = None
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """(row of each key, rows given to new keys); with `training` one step of the map, the
    given rows passed to `reset` before any later step can read them."""

  def serving_tables(self) -> list[Any]:
    """The hash tables a serving lookup reads (a SavedModel must hold them)."""

  def reindex(self) -> None:
    """Rebuilds the hash tables from the map's variables, once something else assigned them."""
