"""`ShardedIdMap`'s layout, resets and refusals, on row blocks in this process (the cluster tests
are in `test_managed_ids_sharded.py`)."""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding
from tpu_embedding.managed_ids import row_resets, sharded_map

E = tf.tpu.experimental.embedding
ShardedVariable = tf.__internal__.distribute.ShardedVariable


def blocks(*sizes: int) -> ShardedVariable:
  return ShardedVariable([tf.Variable(tf.zeros([n, 2])) for n in sizes])


def test_each_shard_gives_the_rows_of_its_block_row_0_left_out():
  assert sharded_map.key_row_ranges([0, 7, 13]) == [(1, 7), (7, 13)]
  assert sharded_map.key_row_ranges([0, 3, 6, 8]) == [(1, 3), (3, 6), (6, 8)]
  assert sharded_map.key_row_ranges([0, 5]) == [(1, 5)]


def test_a_first_block_holding_only_row_0_is_refused_naming_the_table():
  with pytest.raises(ValueError, match=r"Table 'movies'.*into 2 blocks and the first holds only"):
    sharded_map.ShardedIdMap(tpu_embedding.ManagedIds(), "movies", blocks(1, 2))


def test_a_shard_resets_the_rows_it_gives_in_its_own_block_only():
  table = blocks(7, 6)  # rows 0..6 | 7..12
  config = E.TableConfig(13, 2, initializer=tf.constant_initializer(1.0), name="t")
  written = []

  def write(table_config, rows, values, block):
    written.append(block)
    row_resets.write_variables(lambda: {"t": {"parameters": table}})(
      table_config, rows, values, block
    )

  resets = row_resets.ImmediateResets(write)
  id_map = sharded_map.ShardedIdMap(tpu_embedding.ManagedIds(), "t", table)
  keys = [5, -6, 2**40 + 7, 8, 9, 5, 11]
  rows, fresh = id_map.remap(
    tf.constant(keys, tf.int64), True, lambda r, block=None: resets.reset(config, r, block)
  )
  # The documented rule, worked out here: FarmHash64 of the decimal string, modulo 2 blocks;
  # each shard gives its next free row, in first-occurrence order, from its block's range.
  owner = tf.strings.to_hash_bucket_fast([str(k) for k in keys], 2).numpy().tolist()
  assert set(owner) == {0, 1}  # both shards give rows
  following = {0: iter(range(1, 7)), 1: iter(range(7, 13))}
  row_of = {}
  for key, k in zip(keys, owner):
    if key not in row_of:
      row_of[key] = next(following[k])
  assert rows.numpy().tolist() == [row_of[k] for k in keys]
  assert sorted(fresh.numpy().tolist()) == sorted(row_of.values())
  assert written == [0, 1]  # one write per shard, into its block
  expected = np.zeros([13, 2], np.float32)
  expected[sorted(row_of.values())] = 1.0
  np.testing.assert_array_equal(table.numpy(), expected)
