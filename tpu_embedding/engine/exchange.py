"""Cross-replica sums of a step's table gradients, for both engine paths.

The graph path (`gather_and_update`) gathers every replica's (id, gradient) pairs with
`merge_call` and updates the tables once, from the cross-replica context, with the sum over the
global batch. Inside an XLA-compiled replica step that cannot work: a TPU replica context has no
such merge, and shapes must be known at compile time. The static-shape path (`cross_replica_sum`)
instead has every replica contribute a tensor of one fixed shape (a whole-table row gradient and
touched-row count); the sum over replicas reaches every replica, and each replica applies the
same update to its own copy of the table, so the copies stay identical without ever moving a
table.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import tensorflow as tf

from tpu_embedding.engine import lookup
from tpu_embedding.engine.state import TableState

TableConfig = tf.tpu.experimental.embedding.TableConfig
# `update([(table, unique ids, row gradients), ...])`: one step's update of every table from the
# global batch, in one call so that every table's checks can run before any table is written.
Update = Callable[[Sequence[tuple[TableConfig, tf.Tensor, tf.Tensor]]], None]


def in_replica() -> bool:
  """Whether this runs in one replica of a strategy's step, whose gradients are only part of
  the global batch's."""
  return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def copies_to_update(state: TableState) -> list[TableState]:
  """The copies of a table's state an update must write: in a replica step only this replica's
  own (the variables resolve to it); elsewhere each device's copy (one when not distributed).
  Every copy receives the same update from the same global gradient, which keeps mirrored
  copies identical without any table-sized communication."""
  return [state] if in_replica() else state.copies()


def replicas_to_sum() -> int:
  """How many replicas' gradients the current step must sum (1 outside a replica step)."""
  if not in_replica():
    return 1
  return tf.distribute.get_replica_context().num_replicas_in_sync


def cross_replica_sum(value: tf.Tensor) -> tf.Tensor:
  """`value` summed over every replica of the step, on every replica; itself with one replica.

  On TPU and on GPUs under XLA this is one collective all-reduce. Under MirroredStrategy on CPU,
  TensorFlow has no XLA collective (it refuses to compile one), so there the step that sums must
  be a plain `tf.function`; see docs/xla.md.
  """
  if replicas_to_sum() == 1:
    return value
  return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)


def gather_and_update(per_table: Sequence[tuple[TableConfig, Any, list]], update: Update) -> None:
  """From a replica: hands every id occurrence's (id, gradient) to one cross-replica merge, which
  calls `update` once with every table's unique ids and row gradients of the global batch, in
  the same order as on a single device.

  `per_table` holds (table, the table's forward batch, its bags' activation gradients).
  """
  strategy = tf.distribute.get_strategy()
  context = tf.distribute.get_replica_context()
  bags, sizes = [], []
  for table, batch, upstream in per_table:
    bag_sizes = [tf.size(b.ids) for b in batch.bags]
    split = functools.partial(tf.split, num_or_size_splits=tf.stack(bag_sizes), num=len(bag_sizes))
    grads = batch.occurrence_gradients(upstream, table.dim)
    bags.append(list(zip(split(batch.occurrence_ids), split(grads))))
    sizes.extend(bag_sizes)
  sizes = tf.stack(sizes)[None]  # [1, bags]: gathered into [replicas, bags]
  multi_worker = len(strategy.extended.worker_devices) < strategy.num_replicas_in_sync
  if multi_worker:
    # Replicas on other workers can only be reached by a collective gather, which needs equal
    # shapes: pad each bag to the largest size any replica has; the merge drops the padding.
    largest = tf.reduce_max(context.all_gather(sizes, axis=0), axis=0)
    flat = [pair for table_bags in bags for pair in table_bags]
    padded = iter(
      [(_pad_rows(i, largest[n]), _pad_rows(g, largest[n])) for n, (i, g) in enumerate(flat)]
    )
    bags = [[next(padded) for _ in table_bags] for table_bags in bags]
  context.merge_call(
    functools.partial(_merge_and_update, [t for t, _, _ in per_table], multi_worker, update),
    args=(bags, sizes),
  )


# `merge_call` has AutoGraph convert its function when the step calls it from converted code (a
# model's step in `fit`, Orbit's loop: any step run under a strategy), which would convert the
# whole update (engine, update rules, learning-rate schedules): several times its tracing cost.
# It has no tensor-dependent Python control flow.
@tf.autograph.experimental.do_not_convert
def _merge_and_update(tables, multi_worker, update: Update, strategy, bags, sizes) -> None:
  if multi_worker:
    all_sizes = strategy.gather(sizes, axis=0)  # [replicas, bags]

  def gather(value, bag_index):
    if not multi_worker:  # every replica is on this worker: concatenate, no communication
      return tf.concat(strategy.experimental_local_results(value), axis=0)
    replica_sizes = all_sizes[:, bag_index]
    gathered = strategy.gather(value, axis=0)
    width = tf.shape(gathered)[0] // tf.size(replica_sizes)
    return tf.boolean_mask(
      gathered, tf.reshape(tf.range(width)[None, :] < replica_sizes[:, None], [-1])
    )

  position = 0
  per_table = []
  for table, table_bags in zip(tables, bags):
    ids, grads = [], []
    for bag_ids, bag_grads in table_bags:
      ids.append(gather(bag_ids, position))
      grads.append(gather(bag_grads, position))
      position += 1
    unique_ids, index = tf.unique(tf.concat(ids, 0), out_idx=tf.int64)
    row_grads = lookup.sum_by_index(tf.concat(grads, 0), index, tf.size(unique_ids))
    per_table.append((table, unique_ids, row_grads))
  update(per_table)


def _pad_rows(x: tf.Tensor, size: tf.Tensor) -> tf.Tensor:
  padding = [[0, size - tf.shape(x)[0]]] + [[0, 0]] * (x.shape.rank - 1)
  return tf.pad(x, padding)
