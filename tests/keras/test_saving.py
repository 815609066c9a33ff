"""Legacy HDF5 files of the Keras 3 layers (`tpu_embedding.keras.saving`): they hold and restore
every table, slot and int64-keyed map as the variables hold them (`.keras` files are tested with
each layer, and hold string keys too)."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding
from tpu_embedding.keras import DistributedEmbedding, PartialTPUEmbedding, TPUEmbedding

from child_process import run_python
from managed_ids_reference import ReferenceMap, fingerprints

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

E = tf.tpu.experimental.embedding
IDS = {"f": np.arange(8, dtype=np.int32).reshape(8, 1)}
LAYERS = [TPUEmbedding, PartialTPUEmbedding, DistributedEmbedding]


def model_with(layer_class, vocabulary=20, **kwargs):
  table = E.TableConfig(vocabulary, 3, name="t", optimizer=E.Adagrad(0.5))
  ids = keras.Input((1,), dtype="int32", name="f")
  layer = layer_class({"f": E.FeatureConfig(table, name="f")}, **kwargs)
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


def test_model_h5_file_holds_the_tables_as_they_are_and_the_held_update_after_flush(tmp_path):
  """Reading the weight lists applies nothing: the legacy save leaves the update pipelining
  holds back where it is, and holds it once `flush()` has applied it (a `.keras` save flushes)."""
  model, layer = model_with(TPUEmbedding, pipeline_execution_with_tensor_core=True)
  model.fit(IDS, np.ones((8, 1)), batch_size=4, verbose=0)
  held = table_and_slot(layer)
  model.save(tmp_path / "held.h5")
  for slot, value in table_and_slot(layer).items():
    np.testing.assert_array_equal(value, held[slot], err_msg=slot)
  layer.flush()
  flushed = table_and_slot(layer)
  assert not np.array_equal(flushed["accumulators"], held["accumulators"])
  model.save(tmp_path / "flushed.h5")
  for name, expected in [("held.h5", held), ("flushed.h5", flushed)]:
    fresh, fresh_layer = model_with(TPUEmbedding, pipeline_execution_with_tensor_core=True)
    fresh.load_weights(tmp_path / name)
    for slot, value in table_and_slot(fresh_layer).items():
      np.testing.assert_array_equal(value, expected[slot], err_msg=f"{name} {slot}")


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


# ---------------------------------------------------------------------------------------------
# Managed-ids maps: settings in the layer's config, keys/rows/counts with the tables


def managed_model(layer_class, string_keys=True):
  """A model whose table "small" takes int64 keys and "large" string (or int64) keys."""
  small = E.TableConfig(5, 2, name="small", optimizer=E.Adagrad(0.3))
  large = E.TableConfig(7, 2, name="large", optimizer=E.Adagrad(0.3))
  features = {"a": E.FeatureConfig(small, name="a"), "b": E.FeatureConfig(large, name="b")}
  key_dtype = tf.string if string_keys else tf.int64
  managed = {
    "small": tpu_embedding.ManagedIds(eviction="lru"),
    large: tpu_embedding.ManagedIds(key_dtype=key_dtype, min_count=2, lfu_half_life_steps=3),
  }
  inputs = {
    "a": keras.Input((), dtype="int64", name="a"),
    "b": keras.Input((), dtype=key_dtype.name, name="b"),
  }
  layer = layer_class(features, managed_ids=managed)
  out = layer(inputs)
  return keras.Model(inputs, keras.layers.Concatenate()([out["a"], out["b"]])), layer


def managed_stream(string_keys, steps=10):
  rng = np.random.default_rng(7)
  for _ in range(steps):
    a = [int(k) for k in rng.integers(0, 9, size=3) * 2**33 - 5]
    b = [int(k) for k in rng.integers(0, 12, size=3)]
    yield a, [f"item{k}".encode() for k in b] if string_keys else [k * 10**12 for k in b]


def as_features(a, b):
  return {"a": tf.constant(a, tf.int64), "b": tf.constant(b)}


RELOAD_MANAGED = """
import json, os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
import keras, numpy as np, tensorflow as tf
import tpu_embedding.keras
probe = json.loads(sys.argv[1])
model = keras.models.load_model(sys.argv[2])
(layer,) = [x for x in model.layers if hasattr(x, "managed_ids")]
def keys(values):
  return tf.constant([v.encode() if isinstance(v, str) else v for v in values])
