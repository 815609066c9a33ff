"""A refused call changes no map, no row and no slot: every check of a call (ids, weights,
shapes) passes before a managed table's map admits, evicts or resets anything; on all five
layer classes, compared with the reference map."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding  # noqa: E402
from tpu_embedding import keras as keras3  # noqa: E402

from managed_ids_reference import ReferenceMap  # noqa: E402

E = tf.tpu.experimental.embedding


def _features():
  managed = E.TableConfig(2, 1, initializer=tf.constant_initializer(0.5), name="managed")
  plain = E.TableConfig(3, 1, initializer=tf.constant_initializer(0.5), name="plain")
  return {"m": E.FeatureConfig(managed, name="m"), "u": E.FeatureConfig(plain, name="u")}


def _managed():
  return {"managed": tpu_embedding.ManagedIds(eviction="lru")}


SGD = E.SGD(0.1)
LAYERS = {
  "TPUEmbedding": lambda: tpu_embedding.TPUEmbedding(_features(), SGD, managed_ids=_managed()),
  "PartialTPUEmbedding": lambda: tpu_embedding.PartialTPUEmbedding(
    _features(), SGD, size_threshold=3, managed_ids=_managed()
  ),
  "keras.TPUEmbedding": lambda: keras3.TPUEmbedding(_features(), SGD, managed_ids=_managed()),
  "keras.PartialTPUEmbedding": lambda: keras3.PartialTPUEmbedding(
    _features(), SGD, size_threshold=3, managed_ids=_managed()
  ),
  "keras.DistributedEmbedding": lambda: keras3.DistributedEmbedding(
    _features(), optimizer=SGD, placements={"plain": "default_device"}, managed_ids=_managed()
  ),
}


def _step(layer, features, weights=None, upstream=1.0):
  with tf.GradientTape() as tape:
    out = layer(features, weights)
    loss = tf.reduce_sum(out["m"]) * upstream + tf.reduce_sum(out["u"])
  tape.gradient(loss, layer.trainable_variables)


def _trained(kind):
  """Capacity 2 (one row for keys): key 5 trained once, its row at 0.5 - 0.1."""
  layer, ref = LAYERS[kind](), ReferenceMap(2, "lru")
  _step(layer, {"m": tf.constant([5], tf.int64), "u": tf.constant([1])})
  ref.train([5])
  return layer, ref


def _assert_unchanged(layer, ref):
  keys, rows, counts = (t.numpy().tolist() for t in layer.managed_ids["managed"].export())
  assert (keys, rows, counts) == tuple(ref.export())
  variables = layer.variables_by_table
  np.testing.assert_allclose(variables["managed"]["parameters"].numpy(), [[0.5], [0.4]])
  np.testing.assert_allclose(variables["plain"]["parameters"].numpy(), [[0.5], [0.4], [0.5]])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_out_of_range_id_of_another_feature_refuses_before_the_map_step(kind, traced):
  layer, ref = _trained(kind)
  step = tf.function(_step) if traced else _step
  with pytest.raises(
    (ValueError, tf.errors.InvalidArgumentError),
    match=r"(?s)Feature .{0,2}u.{0,2} \(table .{0,2}plain.*\b7\b",
  ):
    step(layer, {"m": tf.constant([6], tf.int64), "u": tf.constant([7])})
  _assert_unchanged(layer, ref)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_sparse_weights_fewer_than_keys_refuse_before_the_map_step(kind):
  layer, ref = _trained(kind)
  ids = tf.sparse.from_dense(tf.constant([[6, 7]], tf.int64))
  weights = tf.SparseTensor([[0, 0]], [1.0], [1, 2])
  with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=r"Feature .{0,2}m.{0,2}"):
    _step(layer, {"m": ids, "u": tf.constant([[1]])}, {"m": weights, "u": None})
  _assert_unchanged(layer, ref)
