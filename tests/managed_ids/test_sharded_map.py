"""`ShardedIdMap`'s layout, resets and refusals, on row blocks in this process (the cluster tests
are in `tests/managed_ids/test_sharded.py`)."""

import types

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding
from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding.backends import keras_trained
from tpu_embedding.managed_ids import row_resets, sharded_map
from tpu_embedding.managed_ids.spec import as_keys

from managed_ids_reference import fingerprints

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

  def reset(rows, block=None):
    written.append(block)
    row_resets.write_fresh({"parameters": table}, config, rows, block)

  id_map = sharded_map.ShardedIdMap(tpu_embedding.ManagedIds(), "t", table)
  keys = [5, -6, 2**40 + 7, 8, 9, 5, 11]
  rows, fresh = id_map.remap(tf.constant(keys, tf.int64), True, reset)
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


def test_string_keys_are_split_as_before_maps_held_fingerprints():
  """A string-key map's shards hold the strings' fingerprints, each in the shard that
  `to_hash_bucket_fast` of the string chose when they held the strings (so an older checkpoint's
  shards convert in place); `lookup` takes the strings."""
  table = blocks(5, 5, 5)
  id_map = sharded_map.ShardedIdMap(tpu_embedding.ManagedIds(key_dtype=tf.string), "t", table)
  strings = [f"item{i}".encode() for i in range(12)] + [b"", b"k\x00y"]
  keys = as_keys(tf.constant(strings), tf.string, "t")
  owner = tf.strings.to_hash_bucket_fast(strings, 3).numpy().tolist()
  assert set(owner) == {0, 1, 2}
  assert id_map.shard_of(keys).numpy().tolist() == owner
  rows, _ = id_map.remap(keys, True)
  assert id_map.lookup(tf.constant(strings)).numpy().tolist() == rows.numpy().tolist()
  for k, shard in enumerate(id_map.shards):
    held = set(shard.export()[0].numpy().tolist())
    assert held == {key for key, o in zip(fingerprints(strings), owner) if o == k} & held


@pytest.mark.parametrize(
  "make_optimizer",
  [
    lambda: tf_keras.optimizers.Adagrad(0.3, 0.1),
    lambda: tf_keras.optimizers.legacy.Adagrad(0.3, 0.1),
  ],
  ids=["tf_keras", "legacy"],
)
def test_a_shard_resets_a_keras_trained_table_and_its_keras_slots_in_its_own_block(
  make_optimizer,
):
  """Tables trained by the Keras optimizer (`table_updates="keras"`) under parameter servers:
  Keras keeps one slot per block, named after the block; each shard's reset writes the rows it
  gives, block-local, into its block of the table and of each slot, and nothing else."""
  init = np.arange(26, dtype=np.float32).reshape(13, 2)
  table = ShardedVariable(
    [tf.Variable(init[:7], name="t/part_0"), tf.Variable(init[7:], name="t/part_1")]
  )
  optimizer = make_optimizer()
  optimizer.apply_gradients(
    [(tf.ones([7, 2]), table.variables[0]), (tf.ones([6, 2]), table.variables[1])]
  )
  # One Adagrad step with gradient 1: accumulator 0.1 + 1, table init - 0.3 / sqrt(1.1).
  trained = init - np.float32(0.3) / np.sqrt(np.float32(1.1))
  features = {
    "f": E.FeatureConfig(E.TableConfig(13, 2, initializer=tf.constant_initializer(init), name="t"))
  }
  config = config_lib.prepare(features, optimizer)
  backend = types.SimpleNamespace(  # what the reset reads of a built CPU backend
    path=hardware.ExecutionPath.CPU,
    config=config,
    variables_by_table={"t": {"parameters": table}},
    is_built=lambda: True,
  )
  spec = tpu_embedding.ManagedIds()
  writer = keras_trained.row_writer_of(backend, optimizer, {"t": spec})
  id_map = sharded_map.ShardedIdMap(spec, "t", table)
  keys = [5, -6, 2**40 + 7, 8, 9, 5, 11]
  rows, fresh = id_map.remap(
    tf.constant(keys, tf.int64), True, lambda r, block=None: writer.write({"t": r}, block)
  )
  fresh = sorted(fresh.numpy().tolist())
  assert {row < 7 for row in fresh} == {True, False}  # both blocks gave rows
  want_table, want_slot = trained.copy(), np.full([13, 2], 1.1, np.float32)
  want_table[fresh], want_slot[fresh] = init[fresh], 0.1
  np.testing.assert_allclose(table.numpy(), want_table, rtol=1e-6)
  # The slots, found without the package's lookup: the optimizer's variables of a block's shape.
  variables = optimizer.variables() if callable(optimizer.variables) else optimizer.variables
  blocks = [b for v in variables for b in getattr(v, "variables", [v]) if b.shape.rank == 2]
  assert [tuple(b.shape) for b in blocks] == [(7, 2), (6, 2)]
  np.testing.assert_allclose(np.concatenate([b.numpy() for b in blocks]), want_slot, rtol=1e-6)


def test_remap_returning_its_resets_is_refused_for_maps_split_over_parameter_servers():
  """Each shard resets the rows it gives inside its own step: `defer_resets` is refused."""
  table = E.TableConfig(6, 2, name="movies")
  config = config_lib.prepare({"movie": E.FeatureConfig(table, name="movie")})
  managed = tpu_embedding.managed_ids.ManagedTables({"movies": tpu_embedding.ManagedIds()}, config)
  managed.maps["movies"] = sharded_map.ShardedIdMap(
    tpu_embedding.ManagedIds(), "movies", blocks(3, 3)
  )
  with pytest.raises(ValueError, match=r"Layer 'ranker'.*parameter servers.*defer_resets=True"):
    managed.check_resets_returned("ranker")
