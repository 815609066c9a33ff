"""Keras weight files of the tf-keras layers (`tpu_embedding.weight_files`): every format
tf-keras writes holds the trained tables and slots, and a model built anew in a fresh process
gets them back from `load_weights`.

The formats: tf-keras's own format (`save_weights("w.weights.h5")`, `model.save("m.keras")`),
which stores what each layer's `save_own_variables` gives, by name, and the legacy HDF5 writer
(`save_weights("w.h5")`, `model.save("m.h5")`, `model.save(path, save_format="h5")`), which
stores each layer's Keras weights by position, as they are: what `flush` applies only after a
`flush`. A string-key map holds its strings' int64 fingerprints, so every format holds it; files
written before (strings stored as their bytes and lengths) load converted.
"""

import hashlib
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
import weight_files_scenario as scenario

import tpu_embedding
from tpu_embedding import hardware, weight_files
from tpu_embedding import keras as tpu_keras

import tpu_harness
import write_string_key_files
from child_process import run_python
from managed_ids_reference import ReferenceMap, fingerprints

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

E = tf.tpu.experimental.embedding
SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")

# Keras's own formats first: with pipelining, the first save finds an update held back, and
# must apply it itself (as a checkpoint save does). The legacy HDF5 formats read the variables as
# they are (`test_legacy_hdf5_holds_the_tables_as_they_are_and_reading_them_applies_nothing`).
SAVES = {
  "w.weights.h5": lambda model, path: model.save_weights(path),
  "m.keras": lambda model, path: model.save(path),
  "w.h5": lambda model, path: model.save_weights(path),
  "m.h5": lambda model, path: model.save(path),
  "m_h5": lambda model, path: model.save(path, save_format="h5"),
}
LEGACY_HDF5 = {"w.h5", "m.h5", "m_h5", "k.h5"}


