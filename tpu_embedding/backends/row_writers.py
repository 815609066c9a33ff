"""Each path's `row_resets.Writer`: where the rows a training remap gives to new keys get fresh
values (docs/managed-ids.md, "TPU"; the layer hands them over, `ManagedIdsMixin`)."""

from __future__ import annotations

import types
from typing import Callable, Mapping, Optional

import tensorflow as tf

from tpu_embedding.managed_ids import row_resets

TableConfig = tf.tpu.experimental.embedding.TableConfig
# Writes fresh values into `rows` (all in row block `block`, if not None) of one table and its
# slots, in the path's memory.
WriteRows = Callable[[TableConfig, tf.Tensor, Optional[int]], None]
_NOTHING_WAITS = types.MappingProxyType({})


class ImmediateWriter:
  """Writes the rows at once: tables the host writes between steps (off TPU, SparseCore, tables
  in TensorCore memory)."""

  waiting = _NOTHING_WAITS

  def __init__(
    self,
    tables: Mapping[str, TableConfig],
    write_rows: WriteRows,
    tables_exist: Callable[[], bool] = lambda: True,
    check: Callable[[], None] = lambda: None,
  ):
    self._tables, self._write_rows = dict(tables), write_rows
    self._tables_exist, self._check = tables_exist, check
    self._restored_early = False  # a restore waits for the tables to be created

  def check(self, layer_name: str, deferring: bool) -> None:
    del deferring  # the caller may write them: any time between steps will do here
    if self._restored_early and not self._tables_exist():
      raise ValueError(restored_early_refusal(layer_name))
    self._check()

  def write(self, given: Mapping[str, tf.Tensor], block: Optional[int] = None) -> None:
    if self._tables_exist():
      for name, rows in given.items():
        self._write_rows(self._tables[name], rows, block)

  def flush(self, restoring: bool = False) -> None:
    if restoring:  # nothing waits here
      self._restored_early = not self._tables_exist()


class DeferredWriter:
  """TPU V1: rows wait for a flush; until then their keys read row 0.

  A flush happens at the end of a training remap (the `n`-th since the layer was created) when
  `n` is a multiple of `reset_every_steps` of a table with waiting rows, and by `flush`. It
  copies every table out of TPU memory (`copy_out`), writes the fresh values of the waiting rows
  into the host copies, and loads them back (`copy_in`). With pipelining, a row given in remap
  `n` waits at least until remap `n + 1`: the gradient of its previous key, held back one step by
  the TPU, has then landed and is overwritten rather than added to the fresh row.
  """

  def __init__(
    self,
    tables: Mapping[str, tuple[TableConfig, int]],
    write_rows: WriteRows,
    copies: tuple[Callable[[], None], Callable[[], None]],
    tables_exist: Callable[[], bool],
    pipelining: bool,
    path_name: str,
  ):
    self._tables = {name: table for name, (table, _) in tables.items()}
    self._every = {name: every for name, (_, every) in tables.items()}
    self._write_rows, (self._copy_out, self._copy_in) = write_rows, copies
    self._tables_exist = tables_exist
    self._lag = 1 if pipelining else 0
    self._path_name = path_name
    self._restored_early = False
    self._remaps = 0
    self._last_given = {name: 0 for name in self._tables}  # remap that last gave a row
    self._flushed_until = 0  # every row given up to this remap has been written
    with tf.init_scope():
      # Waiting row -> the remap that gave it: only waiting rows, in a host hash table.
      self.waiting = {
        name: tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)
        for name in self._tables
      }

  def check(self, layer_name: str, deferring: bool) -> None:
    if deferring:
      raise ValueError(
        f"Layer {layer_name!r} is on path {self._path_name}, where the rows given to new keys "
        "are reset at flushes that copy the tables out of TPU memory and back, in the remap "
        "itself: remap(..., defer_resets=True) cannot return them. Call rows = "
        "layer.remap(features) in the training loop right before the step. Nothing was changed."
      )
    if not tf.executing_eagerly():
      raise ValueError(
        f"On path {self._path_name}, a training remap of managed ids (layer.remap(features), or "
        "a call with raw keys) must run eagerly, between steps: the rows it gives new keys are "
        "reset by copying the tables out of TPU memory and back, which cannot happen inside a "
        "tf.function or a tf.data pipeline. Call rows = layer.remap(features) in the Python "
        "training loop right before the step, then layer(rows, remapped=True) inside it."
      )
    if self._restored_early and not self._tables_exist():
      raise ValueError(restored_early_refusal(layer_name))

  def write(self, given: Mapping[str, tf.Tensor], block: Optional[int] = None) -> None:
    """Queues `given` (tables in TPU memory have no row `block`); flushes when one is due."""
    self._remaps += 1
    if not self._tables_exist():
      return
    for name, rows in given.items():
      self._last_given[name] = self._remaps
      since = tf.fill(tf.shape(rows), tf.constant(self._remaps, tf.int64))
      self.waiting[name].insert(rows, since)
    if any(self._remaps % self._every[n] == 0 and self._waits(n) for n in self._tables):
      self._flush(self._remaps - self._lag)

  def flush(self, restoring: bool = False) -> None:
    if self._tables_exist() and any(self._waits(name) for name in self._tables):
      self._flush(self._remaps)
    if restoring:
      self._restored_early = not self._tables_exist()

  def _waits(self, name: str) -> bool:
    return self._last_given[name] > self._flushed_until

  def _flush(self, given_until: int) -> None:
    """Writes the rows given in remaps up to `given_until`, through the host copies."""
    due = {}
    for name, waiting in self.waiting.items():
      rows, since = waiting.export()
      rows = tf.sort(tf.boolean_mask(rows, since <= given_until))  # export order is arbitrary
      if int(tf.size(rows)):
        due[name] = rows
    self._flushed_until = max(self._flushed_until, given_until)
    if not due:
      return
    self._copy_out()  # the host copies were stale: TPU memory holds every update since
    for name, rows in due.items():
      self._write_rows(self._tables[name], rows, None)
      self.waiting[name].remove(rows)
    self._copy_in()


class RoutedWriter:
  """PartialTPUEmbedding: each table's rows go to the writer of the side holding it."""

  def __init__(self, by_table: Mapping[str, row_resets.Writer]):
    self._by_table = dict(by_table)
    self._sides = list({id(w): w for w in by_table.values()}.values())
    self.waiting = {name: rows for side in self._sides for name, rows in side.waiting.items()}

  def check(self, layer_name: str, deferring: bool) -> None:
    for side in self._sides:
      side.check(layer_name, deferring)

  def write(self, given: Mapping[str, tf.Tensor], block: Optional[int] = None) -> None:
    """Every side's share of `given`, even an empty one: each side counts the remaps."""
    for side in self._sides:
      side.write({n: rows for n, rows in given.items() if self._by_table[n] is side}, block)

  def flush(self, restoring: bool = False) -> None:
    for side in self._sides:
      side.flush(restoring)


def restored_early_refusal(layer_name: str) -> str:
  """Why a training remap is refused between a restore made before the tables exist and their
  creation, and what to do."""
  return (
    f"A checkpoint was restored into layer {layer_name!r} before its tables exist (before the "
    "layer is built): the restore fills them only as they are created, and would overwrite the "
    "fresh values of any row a training remap gave meanwhile. Build the layer first (call it, "
    "or layer.build(...)), then remap. Nothing was changed."
  )
