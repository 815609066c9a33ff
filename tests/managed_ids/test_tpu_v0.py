"""managed_ids on TPU V0 (no embedding engine), on TF's real `TPUEmbeddingV0` (tpu_harness).

V0's tables are replicated variables trained by the Keras optimizer the train step applies, so
their slots live in that optimizer. Each step here remaps on the host, checks the rows against
the reference map, checks that exactly the rows given to new keys were reset (table initializer,
the Keras slots' initial values) and nothing else changed, then trains one real Keras step on
the rows, so that every later reset overwrites trained values. Off TPU, tables trained by the
Keras optimizer (`table_updates="keras"`) are reset the same way (`backends.keras_trained`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding
from tpu_embedding import hardware

import tpu_harness
from managed_ids_reference import ReferenceMap

E = tf.tpu.experimental.embedding
CAPACITY, DIM, BATCH, ACC = 6, 2, 4, 0.1
INIT = np.arange(CAPACITY * DIM, dtype=np.float32).reshape(CAPACITY, DIM) / 10.0
KEYS = np.array([9_123_456_789_012, -7, 2**31 + 1, 3, -(2**40), 77, 123456789, 11, -5])

OPTIMIZERS = {  # (Keras optimizer, the value each of its slots starts at)
  "legacy-adagrad": (lambda: tf_keras.optimizers.legacy.Adagrad(0.3, ACC), ACC),
  "tf_keras-adagrad": (lambda: tf_keras.optimizers.Adagrad(0.3, ACC), ACC),
  "keras3-adagrad": (lambda: keras.optimizers.Adagrad(0.3, ACC), ACC),
  "legacy-adam": (lambda: tf_keras.optimizers.legacy.Adam(0.05), 0.0),
  "tf_keras-adam": (lambda: tf_keras.optimizers.Adam(0.05), 0.0),
  "keras3-adam": (lambda: keras.optimizers.Adam(0.05), 0.0),
}


def _features():
  movies = E.TableConfig(
    CAPACITY, DIM, initializer=tf.constant_initializer(INIT), name="movies", combiner="sum"
  )
  return {"movie": E.FeatureConfig(movies, name="movie")}


def _table_slots(optimizer):
  """The optimizer's variables shaped like the table: its slots for it (the layer's only
  variable of that shape), found without the package's own lookup."""
  variables = optimizer.variables() if callable(optimizer.variables) else optimizer.variables
  return [v for v in variables if tuple(v.shape) == (CAPACITY, DIM)]


def _train_step(strategy, layer, optimizer):
  """One replicated Keras step on remapped rows: `optimizer` trains the layer's table."""

  @tf.function
  def train(rows):
    def step(rows):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(rows, remapped=True)["movie"] * [[1.0, -2.0]])
      variables = layer.trainable_variables
      optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    strategy.run(step, args=(rows,))

  return train


# Every optimizer on TPUEmbedding; two on a PartialTPUEmbedding, whose tables are all replicated
# on V0 (nothing to shard onto), here trained by the Keras optimizer.
@pytest.mark.parametrize(
  "kind,partial",
  [(kind, False) for kind in OPTIMIZERS] + [("tf_keras-adagrad", True), ("keras3-adam", True)],
)
def test_v0_resets_the_table_and_the_keras_optimizers_slots(monkeypatch, kind, partial):
  make_optimizer, slot_start = OPTIMIZERS[kind]
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.UNSUPPORTED)
  with strategy.scope():
    optimizer = make_optimizer()
    managed = {"movies": tpu_embedding.ManagedIds(eviction="lru")}
    if partial:
      layer = tpu_embedding.PartialTPUEmbedding(
        _features(),
        optimizer=optimizer,
        size_threshold=None,
        table_updates="keras",
        managed_ids=managed,
      )
      assert layer.side("movies") == "replicated"
    else:
      layer = tpu_embedding.TPUEmbedding(_features(), optimizer=optimizer, managed_ids=managed)
      assert layer.execution_path is hardware.ExecutionPath.TPU_V0
    layer.build({"movie": tf.TensorShape([BATCH])})
  table = layer.variables_by_table["movies"]["parameters"]
  train = _train_step(strategy, layer, optimizer)
  reference = ReferenceMap(CAPACITY, "lru")
  rng = np.random.default_rng(0)
  overwritten = 0  # reset rows whose slots held trained values
  for step in range(1, 13):
    keys = KEYS[rng.integers(0, len(KEYS), BATCH)]
    slots = _table_slots(optimizer)
    before = [table.numpy()] + [slot.numpy() for slot in slots]
    with strategy.scope():
      rows = layer.remap({"movie": tf.constant(keys, tf.int64)})
    want_rows, fresh = reference.train(keys.tolist())
    assert rows["movie"].numpy().tolist() == want_rows, step
    want = [b.copy() for b in before]
    want[0][fresh] = INIT[fresh]
    for slot in want[1:]:
      overwritten += int(np.any(slot[fresh] != slot_start))
      slot[fresh] = slot_start
    for index, (variable, expected) in enumerate(zip([table] + slots, want)):
      np.testing.assert_array_equal(variable.numpy(), expected, err_msg=f"{index} step {step}")
    with strategy.scope():
      train(rows)
  assert len(_table_slots(optimizer)) == (1 if slot_start else 2)
  assert overwritten >= 3  # rows were trained, given to another key and reset


