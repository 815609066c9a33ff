"""How the rows a map gives to new keys are reset in the memory that holds the tables.

Off TPU, on SparseCore (V2) and for tables in TensorCore memory the tables are variables the host
can write between steps, so a reset is written at once (`ImmediateResets`). TPU V1 keeps its
tables in the embedding engine's memory, which TF's class fills only whole, from its host copies
(`DeferredResets`): rows given to new keys wait, their keys reading the out-of-vocabulary row 0,
until a flush copies the tables out, resets every waiting row and slot in the host copies and
loads them back (docs/managed-ids.md, "TPU").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import tf_internals
from tpu_embedding.engine import native, sharded
from tpu_embedding.managed_ids import resets

TableConfig = tf.tpu.experimental.embedding.TableConfig
# Writes {"parameters"/slot name: [len(rows), ...] values} into `rows` of one table's memory;
# the last argument, when not None, is the row block of a table sharded over parameter servers
# that holds all of `rows` (the write then touches that block, on its ps task, only).
Write = Callable[[TableConfig, tf.Tensor, Mapping[str, tf.Tensor], Optional[int]], None]
# Resets `rows` (all in row block `block`, if not None) of one table and its slots to what a
# fresh table holds.
Reset = Callable[[TableConfig, tf.Tensor, Optional[int]], None]


def fresh_values(write: Write) -> Reset:
  """A `Reset` writing, through `write`, the values `resets.fresh_rows` draws with TF's ops."""

  def reset(table: TableConfig, rows: tf.Tensor, block: Optional[int]) -> None:
    write(table, rows, resets.fresh_rows(table, rows), block)

  return reset


def reset_variables(variables_by_table: Callable[[], Mapping[str, Mapping[str, Any]]]) -> Reset:
  """A `Reset` of variables kept per table ({table name: {"parameters"/slot: variable}}).

  Where the kernels run on them (float32 matrices of this process, not mirrored: one op cannot
  write several devices) and every initializer is one they draw, one kernel draws each row
  straight into every variable (cc/reset_rows.cc); elsewhere TF's ops draw and scatter.
  """
  with_ops = fresh_values(_write_variables(variables_by_table))

  def reset(table: TableConfig, rows: tf.Tensor, block: Optional[int]) -> None:
    variables = variables_by_table()[table.name]
    draws = resets.draws(table)
    if draws is not None:
      names = [name for name in draws.by_variable if name in variables]
      # Slots are cut into the table's blocks (`sharded.create_slots`).
      here = [sharded.in_block(variables[name], rows, block) for name in names]
      targets = [variable for variable, _ in here]
      if _kernel_writes(targets):
        specs = [dataclasses.astuple(draws.by_variable[name]) for name in names]
        native.reset_rows(here[0][1], targets, specs, draws.seeds)
        return
    with_ops(table, rows, block)

  return reset


def _kernel_writes(variables: list[Any]) -> bool:
  """Whether the reset kernel can write all of `variables` in one op: plain variables only (a
  mirrored one has a copy per device; TF's TPU host copies are sharded over the hosts)."""
  return (
    all(
      isinstance(v, tf.Variable) and not isinstance(v, tf.distribute.DistributedValues)
      for v in variables
    )
    and all(v.shape.rank == 2 for v in variables)
    and native.runs_on(variables)
  )


def _write_variables(variables_by_table: Callable[[], Mapping[str, Mapping[str, Any]]]) -> Write:
  """A `Write` into variables kept per table ({table name: {"parameters"/slot: variable}})."""

  def write(
    table: TableConfig, rows: tf.Tensor, values: Mapping[str, tf.Tensor], block: Optional[int]
  ) -> None:
    variables = variables_by_table()[table.name]
    for name, value in values.items():
      if name not in variables:
        continue
      # Slots are cut into the table's blocks (`sharded.create_slots`).
      variable, rows_here = sharded.in_block(variables[name], rows, block)
      variable.scatter_update(tf.IndexedSlices(value, rows_here))

  return write


