"""Cross-replica sums for the static-shape path: an all-reduce of fixed-shape gradients.

The engine's other path gathers every replica's (id, gradient) pairs with `merge_call` and
updates the tables once. Inside an XLA-compiled replica step that cannot work: a TPU replica
context has no such merge, and shapes must be known at compile time. Here every replica instead
contributes a tensor of one fixed shape (a whole-table row gradient and touched-row count), the
sum over replicas reaches every replica, and each replica applies the same update to its own
copy of the table, so the copies stay identical without ever moving a table.
"""

from __future__ import annotations

import tensorflow as tf


def replicas_to_sum() -> int:
  """How many replicas' gradients the current step must sum (1 outside a replica step)."""
  if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
    return 1
  return tf.distribute.get_replica_context().num_replicas_in_sync


def cross_replica_sum(value: tf.Tensor) -> tf.Tensor:
  """`value` summed over every replica of the step, on every replica; itself with one replica.

  On TPU and on GPUs under XLA this is one collective all-reduce. Under MirroredStrategy on CPU,
  TensorFlow has no XLA collective (it refuses to compile one), so there the step that sums must
  be a plain `tf.function`; see the README's "engine paths" section.
  """
  if replicas_to_sum() == 1:
    return value
  return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)
