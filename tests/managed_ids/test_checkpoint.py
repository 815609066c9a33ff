"""Managed-id maps in checkpoints (all-or-nothing) and SavedModels served by TensorFlow alone."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding
from tpu_embedding import serving
from tpu_embedding.managed_ids.spec import as_keys

import write_string_key_files
from child_process import run_python
from managed_ids_reference import fingerprints

pytestmark = pytest.mark.integration  # starts processes (make test-fast leaves it out)

E = tf.tpu.experimental.embedding


def _layer(capacity=5, key_dtype=tf.int64, managed=True, **policy):
  table = E.TableConfig(capacity, 2, initializer=tf.constant_initializer(0.5), name="movies")
  kwargs = {}
  if managed:
    kwargs["managed_ids"] = {"movies": tpu_embedding.ManagedIds(key_dtype=key_dtype, **policy)}
  return tpu_embedding.TPUEmbedding(
    {"movie": E.FeatureConfig(table, name="movie")}, optimizer=E.SGD(0.5), **kwargs
  )


def _train(layer, keys):
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(layer({"movie": tf.constant(keys)})["movie"])
  tape.gradient(loss, layer.trainable_variables)


KEYS = [[2**40, -3, 7], [7, 8, 9], [10, -3, 2**40], [11, 12]]


def _state(layer):
  keys, rows, counts = (t.numpy().tolist() for t in layer.managed_ids["movies"].export())
  table = layer.variables_by_table["movies"]["parameters"].numpy().copy()
  return keys, rows, counts, int(layer.managed_ids["movies"].step), table


@pytest.mark.parametrize(
  "policy", [{}, dict(eviction="distance_lfu", admission="compete")], ids=["default", "distance"]
)
def test_checkpoint_restores_map_with_table_and_training_continues_identically(tmp_path, policy):
  layer = _layer(**policy)
  for keys in KEYS[:2]:
    _train(layer, keys)
  path = tf.train.Checkpoint(layer=layer).save(str(tmp_path / "ckpt"))
  saved = _state(layer)
  restored = _layer(**policy)
  assert restored.variables_by_table  # tables created: the restore binds at once
  tf.train.Checkpoint(layer=restored).restore(path).assert_consumed()
  for got, want in zip(_state(restored), saved):
    np.testing.assert_array_equal(got, want)
  assert saved[0]  # the map was not empty
  lookup = tf.constant([2**40, -3, 7, 8, 9, 555], tf.int64)
  np.testing.assert_array_equal(
    restored.managed_ids["movies"].lookup(lookup), layer.managed_ids["movies"].lookup(lookup)
  )
  for keys in KEYS[2:]:  # evictions after the restore follow the restored ages and counts
    _train(layer, keys)
    _train(restored, keys)
  for got, want in zip(_state(restored), _state(layer)):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
  "other, message",
  [
    (dict(key_dtype=tf.string), "key dtype int64 in this layer, but 5 and string"),
    (dict(managed=False), "holds no managed-id map"),
  ],
)
def test_checkpoint_of_another_map_is_refused_with_nothing_changed(tmp_path, other, message):
  source = _layer(**other)
  _train(source, ["a", "b"] if other.get("key_dtype") == tf.string else [1, 2])
  path = tf.train.Checkpoint(layer=source).save(str(tmp_path / "other"))
  layer = _layer()
  _train(layer, [1, 2, 3])
  before = _state(layer)
  with pytest.raises(ValueError, match=f"table 'movies'.*{message}(.|\\n)*Nothing was changed"):
    tf.train.Checkpoint(layer=layer).restore(path)
  for got, want in zip(_state(layer), before):
    np.testing.assert_array_equal(got, want)


def test_int64_map_checkpoint_is_refused_by_a_string_key_map(tmp_path):
  source = _layer()
  _train(source, [1, 2])
  path = tf.train.Checkpoint(layer=source).save(str(tmp_path / "int64"))
  layer = _layer(key_dtype=tf.string)
  with pytest.raises(ValueError, match="key dtype string in this layer, but 5 and int64"):
    tf.train.Checkpoint(layer=layer).restore(path)
  assert int(layer.managed_ids["movies"].size()) == 0


OLD_FILES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "string_key_maps")


@pytest.mark.parametrize("restore", ["checkpoint", "restore_checkpoint"])
def test_checkpoint_of_string_keys_stored_as_strings_restores_as_their_fingerprints(restore):
  """A checkpoint written before string-key maps held fingerprints (by main at a8de19d, with
  waiting candidates: min_count=2): every key, row, count and candidate count comes back, as
  the strings' fingerprints, and TF's restore finds every object of the layer bound."""
  (_, layer), state = _old_string_key_model()
  path = os.path.join(OLD_FILES, "ckpt-1")
  if restore == "checkpoint":
    tf.train.Checkpoint(layer=layer).restore(path).assert_consumed()
  else:
    tpu_embedding.restore_checkpoint(tf.train.Checkpoint(layer=layer), path).assert_consumed()
  id_map = layer.managed_ids["movies"]
  keys, rows, counts = (t.numpy().tolist() for t in id_map.export())
  assert (keys, rows, counts) == (state["keys"], state["rows"], state["counts"])
  assert int(id_map.step) == state["step"]
  waiting = sorted(zip(*(t.numpy().tolist() for t in id_map.candidates.export())))
  strings = [k.encode("latin-1") for k, _ in state["candidates"]]
  assert waiting == sorted(zip(fingerprints(strings), [c for _, c in state["candidates"]]))
  np.testing.assert_array_equal(layer.variables_by_table["movies"]["parameters"], state["table"])
  # "kiwi" waits with count 1: one more occurrence makes it 2 (not 1: its count was kept).
  (kiwi,) = fingerprints([b"kiwi"])
  rows, _ = id_map.remap(as_keys(tf.constant([b"kiwi", b"apple"]), tf.string, "t"), True)
  assert rows.numpy().tolist() == [0, 1]
  waiting = dict(zip(*(t.numpy().tolist() for t in id_map.candidates.export())))
  assert waiting[kiwi] == 2


def test_checkpoint_of_string_keys_stored_as_strings_is_refused_by_an_int64_map():
  layer = _layer(capacity=5)
  with pytest.raises(ValueError, match="key dtype int64 in this layer, but 5 and string"):
    tf.train.Checkpoint(layer=layer).restore(os.path.join(OLD_FILES, "ckpt-1"))
  assert int(layer.managed_ids["movies"].size()) == 0


def _old_string_key_model():
  """The model `tests/jobs/write_string_key_files.py` wrote the old files of, and the map's
  state it saved (its strings as the fingerprints this map holds)."""
  with open(os.path.join(OLD_FILES, "state.json")) as f:
    state = json.load(f)
  state["keys"] = fingerprints([k.encode("latin-1") for k in state["keys"]])
  return write_string_key_files.model(), state


def _model_and_expected(tmp_path):
  layer = _layer(admission="always")  # the rows below are the former default's
  for keys in KEYS[:2]:
    _train(layer, keys)
  table = layer.variables_by_table["movies"]["parameters"].numpy()
  probe = [7, 8, 9, -3, 2**40]  # 2**40 lost its row to 9 in step 2
  rows = layer.managed_ids["movies"].lookup(tf.constant(probe, tf.int64)).numpy()
  assert rows[-1] == 0 and (rows[:-1] > 0).all()
  model = tf.Module()
  model.layer = layer

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
  def serve(keys):
    return model.layer({"movie": keys}, training=False)["movie"]

  return model, serve, probe, table[rows]


_SERVE = """
import json, sys
import tensorflow as tf
loaded = tf.saved_model.load({path!r})
out = loaded.signatures["serving_default"](keys=tf.constant({probe!r}, tf.int64))
print(json.dumps(list(out.values())[0].numpy().tolist()))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tpu_embedding"))))
"""


@pytest.mark.parametrize("how", ["export_for_serving", "saved_model_save"])
def test_export_serves_raw_keys_in_a_process_with_only_tensorflow(tmp_path, how):
  model, serve, probe, expected = _model_and_expected(tmp_path)
  path = str(tmp_path / "export")
  if how == "export_for_serving":
    serving.export_for_serving(model, path, serve)
  else:
    tf.saved_model.save(model, path, signatures=serve)
  step = int(model.layer.managed_ids["movies"].step)
  out, modules = run_python(_SERVE.format(path=path, probe=probe), timeout=300).splitlines()[-2:]
  np.testing.assert_allclose(json.loads(out), expected, rtol=1e-6)
  assert json.loads(modules) == []
  assert int(model.layer.managed_ids["movies"].step) == step  # the export admitted nothing


_SERVE_STRINGS = """
import json, sys
import tensorflow as tf
loaded = tf.saved_model.load({path!r})
out = loaded.signatures["serving_default"](keys=tf.constant({probe!r}))
print(json.dumps(list(out.values())[0].numpy().tolist()))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("tpu_embedding"))))
"""


def test_export_of_a_string_key_map_fingerprints_its_inputs_with_only_tensorflow(tmp_path):
  """The SavedModel takes the strings and fingerprints them in its own graph (a stock op), so
  a process importing only TensorFlow serves the rows the layer gives them."""
  layer = _layer(key_dtype=tf.string, admission="always")
  _train(layer, [b"apple", b"", b"k\x00y"])
  _train(layer, [b"pear", b"apple"])
  probe = ["apple", "", "pear", "never"]
  rows = layer.managed_ids["movies"].lookup(tf.constant(probe)).numpy()
  assert rows[-1] == 0 and (rows[:-1] > 0).all()
  expected = layer.variables_by_table["movies"]["parameters"].numpy()[rows]
  model = tf.Module()
  model.layer = layer

  @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
  def serve(keys):
    return model.layer({"movie": keys}, training=False)["movie"]

  path = str(tmp_path / "export")
  serving.export_for_serving(model, path, serve)
  out, modules = run_python(
    _SERVE_STRINGS.format(path=path, probe=probe), timeout=300
  ).splitlines()[-2:]
  np.testing.assert_allclose(json.loads(out), expected, rtol=1e-6)
  assert json.loads(modules) == []
  graph = tf.saved_model.load(path).signatures["serving_default"].graph.as_graph_def()
  ops = {node.op for function in graph.library.function for node in function.node_def}
  assert "Fingerprint" in ops


def test_a_signature_calling_the_layer_in_training_mode_still_never_admits(tmp_path):
  """A SavedModel traces every call of the layer as a lookup, whatever `training` it passes:
  the export's map never changes, unknown keys read row 0."""
  model, _, probe, expected = _model_and_expected(tmp_path)

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
  def serve(keys):
    return model.layer({"movie": keys}, training=True)["movie"]

  row0 = np.array([9.0, -9.0], np.float32)  # apart from the fresh rows an admission gives
  model.layer.variables_by_table["movies"]["parameters"].scatter_update(
    tf.IndexedSlices(row0[None], [0])
  )
  expected[-1] = row0  # the probe's last key reads row 0
  step = int(model.layer.managed_ids["movies"].step)
  path = str(tmp_path / "export")
  tf.saved_model.save(model, path, signatures=serve)
  assert int(model.layer.managed_ids["movies"].step) == step
  loaded = tf.saved_model.load(path)
  serve_loaded = lambda keys: list(
    loaded.signatures["serving_default"](keys=tf.constant(keys, tf.int64)).values()
  )[0].numpy()
  new = [555, 556]  # admitting them would evict two rows, whose fresh values are not row 0's
  for _ in range(2):
    np.testing.assert_allclose(serve_loaded(new), np.tile(row0, (len(new), 1)), rtol=1e-6)
    np.testing.assert_allclose(serve_loaded(probe), expected, rtol=1e-6)