def digest(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def reloaded_in_a_fresh_process(tmp_path_factory) -> dict:
  """Every kind of layer trained here and saved in every format, then all of them reloaded in
  one fresh process: {kind: (trained state, prediction, what the fresh process read back)}."""
  saved, runs = {}, []
  for kind in sorted(scenario.LAYERS):
    directory = tmp_path_factory.mktemp(kind)
    model, layer = scenario.build(kind)
    model.fit(scenario.ids(kind), scenario.LABELS, batch_size=4, epochs=2, verbose=0)
    paths = []
    for name, save in SAVES.items():
      paths.append(str(directory / name))
      save(model, paths[-1])
    layer.flush()  # the tables as a checkpoint would hold them, every update applied
    out = directory / "reloaded.npz"
    saved[kind] = (scenario.state(layer), model.predict(scenario.ids(kind), verbose=0), out)
    runs.append((kind, str(out), paths))
  run_python(
    f"import sys; sys.path.insert(0, {SUPPORT!r}); import weight_files_scenario as s\n"
    f"for kind, out, paths in {runs!r}:\n  s.main(kind, out, paths)",
    timeout=600,
  )
  return {
    kind: (trained, prediction, dict(np.load(out)))
    for kind, (trained, prediction, out) in saved.items()
  }


@pytest.mark.parametrize("kind", sorted(scenario.LAYERS))
def test_every_format_restores_the_trained_tables_in_a_fresh_process(
  kind, reloaded_in_a_fresh_process
):
  trained, prediction, reloaded = reloaded_in_a_fresh_process[kind]
  assert trained["small/accumulators"].max() > 0.2 and trained["large/accumulators"].max() > 0.2
  for i, name in enumerate(SAVES):
    for key, value in trained.items():
      assert not np.array_equal(reloaded[f"{i}:before:{key}"], value), (name, key)
      np.testing.assert_array_equal(reloaded[f"{i}:after:{key}"], value, err_msg=f"{name} {key}")
    np.testing.assert_allclose(reloaded[f"{i}:prediction"], prediction, rtol=1e-6, err_msg=name)


def test_legacy_hdf5_holds_the_tables_as_they_are_and_reading_them_applies_nothing(tmp_path):
  """No weight list applies the update pipelining holds back: the legacy HDF5 file holds the
  tables without it, and with it once `flush` has applied it (Keras's own formats flush)."""
  model, layer = scenario.build("pipelined")
  model.fit(scenario.ids("pipelined"), scenario.LABELS, batch_size=4, epochs=1, verbose=0)
  held = scenario.state(layer)
  assert layer.weights and layer.non_trainable_weights and layer.non_trainable_variables
  assert model.get_weights() and model.non_trainable_weights
  path = str(tmp_path / "w.h5")
  model.save_weights(path)
  for key, value in scenario.state(layer).items():
    np.testing.assert_array_equal(value, held[key], err_msg=key)
  layer.flush()
  flushed = scenario.state(layer)
  assert not np.array_equal(flushed["large/accumulators"], held["large/accumulators"])
  flushed_path = str(tmp_path / "flushed.h5")
  model.save_weights(flushed_path)
  for file, expected in [(path, held), (flushed_path, flushed)]:
    other, other_layer = scenario.build("pipelined")
    other.load_weights(file)
    for key, value in scenario.state(other_layer).items():
      np.testing.assert_array_equal(value, expected[key], err_msg=f"{file} {key}")


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
  with pytest.raises(
    ValueError,
    match=r"'table:large' has shape \[50, 2\] in the Keras file; the layer expects \[60, 2\]",
  ):
    other_model.load_weights(path)
  for key, value in scenario.state(other).items():
    np.testing.assert_array_equal(value, before[key], err_msg=key)
  assert digest(path) == saved


# ---------------------------------------------------------------------------------------------
# TPU V1 and SparseCore (V2): TF's own classes, the TPU runtime stubbed
# (tests/support/tpu_harness.py).
# TF splits each table over hosts (V1, host copies of the TPU's memory) or devices (V2): every
# format holds the pieces, V1's copied out of the TPU's memory by `flush` (Keras's own formats
# call it, a legacy HDF5 save comes after the user's) and loaded back after they are assigned.

# Per flavour, the formats a functional model is saved in (a subclassed one: save_weights only).
TPU_SAVES = {
  "tf_keras": SAVES,
  "tf_keras_partial": SAVES,
  "keras3": {
    "k.weights.h5": lambda model, path: model.save_weights(path),
    "k.keras": lambda model, path: model.save(path),
    "k.h5": lambda model, path: model.save(path),
  },
}
SUBCLASSED = {"tf_keras": ["w.weights.h5", "w.h5"], "keras3": ["k.weights.h5", "k.h5"]}
FEATURES = {"V1": hardware.EmbeddingFeature.V1, "V2": hardware.EmbeddingFeature.V2}
REPLICAS = 2  # two SparseCore devices: two pieces per table and slot on V2


class Holder(tf_keras.Model):
  """A subclassed model holding the layer, built without a symbolic call (SparseCore lookups
  trace only inside `strategy.run`); tf-keras saves such a model with `save_weights` only."""

  def __init__(self, layer):
    super().__init__()
    self.embedding = layer

  def call(self, inputs):
    return self.embedding(inputs)


class Keras3Holder(keras.Model):
  """`Holder` for Keras 3, whose `model.save("m.h5")` takes a subclassed model."""

  def __init__(self, layer=None, **kwargs):
    super().__init__(**kwargs)
    self.embedding = layer

  def call(self, inputs):
    return self.embedding(inputs)


def _tpu_model(flavour, strategy, functional):
  """(model, the layer in it, the TPUEmbedding layer whose TF object holds the TPU tables):
  tables "video" (6 x 4) and "user" (12 x 2); a Partial replicates "video" and shards "user".
  `functional`: a functional model (its call traced symbolically), else a built subclassed one."""
  video = E.TableConfig(6, 4, name="video", initializer=tpu_harness.pattern(0.0))
  user = E.TableConfig(12, 2, name="user", initializer=tpu_harness.pattern(1000.0))
  per_replica = 2
  features = {
    "watched": E.FeatureConfig(video, name="watched", output_shape=[per_replica]),
    "friends": E.FeatureConfig(user, name="friends", output_shape=[per_replica]),
  }
  keras_lib = keras if flavour == "keras3" else tf_keras
  with strategy.scope():
    if flavour == "keras3":
      layer = tpu_keras.TPUEmbedding(features, E.Adagrad(0.1))
    elif flavour == "tf_keras":
      layer = tpu_embedding.TPUEmbedding(features, E.Adagrad(0.1))
    else:
      layer = tpu_embedding.PartialTPUEmbedding(features, E.Adagrad(0.1), size_threshold=8)
    if functional:
      # tf-keras hands each replica its share of the batch; Keras 3 traces the whole of it.
      batch = per_replica * (1 if flavour == "keras3" else REPLICAS)
      inputs = {k: keras_lib.Input((), batch_size=batch, dtype="int32", name=k) for k in features}
      out = layer(inputs)
      joined = keras_lib.layers.Concatenate()([out["watched"], out["friends"]])
      model = keras_lib.Model(inputs, joined)
    else:
      layer.build({k: tf.TensorShape([per_replica]) for k in features})
      model = (Keras3Holder if flavour == "keras3" else Holder)(layer)
      model.built = True  # its one layer is: tf-keras loads HDF5 weights into built models only
  sharded = layer.tpu_embedding if flavour == "tf_keras_partial" else layer
  return model, layer, sharded


def _tpu_state(layer, sharded, memory):
  """{name: values} of every table and slot: those in the TPU as the TPU holds them (V1's
  memory, V2's per-device variables), a Partial's replicated ones as variables."""
  variables = sharded.variables_by_table
  if sharded.execution_path is hardware.ExecutionPath.TPU_V1:
    state = {f"{t}/{s}/{host}": v for (t, s, host), v in memory.of(variables).items()}
  else:
    state = {
      f"{t}/{s}/{i}": piece.numpy()
      for t, slots in variables.items()
      for s, variable in slots.items()
      for i, piece in enumerate(variable.values)
    }
  for t, slots in layer.variables_by_table.items():
    if t not in variables and isinstance(t, str):
      state.update({f"{t}/{s}": variable.numpy() for s, variable in slots.items()})
  return state


def _train_by_hand(layer, sharded, memory, seed):
  """Gives every table and slot seeded values where it lives (V1: the TPU's memory only, so
  that the host copies are stale, as after steps on a TPU)."""
  rng = np.random.default_rng(seed)
  variables = sharded.variables_by_table
  if sharded.execution_path is hardware.ExecutionPath.TPU_V1:
    tpu = memory.of(variables)
    for key, value in tpu.items():
      tpu[key] = rng.uniform(0.1, 1.0, value.shape).astype(np.float32)
  else:
    tpu_harness.fill_shards([v for slots in variables.values() for v in slots.values()], seed)
  for t, slots in layer.variables_by_table.items():
    if t not in variables:
      for variable in slots.values():
        variable.assign(rng.uniform(0.1, 1.0, variable.shape).astype(np.float32))


CASES = [("V1", flavour, name) for flavour, saves in TPU_SAVES.items() for name in saves] + [
  ("V2", flavour, name) for flavour, names in SUBCLASSED.items() for name in names
]


@pytest.mark.parametrize("path_name, flavour, name", CASES)
def test_every_format_holds_and_restores_the_tpu_tables(
  monkeypatch, tmp_path, path_name, flavour, name
):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, FEATURES[path_name], replicas=REPLICAS)
  memory = tpu_harness.TpuMemory(monkeypatch)
  functional = path_name == "V1"
  model, layer, sharded = _tpu_model(flavour, strategy, functional)
  _train_by_hand(layer, sharded, memory, seed=7)
  trained = _tpu_state(layer, sharded, memory)
  path = str(tmp_path / name)
  if name in LEGACY_HDF5:
    layer.flush()  # the file holds the variables as they are: V1's host copies once flushed
  TPU_SAVES[flavour][name](model, path)

  other, other_layer, other_sharded = _tpu_model(flavour, strategy, functional)
  before = _tpu_state(other_layer, other_sharded, memory)
  other.load_weights(path)
  after = _tpu_state(other_layer, other_sharded, memory)
  assert sorted(after) == sorted(trained)
  for key, value in trained.items():
    assert not np.array_equal(before[key], value), key
    np.testing.assert_array_equal(after[key], value, err_msg=key)


