"""Tests of `tpu_embedding.config`: the one rule that resolves a user's table to the layer's."""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding
from tpu_embedding import config as config_lib

emb = tf.tpu.experimental.embedding


def _config():
  video = emb.TableConfig(10, 2, name="video")
  user = emb.TableConfig(5, 3, name="user")
  prepared = config_lib.prepare(
    {"a": emb.FeatureConfig(video), "b": emb.FeatureConfig(user)}, emb.SGD(0.1)
  )
  return prepared, video, user


def test_the_same_object_resolves_first_then_the_name():
  prepared, video, user = _config()
  clones = {clone.name: clone for clone in prepared.tables}
  assert clones["video"] is not video  # the layer holds clones, never the user's objects
  assert prepared.find_table(video) is clones["video"]
  assert prepared.find_table(clones["user"]) is clones["user"]
  assert prepared.find_table("user") is clones["user"]
  # Another TableConfig object of the same name resolves by name.
  assert prepared.find_table(emb.TableConfig(10, 2, name="video")) is clones["video"]


def test_an_unknown_table_is_none_or_refused_by_name():
  prepared, _, _ = _config()
  assert prepared.find_table("item") is None
  assert prepared.find_table(emb.TableConfig(3, 2, name="item")) is None
  with pytest.raises(
    ValueError, match=r"'item' is not one of this layer's tables \(\['video', 'user'\]\)"
  ):
    prepared.resolve_table("item")


def test_a_table_named_like_a_slot_of_another_table_is_refused():
  """TF's checkpoint names a slot `<table>/<slot>`: a table of that name would clash with it."""
  adagrad = emb.TableConfig(10, 2, name="t", optimizer=emb.Adagrad(0.1))
  clash = emb.TableConfig(10, 2, name="t/accumulators")
  with pytest.raises(
    ValueError,
    match=r"Table name 't/accumulators' is also the checkpoint name of the 'accumulators' slot "
    r"of table 't' \(its Adagrad optimizer's\).*nothing was created",
  ):
    config_lib.prepare({"a": emb.FeatureConfig(adagrad), "b": emb.FeatureConfig(clash)}, "sgd")
  # Without a slot of that name (SGD has none) the name is free.
  sgd = emb.TableConfig(10, 2, name="t", optimizer=emb.SGD(0.1))
  config_lib.prepare({"a": emb.FeatureConfig(sgd), "b": emb.FeatureConfig(clash)}, "sgd")


def test_a_table_config_changed_after_construction_changes_nothing_of_the_layer():
  table = emb.TableConfig(5, 2, name="videos", initializer=tf.constant_initializer(1.0))
  layer = tpu_embedding.TPUEmbedding({"f": emb.FeatureConfig(table)}, emb.SGD(0.5))
  layer({"f": tf.constant([1])})
  table.dim, table.vocabulary_size = 0, 1  # the layer works from its own copy, taken when built
  with tf.GradientTape() as tape:
    out = layer({"f": tf.constant([1, 4])})["f"]
    loss = tf.reduce_sum(out)
  tape.gradient(loss, layer.trainable_variables)
  np.testing.assert_array_equal(out.numpy(), np.ones([2, 2]))
  expected = np.ones([5, 2], np.float32)
  expected[[1, 4]] -= 0.5
  np.testing.assert_array_equal(layer.variables_by_table["videos"]["parameters"].numpy(), expected)


@pytest.mark.parametrize("field,value", [("dim", 0), ("vocabulary_size", -3), ("dim", 2.0)])
@pytest.mark.parametrize("managed", [False, True], ids=["plain", "managed_ids"])
def test_a_table_config_changed_before_the_layer_is_made_is_refused_by_name(field, value, managed):
  """TF checks dim and vocabulary_size when the TableConfig is made; set after, they reach the
  layer unchecked ([B, 0] outputs trained without a word)."""
  table = emb.TableConfig(5, 2, name="videos")
  setattr(table, field, value)
  managed_ids = {"videos": tpu_embedding.ManagedIds()} if managed else None
  with pytest.raises(ValueError, match=f"Table 'videos' has {field}={value!r}.*int >= 1"):
    tpu_embedding.TPUEmbedding(
      {"f": emb.FeatureConfig(table)}, emb.SGD(0.5), managed_ids=managed_ids
    )


def test_numpy_integer_sizes_are_taken_as_ints():
  table = emb.TableConfig(5, 2, name="videos")
  table.dim, table.vocabulary_size = np.int64(3), np.int32(4)
  layer = tpu_embedding.TPUEmbedding({"f": emb.FeatureConfig(table)}, emb.SGD(0.5))
  assert layer({"f": tf.constant([1])})["f"].shape == (1, 3)
  assert layer.variables_by_table["videos"]["parameters"].shape == (4, 3)
