"""Fresh values for the rows a map gives to new keys, written by one `Writer` per path.

A training remap returns, per table, the rows it gave to new keys (`ManagedTables.step`), and
the layer hands them to its path's writer, which puts a fresh table's values (table and slots)
there before any step reads them. Off TPU, on SparseCore (V2) and for tables in TensorCore
memory the tables are variables the host writes between steps: the writer writes at once. TPU V1
keeps its tables in the embedding engine's memory, which TF's class fills only whole: its writer
keeps the rows in a queue (`Writer.waiting`), their keys reading the out-of-vocabulary row 0,
until a flush copies the tables out, writes the waiting rows and loads the tables back
(docs/managed-ids.md, "TPU"). The writers live with their paths (`backends/row_writers.py`);
this module holds their protocol and the writes into variables that they share.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Protocol

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import tf_internals
from tpu_embedding.engine import native, sharded
from tpu_embedding.managed_ids import resets

TableConfig = tf.tpu.experimental.embedding.TableConfig


class Writer(Protocol):
  """How one path's memory receives the rows given to new keys: its three hooks."""

  # {table name: its waiting rows, a hash table row -> the remap that gave it}: rows given but
  # not written yet, which read row 0 meanwhile (TPU V1); empty where the writer writes at once.
  waiting: Mapping[str, Any]

  def check(self, layer_name: str, deferring: bool) -> None:
    """Refuses, before any map changes, a training remap of layer `layer_name` whose rows this
    path could not write; `deferring`: one returning them (`remap(..., defer_resets=True)`)."""

  def write(self, given: Mapping[str, tf.Tensor], block: Optional[int] = None) -> None:
    """Fresh values for the rows one training remap gave ({managed table name: rows}, every
    table it stepped; or rows a remap returned, written now, on paths that allow that).
    `block`: the table's row block holding them all (a map shard's step under parameter
    servers). Rows given before the tables exist are left: the tables are created fresh."""

  def flush(self, restoring: bool = False) -> None:
    """Writes every row still waiting (before a save, an export or a restore). `restoring`: a
    restore follows; made before the tables exist, it fills them only as they are created, so
    `check` refuses training remaps until then (their rows could not be written)."""


def write_fresh(
  variables: Mapping[str, Any], table: TableConfig, rows: tf.Tensor, block: Optional[int]
) -> None:
  """Fresh values into `rows` of one table's variables ({"parameters"/slot name: variable}; all
  of `rows` in row block `block`, if not None).

  Where the kernels run on them (float32 matrices of this process, not mirrored: one op cannot
  write several devices) and every initializer is one they draw, one kernel draws each row
  straight into every variable (cc/reset_rows.cc); elsewhere TF's ops draw and scatter.
  """
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
  _write_values(variables, rows, resets.fresh_rows(table, rows), block)


def _write_values(
  variables: Mapping[str, Any],
  rows: tf.Tensor,
  values: Mapping[str, tf.Tensor],
  block: Optional[int],
) -> None:
  """`values` ({"parameters"/slot name: [len(rows), ...]}) into `rows` of the `variables` that
  have their names (all of `rows` in row block `block`, if not None)."""
  for name, value in values.items():
    if name in variables:
      variable, rows_here = sharded.in_block(variables[name], rows, block)
      variable.scatter_update(tf.IndexedSlices(value, rows_here))


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


def hide_waiting(
  waiting: Mapping[str, Any], config: config_lib.EmbeddingConfig, features: Any
) -> Any:
  """`features` (rows) with the rows still `waiting` for their write read as row 0 (not in a
  SavedModel's trace: exports flush first)."""
  if not waiting or tf_internals.in_save_context():
    return features
  leaves = []
  for feature, rows in config_lib.match_structure(config, features, subset=True):
    table = waiting.get(feature.table.name)
    leaves.append(rows if table is None else _map_values(rows, _hide(table)))
  return tf.nest.pack_sequence_as(features, leaves)


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
