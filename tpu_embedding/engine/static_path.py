"""The engine's static-shape path: lookups and updates that XLA compiles.

Chosen whenever the step is being compiled by XLA: inside a TPU replica step (where
`PartialTPUEmbedding`'s replicated tables are trained) and under `jit_compile` on CPU/GPU. There
every op needs an XLA kernel and every shape must be known at compile time, so nothing here
depends on the number of unique ids: shapes follow the batch's id capacity (its number of id
occurrences, fixed when the step compiles) or the table's size. The maths is the other paths'
(`updates.UpdateRule.compute` and the shared clipping and decay), so the numbers are the same.

Two formulations of a table's update, both exact (`update_for` picks one per table):

* **whole table**: the row gradient is one segment sum into `[V, D]`, the touch count one into
  `[V]`; untouched rows get g = 0 and the rule runs once over every row, with gradient clipping
  and weight decay masked to the touched rows; `tf.where(touched, new, old)` then keeps untouched
  rows bit-identical, except under non-lazy Adam, whose g = 0 step they take (as the TPU does).
  Its cost follows the vocabulary. It is the only one whose per-replica contribution has a fixed
  shape, so it is what several replicas sum (`exchange.cross_replica_sum`) before each applies it
  to its own copy; it also serves non-lazy Adam (which rewrites every row anyway).
* **unique rows**: one replica, rules that leave untouched rows alone. Each id occurrence's
  position is scattered (min) into a `[V]` int32 array, so every occurrence finds its id's first
  occurrence, the slot its gradient is summed into (N = occurrences slots, no sort); the N gathered
  rows get the rule and are scattered back; unused slots point one past the table, which XLA's
  scatter skips. Its cost follows the step's id slots plus one int32 pass over V.

On one replica a lazy rule takes the whole table while the table has at most
`WHOLE_TABLE_ROWS_PER_ID` rows per id slot, unique rows above: the crossover that
`benchmarks/static_path_formulations.py` measures (results in
`benchmarks/results/static_path_formulations.md`, between 2 and 4 rows per id for Adagrad and lazy
Adam at 1,024 and 4,096 ids per step).

XLA cannot raise at run time, so an out-of-range id cannot fail the step here (the id checks of
the other paths compile to nothing): its row reads are clamped to the table and its gradient is
dropped.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tpu_embedding import optimizer_specs, tf_internals
from tpu_embedding.engine import exchange, inputs, lookup, updates
from tpu_embedding.engine.state import TableState

Tensor = tf.Tensor
TableConfig = tf.tpu.experimental.embedding.TableConfig


def compiling() -> bool:
  """Whether XLA compiles the graph being built: a TPU replica step, or a `jit_compile`
  function (including tf-keras `compile(jit_compile=True)`); both enter an XLA context."""
  return tf_internals.compiling_with_xla()


# ---------------------------------------------------------------------------------------------
# Forward


def look_up_table(
  table: TableConfig, variable: Tensor, bags: tuple[inputs.Bags, ...]
) -> tuple[lookup.TableLookup, list[Tensor]]:
  """A table's activations (`lookup.look_up`): one gather per id occurrence, one segment sum."""
  activations = [
    lookup.shape_activations(
      bag, _combine(bag, lookup.quantize(tf.gather(variable, bag.ids), table))
    )
    for bag in bags
  ]
  return lookup.TableLookup(bags, lookup.Kernel.XLA), activations


def _combine(bag: inputs.Bags, rows: Tensor) -> Tensor:
  if bag.gains is not None:
    rows = rows * bag.gains[:, None]
  if bag.samples is None:
    return rows
  return tf.math.unsorted_segment_sum(rows, bag.samples, bag.num_samples)


# ---------------------------------------------------------------------------------------------
# Backward


def apply_gradients(
  per_table: Sequence[tuple[TableConfig, lookup.TableLookup, list]],
  rule_of: Callable[[TableConfig], updates.UpdateRule],
  state_of: Callable[[TableConfig], TableState],
  learning_rate_of: Callable[[TableConfig], Tensor],
) -> None:
  """One update per table from this replica's activation gradients, summed over replicas, in
  the formulation `update_for` picks (module docstring)."""
  summed = exchange.replicas_to_sum() > 1
  for table, batch, upstream in per_table:
    ids = lookup.concat([bag.ids for bag in batch.bags])
    grads = batch.occurrence_gradients(upstream, table.dim)
    rule = rule_of(table)
    learning_rate = learning_rate_of(table)
    update = FORMULATIONS[update_for(rule, summed, table.vocabulary_size, ids.shape[0])]
    update(rule, state_of(table), ids, grads, table.vocabulary_size, learning_rate)


# Lazy rules on one replica take the whole-table formulation while the table has at most this
# many rows per id slot of the step, unique rows above: where
# `benchmarks/static_path_formulations.py` measures the two cross.
WHOLE_TABLE_ROWS_PER_ID = 2


