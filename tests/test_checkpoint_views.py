"""Tests of `tpu_embedding.checkpoint_views`: a `PartialTPUEmbedding`'s tables saved once, found
under this package's names and under both of tf-recommenders' (rebuilt here as plain trackables,
not through the module)."""

import numpy as np
import tensorflow as tf

from tpu_embedding import checkpoint_views
from tpu_embedding import config as config_lib

E = tf.tpu.experimental.embedding


def _written(tmp_path):
  """A checkpoint of the views of table 't' ([[1, 2]], Adagrad accumulators [[3, 4]]), read by
  feature 'a/b'."""
  table = E.TableConfig(4, 2, name="t")
  prepared = config_lib.prepare({"a": {"b": E.FeatureConfig(table)}}, E.Adagrad(0.1))
  variables = {"parameters": tf.Variable([[1.0, 2.0]]), "accumulators": tf.Variable([[3.0, 4.0]])}
  views = checkpoint_views.PartialLayerViews()
  views.track({"t": variables}, prepared.features)
  return tf.train.Checkpoint(**views.children()).write(str(tmp_path / "views"))


def test_each_variable_is_saved_once_under_this_packages_names(tmp_path):
  path = _written(tmp_path)
  saved = dict(tf.train.list_variables(path))
  saved.pop("_CHECKPOINTABLE_OBJECT_GRAPH")
  # A checkpoint key escapes "/" inside a name as ".S": "t/accumulators" -> "t.Saccumulators".
  assert saved == {
    "_tpu_embedding/t/.ATTRIBUTES/VARIABLE_VALUE": [1, 2],
    "_tpu_embedding/t.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE": [1, 2],
  }


def test_the_table_restores_into_tf_recommenders_sharded_layout(tmp_path):
  # `_tpu_embedding` (its layer's mid-level object), whose own `_tpu_embedding` holds each table.
  table = tf.Variable(tf.zeros([1, 2]))
  tables = tf.Module()
  tables.t = table
  mid_level = tf.Module()
  mid_level._tpu_embedding = tables
  tf.train.Checkpoint(_tpu_embedding=mid_level).read(
    _written(tmp_path)
  ).assert_existing_objects_matched()
  np.testing.assert_array_equal(table.numpy(), [[1.0, 2.0]])


def test_the_table_restores_into_tf_recommenders_replicated_layout(tmp_path):
  # One Keras `Embedding` per feature path, under `_keras_embedding_layers`, its table at
  # `embeddings`.
  table = tf.Variable(tf.zeros([1, 2]))
  embedding = tf.Module()
  embedding.embeddings = table
  keras_layers = tf.Module()
  setattr(keras_layers, "a/b", embedding)
  tf.train.Checkpoint(_keras_embedding_layers=keras_layers).read(
    _written(tmp_path)
  ).assert_existing_objects_matched()
  np.testing.assert_array_equal(table.numpy(), [[1.0, 2.0]])
