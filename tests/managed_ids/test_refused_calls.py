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


def _step(layer, features, weights=None, upstream=1.0, **kwargs):
  with tf.GradientTape() as tape:
    out = layer(features, weights, **kwargs)
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


# ---------------------------------------------------------------------------------------------
# Resets a remap returned are due once, never after their key trained the row


def _saved_twice(layer, tmp_path):
  checkpoint = tf.train.Checkpoint(layer=layer)
  checkpoint.save(str(tmp_path / "first"))
  checkpoint.save(str(tmp_path / "second"))
  return checkpoint


@pytest.mark.parametrize("kind", list(LAYERS))
def test_resets_left_in_a_stopped_pipeline_never_undo_training_since(kind, tmp_path):
  """Key 6 remapped ahead (its reset returned, never written: the loop stopped), then trained
  by calls with raw keys: its reset is written before it first trains, never at a save."""
  layer, ref = _trained(kind)
  layer.remap({"m": tf.constant([6], tf.int64), "u": tf.constant([0])}, defer_resets=True)
  ref.train([6])
  for _ in range(2):
    _step(layer, {"m": tf.constant([6], tf.int64), "u": tf.constant([1])})
    ref.train([6])
  _saved_twice(layer, tmp_path)
  keys, rows, counts = (t.numpy().tolist() for t in layer.managed_ids["managed"].export())
  assert (keys, rows, counts) == tuple(ref.export())
  managed = layer.variables_by_table["managed"]["parameters"].numpy()
  np.testing.assert_allclose(managed, [[0.5], [0.5 - 0.1 - 0.1]])  # fresh row, trained twice


@pytest.mark.parametrize("kind", ["TPUEmbedding", "keras.DistributedEmbedding"])
def test_resets_of_batches_dropped_at_a_restore_are_written_once(kind, tmp_path):
  """The documented restore flow: remap ahead, save, restore, drop the batches remapped
  before it; rows trained after the restore stay trained at every later save."""
  layer, _ = _trained(kind)
  layer.remap({"m": tf.constant([6], tf.int64), "u": tf.constant([0])}, defer_resets=True)
  checkpoint = tf.train.Checkpoint(layer=layer)
  path = checkpoint.save(str(tmp_path / "ahead"))
  checkpoint.restore(path)
  _step(layer, {"m": tf.constant([6], tf.int64), "u": tf.constant([1])}, upstream=3.0)
  _saved_twice(layer, tmp_path)
  managed = layer.variables_by_table["managed"]["parameters"].numpy()
  np.testing.assert_allclose(managed, [[0.5], [0.5 - 0.3]])


# ---------------------------------------------------------------------------------------------
# Keys and specs the maps cannot take exactly: refused by name, nothing changed


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_uint64_keys_above_int64_max_are_refused_naming_feature_and_table(traced):
  layer, ref = _trained("TPUEmbedding")
  step = tf.function(_step) if traced else _step
  keys = tf.constant([6, 2**63 + 5, 2**64 - 1], tf.uint64)
  with pytest.raises(
    (ValueError, tf.errors.InvalidArgumentError),
    match=r"Feature .{0,2}m.{0,2}: its table .{0,2}managed.{0,2} manages int64 keys: uint64",
  ):
    step(layer, {"m": keys, "u": tf.constant([1])})
  _assert_unchanged(layer, ref)
  _step(layer, {"m": tf.constant([2**63 - 1], tf.uint64), "u": tf.constant([1])})
  ref.train([2**63 - 1])
  assert layer.managed_ids["managed"].export()[0].numpy().tolist() == ref.export()[0]


