"""Tables row-sharded over parameter servers (`ParameterServerStrategy` with a partitioner).

A table created under a `variable_partitioner` is a `ShardedVariable`: a list of row blocks
(shards), shard k holding rows `[start_k, start_k + rows_k)` on its own ps task. Everything a
step does to such a table is split by shard, so that nothing of size [vocabulary, dim] is ever
built or sent:

* lookup: the step's ids are partitioned by the shards' row ranges; each ps receives only the
  ids it owns (as local row numbers) and returns only those rows, gathered on the ps;
* update: each shard's part of the step's (unique ids, row gradients) is applied on the
  shard's ps by the table's own optimizer (`updates.apply_sparse_update`) to the shard and to
  the same shard of every slot, which are sharded exactly like the table (`create_slots`).

Concurrent workers: each shard has one `tf.CriticalSection` (a mutex living on the shard's
ps). A worker's update of a shard holds it for the whole gather-compute-scatter of the shard's
rows and slots, so two workers' read-modify-writes of a row never interleave and no update is
lost, for every optimizer. Updates of different shards (and tables) run in parallel; lookups
read without the lock, as asynchronous parameter-server training does (a row read during an
update is either wholly old or wholly new per element).

Checkpoints need nothing here: a `ShardedVariable` saves each shard as a slice of one logical
variable, so a checkpoint restores under another number of shards or into an unsharded table.
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tpu_embedding import checkpoint_names, tf_internals
from tpu_embedding import config as config_lib
from tpu_embedding.engine import updates
from tpu_embedding.engine.state import TableState

ShardedVariable = tf_internals.ShardedVariable
TableConfig = tf.tpu.experimental.embedding.TableConfig


def is_sharded(variable: Any) -> bool:
  return isinstance(variable, ShardedVariable)


def shards(variable: Any) -> list[tf.Variable]:
  """The row blocks of a sharded variable, in row order; a whole table is its only block."""
  return list(variable.variables) if is_sharded(variable) else [variable]


def row_starts(variable: ShardedVariable) -> list[int]:
  """First row of each shard, then the number of rows (the partition's boundaries)."""
  starts = [0]
  for shard in shards(variable):
    starts.append(starts[-1] + shard.shape[0])
  return starts


def in_block(variable: Any, rows: tf.Tensor, block: Optional[int]) -> tuple[Any, tf.Tensor]:
  """(the variable holding row block `block` of `variable`, `rows` counted from that block's
  first row), all of `rows` lying in that block; `variable` and `rows` as they are where
  `block` is None (a whole table)."""
  if block is None:
    return variable, rows
  return shards(variable)[block], rows - row_starts(variable)[block]


def colocated_with(parameters: tf.Variable, on_parameter_servers: bool):
  """Where a whole (unsharded) table's slots are created: beside the table on its ps task.

  Left to `ParameterServerStrategy`, each variable goes to the next ps task in turn, so a
  slot would land on another ps than its table and the update, which reads both, could not
  be placed.
  """
  if on_parameter_servers:
    return tf.distribute.get_strategy().extended.colocate_vars_with(parameters)
  return contextlib.nullcontext()


def refuse_pipelining(table: TableConfig) -> None:
  raise ValueError(
    f"Table {table.name!r} is sharded over parameter servers (a variable_partitioner was "
    "given to ParameterServerStrategy), which does not support "
    "pipeline_execution_with_tensor_core=True: set it to False for this layer, or create the "
    "strategy without a variable_partitioner."
  )


class _Partition:
  """Where each of a step's ids lives: its shard and its row number inside that shard."""

  def __init__(self, variable: ShardedVariable, ids: tf.Tensor):
    starts = row_starts(variable)
    self.count = len(starts) - 1
    ids = tf.cast(ids, tf.int64)
    shard_of = tf.searchsorted(
      tf.constant(starts[1:-1], tf.int64), ids, side="right", out_type=tf.int32
    )
    local = ids - tf.gather(tf.constant(starts[:-1], tf.int64), shard_of)
    self._shard_of = shard_of
    self.positions = tf.dynamic_partition(tf.range(tf.size(ids)), shard_of, self.count)
    self.local_ids = tf.dynamic_partition(local, shard_of, self.count)

  def split(self, values: tf.Tensor) -> list[tf.Tensor]:
    """`values` (one row per id) cut into each shard's part, in the order of `local_ids`."""
    return tf.dynamic_partition(values, self._shard_of, self.count)

  def stitch(self, parts: Sequence[tf.Tensor]) -> tf.Tensor:
    """The inverse of `split`: one row per id, in the ids' order."""
    return tf.dynamic_stitch(self.positions, list(parts))


def gather(table: Any, ids: tf.Tensor) -> tf.Tensor:
  """`tf.gather(table, ids)`; for a sharded table, each ps gathers the rows it owns."""
  if not is_sharded(table):
    return tf.gather(table, ids)
  partition = _Partition(table, ids)
  rows = []
  for shard, local_ids in zip(shards(table), partition.local_ids):
    with tf.device(shard.device):
      rows.append(tf.gather(shard, local_ids))
  return partition.stitch(rows)


def create_slots(
  table: TableConfig,
  parameters: ShardedVariable,
  names: Sequence[str],
  initializers: Sequence[Callable],
) -> dict[str, ShardedVariable]:
  """The table's slots, each split into the table's shards and placed with them.

  Left to the partitioner, a slot of another shape or size (e.g. `[vocabulary]`) could be cut
  differently from its table; each slot shard is instead created beside its table shard, with
  the table shard's rows.
  """
  strategy = tf.distribute.get_strategy()
  shapes = dict(config_lib.slot_shapes(table))
  slots = {}
  for name, initializer in zip(names, initializers):
    parts = []
    for index, shard in enumerate(shards(parameters)):
      shape = [shard.shape[0]] + list(shapes[name][1:])
      with strategy.extended.colocate_vars_with(shard):
        parts.append(
          tf.Variable(
            initial_value=functools.partial(initializer, shape=shape, dtype=tf.float32),
            trainable=False,
            name=f"{table.name}/{name}/part_{index}",
          )
        )
    slots[name] = ShardedVariable(parts, name=checkpoint_names.variable_key(table.name, name))
  return slots


class ShardLocks:
  """One critical section per shard of a table, on the shard's ps (see the module docstring).

  A whole table on a ps is locked the same way, as its one shard: TF's locked kernels cover
  only SGD and Adagrad, and the other rules' gather-compute-scatter would otherwise interleave
  between workers and lose updates.
  """

  def __init__(self, parameters: Any):
    self._locks = []
    with tf.init_scope():
      for shard in shards(parameters):
        with tf.device(shard.device):
          # A name no other lock has: locks with one name on a ps are one mutex, which a step
          # taking it for two tables would wait on forever.
          self._locks.append(
            tf.CriticalSection(name="shard_lock", shared_name=f"shard_lock_{uuid.uuid4().hex}")
          )

  def apply(
    self,
    rule: updates.UpdateRule,
    state: TableState,
    ids: tf.Tensor,
    grads: tf.Tensor,
    learning_rate: tf.Tensor,
  ) -> None:
    """Applies one step's unique (ids, row gradients) to a sharded table's state."""
    partition = _Partition(state.parameters, ids)
    per_shard = zip(self._locks, state.split(shards), partition.local_ids, partition.split(grads))
    for lock, shard, local_ids, shard_grads in per_shard:
      with tf.device(shard.parameters.device):
        lock.execute(
          functools.partial(_update_shard, rule, shard, local_ids, shard_grads, learning_rate),
          # Not exclusively: a managed table's map resets rows of the shard under its own lock.
          exclusive_resource_access=False,
        )


def _update_shard(
  rule: updates.UpdateRule,
  state: TableState,
  ids: tf.Tensor,
  grads: tf.Tensor,
  learning_rate: tf.Tensor,
) -> list[tf.Tensor]:
  """One shard's update, returning reads that come after its writes.

  The critical section releases its lock once what this returns is computed; reading zero
  rows of each variable (ordered after the writes to it) makes that wait for every write.
  """
  updates.apply_sparse_update(rule, state, ids, grads, learning_rate, atomic=True)
  return [v.sparse_read(ids[:0]) for v in state.variables]