# ---------------------------------------------------------------------------------------------
# Keras 3 and managed ids: `save_weights` holds the map; the formats that also save the layer's
# config refuse it (a layer rebuilt from config alone would have no map).


def _keras3_managed_model():
  features = {
    "a": E.FeatureConfig(E.TableConfig(20, 3, name="small"), name="a"),
    "b": E.FeatureConfig(E.TableConfig(50, 2, name="large"), name="b"),
  }
  layer = tpu_keras.TPUEmbedding(
    features, E.Adagrad(0.5), managed_ids={"large": tpu_embedding.ManagedIds()}
  )
  ids = scenario.ids("managed")
  inputs = {k: keras.Input((1,), dtype=v.dtype.name, name=k) for k, v in ids.items()}
  out = layer(inputs)
  model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(list(out.values()))))
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  return model, layer


def test_keras3_save_weights_holds_the_managed_ids_map(tmp_path):
  model, layer = _keras3_managed_model()
  model.fit(scenario.ids("managed"), scenario.LABELS, batch_size=4, epochs=2, verbose=0)
  trained = scenario.state(layer)
  path = str(tmp_path / "k.weights.h5")
  model.save_weights(path)

  other, other_layer = _keras3_managed_model()
  before = scenario.state(other_layer)
  other.load_weights(path)
  after = scenario.state(other_layer)
  assert sorted(trained["large/rows of keys"]) == list(range(1, 17))  # 16 keys, 16 rows
  for key, value in trained.items():
    assert not np.array_equal(before[key], value), key
    np.testing.assert_array_equal(after[key], value, err_msg=key)


