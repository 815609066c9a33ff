"""Tests of `tpu_embedding.preflight.sources`: the ids a report reads from .csv and .tfrecord
files, and the feature config it reads from a saved Keras layer."""

import json
import zipfile

import pytest
import tensorflow as tf

from tpu_embedding.preflight import sources

from preflight_features import feature_config

emb = tf.tpu.experimental.embedding


def test_csv_and_tfrecord_files_give_the_ids_they_hold(tmp_path):
  csv = tmp_path / "ids.csv"
  csv.write_text("movie,user,label\n3,7,1\n4,8,0\n5,9,1\n")
  (first,) = list(sources.load_batches(str(csv), feature_config(), 3)[0])
  assert first["user"].numpy().tolist() == [7, 8, 9]
  assert first["movie"].numpy().tolist() == [3, 4, 5]
  assert set(first) == {"user", "movie"}

  records = tmp_path / "ids.tfrecord"
  with tf.io.TFRecordWriter(str(records)) as writer:
    for user, movies in [([1], [2, 3]), ([4], [])]:
      feature = {
        "user": tf.train.Feature(int64_list=tf.train.Int64List(value=user)),
        "movie": tf.train.Feature(int64_list=tf.train.Int64List(value=movies)),
      }
      writer.write(
        tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
      )
  (batch,) = list(sources.load_batches(str(records), feature_config(), 2)[0])
  assert tf.sparse.to_dense(batch["movie"]).numpy().tolist() == [[2, 3], [0, 0]]
  assert batch["movie"].indices.numpy().tolist() == [[0, 0], [0, 1]]
  assert batch["user"].values.numpy().tolist() == [1, 4]


def test_a_saved_keras_layer_config_is_read_with_its_optimizers(tmp_path):
  from tpu_embedding import config as config_lib
  from tpu_embedding.keras import saving

  prepared = config_lib.prepare(feature_config(), emb.Adam(0.1))
  document = {
    "config": {
      "layers": [{"config": {"feature_config": saving.serialize_feature_config(prepared)}}]
    }
  }
  path = tmp_path / "model.json"
  path.write_text(json.dumps(document))
  keras_file = tmp_path / "model.keras"  # a zip holding config.json, as Keras 3 saves
  with zipfile.ZipFile(keras_file, "w") as archive:
    archive.writestr("config.json", json.dumps(document))
  for saved in (path, keras_file):
    loaded = sources.load_config(str(saved))
    tables = {f.table.name: f.table for f in loaded.feature_config.values()}
    assert {name: (t.vocabulary_size, t.dim) for name, t in tables.items()} == {
      "user": (100, 8),
      "movie": (50, 4),
    }
    assert all(isinstance(t.optimizer, emb.Adam) for t in tables.values())
  path.write_text(json.dumps({"config": {}}))
  with pytest.raises(ValueError, match="holds no embedding layer config"):
    sources.load_config(str(path))
