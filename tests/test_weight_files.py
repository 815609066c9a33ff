"""Keras weight files of the tf-keras layers (`tpu_embedding.weight_files`): every format
tf-keras writes holds the trained tables and slots, and a model built anew in a fresh process
gets them back from `load_weights`.

The formats: the legacy HDF5 writer (`save_weights("w.h5")`, `model.save("m.h5")`,
`model.save(path, save_format="h5")`), which stores each layer's Keras weights by position, and
tf-keras's own format (`save_weights("w.weights.h5")`, `model.save("m.keras")`), which stores
what each layer's `save_own_variables` gives, by name.
"""

import hashlib
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
import weight_files_scenario as scenario

import tpu_embedding
from tpu_embedding import hardware

import tpu_harness
from child_process import run_python

E = tf.tpu.experimental.embedding
TESTS = os.path.dirname(os.path.abspath(__file__))

# The name-keyed formats first: they apply an update pipelining holds back (the HDF5 writer reads
# the weights as they are; docs/checkpoints-and-serving.md asks for `flush()` before it).
SAVES = {
  "w.weights.h5": lambda model, path: model.save_weights(path),
  "m.keras": lambda model, path: model.save(path),
  "w.h5": lambda model, path: model.save_weights(path),
  "m.h5": lambda model, path: model.save(path),
  "m_h5": lambda model, path: model.save(path, save_format="h5"),
}


def digest(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("kind", sorted(scenario.LAYERS))
def test_every_format_restores_the_trained_tables_in_a_fresh_process(kind, tmp_path):
  model, layer = scenario.build(kind)
  model.fit(scenario.IDS, scenario.LABELS, batch_size=4, epochs=2, verbose=0)
  paths = []
  for name, save in SAVES.items():
    paths.append(str(tmp_path / name))
    save(model, paths[-1])
  layer.flush()  # the tables as a checkpoint would hold them, every update applied
  trained = scenario.state(layer)
  assert trained["small/accumulators"].max() > 0.2 and trained["large/accumulators"].max() > 0.2
  prediction = model.predict(scenario.IDS, verbose=0)

  out = tmp_path / "reloaded.npz"
  run_python(
    f"import sys; sys.path.insert(0, {TESTS!r}); import weight_files_scenario as s; "
    f"s.main({kind!r}, {str(out)!r}, {paths!r})",
    timeout=600,
  )
  reloaded = np.load(out)
  for i, name in enumerate(SAVES):
    for key, value in trained.items():
      assert not np.array_equal(reloaded[f"{i}:before:{key}"], value), (name, key)
      np.testing.assert_array_equal(reloaded[f"{i}:after:{key}"], value, err_msg=f"{name} {key}")
    np.testing.assert_allclose(reloaded[f"{i}:prediction"], prediction, rtol=1e-6, err_msg=name)


def test_the_keras_optimizer_never_sees_the_tables():
  model, layer = scenario.build("PartialTPUEmbedding")
  tables = {v.ref() for variables in layer.variables_by_table.values() for v in variables.values()}
  assert tables <= {w.ref() for w in model.non_trainable_weights}
  assert not tables & {w.ref() for w in model.trainable_weights}


@pytest.mark.parametrize("kind", ["TPUEmbedding", "PartialTPUEmbedding"])
@pytest.mark.parametrize("name", ["m.h5", "m.keras"])
def test_load_model_refuses_and_names_load_weights(kind, name, tmp_path):
  model, _ = scenario.build(kind)
  path = str(tmp_path / name)
  model.save(path)
  before = digest(path)
  refusal = rf"holding a {kind} layer cannot be rebuilt by tf_keras.models.load_model"
  with pytest.raises(ValueError, match=refusal) as e:
    tf_keras.models.load_model(path)
  assert "model.load_weights(path)" in str(e.value)
  assert digest(path) == before


def test_a_file_of_other_tables_is_refused_by_name_and_changes_nothing(tmp_path):
  model, _ = scenario.build("TPUEmbedding")
  path = str(tmp_path / "w.weights.h5")
  model.save_weights(path)
  saved = digest(path)
  inputs = {key: tf_keras.Input((1,), dtype="int32", name=key) for key in scenario.IDS}
  other = tpu_embedding.TPUEmbedding(
    {
      "a": E.FeatureConfig(E.TableConfig(20, 3, name="small"), name="a"),
      "b": E.FeatureConfig(E.TableConfig(60, 2, name="large"), name="b"),
    },
    E.Adagrad(0.5),
  )
  out = other(inputs)
  other_model = tf_keras.Model(inputs, [out["a"], out["b"]])
  before = scenario.state(other)
  with pytest.raises(ValueError, match=r"table 'large' 'parameters' has shape \[50, 2\]"):
    other_model.load_weights(path)
  for key, value in scenario.state(other).items():
    np.testing.assert_array_equal(value, before[key], err_msg=key)
  assert digest(path) == saved


@pytest.mark.parametrize(
  "layer_class", [tpu_embedding.TPUEmbedding, tpu_embedding.PartialTPUEmbedding]
)
def test_managed_ids_are_refused_by_name_in_keras_files(layer_class):
  layer = layer_class(
    {"a": E.FeatureConfig(E.TableConfig(5, 2, name="t"), name="a")},
    E.Adagrad(0.5),
    managed_ids={"t": tpu_embedding.ManagedIds()},
  )
  layer({"a": tf.constant([[7]], tf.int64)})
  before = scenario.state(layer)
  store = {}
  message = rf"layer '{layer.name}' has managed_ids.*tf.train.Checkpoint"
  with pytest.raises(ValueError, match=message):
    layer.save_own_variables(store)
  assert store == {}
  with pytest.raises(ValueError, match=message):
    layer.load_own_variables({"table:t": np.zeros((5, 2))})
  for key, value in scenario.state(layer).items():
    np.testing.assert_array_equal(value, before[key], err_msg=key)


def test_tables_in_a_tpu_engine_are_refused_by_name(monkeypatch):
  """On V1 (TF's own class, TPU runtime stubbed) the tables are in the engine's memory."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1)
  video, _ = tpu_harness.video_and_user_tables()
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(
      {"watched": E.FeatureConfig(video, name="watched")}, E.Adagrad(0.1)
    )
    layer.build({"watched": tf.TensorShape([4])})
  message = r"memory \(path TPU_V1\).*tf.train.Checkpoint"
  store = {}
  with pytest.raises(ValueError, match=message):
    layer.save_own_variables(store)
  assert store == {}
  with pytest.raises(ValueError, match=message):
    layer.load_own_variables({"table:video": np.zeros((2, 4))})