def _string_key_model():
  table = E.TableConfig(7, 2, name="t")
  layer = tpu_embedding.TPUEmbedding(
    {"b": E.FeatureConfig(table, name="b")},
    E.Adagrad(0.3),
    managed_ids={"t": tpu_embedding.ManagedIds(key_dtype=tf.string)},
  )
  ids = tf_keras.Input((1,), dtype="string", name="b")
  return tf_keras.Model({"b": ids}, layer({"b": ids})["b"]), layer


STRING_KEYS = [b"x", b"y\x00", b"", b"x", b"y"]


def _trained_string_key_model():
  model, layer = _string_key_model()
  with tf.GradientTape() as tape:
    out = model({"b": tf.constant([[k] for k in STRING_KEYS])}, training=True)
  tape.gradient(out, model.trainable_variables)
  return model, layer


@pytest.mark.parametrize("name", ["w.weights.h5", "m.keras", "w.h5", "m.h5"])
def test_string_keys_of_any_bytes_travel_in_every_format(name, tmp_path):
  """A string-key map holds int64 fingerprints (an embedded NUL and the empty key among its
  strings): Keras's own formats and the legacy HDF5 ones (by position, through h5py, which
  takes no strings) hold it, and the loaded layer looks the strings up as the saved one did."""
  model, layer = _trained_string_key_model()
  reference = ReferenceMap(7)
  reference.train(fingerprints(STRING_KEYS))
  path = str(tmp_path / name)
  model.save_weights(path) if name.startswith("w.") else model.save(path)
  other, other_layer = _string_key_model()
  other.load_weights(path)
  exported = [t.numpy().tolist() for t in other_layer.managed_ids["t"].export()]
  assert exported == [t.numpy().tolist() for t in layer.managed_ids["t"].export()]
  assert sorted(zip(*exported)) == sorted(zip(*reference.export()))
  probe = [b"y\x00", b"y", b"", b"never"]
  assert other_layer.managed_ids["t"].lookup(tf.constant(probe)).numpy().tolist() == (
    reference.lookup(fingerprints(probe))
  )
  for table, variables in layer.variables_by_table.items():
    for slot, variable in variables.items():
      loaded = other_layer.variables_by_table[table][slot]
      np.testing.assert_array_equal(loaded.numpy(), variable.numpy(), err_msg=slot)


OLD_FILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "string_key_maps")


def _old_string_key_model():
  """The model `tests/jobs/write_string_key_files.py` saved, its expected state (the strings the
  map held as fingerprints) and how to look strings up in it."""
  with open(os.path.join(OLD_FILES, "state.json")) as f:
    state = json.load(f)
  state["keys"] = fingerprints([k.encode("latin-1") for k in state["keys"]])
  return write_string_key_files.model(), state


@pytest.mark.parametrize("name", ["w.weights.h5", "m.keras"])
def test_files_of_string_keys_stored_as_strings_load_as_their_fingerprints(name):
  """Files written before string-key maps held fingerprints (by main at a8de19d) store the
  strings as bytes and lengths: loading converts them, losing no key, row, count or table."""
  (model, layer), state = _old_string_key_model()
  model.load_weights(os.path.join(OLD_FILES, name))
  id_map = layer.managed_ids["movies"]
  keys, rows, counts = (t.numpy().tolist() for t in id_map.export())
  assert (keys, rows, counts) == (state["keys"], state["rows"], state["counts"])
  assert int(id_map.step) == state["step"]
  lookup = id_map.lookup(tf.constant([b"k\x00y", b"apple", b"plum"])).numpy().tolist()
  assert lookup == [4, 1, 0]
  np.testing.assert_array_equal(layer.variables_by_table["movies"]["parameters"], state["table"])


def test_a_file_of_string_keys_stored_as_strings_is_refused_by_an_int64_map():
  keys = tf.Variable(tf.zeros([3], tf.int64))
  store = {"managed:t:0": np.frombuffer(b"abc", np.uint8), "managed:t:0:lengths": [2, 0, 1]}
  with pytest.raises(ValueError, match=r"'managed:t:0' holds a string-key map's keys.*int64"):
    weight_files.load_variables(store, {"managed:t:0": keys}, "layer")
  assert keys.numpy().tolist() == [0, 0, 0]


STRING_MAP_KEYS = "managed:t:0" + weight_files.FINGERPRINTS  # a string-key map's keys' entry


