"""Tests of `tpu_embedding.managed_ids.row_resets.write_fresh`: the reset kernel where it
runs, TF's ops elsewhere, the same values where they are not random (the layer's resets on each
path: test_managed_ids_layer, _tpu, _sharded)."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding
from tpu_embedding.engine import native
from tpu_embedding.managed_ids import row_resets

E = tf.tpu.experimental.embedding
ROWS = tf.constant([5, 2, 7], tf.int64)


def _variables(table, fill=9.0):
  shape = [table.vocabulary_size, table.dim]
  return {
    "parameters": tf.Variable(tf.fill(shape, fill)),
    "accumulators": tf.Variable(tf.fill(shape, fill)),
  }


def _reset_ops(table, variables):
  """The op types a traced reset of ROWS runs."""
  graph = (
    tf.function(lambda: row_resets.write_fresh(variables, table, ROWS, None))
    .get_concrete_function()
    .graph
  )
  return {op.type for op in graph.get_operations()}


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_constant_resets_write_the_same_rows_on_the_kernel_and_on_tf_ops(kernels, monkeypatch):
  monkeypatch.setenv(native.ENV_SWITCH, kernels)
  table = E.TableConfig(
    8,
    3,
    initializer=tf.constant_initializer(0.5),
    optimizer=E.Adagrad(0.1, initial_accumulator_value=0.2),
    name="t",
  )
  variables = _variables(table)
  ops = _reset_ops(table, variables)
  assert ("TpuEmbeddingResetRows" in ops) == (kernels == "1")
  assert ("ResourceScatterUpdate" in ops) == (kernels == "0")
  row_resets.write_fresh(variables, table, ROWS, None)
  expected_table, expected_slot = np.full((8, 3), 9.0, np.float32), np.full((8, 3), 9.0, np.float32)
  expected_table[[5, 2, 7]], expected_slot[[5, 2, 7]] = 0.5, 0.2
  np.testing.assert_array_equal(variables["parameters"].numpy(), expected_table)
  np.testing.assert_array_equal(variables["accumulators"].numpy(), expected_slot)


def test_initializers_the_kernel_cannot_draw_are_reset_by_tf_ops():
  """Glorot's rows depend on the table's shape: the rows of a fresh full-shape draw, within
  its bound sqrt(6 / (fan_in + fan_out)), every other row untouched."""
  table = E.TableConfig(
    8, 3, initializer=tf.initializers.GlorotUniform(), optimizer=E.SGD(0.1), name="t"
  )
  variables = {"parameters": tf.Variable(tf.fill([8, 3], 9.0))}
  ops = _reset_ops(table, variables)
  assert "TpuEmbeddingResetRows" not in ops and "ResourceScatterUpdate" in ops
  row_resets.write_fresh(variables, table, ROWS, None)
  values = variables["parameters"].numpy()
  assert np.all(np.abs(values[[5, 2, 7]]) <= np.sqrt(6 / 11))
  np.testing.assert_array_equal(np.delete(values, [5, 2, 7], 0), 9.0)


def test_mirrored_copies_are_reset_by_tf_ops_with_one_draw():
  """Under MirroredStrategy (2 logical CPUs) one op cannot write both devices: TF's ops draw
  once (the table's truncated normal: |z| < 2) and write both copies alike, outside any
  replica's step."""
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  table = E.TableConfig(
    8, 16, initializer=tf.initializers.TruncatedNormal(0.0, 0.1), optimizer=E.Adagrad(0.1), name="t"
  )
  with strategy.scope():
    variables = _variables(table)
  assert "TpuEmbeddingResetRows" not in _reset_ops(table, variables)
  row_resets.write_fresh(variables, table, ROWS, None)
  first, second = (v.numpy() for v in variables["parameters"].values)
  np.testing.assert_array_equal(first, second)
  assert np.all(np.abs(first[[5, 2, 7]]) < 0.2) and np.all(first[[5, 2, 7]] != 0)
  np.testing.assert_array_equal(np.delete(first, [5, 2, 7], 0), 9.0)
  for accumulators in variables["accumulators"].values:
    np.testing.assert_array_equal(accumulators.numpy()[[5, 2, 7]], np.float32(0.1))


def test_tracing_a_training_call_leaves_autograph_nothing_to_warn_about(caplog):
  """The resets' hooks run at every traced training call and remap (here also one returning its
  resets, as a `tf.data` map traces it); AutoGraph once failed on those whose body is a
  docstring and warned at every trace."""
  table = E.TableConfig(5, 2, initializer=tf.constant_initializer(0.5), name="movies")
  layer = tpu_embedding.TPUEmbedding(
    {"movie": E.FeatureConfig(table, name="movie")},
    optimizer=E.SGD(0.1),
    managed_ids={"movies": tpu_embedding.ManagedIds()},
  )
  call = tf.function(lambda keys: layer({"movie": keys}, training=True))
  ahead = tf.function(lambda keys: layer.remap({"movie": keys}, defer_resets=True))
  with caplog.at_level("WARNING"):
    out = call(tf.constant([7, 9], tf.int64))
    rows, resets = ahead(tf.constant([9, 4], tf.int64))
  np.testing.assert_array_equal(out["movie"].numpy(), np.full((2, 2), 0.5, np.float32))
  np.testing.assert_array_equal(rows["movie"].numpy(), [2, 3])
  np.testing.assert_array_equal(resets["movies"].numpy(), [3, 0])
  assert not [r for r in caplog.records if "AutoGraph could not transform" in r.getMessage()]


def test_tpu_host_copies_sharded_over_hosts_are_reset_by_tf_ops():
  """TF's TPU embedding keeps a V1 table's host copies as a `TPUEmbeddingVariable` (row shards,
  one per host): TF's ops write the row into its shard."""
  from tensorflow.python.tpu import tpu_embedding_v2

  shards = [tf.Variable(tf.fill([3, 2], 9.0)), tf.Variable(tf.fill([2, 2], 9.0))]
  host_copy = tpu_embedding_v2.TPUEmbeddingVariable(shards, name="t")
  table = E.TableConfig(5, 2, initializer=tf.constant_initializer(0.5), name="t")
  row_resets.write_fresh({"parameters": host_copy}, table, tf.constant([4], tf.int64), None)
  np.testing.assert_array_equal(shards[0].numpy(), np.full((3, 2), 9.0))
  np.testing.assert_array_equal(shards[1].numpy(), [[9.0, 9.0], [0.5, 0.5]])


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_resets_of_constant_tables_need_no_seed_under_op_determinism(kernels, monkeypatch):
  from tensorflow.python.framework import config

  monkeypatch.setenv(native.ENV_SWITCH, kernels)
  tf.random.set_seed(None)  # whatever an earlier test left: the case is "no seed anywhere"
  table = E.TableConfig(
    8, 3, initializer=tf.zeros_initializer(), optimizer=E.Adagrad(0.1), name="t"
  )
  variables = _variables(table)
  tf.config.experimental.enable_op_determinism()
  try:
    row_resets.write_fresh(variables, table, ROWS, None)
  finally:
    config.disable_op_determinism()
  np.testing.assert_array_equal(variables["parameters"].numpy()[[5, 2, 7]], 0.0)
  np.testing.assert_array_equal(variables["accumulators"].numpy()[[5, 2, 7]], np.float32(0.1))


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_each_reset_of_a_seeded_keras_initializer_draws_new_values(kernels, monkeypatch):
  """Keras's seeded initializers return the same block at every call: two resets of as many
  rows would write the same values. Both paths draw a stream from the seed instead."""
  monkeypatch.setenv(native.ENV_SWITCH, kernels)
  initializer = tf_keras.initializers.RandomNormal(0.0, 1.0, seed=4)
  table = E.TableConfig(8, 3, initializer=initializer, optimizer=E.SGD(0.1), name="t")
  variables = {"parameters": tf.Variable(tf.zeros([8, 3]))}
  reset = tf.function(lambda rows: row_resets.write_fresh(variables, table, rows, None))
  reset(tf.constant([0, 1], tf.int64))
  reset(tf.constant([2, 3], tf.int64))
  values = variables["parameters"].numpy()
  assert np.all(values[:4] != 0) and not np.any(values[0:2] == values[2:4])
