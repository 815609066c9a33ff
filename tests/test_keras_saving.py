"""Legacy HDF5 files of the Keras 3 layers (`tpu_embedding.keras.saving`): they hold and restore
every table and slot (`.keras` files are tested with each layer)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.keras import DistributedEmbedding, PartialTPUEmbedding, TPUEmbedding

E = tf.tpu.experimental.embedding
IDS = {"f": np.arange(8, dtype=np.int32).reshape(8, 1)}
LAYERS = [TPUEmbedding, PartialTPUEmbedding, DistributedEmbedding]


def model_with(layer_class, vocabulary=20):
  table = E.TableConfig(vocabulary, 3, name="t", optimizer=E.Adagrad(0.5))
  ids = keras.Input((1,), dtype="int32", name="f")
  layer = layer_class({"f": E.FeatureConfig(table, name="f")})
  model = keras.Model({"f": ids}, keras.layers.Dense(1)(layer({"f": ids})["f"]))
  model.compile(optimizer="sgd", loss="mse")
  return model, layer


def table_and_slot(layer):
  return {slot: v.numpy() for slot, v in layer.variables_by_table["t"].items()}


@pytest.mark.parametrize("layer_class", LAYERS)
def test_model_h5_file_restores_tables_and_slots(layer_class, tmp_path):
  model, layer = model_with(layer_class)
  model.fit(IDS, np.ones((8, 1)), verbose=0)
  trained = table_and_slot(layer)
  assert trained["accumulators"].max() > 0.1  # Adagrad's slot was trained
  model.save(tmp_path / "m.h5")
  loaded = keras.models.load_model(tmp_path / "m.h5", compile=False)
  (reloaded,) = [x for x in loaded.layers if isinstance(x, layer_class)]
  for slot, value in table_and_slot(reloaded).items():
    np.testing.assert_array_equal(value, trained[slot], err_msg=slot)
  np.testing.assert_allclose(loaded.predict(IDS, verbose=0), model.predict(IDS, verbose=0))


@pytest.mark.parametrize("layer_class", LAYERS)
def test_load_weights_from_h5_assigns_tables_and_slots(layer_class, tmp_path):
  model, layer = model_with(layer_class)
  model.fit(IDS, np.ones((8, 1)), verbose=0)
  model.save(tmp_path / "m.h5")
  fresh, fresh_layer = model_with(layer_class)
  fresh.load_weights(tmp_path / "m.h5")
  for slot, value in table_and_slot(fresh_layer).items():
    np.testing.assert_array_equal(value, table_and_slot(layer)[slot], err_msg=slot)


def test_h5_file_of_another_table_shape_is_refused_and_changes_nothing(tmp_path):
  model, _ = model_with(TPUEmbedding)
  model.save(tmp_path / "m.h5")
  other, layer = model_with(TPUEmbedding, vocabulary=30)
  before = table_and_slot(layer)
  with pytest.raises(ValueError, match="tpu_embedding"):
    other.load_weights(tmp_path / "m.h5")
  for slot, value in table_and_slot(layer).items():
    np.testing.assert_array_equal(value, before[slot], err_msg=slot)


def test_a_truncated_keras_file_fails_in_keras_before_any_variable_changes(tmp_path):
  """What docs/keras3.md says: Keras decides before any layer code runs, with its own message
  (no hook lets the layers word it better); the model loading into is left as it was."""
  import zipfile

  model, layer = model_with(TPUEmbedding)
  model.fit(IDS, np.ones((8, 1)), verbose=0)
  path = tmp_path / "m.keras"
  model.save(path)
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  target, target_layer = model_with(TPUEmbedding)
  before = [v.numpy() for v in target.variables]
  assert not zipfile.is_zipfile(path)
  with pytest.raises(ValueError, match=f"File not found: filepath={path}"):
    keras.models.load_model(path)
  with pytest.raises(zipfile.BadZipFile, match="File is not a zip file"):
    target.load_weights(path)
  for value, variable in zip(before, target.variables):
    np.testing.assert_array_equal(variable.numpy(), value)