def test_stored_strings_whose_lengths_disagree_with_their_bytes_are_refused():
  keys = tf.Variable(tf.zeros([3], tf.int64))
  store = {"managed:t:0": np.frombuffer(b"abc\x00", np.uint8), "managed:t:0:lengths": [2, 0, 3]}
  fingerprinted = frozenset([STRING_MAP_KEYS])
  with pytest.raises(ValueError, match=r"'managed:t:0' holds 4 bytes .* add up to 5"):
    weight_files.load_variables(store, {STRING_MAP_KEYS: keys}, "layer", fingerprinted)
  assert keys.numpy().tolist() == [0, 0, 0]


def test_neither_kind_of_map_loads_the_others_int64_keys():
  """A string-key map's fingerprints and an int64-key map's keys are both int64 vectors: the
  file keys them apart, so a layer whose map takes the other kind is refused, unchanged."""
  values = np.array([7, -3, 2**40], np.int64)
  keys = tf.Variable(tf.zeros([3], tf.int64))
  with pytest.raises(ValueError, match=r"holds no 'managed:t:0'.*managed:t:0:fingerprints"):
    weight_files.load_variables({STRING_MAP_KEYS: values}, {"managed:t:0": keys}, "layer")
  with pytest.raises(ValueError, match=r"'managed:t:0' holds an int64-key map's keys.*string"):
    weight_files.load_variables(
      {"managed:t:0": values}, {STRING_MAP_KEYS: keys}, "layer", frozenset([STRING_MAP_KEYS])
    )
  assert keys.numpy().tolist() == [0, 0, 0]
  weight_files.load_variables(
    {STRING_MAP_KEYS: values}, {STRING_MAP_KEYS: keys}, "layer", frozenset([STRING_MAP_KEYS])
  )
  assert keys.numpy().tolist() == values.tolist()


# ---------------------------------------------------------------------------------------------
# Managed ids in the legacy HDF5 files: a PartialTPUEmbedding with a map on each side (TPU V0:
# tests/managed_ids/test_tpu_v0.py).

PARTIAL_KEYS = {"a": [3, -(2**40), 3, 7, 11], "b": [5, 2**50, -1, 5, 12]}


def _partial_managed_model():
  """ "small" (replicated) and "large" (sharded) each map int64 keys."""
  layer = tpu_embedding.PartialTPUEmbedding(
    scenario._features(),
    E.Adagrad(0.5),
    size_threshold=30,
    managed_ids={
      "small": tpu_embedding.ManagedIds(),
      "large": tpu_embedding.ManagedIds(),
    },
  )
  inputs = {
    "a": tf_keras.Input((1,), dtype="int64", name="a"),
    "b": tf_keras.Input((1,), dtype="int64", name="b"),
  }
  out = layer(inputs)
  return tf_keras.Model(inputs, tf_keras.layers.Concatenate()([out["a"], out["b"]])), layer


@pytest.mark.parametrize("name", ["w.h5", "m.h5"])
def test_partial_maps_on_both_sides_travel_in_hdf5(name, tmp_path):
  model, layer = _partial_managed_model()
  assert layer.side("small") == "replicated" and layer.side("large") == "sharded"
  reference = {"small": ReferenceMap(20), "large": ReferenceMap(50)}
  for step in range(3):
    keys = {f: v[step:] + v[:step] for f, v in PARTIAL_KEYS.items()}
    with tf.GradientTape() as tape:
      out = model({f: tf.constant([[k] for k in v]) for f, v in keys.items()}, training=True)
      loss = tf.reduce_sum(out * [1.0, -2.0, 3.0, 0.5, 1.5])
    tape.gradient(loss, model.trainable_variables)
    reference["small"].train(keys["a"])
    reference["large"].train(keys["b"])
  trained = {t: {s: v.numpy() for s, v in vs.items()} for t, vs in layer.variables_by_table.items()}
  assert (
    trained["large"]["accumulators"].max() > 0.2 and trained["small"]["accumulators"].max() > 0.2
  )
  path = str(tmp_path / name)
  model.save_weights(path) if name.startswith("w.") else model.save(path)

  other, other_layer = _partial_managed_model()
  other.load_weights(path)
  for table, ref in reference.items():
    id_map = other_layer.managed_ids[table]
    assert sorted(zip(*[t.numpy().tolist() for t in id_map.export()])) == sorted(
      zip(*ref.export())
    ), table
    probe = [*ref.row_of, 99]
    assert id_map.lookup(tf.constant(probe)).numpy().tolist() == ref.lookup(probe), table
    for slot, value in trained[table].items():
      np.testing.assert_array_equal(
        other_layer.variables_by_table[table][slot].numpy(), value, err_msg=f"{table} {slot}"
      )