def test_a_table_named_twice_in_managed_ids_is_refused():
  features = _features()
  twice = {"managed": tpu_embedding.ManagedIds(), features["m"].table: tpu_embedding.ManagedIds()}
  for make in (tpu_embedding.TPUEmbedding, keras3.TPUEmbedding):
    with pytest.raises(ValueError, match="names table 'managed' twice"):
      make(features, SGD, managed_ids=twice)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_raw_keys_in_a_jit_compiled_step_name_the_layer_and_the_remedy(kind):
  layer, ref = _trained(kind)
  features = {"m": tf.constant([6], tf.int64), "u": tf.constant([1])}
  with pytest.raises(
    ValueError,
    match=r"(?s)managed_ids and was given raw keys in a step that "
    r"XLA compiles.*rows = layer.remap\(features\).*remapped=True",
  ):
    tf.function(_step, jit_compile=True)(layer, features)
  _assert_unchanged(layer, ref)
  rows = layer.remap(features)
  ref.train([6])
  tf.function(lambda: _step(layer, rows, remapped=True), jit_compile=True)()  # the documented way
  keys = layer.managed_ids["managed"].export()[0].numpy().tolist()
  assert keys == ref.export()[0] == [6]


# ---------------------------------------------------------------------------------------------
# check_finite: the verdict comes after the map's step, which a refused step undoes


def _checked(kind, min_count=1):
  """As `_trained`, with check_finite=True (and min_count: the candidates are undone too)."""
  managed = {"managed": tpu_embedding.ManagedIds(eviction="lru", min_count=min_count)}
  make = {
    "TPUEmbedding": lambda: tpu_embedding.TPUEmbedding(
      _features(), SGD, check_finite=True, managed_ids=managed
    ),
    "PartialTPUEmbedding": lambda: tpu_embedding.PartialTPUEmbedding(
      _features(), SGD, size_threshold=3, check_finite=True, managed_ids=managed
    ),
    "keras.TPUEmbedding": lambda: keras3.TPUEmbedding(
      _features(), SGD, check_finite=True, managed_ids=managed
    ),
    "keras.PartialTPUEmbedding": lambda: keras3.PartialTPUEmbedding(
      _features(), SGD, size_threshold=3, check_finite=True, managed_ids=managed
    ),
    "keras.DistributedEmbedding": lambda: keras3.DistributedEmbedding(
      _features(), optimizer=SGD, check_finite=True, managed_ids=managed
    ),
  }[kind]
  layer, ref = make(), ReferenceMap(2, "lru", min_count=min_count)
  for _ in range(min_count):
    _step(layer, {"m": tf.constant([5], tf.int64), "u": tf.constant([1])})
    ref.train([5])
  return layer, ref


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_a_step_refused_for_a_nan_gradient_undoes_the_map_step(kind, traced):
  layer, ref = _checked(kind)
  step = tf.function(_step) if traced else _step
  features = {"m": tf.constant([6, 6], tf.int64), "u": tf.constant([1])}
  with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite.*wrote nothing"):
    step(layer, features, upstream=float("nan"))
  _assert_unchanged(layer, ref)  # key 5 kept its row, trained once (0.4); key 6 has none
  step(layer, features)  # accepted: key 6 evicts key 5 and trains its fresh row
  ref.train([6, 6])
  keys, rows, counts = (t.numpy().tolist() for t in layer.managed_ids["managed"].export())
  assert (keys, rows, counts) == tuple(ref.export())
  np.testing.assert_allclose(layer.variables_by_table["managed"]["parameters"], [[0.5], [0.3]])


def test_a_refused_step_leaves_the_candidates_as_they_were(engine_path):
  layer, ref = _checked("TPUEmbedding", min_count=2)
  features = {"m": tf.constant([7], tf.int64), "u": tf.constant([1])}
  with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
    _step(layer, features, upstream=float("inf"))
  _step(layer, features)
  ref.train([7])
  keys, rows, counts = (t.numpy().tolist() for t in layer.managed_ids["managed"].export())
  assert (keys, rows, counts) == tuple(ref.export()) == ([5], [1], [2])  # 7 counted once


@pytest.mark.parametrize("kind", ["TPUEmbedding", "keras.PartialTPUEmbedding"])
def test_non_finite_weights_are_refused_before_the_map_step(kind):
  layer, ref = _checked(kind)
  ids = tf.ragged.constant([[6, 6]], tf.int64)
  weights = {"m": tf.ragged.constant([[1.0, float("nan")]]), "u": None}
  with pytest.raises(
    (ValueError, tf.errors.InvalidArgumentError), match=r"Feature .{0,2}m.{0,2}.*weights hold"
  ):
    _step(layer, {"m": ids, "u": tf.ragged.constant([[1]])}, weights)
  _assert_unchanged(layer, ref)
