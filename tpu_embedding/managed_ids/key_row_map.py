"""`KeyRowMap`: what callers ask of a managed table's map, whichever kind it is.

Off parameter servers a table has one `IdMap`; under `ParameterServerStrategy` a `ShardedIdMap`
split with the table's row blocks. Both satisfy this protocol, so the layer, serving and the
tests call them alike and never ask which one they hold.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import numpy as np
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


def as_keys(keys: Any, key_dtype: tf.DType, where: str) -> tf.Tensor:
  """`keys` in a map's `key_dtype`: narrower integers widened to int64, uint64 keys above
  2**63 - 1 refused (int64 cannot hold them: they would wrap onto negative keys); `where`
  starts each error, naming the feature and table."""
  keys = tf.convert_to_tensor(keys)
  dtype = keys.dtype
  if not (dtype == tf.string if key_dtype == tf.string else dtype.is_integer):
    wanted = "tf.string keys" if key_dtype == tf.string else "integer keys (int64 or narrower)"
    raise ValueError(
      f"{where} manages its ids with key_dtype {key_dtype.name}, which takes {wanted}; got "
      f"{dtype.name} keys."
    )
  if dtype == tf.uint64:
    keys = _below_int64_max(keys, where)
  return tf.cast(keys, key_dtype) if dtype != key_dtype else keys


def _below_int64_max(keys: tf.Tensor, where: str) -> tf.Tensor:
  """uint64 `keys`, checked to fit int64 (eagerly an error listing some; traced, an op)."""
  largest = tf.constant(np.iinfo(np.int64).max, tf.uint64)
  message = (
    f"{where} manages int64 keys: uint64 keys above 2**63 - 1 cannot be held without wrapping "
    "onto negative ones. Map them into int64 first (e.g. tf.bitcast to int64, if the bits "
    "are what identifies a key). Nothing was changed."
  )
  if tf.executing_eagerly():
    too_large = tf.boolean_mask(keys, keys > largest)[:5].numpy().tolist()
    if too_large:
      raise ValueError(f"{message} Offending keys: {too_large}.")
    return keys
  with tf.control_dependencies([tf.debugging.assert_less_equal(keys, largest, message=message)]):
    return tf.identity(keys)
