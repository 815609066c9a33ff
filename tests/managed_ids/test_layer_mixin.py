"""TPUEmbedding with managed_ids on the CPU engine, against the reference map and NumPy training."""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding

import reference
from managed_ids_reference import ReferenceMap

E = tf.tpu.experimental.embedding
CAPACITY, DIM, LR, INIT, ACC = 5, 3, 0.3, 0.5, 0.1


def _layer(
  eviction="lru", key_dtype=tf.int64, min_count=1, initializer=None, combiner="sum", **policy
):
  table = E.TableConfig(
    CAPACITY,
    DIM,
    initializer=initializer or tf.constant_initializer(INIT),
    combiner=combiner,
    name="movies",
  )
  features = {"movie": E.FeatureConfig(table, name="movie")}
  return tpu_embedding.TPUEmbedding(
    features,
    optimizer=E.Adagrad(LR, initial_accumulator_value=ACC),
    managed_ids={
      "movies": tpu_embedding.ManagedIds(
        key_dtype=key_dtype, eviction=eviction, min_count=min_count, **policy
      )
    },
  )


def _train(layer, features, upstream, weights=None, training=None, **kwargs):
  with tf.GradientTape() as tape:
    out = layer(features, weights, training=training, **kwargs)["movie"]
    loss = tf.reduce_sum(out * upstream)
  tape.gradient(loss, layer.trainable_variables)
  return out


def _stream(steps=12, batch=4, seed=0):
  rng = np.random.default_rng(seed)
  universe = np.array([9_123_456_789_012, -7, 2**31 + 1, 3, -(2**40), 77, 123456789])
  for _ in range(steps):
    yield universe[rng.integers(0, len(universe), batch)], rng.normal(size=[batch, DIM])


