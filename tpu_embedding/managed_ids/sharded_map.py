"""`ShardedIdMap`: one managed table's map split with the table's rows over parameter servers.

Under `ParameterServerStrategy` the table is a list of row blocks (one unless a
`variable_partitioner` cuts it), each on a ps task. The map has one part (*shard*) per block,
created on that block's ps task: shard k holds the keys whose 64-bit FarmHash fingerprint is k
modulo the number of blocks (int64 keys hashed as their decimal string; a string-key map's keys
are the strings' fingerprints already, taken modulo as unsigned) and gives them rows of its own
block only. A shard's whole step (count, admit, evict, and the reset of the rows it
gives) therefore reads and writes only its own ps task. Each shard is a whole `IdMap` (its local
row 0 stands for the out-of-vocabulary row 0), so a shard follows exactly the rules of
docs/managed-ids.md on its part of every step's key stream.

The split depends on the number of blocks, not of ps tasks: a checkpoint restores under any
number of ps tasks whose partitioner cuts the table into as many blocks (each key keeps its row,
on the block the table's rows were restored to); under another number of blocks a key's shard
would change while its row could not, and the restore is refused (`checkpoint.py`).

Workers train concurrently: one step of a shard runs on the shard's ps as one function call
inside the shard's `tf.CriticalSection`, so two workers' steps of a shard never interleave and a
key never gets two rows, nor a row two keys. Steps of different shards run in parallel. Which
worker's step a shard takes first is not chosen by anyone, so under concurrent training the map
depends on that order; with steps run one at a time it depends on the key stream only.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Optional

import tensorflow as tf

from tpu_embedding import tf_internals
from tpu_embedding.engine import sharded
from tpu_embedding.engine.distribution import Distribution
from tpu_embedding.managed_ids.id_map import IdMap
from tpu_embedding.managed_ids.spec import KeyRowMap, ManagedIds, Reset, as_keys


def splits_maps() -> bool:
  """Whether maps created now are split with their tables' row blocks (under PSS): the tables
  must then exist before the maps."""
  return Distribution.current() is Distribution.PARAMETER_SERVERS


def new_map(spec: ManagedIds, table_name: str, capacity: int, table: Any = None) -> KeyRowMap:
  """The map of a managed table created now: where `splits_maps()`, split with the rows of
  `table` (the table's variable)."""
  distribution = Distribution.current()
  if distribution is Distribution.LOCAL:
    return IdMap(spec, table_name, capacity)
  if distribution is Distribution.REPLICATED:
    # One map, on this process's CPU, not a copy per replica: every replica's keys reach it in
    # one step (`layer_mixin.run_once`), also where Keras calls the layer outside a replica step.
    host = f"{tf_internals.host_address_space()}/device:CPU:0"
    with tf.init_scope(), tf_internals.undistributed_variables(), tf.device(host):
      return IdMap(spec, table_name, capacity)
  return ShardedIdMap(spec, table_name, table)


def key_row_ranges(row_starts: list[int]) -> list[tuple[int, int]]:
  """[first, end) of the rows each shard gives: its block's rows, row 0 left out."""
  return [(max(start, 1), end) for start, end in zip(row_starts, row_starts[1:])]


class ShardedIdMap(tf.Module):
  """The map of one managed table under PSS: one `IdMap` per row block of the table, on the
  block's ps task, giving that block's rows."""

  def __init__(self, spec: ManagedIds, table_name: str, table: Any):
    super().__init__()
    blocks = sharded.shards(table)
    capacity = int(table.shape[0])
    spec.check_capacity(table_name, capacity)
    ranges = key_row_ranges(sharded.row_starts(table))
    if ranges[0][0] >= ranges[0][1]:
      raise ValueError(
        f"Table {table_name!r}: its managed-id map gives each row block of the table rows of "
        f"its own, but the strategy's variable_partitioner cut the table into {len(blocks)} "
        "blocks and the first holds only row 0 (the out-of-vocabulary row). Cut it into fewer "
        "blocks, or give it more rows."
      )
    self.spec, self.table_name, self.capacity = spec, table_name, capacity
    strategy = tf.distribute.get_strategy()
    shards, locks = [], []
    with tf.init_scope():
      for block, (first, end) in zip(blocks, ranges):
        # Beside the block (colocated, hence never partitioned nor sent to another ps).
        with strategy.extended.colocate_vars_with(block), tf.device(block.device):
          shards.append(IdMap(spec, table_name, end - first + 1))
          locks.append(
            tf.CriticalSection(name="map_lock", shared_name=f"map_lock_{uuid.uuid4().hex}")
          )
    self.shards = shards
    self._devices = tuple(block.device for block in blocks)
    self._offsets = tuple(first - 1 for first, _ in ranges)
    self._locks = self._no_dependency(locks)

  @property
  def key_dtype(self) -> tf.DType:
    """What `lookup` takes (strings for a string-key map, held as their fingerprints)."""
    return self.spec.key_dtype

  @property
  def num_shards(self) -> int:
    return len(self.shards)

  @property
  def devices(self) -> tuple[str, ...]:
    """Where each shard lives and runs its steps: the ps task of its row block."""
    return self._devices

  def shard_of(self, keys: tf.Tensor) -> tf.Tensor:
    """The shard holding each of `keys` (the int64 keys the map holds): FarmHash64 of the key
    mod shards; of an int64 key, its decimal string's; of a string-key map's fingerprint, the
    fingerprint itself as uint64, which puts each string where `to_hash_bucket_fast` of the
    string put it before such maps held fingerprints."""
    n = self.num_shards
    if self.key_dtype != tf.string:
      return tf.cast(tf.strings.to_hash_bucket_fast(tf.strings.as_string(keys), n), tf.int32)
    # uint64(k) mod n in int64 ops: a negative k stands for k + 2**64.
    wrapped = tf.where(keys < 0, tf.constant(2**64 % n, tf.int64), tf.zeros_like(keys))
    return tf.cast(tf.math.floormod(tf.math.floormod(keys, n) + wrapped, n), tf.int32)

  # -------------------------------------------------------------------------------------------
  # The map's API (that of `IdMap`), rows being the table's

  def lookup(self, keys: tf.Tensor) -> tf.Tensor:
    """Rows of `keys` (of `key_dtype`; 0 for keys without a row); never admits, evicts or
    counts."""
    return self.rows_of(as_keys(keys, self.key_dtype, f"Table {self.table_name!r}"))

  def rows_of(self, keys: tf.Tensor) -> tf.Tensor:
    """`lookup` of the int64 keys the map holds (`as_keys`'s)."""
    flat = tf.reshape(keys, [-1])
    rows = self._per_shard(
      flat, lambda k, shard, part: self._global(k, shard.rows_of(part)), on_ps=False
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

  def serving_tables(self) -> list[Any]:
    """Every shard's hash table (a serving lookup routes each key to its shard's)."""
    return [table for shard in self.shards for table in shard.serving_tables()]

  def reindex(self) -> None:
    """Every shard's `IdMap.reindex`."""
    for shard in self.shards:
      shard.reindex()

  def remap(
    self, keys: tf.Tensor, training: bool, reset: Optional[Reset] = None
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """(row of each key, rows given to new keys this step); one step of every shard; `keys`:
    the int64 keys the map holds (`as_keys`).

    `reset(rows)` writes fresh values into rows given to new keys; it runs inside the shard's
    critical section on the shard's ps (the rows are its block's), so no other worker can look
    a new key up before its row is reset.
    """
    if not training:
      return self.rows_of(keys), tf.zeros([0], tf.int64)
    fresh = []

    def step(k: int, shard: IdMap, part: tf.Tensor) -> tf.Tensor:
      def locked(part: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        # The reset writes this shard's block only, on this ps.
        global_reset = None if reset is None else lambda local: reset(self._global(k, local), k)
        local, new_local = shard.remap(part, True, global_reset)
        return self._global(k, local), self._global(k, new_local)

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
    for k, (device, shard, part) in enumerate(zip(self._devices, self.shards, parts)):
      with tf.device(device) if on_ps else contextlib.nullcontext():
        results.append(fn(k, shard, part))
    return tf.dynamic_stitch(positions, results)

  def _global(self, k: int, local_rows: tf.Tensor) -> tf.Tensor:
    """Shard k's local rows as the table's (local 0, out of vocabulary, stays 0)."""
    return tf.where(local_rows > 0, local_rows + self._offsets[k], tf.zeros_like(local_rows))