def test_v0_reset_before_the_optimizer_has_slots_writes_the_table_only(monkeypatch):
  """Slots a Keras optimizer has not created yet will start fresh: nothing to reset there."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.UNSUPPORTED)
  with strategy.scope():
    optimizer = tf_keras.optimizers.legacy.Adagrad(0.3, ACC)
    layer = tpu_embedding.TPUEmbedding(
      _features(), optimizer=optimizer, managed_ids={"movies": tpu_embedding.ManagedIds()}
    )
    layer.build({"movie": tf.TensorShape([BATCH])})
    table = layer.variables_by_table["movies"]["parameters"]
    table.assign(INIT + 50.0)
    rows = layer.remap({"movie": tf.constant([5, 6, 5], tf.int64)})["movie"]
  assert rows.numpy().tolist() == [1, 2, 1]
  want = INIT + 50.0
  want[[1, 2]] = INIT[[1, 2]]
  np.testing.assert_array_equal(table.numpy(), want)
  assert _table_slots(optimizer) == []


def test_v0_rows_given_before_the_tables_exist_need_no_reset(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.UNSUPPORTED)
  with strategy.scope():
    optimizer = tf_keras.optimizers.Adagrad(0.3, ACC)
    layer = tpu_embedding.TPUEmbedding(
      _features(), optimizer=optimizer, managed_ids={"movies": tpu_embedding.ManagedIds()}
    )
    rows = layer.remap({"movie": tf.constant([5, 6], tf.int64)})["movie"]
    assert rows.numpy().tolist() == [1, 2]
    layer.build({"movie": tf.TensorShape([BATCH])})
  np.testing.assert_array_equal(layer.variables_by_table["movies"]["parameters"].numpy(), INIT)


def test_v0_slots_that_cannot_be_told_apart_are_refused_before_the_map_changes(monkeypatch):
  """Two layers' tables of one name, trained by one tf-keras optimizer: its two slots carry the
  same name, so the reset could hit the wrong one. Refused, naming the slot; no map changed."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.UNSUPPORTED)
  with strategy.scope():
    optimizer = tf_keras.optimizers.Adagrad(0.3, ACC)
    layers = [
      tpu_embedding.TPUEmbedding(
        _features(), optimizer=optimizer, managed_ids={"movies": tpu_embedding.ManagedIds()}
      )
      for _ in range(2)
    ]
    for layer in layers:
      layer.build({"movie": tf.TensorShape([BATCH])})
    optimizer.build([v for layer in layers for v in layer.trainable_variables])
    table = layers[0].variables_by_table["movies"]["parameters"]
    table.assign(INIT + 50.0)
    with pytest.raises(ValueError, match=r"two 'accumulator' slots named .*movies"):
      layers[0].remap({"movie": tf.constant([5, 6], tf.int64)})
  assert int(layers[0].managed_ids["movies"].size()) == 0
  assert int(layers[0].managed_ids["movies"].step) == 0
  np.testing.assert_array_equal(table.numpy(), INIT + 50.0)


