"""managed_ids on PartialTPUEmbedding and the Keras 3 layers (DistributedEmbedding included):
the same maps and tables as TPUEmbedding for the same stream; checkpoints interchangeable."""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding  # noqa: E402
from tpu_embedding import keras as keras3  # noqa: E402

E = tf.tpu.experimental.embedding


def _features():
  small = E.TableConfig(5, 2, initializer=tf.constant_initializer(0.1), name="small")
  large = E.TableConfig(7, 2, initializer=tf.constant_initializer(0.2), name="large")
  return {"a": E.FeatureConfig(small, name="a"), "b": E.FeatureConfig(large, name="b")}


def _managed():
  return {
    "small": tpu_embedding.ManagedIds(eviction="lru"),
    "large": tpu_embedding.ManagedIds(key_dtype=tf.string, eviction="lfu", min_count=2),
  }


LAYERS = {
  "TPUEmbedding": lambda: tpu_embedding.TPUEmbedding(
    _features(), E.Adagrad(0.3), managed_ids=_managed()
  ),
  "PartialTPUEmbedding": lambda: tpu_embedding.PartialTPUEmbedding(
    _features(), E.Adagrad(0.3), size_threshold=6, managed_ids=_managed()
  ),
  "keras.TPUEmbedding": lambda: keras3.TPUEmbedding(
    _features(), E.Adagrad(0.3), managed_ids=_managed()
  ),
  "keras.PartialTPUEmbedding": lambda: keras3.PartialTPUEmbedding(
    _features(), E.Adagrad(0.3), size_threshold=6, managed_ids=_managed()
  ),
  "keras.DistributedEmbedding": lambda: keras3.DistributedEmbedding(
    _features(),
    optimizer=E.Adagrad(0.3),
    placements={"small": "default_device", "large": "auto"},
    managed_ids=_managed(),
  ),
}


def _stream(steps=10):
  rng = np.random.default_rng(5)
  for _ in range(steps):
    a = rng.integers(-(2**40), 2**40, size=3) % 9 * 2**33
    b = [f"item{i}".encode() for i in rng.integers(0, 12, size=3)]
    yield {"a": tf.constant(a), "b": tf.constant(b)}


def _step(layer, features, **kwargs):
  with tf.GradientTape() as tape:
    out = layer(features, **kwargs)
    loss = tf.reduce_sum(out["a"]) + 2 * tf.reduce_sum(out["b"])
  tape.gradient(loss, layer.trainable_variables)


def _train(layer):
  for features in _stream():
    _step(layer, features)
  return _state(layer)


def _state(layer):
  return {
    name: (
      [t.numpy().tolist() for t in layer.managed_ids[name].export()],
      layer.variables_by_table[name]["parameters"].numpy(),
    )
    for name in ("small", "large")
  }


@pytest.mark.parametrize("kind", [k for k in LAYERS if k != "TPUEmbedding"])
def test_layer_trains_managed_tables_as_tpu_embedding_does(kind):
  expected = _train(LAYERS["TPUEmbedding"]())
  layer = LAYERS[kind]()
  got = _train(layer)
  if "Partial" in kind:
    assert layer.side("small") == "replicated" and layer.side("large") == "sharded"
  for name in ("small", "large"):
    assert got[name][0] == expected[name][0]
    np.testing.assert_allclose(got[name][1], expected[name][1], rtol=1e-6)
  assert len(expected["large"][0][0]) == 6  # the string table filled up (min_count=2)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_remap_far_ahead_with_deferred_resets_trains_as_the_call_does(kind):
  """Every batch remapped before any step (as far ahead as a pipeline may run), each batch's
  resets written right before its step: the same maps and tables as remaps in the calls."""
  expected = _train(LAYERS["TPUEmbedding"]())
  layer = LAYERS[kind]()
  remapped = [layer.remap(features, defer_resets=True) for features in _stream()]
  given = [int(tf.math.count_nonzero(r)) for _, resets in remapped for r in resets.values()]
  assert sum(given) > 10  # rows were given (the rest of each vector is 0s: padding)
  for rows, resets in remapped:
    layer.reset_rows(resets)
    _step(layer, rows, remapped=True)
  got = _state(layer)
  for name in ("small", "large"):
    assert got[name][0] == expected[name][0]
    np.testing.assert_allclose(got[name][1], expected[name][1], rtol=1e-6)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_inference_calls_never_admit_keys(kind):
  """`training=False` reaches the map on every layer (Keras 3 passes `training` only to a
  `call` naming it), and a Keras 3 model's `predict` is such a call."""
  layer = LAYERS[kind]()
  features = next(_stream())
  out = layer(features, training=False)
  np.testing.assert_allclose(out["a"].numpy(), np.full([3, 2], 0.1))  # row 0 for every key
  assert int(layer.managed_ids["small"].size()) == 0
  if kind.startswith("keras."):
    inputs = {
      "a": keras.Input(shape=(), dtype="int64", name="a"),
      "b": keras.Input(shape=(), dtype="string", name="b"),
    }
    model = keras.Model(inputs, layer(inputs)["a"])
    model.predict(tf.data.Dataset.from_tensors(features), verbose=0)
    assert int(layer.managed_ids["small"].size()) == 0
  layer(features)
  assert int(layer.managed_ids["small"].size()) == 3


