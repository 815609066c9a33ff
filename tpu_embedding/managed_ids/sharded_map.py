"""`ShardedIdMap`: one managed table's map split over the parameter-server tasks.

Under `ParameterServerStrategy` no worker holds the map: shard k lives on a ps task, holds the
keys whose 64-bit FarmHash fingerprint is k modulo the number of shards (int64 keys hashed as
their decimal string), and gives them rows from its own contiguous range of the table's rows.
Each shard is a whole `IdMap` (its local row 0 stands for the out-of-vocabulary row 0), so a
shard follows exactly the rules of docs/managed-ids.md on its part of every step's key stream.

Workers train concurrently: one step of a shard (count, admit, evict) runs on the shard's ps as
one function call inside the shard's `tf.CriticalSection`, so two workers' steps of a shard never
interleave and a key never gets two rows, nor a row two keys. Steps of different shards run in
parallel. Which worker's step a shard takes first is not chosen by anyone, so under concurrent
training the map depends on that order; with steps run one at a time it depends on the key
stream only.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Callable, Optional

import tensorflow as tf

from tpu_embedding.engine.distribution import Distribution
from tpu_embedding.managed_ids.id_map import IdMap
from tpu_embedding.managed_ids.spec import ManagedIds

Reset = Callable[[tf.Tensor], None]


def new_map(spec: ManagedIds, table_name: str, capacity: int) -> IdMap | ShardedIdMap:
  """The map of a managed table created now: sharded over the ps tasks under PSS."""
  if Distribution.current() is not Distribution.PARAMETER_SERVERS:
    return IdMap(spec, table_name, capacity)
  return ShardedIdMap(spec, table_name, capacity, len(parameter_server_devices()))


def parameter_server_devices() -> list[str]:
  """The CPU of each ps task of the cluster this process is connected to."""
  return [d.name for d in tf.config.list_logical_devices("CPU") if "/job:ps/" in d.name]


def remap_and_reset(
  id_map: IdMap | ShardedIdMap, keys: tf.Tensor, training: bool, reset: Optional[Reset]
) -> tf.Tensor:
  """Rows of `keys` after one step of `id_map` (with `training`), the rows given to new keys
  reset by `reset` before anything reads them (for a sharded map, within the shard's step)."""
  if isinstance(id_map, ShardedIdMap):
    return id_map.remap(keys, training, reset)[0]
  rows, fresh = id_map.remap(keys, training)
  if reset is not None:
    reset(fresh)
  return rows


def serving_tables(id_map: IdMap | ShardedIdMap) -> Any:
  """The hash tables a serving lookup of `id_map` reads (a SavedModel must hold them)."""
  if isinstance(id_map, ShardedIdMap):
    return [shard.rows_of_keys for shard in id_map.shards]
  return id_map.rows_of_keys


def row_ranges(capacity: int, num_shards: int) -> list[tuple[int, int]]:
  """[first, end) of the rows each shard gives: rows 1..capacity-1 cut in contiguous ranges,
  the first `(capacity - 1) % num_shards` ranges one row longer."""
  size, extra = divmod(capacity - 1, num_shards)
  ranges, first = [], 1
  for k in range(num_shards):
    end = first + size + (k < extra)
    ranges.append((first, end))
    first = end
  return ranges


class ShardedIdMap(tf.Module):
  """The map of one managed table under PSS: `num_shards` `IdMap`s, one per ps task."""

  def __init__(self, spec: ManagedIds, table_name: str, capacity: int, num_shards: int):
    super().__init__()
    spec.check_capacity(table_name, capacity)
    if capacity - 1 < num_shards:
      raise ValueError(
        f"Table {table_name!r}: its managed-id map is split over {num_shards} parameter servers, "
        f"each giving rows of its own, so it needs vocabulary_size >= {num_shards + 1}; got "
        f"{capacity}."
      )
    self.spec, self.table_name, self.capacity = spec, table_name, capacity
    strategy = tf.distribute.get_strategy()
    ranges = row_ranges(capacity, num_shards)
    with tf.init_scope():
      # Created one after another, PSS puts these on consecutive ps tasks; each shard's state
      # is then created beside its own (colocated, hence never partitioned).
      self.first_rows = [
        tf.Variable(first, dtype=tf.int64, trainable=False, name="first_row") for first, _ in ranges
      ]
      shards, locks = [], []
      for anchor, (first, end) in zip(self.first_rows, ranges):
        with strategy.extended.colocate_vars_with(anchor), tf.device(anchor.device):
          shards.append(IdMap(spec, table_name, end - first + 1))
          locks.append(
            tf.CriticalSection(name="map_lock", shared_name=f"map_lock_{uuid.uuid4().hex}")
          )
    self.shards = shards
    self._offsets = tuple(first - 1 for first, _ in ranges)
    self._locks = self._no_dependency(locks)

  @property
  def key_dtype(self) -> tf.DType:
    return self.spec.key_dtype

  @property
  def num_shards(self) -> int:
    return len(self.shards)

  def shard_of(self, keys: tf.Tensor) -> tf.Tensor:
    """The shard holding each key: FarmHash64 of the key (int64: its decimal string) mod shards."""
    keys = tf.convert_to_tensor(keys, self.key_dtype)
    text = keys if keys.dtype == tf.string else tf.strings.as_string(keys)
    return tf.cast(tf.strings.to_hash_bucket_fast(text, self.num_shards), tf.int32)

  # -------------------------------------------------------------------------------------------
  # The map's API (that of `IdMap`), rows being the table's

  def lookup(self, keys: tf.Tensor) -> tf.Tensor:
    """Rows of `keys` (0 for keys without a row); never admits, evicts or counts."""
    keys = tf.convert_to_tensor(keys, self.key_dtype)
    flat = tf.reshape(keys, [-1])
    rows = self._per_shard(
      flat, lambda k, shard, part: self._global(k, shard.lookup(part)), on_ps=False
    )
    return tf.reshape(rows, tf.shape(keys))

  def size(self) -> tf.Tensor:
    """How many keys hold a row (all shards)."""
    return tf.add_n([shard.size() for shard in self.shards])

  def export(self) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(keys, rows, counts) of every key holding a row, by ascending row; counts aged to now."""
    parts = [shard.export() for shard in self.shards]
    keys = tf.concat([p[0] for p in parts], 0)
    rows = tf.concat([self._global(k, p[1]) for k, p in enumerate(parts)], 0)
    return keys, rows, tf.concat([p[2] for p in parts], 0)  # shards' ranges ascend

  def remap(
    self, keys: tf.Tensor, training: bool, reset: Optional[Reset] = None
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """(row of each key, rows given to new keys this step); one step of every shard.

    `reset(rows)` writes fresh values into rows given to new keys; it runs inside the shard's
    critical section, so no other worker can look a new key up before its row is reset.
    """
    if not training:
      return self.lookup(keys), tf.zeros([0], tf.int64)
    fresh = []

    def step(k: int, shard: IdMap, part: tf.Tensor) -> tf.Tensor:
      def locked(part: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        local, new_local = shard.remap(part, True)
        new_rows = self._global(k, new_local)
        if reset is not None:
          reset(new_rows)
        return self._global(k, local), new_rows

      # As one function call, whose outputs exist only once all its writes are done, so the
      # lock covers every write. The table's own shard locks guard its rows too (not
      # exclusively: a reset and an update of a row are each atomic, in either order).
      rows, new_rows = self._locks[k].execute(
        lambda: tf.function(locked)(part), exclusive_resource_access=False
      )
      fresh.append(new_rows)
      return rows

    rows = self._per_shard(tf.reshape(keys, [-1]), step, on_ps=True)
    return rows, tf.concat(fresh, 0)

  # -------------------------------------------------------------------------------------------

  def _per_shard(self, keys: tf.Tensor, fn, on_ps: bool) -> tf.Tensor:
    """fn(k, shard, shard k's part of `keys`), stitched back in key order; `on_ps`: run on
    shard k's ps task (a training step). Lookups name no device, so that a serving graph runs
    where no ps exists (their hash-table reads go to the tables wherever they are)."""
    shard_of = self.shard_of(keys)
    positions = tf.dynamic_partition(tf.range(tf.size(keys)), shard_of, self.num_shards)
    parts = tf.dynamic_partition(keys, shard_of, self.num_shards)
    results = []
    for k, (anchor, shard, part) in enumerate(zip(self.first_rows, self.shards, parts)):
      with tf.device(anchor.device) if on_ps else contextlib.nullcontext():
        results.append(fn(k, shard, part))
    return tf.dynamic_stitch(positions, results)

  def _global(self, k: int, local_rows: tf.Tensor) -> tf.Tensor:
    """Shard k's local rows as the table's (local 0, out of vocabulary, stays 0)."""
    return tf.where(local_rows > 0, local_rows + self._offsets[k], tf.zeros_like(local_rows))
