"""Managed ids where the remap runs outside the step: XLA-compiled steps and MirroredStrategy."""

import numpy as np
import tensorflow as tf

import tpu_embedding

E = tf.tpu.experimental.embedding
CAPACITY, DIM = 6, 2


def _layer(eviction="lru"):
  table = E.TableConfig(CAPACITY, DIM, initializer=tf.constant_initializer(0.25), name="movies")
  return tpu_embedding.TPUEmbedding(
    {"movie": E.FeatureConfig(table, name="movie")},
    optimizer=E.Adagrad(0.2),
    managed_ids={"movies": tpu_embedding.ManagedIds(eviction=eviction)},
  )


def _batches(steps=8, batch=4, seed=3):
  rng = np.random.default_rng(seed)
  universe = rng.integers(-(2**62), 2**62, size=12)
  for _ in range(steps):
    yield universe[rng.integers(0, 12, size=batch)], rng.normal(size=[batch, DIM]).astype("f4")


def _step(layer, features, upstream, remapped=False):
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(layer(features, remapped=remapped)["movie"] * upstream)
  tape.gradient(loss, layer.trainable_variables)


def _tables(layer):
  keys, rows, _ = layer.managed_ids["movies"].export()
  table = layer.variables_by_table["movies"]["parameters"].numpy()
  slots = layer.variables_by_table["movies"]["accumulators"].numpy()
  return keys.numpy(), rows.numpy(), table, slots


def _eager_reference():
  layer = _layer()
  for keys, upstream in _batches():
    _step(layer, {"movie": tf.constant(keys)}, upstream)
  return _tables(layer)


def _assert_equals_eager_reference(layer):
  """The layer's map, table and slots equal an eager run on the same global batches."""
  expected = _eager_reference()
  got = _tables(layer)
  np.testing.assert_array_equal(got[0], expected[0])
  np.testing.assert_array_equal(got[1], expected[1])
  np.testing.assert_allclose(got[2], expected[2], rtol=1e-5)
  np.testing.assert_allclose(got[3], expected[3], rtol=1e-5)
  return got


def test_jit_compiled_step_trains_a_managed_table_remapped_outside():
  layer = _layer()
  compiled = tf.function(
    lambda rows, upstream: _step(layer, rows, upstream, remapped=True), jit_compile=True
  )
  remap = tf.function(layer.remap)
  for keys, upstream in _batches():
    compiled(remap({"movie": tf.constant(keys)}), upstream)
  got = _assert_equals_eager_reference(layer)
  assert len(got[0]) == CAPACITY - 1  # the map filled up and evicted


def test_mirrored_two_replicas_equal_one_replica_with_the_global_batch():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    layer = _layer()

  @tf.function
  def train(rows, upstream):
    def replica_step(rows, upstream):
      _step(layer, rows, upstream, remapped=True)

    strategy.run(replica_step, args=(rows, upstream))

  def halves(value):
    return strategy.experimental_distribute_values_from_function(
      lambda context: tf.split(value, 2)[context.replica_id_in_sync_group]
    )

  for keys, upstream in _batches():
    rows = layer.remap({"movie": tf.constant(keys)})  # cross-replica: the global batch, in order
    train({"movie": halves(rows["movie"])}, halves(tf.constant(upstream)))
  _assert_equals_eager_reference(layer)
  copies = layer.variables_by_table["movies"]["parameters"].values
  np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())