class ImmediateResets:
  """Resets written as the map gives the rows, before the step that reads them."""

  def __init__(
    self,
    reset: Reset,
    built: Callable[[], bool] = lambda: True,
    check: Callable[[], None] = lambda: None,
  ):
    self._reset = reset
    self._built = built  # before the tables exist, rows need no reset: they will be fresh...
    self._check = check
    self._restored_unbuilt = False  # ...unless a restore fills them as it creates them
    # Rows given since such a restore, reset once the tables exist: (table, rows, block).
    self._given_unbuilt: list[tuple[TableConfig, tf.Tensor, Optional[int]]] = []
    # Remaps that returned their resets (`remap(..., defer_resets=True)`), per table: how many
    # times they gave each row, and how many of those resets the caller wrote. Each count has
    # one writer (the remaps' thread, the training loop), so neither races the other.
    self._returned: dict[str, tuple[TableConfig, tf.Variable, tf.Variable]] = {}

  def check_training_remap(self) -> None:
    """Refuses, before any map changes, a training remap this path could not reset rows for
    (`check` raises, or the rows would have to wait for the tables inside a trace)."""
    if self._restored_unbuilt and not self._built() and not tf.executing_eagerly():
      raise ValueError(
        "A checkpoint was restored into this layer with managed_ids before its tables exist "
        "(before the layer is built): a training remap must then run eagerly (or after the "
        "layer is built), so that the rows it gives are reset once the restore has written the "
        "tables. Nothing was changed."
      )
    self._check()

  @tf.autograph.experimental.do_not_convert  # a docstring alone: see `end_step`
  def check_resets_returned(self, layer_name: str) -> None:
    """Refuses, before any map changes, a remap whose resets the caller writes later
    (`remap(..., defer_resets=True)`); here they can be written at any time between steps."""

  def restoring(self) -> None:
    """A checkpoint restore begins: resets still waiting are written first (none may wait for
    a row the restored map gives away); before the tables exist, the restore is remembered,
    and rows given before it are forgotten (the restored map and tables replace them)."""
    self.apply()
    self._restored_unbuilt = not self._built()
    self._given_unbuilt = []

  def tables_created(self) -> None:
    """The layer's tables were just created (its `build`), filled by a restore made before:
    the rows given to new keys since that restore are reset now, before any step reads them."""
    given, self._given_unbuilt = self._given_unbuilt, []
    self._restored_unbuilt = False
    for table, rows, block in given:
      self.reset(table, rows, block)

  def reset(self, table: TableConfig, rows: tf.Tensor, block: Optional[int] = None) -> None:
    """`rows` of `table` (all in row block `block`, if given) were just given to new keys."""
    if self._built():
      self._reset(table, rows, block)
    elif self._restored_unbuilt:
      self._given_unbuilt.append((table, rows, block))

  def returned(self, table: TableConfig, rows: tf.Tensor) -> None:
    """`rows` of `table` were given by a remap that returned their resets unwritten."""
    given, _ = self._counts(table)
    given.scatter_add(tf.IndexedSlices(tf.ones_like(rows, tf.int32), rows))

  def reset_returned(self, table: TableConfig, rows: tf.Tensor) -> None:
    """The caller writes resets a remap returned (`reset_rows`); one written late, after
    `apply` or `before_training` wrote it, is written again but counted once."""
    self.reset(table, rows)
    given, written = self._counts(table)
    done = tf.minimum(tf.gather(written, rows) + 1, tf.gather(given, rows))
    written.scatter_update(tf.IndexedSlices(done, rows))

  def before_training(self, table: TableConfig, rows: tf.Tensor) -> None:
    """A call with raw keys is about to train `rows` of `table`: resets a remap returned for
    them and nobody wrote (its batch was dropped) are written now, once, before their keys
    train the rows; never after (a later `apply` finds them written)."""
    if table.name not in self._returned:  # no remap returned resets of this table
      return
    given, written = self._counts(table)
    rows = tf.unique(tf.cast(rows, tf.int64))[0]
    due = tf.boolean_mask(rows, tf.gather(given, rows) > tf.gather(written, rows))
    self.reset(table, due)
    written.scatter_update(tf.IndexedSlices(tf.gather(given, due), due))

  def _counts(self, table: TableConfig) -> tuple[tf.Variable, tf.Variable]:
    if table.name not in self._returned:
      with tf.init_scope():  # made once, eagerly, also when first asked inside a trace
        given, written = (
          tf.Variable(tf.zeros([table.vocabulary_size], tf.int32), trainable=False, name=name)
          for name in ("resets_returned", "resets_written")
        )
      self._returned[table.name] = (table, given, written)
    return self._returned[table.name][1:]

  # Hooks with nothing to do here are left to Python: AutoGraph fails on a body that is only
  # a docstring (a warning at every trace).
  @tf.autograph.experimental.do_not_convert
  def end_step(self) -> None:
    """One training remap of every map is done."""

  @tf.autograph.experimental.do_not_convert
  def apply(self) -> None:
    """Writes every reset still waiting (before a save, an export or a restore): here, those
    remaps returned that `reset_rows` has not written (batches remapped ahead of training, or
    left in a pipeline when its loop stopped). Each is due once: it counts as written, so
    later saves leave the row (trained since) alone; `reset_rows` still writes it when it
    comes, before its batch's step."""
    for table, given, written in self._returned.values():
      self.reset(table, tf.where(given > written)[:, 0])
      written.assign(given)

  def visible(self, config: config_lib.EmbeddingConfig, features: Any) -> Any:
    """`features` (rows) as the tables can serve them now."""
    return features


