"""Tests of `tpu_embedding.config`: the one rule that resolves a user's table to the layer's."""

import pytest
import tensorflow as tf

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
