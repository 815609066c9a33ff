"""Managed ids where the remap runs outside the step (XLA-compiled steps, MirroredStrategy), and
raw keys inside `strategy.run` and `model.fit` under MirroredStrategy (2 logical CPUs): one map
step per global batch, equal to one device fed that batch (docs/managed-ids.md)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tpu_embedding  # noqa: E402
from tpu_embedding import keras as keras3  # noqa: E402

from managed_ids_reference import ReferenceMap, fingerprints  # noqa: E402

E = tf.tpu.experimental.embedding
CAPACITY, DIM = 6, 2


def _layer(eviction="lru"):
  table = E.TableConfig(CAPACITY, DIM, initializer=tf.constant_initializer(0.25), name="movies")
  return tpu_embedding.TPUEmbedding(
    {"movie": E.FeatureConfig(table, name="movie")},
    optimizer=E.Adagrad(0.2),
    managed_ids={"movies": tpu_embedding.ManagedIds(eviction=eviction)},
  )


def _batches(steps=8, batch=4, seed=3):
  rng = np.random.default_rng(seed)
  universe = rng.integers(-(2**62), 2**62, size=12)
  for _ in range(steps):
    yield universe[rng.integers(0, 12, size=batch)], rng.normal(size=[batch, DIM]).astype("f4")


def _step(layer, features, upstream, remapped=False):
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(layer(features, remapped=remapped)["movie"] * upstream)
  tape.gradient(loss, layer.trainable_variables)


def _tables(layer):
  keys, rows, _ = layer.managed_ids["movies"].export()
  table = layer.variables_by_table["movies"]["parameters"].numpy()
  slots = layer.variables_by_table["movies"]["accumulators"].numpy()
  return keys.numpy(), rows.numpy(), table, slots


def _eager_reference():
  layer = _layer()
  for keys, upstream in _batches():
    _step(layer, {"movie": tf.constant(keys)}, upstream)
  return _tables(layer)


def _assert_equals_eager_reference(layer):
  """The layer's map, table and slots equal an eager run on the same global batches."""
  expected = _eager_reference()
  got = _tables(layer)
  np.testing.assert_array_equal(got[0], expected[0])
  np.testing.assert_array_equal(got[1], expected[1])
  np.testing.assert_allclose(got[2], expected[2], rtol=1e-5)
  np.testing.assert_allclose(got[3], expected[3], rtol=1e-5)
  return got


def test_jit_compiled_step_trains_a_managed_table_remapped_outside():
  layer = _layer()
  compiled = tf.function(
    lambda rows, upstream: _step(layer, rows, upstream, remapped=True), jit_compile=True
  )
  remap = tf.function(layer.remap)
  for keys, upstream in _batches():
    compiled(remap({"movie": tf.constant(keys)}), upstream)
  got = _assert_equals_eager_reference(layer)
  assert len(got[0]) == CAPACITY - 1  # the map filled up and evicted


def test_mirrored_two_replicas_equal_one_replica_with_the_global_batch():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    layer = _layer()

  @tf.function
  def train(rows, upstream):
    def replica_step(rows, upstream):
      _step(layer, rows, upstream, remapped=True)

    strategy.run(replica_step, args=(rows, upstream))

  def halves(value):
    return strategy.experimental_distribute_values_from_function(
      lambda context: tf.split(value, 2)[context.replica_id_in_sync_group]
    )

  for keys, upstream in _batches():
    rows = layer.remap({"movie": tf.constant(keys)})  # cross-replica: the global batch, in order
    train({"movie": halves(rows["movie"])}, halves(tf.constant(upstream)))
  _assert_equals_eager_reference(layer)
  copies = layer.variables_by_table["movies"]["parameters"].values
  np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())


# ---------------------------------------------------------------------------------------------
# Raw keys in each replica (`layer_mixin`'s one step for all replicas).

GLOBAL_BATCH = 4


def _mirrored():
  # No collectives (TF's default all-reduce keys restart with each strategy: see test_keras_layer).
  return tf.distribute.MirroredStrategy(
    ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
  )


def _halves(strategy, value):
  """Replica r gets the r-th half of the global batch."""
  return strategy.experimental_distribute_values_from_function(
    lambda context: tf.split(value, 2)[context.replica_id_in_sync_group]
  )


# ---------------------------------------------------------------------------------------------
# A custom loop: two features of one managed table, raw keys in each replica.


def _shared_table_layer(key_dtype):
  items = E.TableConfig(6, 2, initializer=tf.constant_initializer(0.25), name="items")
  return tpu_embedding.TPUEmbedding(
    {"a": E.FeatureConfig(items, name="a"), "b": E.FeatureConfig(items, name="b")},
    optimizer=E.Adagrad(0.2),
    managed_ids={"items": tpu_embedding.ManagedIds(key_dtype=key_dtype, eviction="lfu")},
  )