def test_traced_reset_rows_checks_every_table_before_writing_any():
  layer = LAYERS["TPUEmbedding"]()
  _step(layer, next(_stream()))
  small = layer.variables_by_table["small"]["parameters"]
  small.assign(tf.fill(small.shape, 9.0))
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"table .{0,2}large.{0,2} gives rows 1 \.\. 6"
  ):
    tf.function(layer.reset_rows)({"small": tf.constant([1, 2]), "large": tf.constant([1, 70])})
  np.testing.assert_array_equal(small.numpy(), np.full(small.shape, 9.0))


def test_partial_checkpoint_restores_into_tpu_embedding(tmp_path):
  partial = LAYERS["PartialTPUEmbedding"]()
  trained = _train(partial)
  path = tf.train.Checkpoint(layer=partial).save(str(tmp_path / "ckpt"))
  layer = LAYERS["TPUEmbedding"]()
  assert layer.variables_by_table
  tf.train.Checkpoint(layer=layer).restore(path)
  for name in ("small", "large"):
    assert [t.numpy().tolist() for t in layer.managed_ids[name].export()] == trained[name][0]


# ManagedIds's defaults, as a config gives them.
SETTINGS = dict(ttl_steps=None, lfu_half_life_steps=1000, candidate_capacity=None)
SETTINGS.update(reset_every_steps=1, min_count=1, distance_decay=1.0)


@pytest.mark.parametrize("kind", ["keras.TPUEmbedding", "keras.PartialTPUEmbedding"])
def test_keras3_config_holds_managed_ids_as_json_and_rebuilds_them(kind):
  """The settings travel in the config (a .keras file's JSON); keys, rows and counts travel with
  the weights (tests/keras/test_saving.py reloads them in a fresh process)."""
  layer = LAYERS[kind]()
  config = json.loads(json.dumps(layer.get_config()))
  assert config["managed_ids"] == {
    "small": dict(SETTINGS, key_dtype="int64", eviction="lru", admission="always"),
    "large": dict(SETTINGS, key_dtype="string", eviction="lfu", min_count=2, admission="compete"),
  }
  rebuilt = type(layer).from_config(config)
  assert {t: m.spec for t, m in rebuilt.managed_ids.items()} == _managed()


def test_keras3_config_names_a_table_given_as_its_table_config():
  features = _features()
  spec = tpu_embedding.ManagedIds(eviction="ttl", ttl_steps=4)
  layer = keras3.TPUEmbedding(features, E.Adagrad(0.3), managed_ids={features["b"].table: spec})
  config = layer.get_config()
  expected = dict(SETTINGS, key_dtype="int64", eviction="ttl", ttl_steps=4, admission="always")
  assert config["managed_ids"] == {"large": expected}
  assert keras3.TPUEmbedding.from_config(config).managed_ids["large"].spec == spec


def test_managed_ids_config_with_unknown_settings_is_refused_naming_them():
  config = dict(SETTINGS, key_dtype="int64", eviction="lfu")
  assert tpu_embedding.ManagedIds.from_config(config) == tpu_embedding.ManagedIds()
  with pytest.raises(ValueError, match=r"unknown settings \['eviction_policy'\]"):
    tpu_embedding.ManagedIds.from_config(dict(config, eviction_policy="lfu"))
  with pytest.raises(ValueError, match="key_dtype='float32'"):
    tpu_embedding.ManagedIds.from_config(dict(config, key_dtype="float32"))