def update_for(
  rule: updates.UpdateRule, summed: bool, vocabulary_size: int, id_capacity: Optional[int]
) -> updates.XlaForm:
  """The formulation a table's update takes (module docstring): the one its rule needs
  (`UpdateRule.xla_form`: whole table when replicas sum their contributions or the rule rewrites
  every row), else whole table too while the table is small next to the step's id capacity (unknown
  when the step was traced with a relaxed shape: then unique rows, whose cost does not grow with the
  table)."""
  small = id_capacity is not None and vocabulary_size <= WHOLE_TABLE_ROWS_PER_ID * id_capacity
  return updates.XlaForm.WHOLE_TABLE if small else rule.xla_form(summed)


def _update_whole_table(
  rule: updates.UpdateRule,
  state: TableState,
  ids: Tensor,
  grads: Tensor,
  vocabulary_size: int,
  learning_rate: Tensor,
) -> None:
  # Row gradients and touch counts in separate [V, D] and [V] arrays, summed over replicas each:
  # faster than one [V, D + 1] array (`static_path_formulations.measure`, before and after).
  row_grads = exchange.cross_replica_sum(tf.math.unsorted_segment_sum(grads, ids, vocabulary_size))
  counts = tf.math.unsorted_segment_sum(tf.ones_like(ids, grads.dtype), ids, vocabulary_size)
  touched = exchange.cross_replica_sum(counts) > 0
  optimizer = rule.optimizer
  # Clipping and weight decay act on touched rows only (SPEC §2.2, §2.9); untouched rows get
  # g = 0, the step non-lazy Adam gives them, so one pass of the rule serves every row.
  row_grads = _touched_or(touched, updates.clip_gradient(optimizer, row_grads), 0.0)
  for copy in exchange.copies_to_update(state):
    old = tuple(variable.value() for variable in copy.variables)
    table = old[0]
    if optimizer_specs.has_weight_decay(optimizer):
      table = _touched_or(touched, updates.decay_weights(optimizer, table, learning_rate), table)
    new_table, new_slots = rule.compute(table, old[1:], row_grads, learning_rate)
    new = (updates.clip_weights(optimizer, new_table),) + tuple(new_slots)
    if not rule.updates_every_row:  # the other rules leave untouched rows bit-identical
      new = tuple(_touched_or(touched, value, kept) for value, kept in zip(new, old))
    for variable, value in zip(copy.variables, new):
      tf.raw_ops.AssignVariableOp(resource=variable.handle, value=tf.cast(value, variable.dtype))


def _touched_or(touched: Tensor, value: Tensor, other: Any) -> Tensor:
  """`value` on the touched rows, `other` elsewhere (rows are the first axis of either)."""
  mask = tf.reshape(touched, [-1] + [1] * (value.shape.rank - 1))
  return tf.where(mask, value, tf.cast(other, value.dtype))


def _update_unique_rows(
  rule: updates.UpdateRule,
  state: TableState,
  ids: Tensor,
  grads: Tensor,
  vocabulary_size: int,
  learning_rate: Tensor,
) -> None:
  unique_ids, row_grads = _deduplicate(ids, grads, vocabulary_size)
  row_grads = updates.clip_gradient(rule.optimizer, row_grads)
  read_ids = tf.minimum(unique_ids, vocabulary_size - 1)  # unused slots read a real row
  for copy in exchange.copies_to_update(state):
    table, slots = copy.parameters, copy.slots
    rows = updates.update_rows(
      rule, *updates.gather_rows(table, slots, read_ids), row_grads, learning_rate
    )
    updates.scatter_rows(table, slots, unique_ids, rows)


def _deduplicate(ids: Tensor, grads: Tensor, vocabulary_size: int) -> tuple[Tensor, Tensor]:
  """(ids [N], summed gradients [N, D]) with one slot per distinct id, at the position of its
  first occurrence; the other slots hold `vocabulary_size` (out of range) and zero gradients.

  No sort: each occurrence's position is scattered (min) into a `[V]` int32 array, whose value at
  an id is then the id's first occurrence, the slot its gradients are summed into."""
  size = tf.size(ids)
  positions = tf.range(size)
  valid = tf.logical_and(ids >= 0, ids < vocabulary_size)
  clamped = tf.clip_by_value(ids, 0, vocabulary_size - 1)
  first = tf.tensor_scatter_nd_min(
    tf.fill([vocabulary_size], size), tf.where(valid, clamped, vocabulary_size)[:, None], positions
  )
  slot = tf.where(valid, tf.gather(first, clamped), size)  # out-of-range ids: a dropped slot
  row_grads = tf.math.unsorted_segment_sum(grads, slot, size + 1)[:-1]
  unique_ids = tf.where(tf.equal(slot, positions), ids, tf.constant(vocabulary_size, tf.int64))
  return unique_ids, row_grads


# The function computing each formulation of a table's update, which `update_for` picks.
FORMULATIONS: dict[updates.XlaForm, Callable[..., None]] = {
  updates.XlaForm.WHOLE_TABLE: _update_whole_table,
  updates.XlaForm.UNIQUE_ROWS: _update_unique_rows,
}