def plain(values):
  return [v.decode() if isinstance(v, bytes) else v for v in values.numpy().tolist()]
out = {"config": {t: m.spec.to_config() for t, m in layer.managed_ids.items()}}
for table, id_map in layer.managed_ids.items():
  out[table] = {
    "export": [plain(t) for t in id_map.export()],
    "lookup": plain(id_map.lookup(keys(probe[table]))),
    "variables": {s: v.numpy().tolist() for s, v in layer.variables_by_table[table].items()},
  }
n = min(len(probe["small"]), len(probe["large"]))
features = {"a": keys(probe["small"][:n]), "b": keys(probe["large"][:n])}
out["embeddings"] = model(features, training=False).numpy().tolist()
print("RESULT" + json.dumps(out))
"""


@pytest.mark.parametrize(
  "layer_class, suffix, string_keys",
  [(TPUEmbedding, "keras", True), (PartialTPUEmbedding, "keras", True)]
  + [(DistributedEmbedding, "keras", True), (TPUEmbedding, "h5", True)]
  + [(PartialTPUEmbedding, "h5", False), (DistributedEmbedding, "h5", True)],
)
def test_model_file_keeps_managed_maps_tables_and_slots_in_a_fresh_process(
  layer_class, suffix, string_keys, tmp_path
):
  """The reloaded layer gives the same keys the same rows (the NumPy reference map, fed a
  string-key map's fingerprints), and holds the saving process's tables and slots: the same
  embeddings for the same keys. Legacy HDF5 holds string-key maps too (numbers only)."""
  model, layer = managed_model(layer_class, string_keys)
  reference = {
    "small": ReferenceMap(5, eviction="lru"),
    "large": ReferenceMap(7, min_count=2, half_life=3),
  }
  seen = {"small": {}, "large": {}}  # {key the map holds: the key the layer was given}
  for a, b in managed_stream(string_keys):
    held = fingerprints(b) if string_keys else b
    seen["small"].update(zip(a, a))
    seen["large"].update(zip(held, b))
    reference["small"].train(a)
    reference["large"].train(held)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(as_features(a, b), training=True) * [1.0, 2.0, -1.0, 3.0])
    tape.gradient(loss, model.trainable_variables)
  saved = {t: {s: v.numpy() for s, v in layer.variables_by_table[t].items()} for t in reference}
  assert saved["large"]["accumulators"].max() > 0.1 and len(reference["large"].row_of) == 6
  model.save(tmp_path / f"m.{suffix}")
  unseen = b"never" if string_keys else 123
  probe = {t: [unseen if t == "large" else 99, *ref.row_of] for t, ref in reference.items()}
  given = {t: [seen[t].get(k, k) for k in keys] for t, keys in probe.items()}
  argv = ["-c", json.dumps(plain(given)), str(tmp_path / f"m.{suffix}")]
  output = run_python(f"import sys\nsys.argv = {argv!r}\n" + RELOAD_MANAGED, timeout=300)
  got = json.loads(output.split("RESULT")[-1])
  assert got["config"]["large"]["min_count"] == 2
  assert got["config"]["large"]["key_dtype"] == ("string" if string_keys else "int64")
  for table, ref in reference.items():
    keys, rows, counts = ref.export()
    exported = sorted(zip(*got[table]["export"]))
    assert exported == sorted(zip(keys, rows, counts)), table
    assert got[table]["lookup"] == ref.lookup(probe[table]), table
    assert got[table]["lookup"][0] == 0  # an unseen key reads the out-of-vocabulary row
    for slot, value in saved[table].items():
      np.testing.assert_array_equal(got[table]["variables"][slot], value, err_msg=slot)
  n = min(len(probe["small"]), len(probe["large"]))
  expected = np.concatenate(
    [saved[t]["parameters"][ref.lookup(probe[t][:n])] for t, ref in reference.items()], 1
  )
  np.testing.assert_array_equal(got["embeddings"], expected)


def plain(value):
  """`value` with bytes as str, for JSON."""
  if isinstance(value, dict):
    return {k: plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain(v) for v in value]
  return value.decode() if isinstance(value, bytes) else value