class DeferredResets(ImmediateResets):
  """TPU V1: resets wait for a flush; until then their keys read row 0.

  A flush happens at the end of a training remap (the `n`-th since the layer was created) when
  `n` is a multiple of `reset_every_steps` of a table with waiting rows, and by `apply`. It
  copies every table out of TPU memory (`copy_out`), writes the fresh values of the waiting rows
  into the host copies, and loads them back (`copy_in`). With pipelining, a row given in remap
  `n` waits at least until remap `n + 1`: the gradient of its previous key, held back one step by
  the TPU, has then landed and is overwritten rather than added to the fresh row.
  """

  def __init__(
    self,
    reset: Reset,
    copy_out: Callable[[], None],
    copy_in: Callable[[], None],
    tables: Mapping[str, tuple[TableConfig, int]],
    pipelining: bool,
    path_name: str,
    built: Callable[[], bool],
  ):
    super().__init__(reset, built)
    self._copy_out, self._copy_in = copy_out, copy_in
    self._tables = {name: table for name, (table, _) in tables.items()}
    self._every = {name: every for name, (_, every) in tables.items()}
    self._lag = 1 if pipelining else 0
    self._path_name = path_name
    self._remaps = 0
    self._last_given = {name: 0 for name in self._tables}  # remap that last gave a row
    self._flushed_until = 0  # every row given up to this remap has been reset
    with tf.init_scope():
      # Waiting row -> the remap that gave it: only waiting rows, in a host hash table.
      self._waiting = {
        name: tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)
        for name in self._tables
      }

  def check_training_remap(self) -> None:
    if not tf.executing_eagerly():
      raise ValueError(
        f"On path {self._path_name}, a training remap of managed ids (layer.remap(features), or "
        "a call with raw keys) must run eagerly, between steps: the rows it gives new keys are "
        "reset by copying the tables out of TPU memory and back, which cannot happen inside a "
        "tf.function or a tf.data pipeline. Call rows = layer.remap(features) in the Python "
        "training loop right before the step, then layer(rows, remapped=True) inside it."
      )
    super().check_training_remap()

  def check_resets_returned(self, layer_name: str) -> None:
    raise ValueError(
      f"Layer {layer_name!r} is on path {self._path_name}, where the rows given to new keys are "
      "reset at flushes that copy the tables out of TPU memory and back, in the remap itself: "
      "remap(..., defer_resets=True) cannot return them. Call rows = layer.remap(features) in "
      "the training loop right before the step. Nothing was changed."
    )

  def restoring(self) -> None:
    if not self._built():  # rows given since an earlier restore: the restored map replaces them
      for waiting in self._waiting.values():
        waiting.remove(waiting.export()[0])
    super().restoring()

  def reset(self, table: TableConfig, rows: tf.Tensor, block: Optional[int] = None) -> None:
    """Rows wait (reading row 0) for a flush; before the tables exist, only rows given since a
    restore (which will fill the tables at `build`), flushed once the layer is built.
    (`block`: tables in TPU memory have no row blocks.)"""
    if not (self._built() or self._restored_unbuilt):
      return
    self._last_given[table.name] = self._remaps + 1
    since = tf.fill(tf.shape(rows), tf.constant(self._remaps + 1, tf.int64))
    self._waiting[table.name].insert(rows, since)

  def tables_created(self) -> None:
    self._restored_unbuilt = False  # its rows wait in `_waiting` already

  def end_step(self) -> None:
    self._remaps += 1
    if self._built() and any(
      self._remaps % self._every[n] == 0 and self._waits(n) for n in self._tables
    ):
      self._flush(self._remaps - self._lag)

  def apply(self) -> None:
    if self._built() and any(self._waits(name) for name in self._tables):
      self._flush(self._remaps)

  def visible(self, config: config_lib.EmbeddingConfig, features: Any) -> Any:
    """Rows still waiting for their reset read row 0 (SavedModel traces: exports flush first)."""
    if tf_internals.in_save_context():
      return features
    pairs = config_lib.match_structure(config, features, subset=True)
    leaves = []
    for feature, rows in pairs:
      waiting = self._waiting.get(feature.table.name)
      leaves.append(rows if waiting is None else _map_values(rows, _hide(waiting)))
    return tf.nest.pack_sequence_as(features, leaves)

  def _waits(self, name: str) -> bool:
    return self._last_given[name] > self._flushed_until

  def _flush(self, given_until: int) -> None:
    """Resets the rows given in remaps up to `given_until`, through the host copies."""
    due = {}
    for name, waiting in self._waiting.items():
      rows, since = waiting.export()
      rows = tf.sort(tf.boolean_mask(rows, since <= given_until))  # export order is arbitrary
      if int(tf.size(rows)):
        due[name] = rows
    self._flushed_until = max(self._flushed_until, given_until)
    if not due:
      return
    self._copy_out()  # the host copies were stale: TPU memory holds every update since
    for name, rows in due.items():
      table = self._tables[name]
      self._reset(table, rows, None)
      self._waiting[name].remove(rows)
    self._copy_in()