def _as_plain_objects(path, cast):
  """A tree of plain trackables holding every value of the checkpoint at `path` under the same
  keys, variables through `cast(name, value)` and each hash table as a `MutableHashTable`: how
  a checkpoint of an older layout is made without the code that wrote it."""
  reader, root = tf.train.load_checkpoint(path), tf.Module()
  for key in reader.get_variable_to_shape_map():
    if "/.ATTRIBUTES/" not in key:
      continue
    names, attribute = key.split("/.ATTRIBUTES/")
    *parents, leaf = names.split("/")
    node = root
    for name in parents:
      if not hasattr(node, name):
        setattr(node, name, tf.Module())
      node = getattr(node, name)
    if attribute == "VARIABLE_VALUE":
      setattr(node, leaf, tf.Variable(cast(leaf, reader.get_tensor(key))))
    elif attribute == "table-keys":
      values = reader.get_tensor(key.replace("table-keys", "table-values"))
      table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0)
      table.insert(reader.get_tensor(key), values)
      setattr(node, leaf, table)
  return root


def test_a_checkpoint_with_the_former_int64_counts_is_refused_with_nothing_changed(tmp_path):
  source = _layer()
  _train(source, [1, 2, 1])
  path = tf.train.Checkpoint(layer=source).write(str(tmp_path / "today"))
  old = _as_plain_objects(
    path, lambda name, value: value.astype(np.int64) if name in ("counts", "last_seen") else value
  )
  old_path = tf.train.Checkpoint(layer=old.layer).write(str(tmp_path / "int64"))
  assert (
    tf.train.load_checkpoint(old_path).get_variable_to_dtype_map()[
      "layer/managed_ids/maps/movies/counts/.ATTRIBUTES/VARIABLE_VALUE"
    ]
    == tf.int64
  )
  layer = _layer()
  _train(layer, [3, 4, 5, 3])
  before = _state(layer)
  with pytest.raises(
    ValueError,
    match="table 'movies': its managed-id map stores counts and last_seen as int64(.|\\n)*"
    "Nothing was changed",
  ):
    tf.train.Checkpoint(layer=layer).read(old_path)
  for got, want in zip(_state(layer), before):
    np.testing.assert_array_equal(got, want)
  # The same plain objects without the cast restore like the layer's own checkpoint.
  same = tf.train.Checkpoint(layer=_as_plain_objects(path, lambda name, value: value).layer)
  tf.train.Checkpoint(layer=layer).read(same.write(str(tmp_path / "int32"))).assert_consumed()
  for got, want in zip(_state(layer), _state(source)):
    np.testing.assert_array_equal(got, want)


def test_a_checkpoint_giving_one_key_two_rows_is_refused_before_anything_is_assigned(tmp_path):
  source = _layer()
  _train(source, [1, 2, 3])  # rows 1, 2, 3
  path = tf.train.Checkpoint(layer=source).write(str(tmp_path / "good"))
  damaged = _as_plain_objects(
    path, lambda name, value: np.where(np.arange(5) == 3, 1, value) if name == "keys" else value
  )
  bad_path = tf.train.Checkpoint(layer=damaged.layer).write(str(tmp_path / "damaged"))
  layer = _layer()
  _train(layer, [3, 4, 5, 3])
  before = _state(layer)
  with pytest.raises(
    ValueError,
    match=r"table 'movies': its managed-id map in the checkpoint gives keys \[1\] two rows"
    r"(.|\n)*Nothing was changed",
  ):
    tf.train.Checkpoint(layer=layer).read(bad_path)
  for got, want in zip(_state(layer), before):
    np.testing.assert_array_equal(got, want)
  assert layer.managed_ids["movies"].lookup(tf.constant([3, 4], tf.int64)).numpy().tolist() == [
    1,
    2,
  ]