def _shared_table_batches(key_dtype, steps=6):
  rng = np.random.default_rng(11)
  universe = rng.integers(-(2**62), 2**62, size=10)
  for _ in range(steps):
    a, b = (universe[rng.integers(0, 10, size=GLOBAL_BATCH)] for _ in "ab")
    if key_dtype == tf.string:
      a, b = ([str(k).encode() for k in keys] for keys in (a, b))
    upstream = rng.normal(size=[2, GLOBAL_BATCH, 2]).astype("f4")
    yield {"a": tf.constant(a), "b": tf.constant(b)}, tf.constant(upstream)


def _loss(layer, features, upstream):
  out = layer(features)
  return tf.reduce_sum(out["a"] * upstream[0]) + tf.reduce_sum(out["b"] * upstream[1])


def _train_step(layer, features, upstream):
  with tf.GradientTape() as tape:
    loss = _loss(layer, features, upstream)
  tape.gradient(loss, layer.trainable_variables)


def _map_and_tables(layer, name):
  keys, rows, counts = (t.numpy().tolist() for t in layer.managed_ids[name].export())
  variables = layer.variables_by_table[name]
  return (keys, rows, counts), {s: v.numpy() for s, v in variables.items()}


@pytest.mark.parametrize("key_dtype", [tf.int64, tf.string], ids=["int64", "string"])
def test_raw_keys_in_each_replica_equal_one_device_fed_the_global_batch(key_dtype):
  strategy = _mirrored()
  with strategy.scope():
    layer = _shared_table_layer(key_dtype)

  @tf.function
  def step(features, upstream):
    strategy.run(_train_step, args=(layer, features, upstream))

  single = _shared_table_layer(key_dtype)
  reference = ReferenceMap(6, eviction="lfu")
  for features, upstream in _shared_table_batches(key_dtype):
    halves = {name: _halves(strategy, keys) for name, keys in features.items()}
    step(
      halves,
      strategy.experimental_distribute_values_from_function(
        lambda context: tf.split(upstream, 2, axis=1)[context.replica_id_in_sync_group]
      ),
    )
    _train_step(single, features, upstream)
    # The map's stream: feature a's global keys, then b's (not replica 0's a and b first).
    stream = features["a"].numpy().tolist() + features["b"].numpy().tolist()
    reference.train(fingerprints(stream) if key_dtype == tf.string else stream)
  (keys, rows, counts), tables = _map_and_tables(layer, "items")
  assert (keys, rows, counts) == tuple(list(t) for t in reference.export())
  assert len(rows) == 5  # the map filled up and evicted
  assert int(layer.managed_ids["items"].step.read_value()) == 6  # one map step per global batch
  expected_map, expected_tables = _map_and_tables(single, "items")
  assert (keys, rows, counts) == expected_map
  for name, copies in layer.variables_by_table["items"].items():
    for copy in copies.values:  # every replica's copy of the table and its slot
      np.testing.assert_allclose(copy.numpy(), expected_tables[name], rtol=1e-5)


def test_deferred_resets_inside_one_of_several_replicas_are_refused_unchanged():
  strategy = _mirrored()
  with strategy.scope():
    layer = _shared_table_layer(tf.int64)
  features = {"a": tf.constant([1, 2], tf.int64), "b": tf.constant([3, 4], tf.int64)}
  with pytest.raises(ValueError, match="'tpu_embedding.*defer_resets=True.*outside strategy.run"):
    strategy.run(lambda: layer.remap(features, defer_resets=True))
  assert int(layer.managed_ids["items"].step.read_value()) == 0


def test_a_layer_made_in_the_scope_keeps_one_plain_map_on_the_host():
  """Not mirrored: Keras calls the layer outside a replica step too (a functional build),
  where a mirrored map's variables cannot be read."""
  strategy = _mirrored()
  with strategy.scope():
    layer = _shared_table_layer(tf.int64)
    inputs = {f: tf_keras.Input((), dtype=tf.int64, name=f) for f in "ab"}
    tf_keras.Model(inputs, layer(inputs))
  id_map = layer.managed_ids["items"]
  for variable in (id_map.keys, id_map.counts, id_map.last_seen, id_map.step):
    assert not isinstance(variable, tf.distribute.DistributedValues)
    assert tf.DeviceSpec.from_string(variable.device).device_type == "CPU"
    assert tf.DeviceSpec.from_string(variable.device).device_index == 0
  assert int(id_map.step.read_value()) == 0  # the symbolic build ran no map step


# ---------------------------------------------------------------------------------------------
# model.fit, evaluate and predict: every layer class, a managed table on each side of Partial.


def _features():
  small = E.TableConfig(5, 2, initializer=tf.constant_initializer(0.1), name="small")
  large = E.TableConfig(7, 2, initializer=tf.constant_initializer(0.2), name="large")
  return {"a": E.FeatureConfig(small, name="a"), "b": E.FeatureConfig(large, name="b")}