def _hide(waiting: Any) -> Callable[[tf.Tensor], tf.Tensor]:
  def hide(rows: tf.Tensor) -> tf.Tensor:
    rows64 = tf.cast(rows, tf.int64)
    return tf.where(waiting.lookup(rows64) >= 0, tf.zeros_like(rows64), rows64)

  return hide


def _map_values(ids: Any, function: Callable[[tf.Tensor], tf.Tensor]) -> Any:
  if isinstance(ids, tf.SparseTensor):
    return ids.with_values(function(ids.values))
  if isinstance(ids, tf.RaggedTensor):
    return ids.with_flat_values(function(ids.flat_values))
  return function(tf.convert_to_tensor(ids))


class RoutedResets(ImmediateResets):
  """PartialTPUEmbedding: each table's resets go to the side holding it."""

  def __init__(self, by_table: Mapping[str, ImmediateResets]):
    self._by_table = dict(by_table)
    self._distinct = list({id(r): r for r in by_table.values()}.values())

  def check_training_remap(self) -> None:
    for side in self._distinct:
      side.check_training_remap()

  def check_resets_returned(self, layer_name: str) -> None:
    for side in self._distinct:
      side.check_resets_returned(layer_name)

  def reset(self, table: TableConfig, rows: tf.Tensor, block: Optional[int] = None) -> None:
    self._by_table[table.name].reset(table, rows, block)

  def returned(self, table: TableConfig, rows: tf.Tensor) -> None:
    self._by_table[table.name].returned(table, rows)

  def reset_returned(self, table: TableConfig, rows: tf.Tensor) -> None:
    self._by_table[table.name].reset_returned(table, rows)

  def before_training(self, table: TableConfig, rows: tf.Tensor) -> None:
    self._by_table[table.name].before_training(table, rows)

  def end_step(self) -> None:
    for side in self._distinct:
      side.end_step()

  def apply(self) -> None:
    for side in self._distinct:
      side.apply()

  def restoring(self) -> None:
    for side in self._distinct:
      side.restoring()

  def tables_created(self) -> None:
    for side in self._distinct:
      side.tables_created()

  def visible(self, config: config_lib.EmbeddingConfig, features: Any) -> Any:
    for side in self._distinct:
      features = side.visible(config, features)
    return features
