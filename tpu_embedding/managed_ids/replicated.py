"""One step of each managed map per training step, however many replicas share the batch.

Inside `strategy.run` with several replicas each replica holds a share of the global batch, but
a map must take each step's keys once, in one order, or the replicas would see different maps.
So the replicas' keys meet in one `merge_call` (as an optimizer's updates are applied once),
ordered as one device fed the global batch reads them: each managed feature in the layer's
order, its replicas' shares in replica order (a replica's share of a feature is its rows of the
global batch). The step runs once there, in the cross-replica context, and each replica gets the
rows of its own keys back. Under `MultiWorkerMirroredStrategy` the keys are all-gathered from
every worker and each worker runs the same deterministic step on its own copy of the map, so
the copies stay equal without sending rows or map state between workers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf

# The rows of the global batch's keys (one flat tensor per managed feature) by one map step.
Step = Callable[[list[tf.Tensor]], list[tf.Tensor]]


def in_replica_of_several() -> bool:
  """Whether this code runs inside one of several replicas of `strategy.run`."""
  if tf.distribute.in_cross_replica_context():
    return False
  return tf.distribute.get_replica_context().num_replicas_in_sync > 1


def run_once(step: Step, keys: list[tf.Tensor]) -> list[tf.Tensor]:
  """`step` on the global batch's keys, once: directly where this call holds the whole batch,
  else once for all replicas (this replica's rows returned)."""
  if not in_replica_of_several():
    return step(keys)
  sizes = tf.stack([tf.size(k, out_type=tf.int64) for k in keys])
  context = tf.distribute.get_replica_context()
  return context.merge_call(functools.partial(_step_once, step=step), args=(keys, sizes))


def _step_once(strategy: tf.distribute.Strategy, keys: list[Any], sizes: Any, step: Step) -> Any:
  """In the cross-replica context: the global keys through `step`, each replica's rows cut out."""
  replicas = strategy.num_replicas_in_sync
  shares = tf.reshape(_gathered(strategy, sizes), [replicas, len(keys)])
  rows = step([_gathered(strategy, k) for k in keys])
  pieces = [tf.split(r, shares[:, f], num=replicas) for f, r in enumerate(rows)]
  return strategy.experimental_distribute_values_from_function(
    lambda context: [p[context.replica_id_in_sync_group] for p in pieces]
  )


def _gathered(strategy: tf.distribute.Strategy, value: Any) -> tf.Tensor:
  """Every replica's `value`, concatenated in replica order. The replicas of this process are
  joined here (any dtype); other workers' come by the strategy's all-gather, which takes
  numbers only: strings travel as their bytes and lengths."""
  local = strategy.experimental_local_results(value)
  if len(local) == strategy.num_replicas_in_sync:
    return tf.concat(local, 0)
  if local[0].dtype != tf.string:
    return strategy.gather(value, axis=0)
  # MultiWorkerMirroredStrategy numbers a worker's replicas consecutively.
  codes, lengths = strategy.experimental_distribute_values_from_function(
    lambda context: _as_bytes(local[context.replica_id_in_sync_group % len(local)])
  )
  codes, lengths = strategy.gather(codes, axis=0), strategy.gather(lengths, axis=0)
  one_byte_strings = tf.constant([bytes([b]) for b in range(256)])
  joined = tf.RaggedTensor.from_row_lengths(tf.gather(one_byte_strings, codes), lengths)
  return tf.strings.reduce_join(joined, axis=1)


def _as_bytes(keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """(every byte of `keys`, as int32 in key order; the length of each key)."""
  chars = tf.strings.bytes_split(keys)
  codes = tf.reshape(tf.io.decode_raw(chars.flat_values, tf.uint8), [-1])
  return tf.cast(codes, tf.int32), chars.row_lengths()