@pytest.mark.parametrize(
  "policy",
  [
    dict(eviction="lfu", admission="always"),
    dict(eviction="lfu"),  # the default: competing
    dict(eviction="lru"),
    dict(eviction="distance_lfu", admission="compete"),
  ],
  ids=lambda p: "-".join(p.values()),
)
@pytest.mark.parametrize("traced", [False, True])
def test_training_follows_numpy_reference_with_resets(policy, traced):
  layer = _layer(**policy)
  ref = ReferenceMap(CAPACITY, **policy)
  table = np.full([CAPACITY, DIM], INIT)
  slots = {"accumulators": np.full([CAPACITY, DIM], ACC)}
  params = reference.params_from_optimizer(E.Adagrad(LR, initial_accumulator_value=ACC))
  step = tf.function(_train) if traced else _train
  evicted = 0
  for keys, upstream in _stream():
    out = step(layer, {"movie": tf.constant(keys, tf.int64)}, tf.constant(upstream, tf.float32))
    used = set(ref.key_of)
    rows, fresh = ref.train(keys.tolist())
    evicted += len(used & set(fresh))
    table[fresh] = INIT
    slots["accumulators"][fresh] = ACC
    np.testing.assert_allclose(out.numpy(), table[rows], rtol=1e-5)
    touched, grads = reference.assemble_gradients([([r], None) for r in rows], upstream, "sum")
    table, slots = reference.apply_step(table, slots, touched, grads, LR, params)
  assert evicted >= 1  # rows were taken from keys and reset (competing LFU keeps most: 1 here)
  variables = layer.variables_by_table["movies"]
  np.testing.assert_allclose(variables["parameters"].numpy(), table, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(variables["accumulators"].numpy(), slots["accumulators"], rtol=1e-5)
  keys, rows, _ = layer.managed_ids["movies"].export()
  assert list(zip(keys.numpy(), rows.numpy())) == sorted(ref.row_of.items(), key=lambda kv: kv[1])


def test_remap_ahead_in_tf_data_with_deferred_resets_follows_numpy_reference():
  """The remap as a prefetching tf.data map (run ahead of the loop: checked), its resets
  written by `reset_rows` right before each jit-compiled step: every step reads and trains what
  the reference map and NumPy say, as a remap in the call does."""
  layer = _layer("lfu", admission="always")  # every new key evicts: many resets to defer
  ref = ReferenceMap(CAPACITY, "lfu", admission="always")
  table = np.full([CAPACITY, DIM], INIT)
  slots = {"accumulators": np.full([CAPACITY, DIM], ACC)}
  params = reference.params_from_optimizer(E.Adagrad(LR, initial_accumulator_value=ACC))
  stream = list(_stream(steps=16, seed=3))
  keys = np.stack([k for k, _ in stream])
  dataset = (
    tf.data.Dataset.from_tensor_slices((keys, np.stack([u for _, u in stream]).astype("f4")))
    .map(lambda k, u: (layer.remap({"movie": k}, defer_resets=True), u))
    .prefetch(2)
  )

  @tf.function(jit_compile=True)
  def step(rows, upstream):
    with tf.GradientTape() as tape:
      out = layer(rows, remapped=True)["movie"]
      loss = tf.reduce_sum(out * upstream)
    tape.gradient(loss, layer.trainable_variables)
    return out

  map_steps, evicted = [], 0
  for (rows, resets), upstream in dataset:
    map_steps.append(int(layer.managed_ids["movies"].step.numpy()))
    layer.reset_rows(resets)
    out = step(rows, upstream)
    used = set(ref.key_of)
    expected_rows, fresh = ref.train(keys[len(map_steps) - 1].tolist())
    assert rows["movie"].numpy().tolist() == expected_rows
    given = resets["movies"].numpy()  # the rows given, then 0 up to the batch's keys
    assert given.shape == (4,) and given[len(fresh) :].tolist() == [0] * (4 - len(fresh))
    assert sorted(given[: len(fresh)].tolist()) == sorted(fresh)
    evicted += len(used & set(fresh))
    table[fresh] = INIT
    slots["accumulators"][fresh] = ACC
    np.testing.assert_allclose(out.numpy(), table[expected_rows], rtol=1e-5)
    grads = [([r], None) for r in expected_rows]
    touched, grads = reference.assemble_gradients(grads, upstream.numpy(), "sum")
    table, slots = reference.apply_step(table, slots, touched, grads, LR, params)
  assert evicted >= 3  # rows were taken from keys trained in earlier batches, and reset
  assert max(s - i for i, s in enumerate(map_steps, 1)) >= 1  # the map ran ahead of training
  variables = layer.variables_by_table["movies"]
  np.testing.assert_allclose(variables["parameters"].numpy(), table, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(variables["accumulators"].numpy(), slots["accumulators"], rtol=1e-5)


def test_reset_rows_refuses_what_remap_did_not_give_and_changes_nothing():
  layer = _layer("lru")
  rows, resets = layer.remap({"movie": tf.constant([5, 6], tf.int64)}, defer_resets=True)
  assert sorted(resets["movies"].numpy().tolist()) == [1, 2]
  layer.reset_rows(resets)
  _train(layer, rows, tf.ones([2, DIM]), training=True)
  before = layer.variables_by_table["movies"]["parameters"].numpy().copy()
  for bad, error, message in [
    ({"genres": [1]}, ValueError, r"table 'genres'.*managed tables are \['movies'\]"),
    ({"movies": [1.5]}, TypeError, r"table 'movies'.*integer rows.*float"),
    ({"movies": [[1]]}, TypeError, r"table 'movies'.*vector"),
    ({"movies": [1, CAPACITY]}, tf.errors.InvalidArgumentError, r"'movies' gives rows 1 \.\. 4"),
    ([1, 2], TypeError, r"dict \{table name: rows\}"),
  ]:
    with pytest.raises(error, match=message):
      layer.reset_rows(bad)
  np.testing.assert_array_equal(layer.variables_by_table["movies"]["parameters"].numpy(), before)


def test_resets_a_remap_returned_are_written_by_flush_if_never_by_reset_rows():
  """Two batches remapped ahead, the loop stopping after the first: `flush` (as every save,
  export and restore does first) writes the second's resets, so its keys read fresh rows, not
  those of the keys they evicted; resets written by `reset_rows` are never written again."""
  layer = _layer("lru")
  first, second = (
    layer.remap({"movie": tf.constant(keys, tf.int64)}, defer_resets=True)
    for keys in ([1, 2, 3, 4], [5, 6, 7, 8])
  )
  assert sorted(second[1]["movies"].numpy().tolist()) == [1, 2, 3, 4]  # the same rows again
  layer.reset_rows(first[1])
  _train(layer, first[0], tf.ones([4, DIM]), remapped=True)
  parameters = layer.variables_by_table["movies"]["parameters"]
  trained = parameters.numpy()[1:5].copy()
  assert not np.allclose(trained, INIT)
  layer.flush()
  out = layer({"movie": tf.constant([5, 6, 7, 8], tf.int64)}, training=False)["movie"]
  np.testing.assert_allclose(out.numpy(), np.full([4, DIM], INIT))
  slots = layer.variables_by_table["movies"]["accumulators"].numpy()
  np.testing.assert_allclose(slots[1:5], np.full([4, DIM], ACC))
  layer.reset_rows(second[1])  # late, as a loop resuming would: written, counted
  _train(layer, second[0], tf.ones([4, DIM]), remapped=True)
  trained = parameters.numpy().copy()
  layer.flush()  # nothing returned is left unwritten: trained rows stay
  np.testing.assert_array_equal(parameters.numpy(), trained)


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_string_keys_ragged_and_sparse_with_weights(kind):
  layer = _layer("lfu", key_dtype=tf.string, min_count=2, combiner="mean")
  ref = ReferenceMap(CAPACITY, "lfu", min_count=2)
  table = np.full([CAPACITY, DIM], INIT)
  params = reference.params_from_optimizer(E.Adagrad(LR, initial_accumulator_value=ACC))
  slots = {"accumulators": np.full([CAPACITY, DIM], ACC)}
  batches = [
    [[b"a", b"b"], [b"a"], [b"c", b"a", b"b"]],
    [[b"b"], [b"d", b"d"], [b"c"]],
  ]
  weights = [[[1.0, 2.0], [0.5], [1.0, 1.0, 3.0]], [[2.0], [1.0, 1.0], [0.25]]]
  for bags, bag_weights in zip(batches, weights):
    ids = tf.ragged.constant(bags, tf.string)
    w = tf.ragged.constant(bag_weights, tf.float32)
    if kind == "sparse":
      ids, w = ids.to_sparse(), w.to_sparse()
    upstream = np.ones([3, DIM])
    out = _train(layer, {"movie": ids}, tf.constant(upstream, tf.float32), {"movie": w})
    rows, fresh = ref.train([k for bag in bags for k in bag])
    table[fresh] = INIT
    slots["accumulators"][fresh] = ACC
    row_bags, start = [], 0
    for bag in bags:
      row_bags.append(rows[start : start + len(bag)])
      start += len(bag)
    expected = [reference.combine_bag(table, r, w_, "mean") for r, w_ in zip(row_bags, bag_weights)]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5)
    touched, grads = reference.assemble_gradients(
      list(zip(row_bags, bag_weights)), upstream, "mean"
    )
    table, slots = reference.apply_step(table, slots, touched, grads, LR, params)
  np.testing.assert_allclose(layer.variables_by_table["movies"]["parameters"].numpy(), table, 1e-5)
  # a (3) and b (2) reach min_count=2 in step 1; d (2) and c (1 + 1) in step 2, d first.
  assert ref.row_of == {b"a": 1, b"b": 2, b"d": 3, b"c": 4}
  found = layer.managed_ids["movies"].lookup(tf.constant([b"a", b"b", b"d", b"c", b"zz"]))
  assert found.numpy().tolist() == [1, 2, 3, 4, 0]


def test_training_false_never_admits_and_reads_row_zero():
  layer = _layer()
  _train(layer, {"movie": tf.constant([11, 12], tf.int64)}, tf.ones([2, DIM]))
  table_before = layer.variables_by_table["movies"]["parameters"].numpy().copy()
  out = layer({"movie": tf.constant([11, 99], tf.int64)}, training=False)["movie"]
  np.testing.assert_allclose(out.numpy(), table_before[[1, 0]])
  assert int(layer.managed_ids["movies"].size()) == 2
  assert int(layer.managed_ids["movies"].step) == 1


def test_random_initializer_resets_rows_with_fresh_draws():
  init = tf.initializers.TruncatedNormal(stddev=0.01, seed=1)
  layer = _layer("lru", initializer=init)
  for keys in ([1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]):  # the third step evicts every row
    _train(layer, {"movie": tf.constant(keys, tf.int64)}, tf.fill([4, DIM], 100.0))
  table = layer.variables_by_table["movies"]["parameters"].numpy()
  accumulators = layer.variables_by_table["movies"]["accumulators"].numpy()
  # Trained twice with huge gradients the old rows moved by ~LR; fresh ones are small draws
  # trained once: |w - (-LR * g / sqrt(ACC + g^2))| <= 2 stddev.
  assert np.all(np.abs(table[1:] + LR * 100 / np.sqrt(ACC + 100**2)) <= 0.02 + 1e-6)
  np.testing.assert_allclose(accumulators[1:], ACC + 100.0**2, rtol=1e-6)


def _error(**layer_kwargs):
  table = E.TableConfig(CAPACITY, DIM, name="movies")
  features = {"movie": E.FeatureConfig(table, name="movie")}
  return tpu_embedding.TPUEmbedding(features, optimizer=E.SGD(0.1), **layer_kwargs)


def test_errors_name_feature_and_table():
  layer = _layer()
  with pytest.raises(ValueError, match="Feature 'movie'.*table 'movies'.*int64.*got string"):
    layer({"movie": tf.constant(["a"])})
  with pytest.raises(ValueError, match="Feature 'movie'.*table 'movies'.*got float32"):
    layer({"movie": tf.constant([1.0])})
  strings = _layer(key_dtype=tf.string)
  with pytest.raises(ValueError, match="Feature 'movie'.*table 'movies'.*tf.string.*got int64"):
    strings({"movie": tf.constant([1], tf.int64)})
  assert int(layer.managed_ids["movies"].step) == 0  # nothing changed
  with pytest.raises(ValueError, match="managed_ids names table 'users'.*\\['movies'\\]"):
    _error(managed_ids={"users": tpu_embedding.ManagedIds()})
  with pytest.raises(TypeError, match="expected tpu_embedding.ManagedIds"):
    _error(managed_ids={"movies": "lfu"})
  tiny = E.TableConfig(1, DIM, name="tiny")
  with pytest.raises(ValueError, match="Table 'tiny'.*vocabulary_size >= 2"):
    tpu_embedding.TPUEmbedding(
      {"f": E.FeatureConfig(tiny)},
      optimizer=E.SGD(0.1),
      managed_ids={tiny: tpu_embedding.ManagedIds()},
    )


def test_tpu_v0_refuses_managed_ids_without_the_keras_optimizer_object(monkeypatch):
  from tpu_embedding import hardware

  import tpu_harness

  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.UNSUPPORTED)
  with strategy.scope():
    with pytest.raises(ValueError, match=r"path TPU_V0.*Keras optimizer object.*got 'sgd'"):
      tpu_embedding.TPUEmbedding(
        {"movie": E.FeatureConfig(E.TableConfig(CAPACITY, DIM, name="movies"))},
        optimizer="sgd",
        managed_ids={"movies": tpu_embedding.ManagedIds()},
      )