def _managed(large_keys):
  return {
    "small": tpu_embedding.ManagedIds(eviction="lru"),
    "large": tpu_embedding.ManagedIds(key_dtype=large_keys, eviction="lfu", min_count=2),
  }


# Keras 3's fit under a strategy averages a first batch over the replicas to build the model
# (`_maybe_symbolic_build`), which string inputs fail whatever the layer: its models take int64
# keys in both tables (string keys: the tf-keras layers and the custom loop above).
LAYERS = {
  "TPUEmbedding": (tf_keras, tpu_embedding.TPUEmbedding, {}),
  "PartialTPUEmbedding": (tf_keras, tpu_embedding.PartialTPUEmbedding, {"size_threshold": 6}),
  "keras.TPUEmbedding": (keras, keras3.TPUEmbedding, {}),
  "keras.PartialTPUEmbedding": (keras, keras3.PartialTPUEmbedding, {"size_threshold": 6}),
  "keras.DistributedEmbedding": (keras, keras3.DistributedEmbedding, {}),
}


def _large_keys(family):
  return tf.string if family is tf_keras else tf.int64


def _model(kind):
  family, layer_class, options = LAYERS[kind]
  large_keys = _large_keys(family)
  layer = layer_class(
    _features(), optimizer=E.Adagrad(0.3), managed_ids=_managed(large_keys), **options
  )
  inputs = {
    "a": family.Input((), dtype="int64", name="a"),
    "b": family.Input((), dtype=large_keys.name, name="b"),
  }
  out = layer(inputs)
  # Predictions [batch, 1]: Keras scales a per-sample loss for the replicas.
  pred = family.layers.Concatenate()([out["a"], 2 * out["b"]])
  pred = family.layers.Lambda(lambda x: tf.reduce_sum(x, axis=1, keepdims=True))(pred)
  model = family.Model(inputs, pred)
  kwargs = {} if family is tf_keras else {"jit_compile": False}
  model.compile(optimizer=family.optimizers.SGD(0.1), loss="mse", **kwargs)
  return model, layer


def _dataset(large_keys, steps=5):
  rng = np.random.default_rng(5)
  a = rng.integers(0, 9, size=steps * GLOBAL_BATCH) * 2**33 - 5
  b = rng.integers(0, 12, size=steps * GLOBAL_BATCH)
  b = np.array([f"item{i}".encode() for i in b]) if large_keys == tf.string else b * 10**12
  labels = rng.normal(size=[steps * GLOBAL_BATCH, 1]).astype("f4")
  return tf.data.Dataset.from_tensor_slices(({"a": a, "b": b}, labels)).batch(GLOBAL_BATCH), (a, b)


def _state(layer):
  return {name: _map_and_tables(layer, name) for name in ("small", "large")}


def _assert_same_state(got, expected):
  for name in ("small", "large"):
    assert got[name][0] == expected[name][0], name
    for slot, value in expected[name][1].items():
      np.testing.assert_allclose(got[name][1][slot], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_fit_evaluate_and_predict_under_mirrored_take_raw_keys(kind):
  large_keys = _large_keys(LAYERS[kind][0])
  dataset, (a, b) = _dataset(large_keys)
  single, single_layer = _model(kind)
  single.fit(dataset, epochs=1, shuffle=False, verbose=0)
  strategy = _mirrored()
  with strategy.scope():
    model, layer = _model(kind)
  model.fit(dataset, epochs=1, shuffle=False, verbose=0)
  got = _state(layer)
  _assert_same_state(got, _state(single_layer))
  # The maps against the reference: each global batch one step, a's keys and b's by batch.
  for name, keys, capacity, reference in (
    ("small", a, 5, ReferenceMap(5, eviction="lru")),
    ("large", b, 7, ReferenceMap(7, eviction="lfu", min_count=2)),
  ):
    for start in range(0, len(keys), GLOBAL_BATCH):
      batch = keys[start : start + GLOBAL_BATCH].tolist()
      reference.train(fingerprints(batch) if keys.dtype.kind in "SO" else batch)
    assert got[name][0] == tuple(list(t) for t in reference.export()), name
  assert len(got["small"][0][0]) == 4  # the small map filled up and evicted
  if "Partial" in kind:
    assert layer.side("small") == "replicated" and layer.side("large") == "sharded"
  if kind == "keras.DistributedEmbedding":
    return  # its call drops `training` (issue 40): its inference admits keys until then
  # Inference never admits: no map step, the same predictions as on one device.
  steps = {n: int(m.step.read_value()) for n, m in layer.managed_ids.items()}
  unseen = {"a": np.array([7 * 2**33, 1]), "b": b[:2]}
  predicted = model.predict(unseen, batch_size=2, verbose=0)
  model.evaluate(dataset, verbose=0)
  np.testing.assert_allclose(predicted, single.predict(unseen, batch_size=2, verbose=0), rtol=1e-5)
  assert {n: int(m.step.read_value()) for n, m in layer.managed_ids.items()} == steps
  _assert_same_state(_state(layer), got)