@pytest.mark.parametrize(
  "layer_class", [tpu_embedding.TPUEmbedding, tpu_embedding.PartialTPUEmbedding]
)
def test_cpu_tables_trained_by_keras_reset_the_keras_optimizers_slots_too(layer_class):
  """Off TPU with table_updates="keras" the slots live in the Keras optimizer as on V0 (a
  `PartialTPUEmbedding` keeps this small table on its replicated side)."""
  optimizer = tf_keras.optimizers.Adagrad(0.3, ACC)
  layer = layer_class(
    _features(),
    optimizer=optimizer,
    table_updates="keras",
    managed_ids={"movies": tpu_embedding.ManagedIds(eviction="lru")},
  )
  layer.build({"movie": tf.TensorShape([BATCH])})
  table = layer.variables_by_table["movies"]["parameters"]
  keys = tf.constant([5, 6, 7, 8, 9], tf.int64)  # rows 1..5, every row taken
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(layer({"movie": keys})["movie"] * [[1.0, -2.0]])
  optimizer.apply_gradients(
    zip(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)
  )
  (slot,) = _table_slots(optimizer)
  table_before, slot_before = table.numpy(), slot.numpy()
  assert (slot_before[1:] != ACC).all()  # trained
  rows = layer.remap({"movie": tf.constant([10, 11], tf.int64)})["movie"]
  assert rows.numpy().tolist() == [1, 2]  # least recently seen rows, smallest first
  table_before[[1, 2]], slot_before[[1, 2]] = INIT[[1, 2]], ACC
  np.testing.assert_array_equal(table.numpy(), table_before)
  np.testing.assert_array_equal(slot.numpy(), slot_before)


@pytest.mark.parametrize("optimizer", ["adagrad", E.Adagrad(0.1)], ids=["name", "mid-level"])
def test_cpu_tables_trained_by_keras_need_the_keras_optimizer_object(optimizer):
  with pytest.raises(ValueError, match=r"table_updates='keras'.*Keras optimizer object"):
    tpu_embedding.TPUEmbedding(
      _features(),
      optimizer=optimizer,
      table_updates="keras",
      managed_ids={"movies": tpu_embedding.ManagedIds()},
    )


class _Holder(tf_keras.Model):
  """A subclassed model around the layer (tf-keras saves such a model with save_weights)."""

  def __init__(self, layer):
    super().__init__()
    self.embedding = layer

  def call(self, inputs):
    return self.embedding(inputs)


def _v0_model(strategy, optimizer):
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(
      _features(),
      optimizer=optimizer,
      managed_ids={"movies": tpu_embedding.ManagedIds(eviction="lru")},
    )
    layer.build({"movie": tf.TensorShape([BATCH])})
    model = _Holder(layer)
    model.built = True  # tf-keras loads HDF5 weights into built models only
  assert layer.execution_path is hardware.ExecutionPath.TPU_V0
  return model, layer


def test_v0_table_and_map_travel_in_a_legacy_hdf5_file(monkeypatch, tmp_path):
  """`save_weights("w.h5")` then `load_weights` into a model built anew: the table and the map
  (keys, rows, counts against the reference). The table's slots are the Keras optimizer's, which
  Keras saves with the optimizer (`model.save` of a compiled model), not with the layer."""
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.UNSUPPORTED)
  optimizer = tf_keras.optimizers.Adagrad(0.3, ACC)
  model, layer = _v0_model(strategy, optimizer)
  train = _train_step(strategy, layer, optimizer)
  reference = ReferenceMap(CAPACITY, "lru")
  for step in range(3):
    keys = KEYS[step * 2 : step * 2 + BATCH]
    with strategy.scope():
      rows = layer.remap({"movie": tf.constant(keys, tf.int64)})
      train(rows)
    reference.train(keys.tolist())
  trained = layer.variables_by_table["movies"]["parameters"].numpy()
  assert not np.array_equal(trained, INIT)
  path = str(tmp_path / "w.h5")
  model.save_weights(path)

  other, other_layer = _v0_model(strategy, tf_keras.optimizers.Adagrad(0.3, ACC))
  other.load_weights(path)
  table = other_layer.variables_by_table["movies"]["parameters"]
  np.testing.assert_array_equal(table.numpy(), trained)
  id_map = other_layer.managed_ids["movies"]
  exported = sorted(zip(*[t.numpy().tolist() for t in id_map.export()]))
  assert exported == sorted(zip(*reference.export())) and len(exported) == CAPACITY - 1
  assert id_map.lookup(tf.constant(KEYS)).numpy().tolist() == reference.lookup(KEYS.tolist())
