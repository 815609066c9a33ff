"""managed_ids on TPU V1 and SparseCore (V2), on TF's real mid-level classes
(tests/support/tpu_harness.py).

The harness runs TF's `TPUEmbedding` / `TPUEmbeddingV2` with only the TPU runtime stubbed: V1's
copies between host and TPU memory are traced and counted, not run, so the host copies stand for
TPU memory here. Each test writes "trained" values into every row first (what a copy out of TPU
memory would bring back), then checks that exactly the rows the reference map gives to new keys
hold a fresh table's values (table initializer, slots' initial values) and nothing else changed.
"""

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding
from tpu_embedding import hardware, sparse_core
from tpu_embedding import keras as keras3

import tpu_harness
from managed_ids_reference import ReferenceMap

E = tf.tpu.experimental.embedding
place = sparse_core.row_placement
CAPACITY, DIM, BATCH, ACC = 6, 2, 4, 0.1
INIT = np.arange(CAPACITY * DIM, dtype=np.float32).reshape(CAPACITY, DIM) / 10.0
KEYS = np.array([9_123_456_789_012, -7, 2**31 + 1, 3, -(2**40), 77, 123456789, 11, -5])


def _stream(steps=14, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    yield KEYS[rng.integers(0, len(KEYS), BATCH)]


def _features():
  movies = E.TableConfig(
    CAPACITY, DIM, initializer=tf.constant_initializer(INIT), name="movies", combiner="sum"
  )
  return {"movie": E.FeatureConfig(movies, name="movie")}


def _v1_layer(monkeypatch, every=1, pipelining=False, layer_class=tpu_embedding.TPUEmbedding):
  strategy, recorded = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1)
  with strategy.scope():
    layer = layer_class(
      _features(),
      optimizer=E.Adagrad(0.3, initial_accumulator_value=ACC),
      pipeline_execution_with_tensor_core=pipelining,
      managed_ids={"movies": tpu_embedding.ManagedIds(eviction="lru", reset_every_steps=every)},
    )
    layer.build({"movie": tf.TensorShape([BATCH])})
  assert layer.execution_path is hardware.ExecutionPath.TPU_V1
  return strategy, recorded, layer


def _train_tpu_memory(variables, step):
  """Stands in for a TPU step: every row of the table and slot changes (the host copies are
  what the stubbed copy out of TPU memory leaves)."""
  values = {name: (step + 1) * 100.0 + variable.numpy() for name, variable in variables.items()}
  for name, variable in variables.items():
    variable.assign(values[name])
  return values


def _expected_v1(steps, every, lag):
  """(visible rows per step, whether a flush happened, reset rows per step), from the
  reference map and the documented flush rule alone."""
  ref = ReferenceMap(CAPACITY, "lru")
  waiting = {}  # row -> step it was given at
  for step, keys in enumerate(steps, start=1):
    rows, fresh = ref.train(keys.tolist())
    waiting.update({row: step for row in fresh})
    flushed = []
    if step % every == 0:
      flushed = sorted(r for r, at in waiting.items() if at <= step - lag)
      for row in flushed:
        del waiting[row]
    yield [0 if r in waiting else r for r in rows], flushed


@pytest.mark.parametrize(
  "every,pipelining", [(1, False), (3, False), (1, True)], ids=["each-step", "every-3", "pipelined"]
)
def test_v1_remap_resets_rows_in_tpu_memory_at_flushes(monkeypatch, every, pipelining):
  strategy, recorded, layer = _v1_layer(monkeypatch, every, pipelining)
  variables = layer.variables_by_table["movies"]
  steps = list(_stream())
  loads, resets_seen = recorded.loads, 0
  for step, (keys, (want_rows, flushed)) in enumerate(
    zip(steps, _expected_v1(steps, every, int(pipelining))), start=1
  ):
    before = _train_tpu_memory(variables, step)
    retrieves = recorded.retrieves
    with strategy.scope():
      rows = layer.remap({"movie": tf.constant(keys, tf.int64)})["movie"]
    assert rows.numpy().tolist() == want_rows, step
    assert recorded.loads == loads + bool(flushed), step  # one load per flush, none otherwise
    assert recorded.retrieves == retrieves + bool(flushed), step  # copied out first
    loads = recorded.loads
    want_table, want_slot = before["parameters"].copy(), before["accumulators"].copy()
    want_table[flushed], want_slot[flushed] = INIT[flushed], ACC
    np.testing.assert_array_equal(variables["parameters"].numpy(), want_table, err_msg=step)
    np.testing.assert_array_equal(variables["accumulators"].numpy(), want_slot, err_msg=step)
    resets_seen += len(flushed)
  assert resets_seen >= 8  # rows were given, taken back and given again


def test_v1_training_step_on_remapped_rows_is_tfs_enqueue_and_send(monkeypatch):
  strategy, _, layer = _v1_layer(monkeypatch)
  with strategy.scope():
    rows = layer.remap({"movie": tf.constant(KEYS[:BATCH], tf.int64)})
  step = tpu_harness.training_step(strategy, layer, remapped=True)
  with strategy.scope():
    graph = step.get_concrete_function(tf.nest.map_structure(tf.TensorSpec.from_tensor, rows)).graph
  types = [op.type for op in graph.get_operations()]
  assert types.count("EnqueueTPUEmbeddingArbitraryTensorBatch") == 1
  assert types.count("SendTPUEmbeddingGradients") == 1
  assert not [t for t in types if "HashTable" in t]  # the map stays on the host


def test_raw_keys_inside_a_tpu_step_are_refused_with_the_way_that_works(monkeypatch):
  strategy, _, layer = _v1_layer(monkeypatch)
  keys = {"movie": tf.constant(KEYS[:BATCH], tf.int64)}
  step = tf.function(lambda keys: strategy.run(layer, args=(keys,)))
  with pytest.raises(ValueError, match=r"raw keys inside a TPU step.*layer\.remap"):
    step(keys)
  assert int(layer.managed_ids["movies"].size()) == 0


def test_v1_training_remap_in_a_tf_function_is_refused_and_changes_nothing(monkeypatch):
  strategy, recorded, layer = _v1_layer(monkeypatch)
  remap = tf.function(lambda f: layer.remap(f))
  with strategy.scope():
    with pytest.raises(ValueError, match=r"TPU_V1.*must run eagerly"):
      remap({"movie": tf.constant(KEYS[:BATCH], tf.int64)})
  assert int(layer.managed_ids["movies"].size()) == 0
  # Lookups alone may be traced: they never admit.
  with strategy.scope():
    looked_up = tf.function(lambda f: layer.remap(f, training=False))(
      {"movie": tf.constant(KEYS[:BATCH], tf.int64)}
    )
  assert looked_up["movie"].numpy().tolist() == [0] * BATCH


def test_v1_remap_cannot_return_its_resets_and_changes_nothing(monkeypatch):
  """On V1 the resets are flushes the remap itself makes: deferring them is refused."""
  strategy, _, layer = _v1_layer(monkeypatch)
  with strategy.scope():
    with pytest.raises(ValueError, match=r"TPU_V1.*defer_resets=True\) cannot return"):
      layer.remap({"movie": tf.constant(KEYS[:BATCH], tf.int64)}, defer_resets=True)
  assert int(layer.managed_ids["movies"].size()) == 0


def _rows_1_and_2_waiting(monkeypatch):
  """A V1 layer whose trained rows 1 and 2 were given to new keys and wait for their reset."""
  strategy, recorded, layer = _v1_layer(monkeypatch, every=100)
  variables = layer.variables_by_table["movies"]
  before = _train_tpu_memory(variables, 0)
  with strategy.scope():
    rows = layer.remap({"movie": tf.constant([5, 6, 5], tf.int64)})["movie"]
  assert rows.numpy().tolist() == [0, 0, 0]  # rows 1, 2 wait for their reset
  np.testing.assert_array_equal(variables["parameters"].numpy(), before["parameters"])
  return strategy, recorded, layer, variables, before


def test_v1_flush_and_checkpoint_apply_waiting_resets(monkeypatch, tmp_path):
  strategy, recorded, layer, variables, before = _rows_1_and_2_waiting(monkeypatch)
  loads = recorded.loads
  tf.train.Checkpoint(layer=layer).write(str(tmp_path / "ckpt"))
  assert recorded.loads == loads + 1
  want = before["parameters"].copy()
  want[[1, 2]] = INIT[[1, 2]]
  np.testing.assert_array_equal(variables["parameters"].numpy(), want)
  with strategy.scope():
    rows = layer.remap({"movie": tf.constant([6, 5], tf.int64)}, training=False)["movie"]
  assert rows.numpy().tolist() == [2, 1]
  layer.flush()
  assert recorded.loads == loads + 1  # nothing waits: no copy


def test_v2_rows_are_reset_at_once_in_the_sparse_core_layout(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2, replicas=2)
  table = E.TableConfig(8, 4, initializer=tf.constant_initializer(0.5), name="movies")
  other = E.TableConfig(16, 4, initializer=tpu_harness.pattern(0.0), name="albums")
  features = {
    "movie": E.FeatureConfig(table, output_shape=[BATCH]),
    "x": E.FeatureConfig(other, output_shape=[BATCH]),
  }
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(
      features,
      optimizer=E.Adagrad(0.3, initial_accumulator_value=ACC),
      managed_ids={"movies": tpu_embedding.ManagedIds(eviction="lfu")},
    )
    layer.build({"movie": tf.TensorShape([BATCH]), "x": tf.TensorShape([BATCH])})
  layouts = layer.engine.embedding_layouts
  stack = layouts["movies"].stacked_table_name
  assert stack == layouts["albums"].stacked_table_name  # stacked with an unmanaged table
  variables = layer.variables_by_table[stack]
  placements = []  # where the reset rows land is worked out once per table and step
  monkeypatch.setattr(
    sparse_core, "row_placement", lambda *args: placements.append(args) or place(*args)
  )
  ref = ReferenceMap(8, "lfu")
  for step, keys in enumerate(_stream(10, seed=3), start=1):
    tpu_harness.fill_shards(variables.values(), seed=step)
    before = {name: tpu_harness.stacked_by_hand(v) for name, v in variables.items()}
    with strategy.scope():
      rows = layer.remap({"movie": tf.constant(keys, tf.int64), "x": tf.constant([1, 2, 3, 4])})
    want_rows, fresh = ref.train(keys.tolist())
    assert rows["movie"].numpy().tolist() == want_rows
    assert rows["x"].numpy().tolist() == [1, 2, 3, 4]
    assert len(placements) == step  # table and accumulators: one placement
    for name, variable in variables.items():
      after = tpu_harness.stacked_by_hand(variable)
      movies = tpu_harness.logical_by_hand(after, layouts["movies"])
      want = tpu_harness.logical_by_hand(before[name], layouts["movies"])
      want[fresh] = 0.5 if name == "parameters" else ACC
      np.testing.assert_array_equal(movies, want, err_msg=f"{name} step {step}")
      np.testing.assert_array_equal(  # padding columns and the other table untouched
        np.delete(after, _physical(fresh, layouts["movies"], after.shape[0]), axis=0),
        np.delete(before[name], _physical(fresh, layouts["movies"], after.shape[0]), axis=0),
      )
      np.testing.assert_array_equal(
        after[_physical(fresh, layouts["movies"], after.shape[0]), 4:],
        before[name][_physical(fresh, layouts["movies"], after.shape[0]), 4:],
      )


def test_v2_lookup_step_on_remapped_rows_is_sparse_core_without_hash_tables(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  table = E.TableConfig(8, 4, initializer=tf.constant_initializer(0.5), name="movies")
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(
      {"movie": E.FeatureConfig(table, output_shape=[BATCH])},
      optimizer=E.Adagrad(0.3),
      managed_ids={"movies": tpu_embedding.ManagedIds()},
    )
    layer.build({"movie": tf.TensorShape([BATCH])})
    rows = layer.remap({"movie": tf.constant(KEYS[:BATCH], tf.int64)})

  @tf.function
  def step(rows):
    return strategy.run(lambda r: layer(r, remapped=True), args=(rows,))

  with strategy.scope():
    graph = step.get_concrete_function(tf.nest.map_structure(tf.TensorSpec.from_tensor, rows)).graph
  types = [op.type for op in graph.get_operations()]
  assert types.count("XlaSparseDenseMatmulWithStaticBufferSize") == 1
  assert not [t for t in types if "HashTable" in t]


def _physical(rows, layout, stacked_rows):
  n = layout.num_sparse_cores
  return [
    ((r % n + layout.sparse_core_shard_rotation) % n) * (stacked_rows // n)
    + layout.sparse_core_shard_row_offset
    + r // n
    for r in rows
  ]


def test_v2_pipelining_with_managed_ids_is_refused_with_the_reason(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  with strategy.scope():
    with pytest.raises(ValueError, match=r"TPU_V2.*held back one step"):
      tpu_embedding.TPUEmbedding(
        {"movie": E.FeatureConfig(E.TableConfig(8, 4, name="movies"), output_shape=[BATCH])},
        optimizer=E.SGD(0.1),
        pipeline_execution_with_tensor_core=True,
        managed_ids={"movies": tpu_embedding.ManagedIds()},
      )


def test_keras3_layer_on_v1_defers_resets_as_the_tf_keras_layer(monkeypatch):
  strategy, recorded, layer = _v1_layer(monkeypatch, every=2, layer_class=keras3.TPUEmbedding)
  variables = layer.variables_by_table["movies"]
  before = _train_tpu_memory(variables, 0)
  with strategy.scope():
    first = layer.remap({"movie": tf.constant([5, 6], tf.int64)})["movie"]
    second = layer.remap({"movie": tf.constant([5, 7], tf.int64)})["movie"]
  assert first.numpy().tolist() == [0, 0] and second.numpy().tolist() == [1, 3]
  want = before["parameters"].copy()
  want[[1, 2, 3]] = INIT[[1, 2, 3]]
  np.testing.assert_array_equal(variables["parameters"].numpy(), want)


@pytest.mark.parametrize(
  "layer_class",
  [tpu_embedding.PartialTPUEmbedding, keras3.PartialTPUEmbedding],
  ids=["tf_keras", "keras3"],
)
def test_partial_layer_on_v1_resets_each_side_where_it_lives(monkeypatch, layer_class):
  strategy, recorded = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1)
  small = E.TableConfig(4, DIM, initializer=tf.constant_initializer(0.25), name="small")
  features = dict(_features(), genre=E.FeatureConfig(small, name="genre"))
  with strategy.scope():
    layer = layer_class(
      features,
      optimizer=E.Adagrad(0.3, initial_accumulator_value=ACC),
      size_threshold=5,
      managed_ids={
        "movies": tpu_embedding.ManagedIds(reset_every_steps=2),
        "small": tpu_embedding.ManagedIds(),
      },
    )
    layer.build({"movie": tf.TensorShape([BATCH]), "genre": tf.TensorShape([BATCH])})
  assert (layer.side("movies"), layer.side("small")) == ("sharded", "replicated")
  variables = layer.variables_by_table
  movies = _train_tpu_memory(variables["movies"], 0)
  small = _train_tpu_memory(variables["small"], 0)
  loads = recorded.loads
  with strategy.scope():
    rows = layer.remap({"movie": tf.constant([5, 6], tf.int64), "genre": tf.constant([8, 9])})
  # The replicated table (TensorCore memory) is reset at once; the sharded one waits.
  assert rows["genre"].numpy().tolist() == [1, 2] and rows["movie"].numpy().tolist() == [0, 0]
  want = small["parameters"].copy()
  want[[1, 2]] = 0.25
  np.testing.assert_array_equal(variables["small"]["parameters"].numpy(), want)
  np.testing.assert_array_equal(variables["movies"]["parameters"].numpy(), movies["parameters"])
  assert recorded.loads == loads
  with strategy.scope():
    rows = layer.remap({"movie": tf.constant([6, 5], tf.int64), "genre": tf.constant([9, 8])})
  assert rows["movie"].numpy().tolist() == [2, 1] and recorded.loads == loads + 1
  want = movies["parameters"].copy()
  want[[1, 2]] = INIT[[1, 2]]
  np.testing.assert_array_equal(variables["movies"]["parameters"].numpy(), want)
  np.testing.assert_array_equal(
    variables["movies"]["accumulators"].numpy()[[1, 2]], np.float32(ACC)
  )


def test_v1_ragged_and_sparse_rows_read_row_0_while_they_wait(monkeypatch):
  strategy, recorded, layer = _v1_layer(monkeypatch, every=2)
  ragged = tf.RaggedTensor.from_row_lengths(tf.constant([5, 6, 5, 7], tf.int64), [1, 3])
  sparse = tf.sparse.from_dense(tf.constant([[8, 0], [5, 9]], tf.int64))
  with strategy.scope():
    first = layer.remap({"movie": ragged})["movie"]
    second = layer.remap({"movie": sparse})["movie"]
  assert first.to_list() == [[0], [0, 0, 0]]  # rows 1, 2, 3 wait (remap 1 of every 2)
  assert isinstance(second, tf.SparseTensor)
  assert second.values.numpy().tolist() == [4, 1, 5]  # remap 2 flushed rows 1..5


def test_v1_rows_given_before_the_tables_exist_need_no_reset(monkeypatch):
  strategy, recorded = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1)
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(
      _features(),
      optimizer=E.Adagrad(0.3, initial_accumulator_value=ACC),
      managed_ids={"movies": tpu_embedding.ManagedIds(reset_every_steps=5)},
    )
    rows = layer.remap({"movie": tf.constant([5, 6], tf.int64)})["movie"]
    assert rows.numpy().tolist() == [1, 2] and recorded.loads == 0
    layer.build({"movie": tf.TensorShape([BATCH])})  # fresh tables, loaded once
  np.testing.assert_array_equal(layer.variables_by_table["movies"]["parameters"].numpy(), INIT)
  assert recorded.loads == 1


def test_v1_flushes_between_remaps_leave_the_reset_every_steps_count_alone(monkeypatch):
  """`reset_every_steps` counts training remaps only: a flush in between (`layer.flush()`, a
  save) writes what waits but does not move the next flush."""
  strategy, recorded, layer = _v1_layer(monkeypatch, every=3)
  with strategy.scope():
    layer.remap({"movie": tf.constant([5], tf.int64)})  # remap 1: row 1 waits
    layer.flush()
    loads = recorded.loads
    second = layer.remap({"movie": tf.constant([6], tf.int64)})["movie"]  # remap 2: waits
    assert second.numpy().tolist() == [0] and recorded.loads == loads
    third = layer.remap({"movie": tf.constant([6, 7], tf.int64)})["movie"]  # remap 3: flush
  assert third.numpy().tolist() == [2, 3] and recorded.loads == loads + 1


def test_v1_plain_saved_model_save_applies_waiting_resets(monkeypatch, tmp_path):
  """`tf.saved_model.save` (not only `export_for_serving`) resets the waiting rows first, so the
  SavedModel never holds a key on a row still holding its previous key's values."""
  _, recorded, layer, variables, before = _rows_1_and_2_waiting(monkeypatch)
  loads = recorded.loads
  module = tf.Module()
  module.layer = layer
  tf.saved_model.save(module, str(tmp_path / "saved"))
  assert recorded.loads == loads + 1
  want = before["parameters"].copy()
  want[[1, 2]] = INIT[[1, 2]]
  np.testing.assert_array_equal(variables["parameters"].numpy(), want)
  want_slot = before["accumulators"].copy()
  want_slot[[1, 2]] = ACC
  np.testing.assert_array_equal(variables["accumulators"].numpy(), want_slot)
  saved = tf.train.load_checkpoint(str(tmp_path / "saved" / "variables" / "variables"))
  held = [
    saved.get_tensor(n)
    for n, s in saved.get_variable_to_shape_map().items()
    if s == [CAPACITY, DIM] and "movies" in n and "accumulators" not in n
  ]
  assert held and all(np.array_equal(h, want) for h in held)


def test_v1_flush_cost_is_one_retrieve_and_one_load_of_every_table(monkeypatch):
  """What docs/managed-ids.md says a flush costs, counted in the graphs TF's own class builds:
  one Retrieve and one Load op per table of the layer (managed or not), each moving the table
  and its slots: (1 + slots) * vocabulary_size * dim * 4 bytes out and the same back."""
  strategy, recorded = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1)
  other = E.TableConfig(5, 3, name="genres")
  features = dict(_features(), genre=E.FeatureConfig(other, name="genre"))
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(
      features,
      optimizer=E.Adagrad(0.3),
      managed_ids={"movies": tpu_embedding.ManagedIds()},
    )
    layer.build({"movie": tf.TensorShape([BATCH]), "genre": tf.TensorShape([BATCH])})
    built = len(recorded.graphs)
    layer.remap({"movie": tf.constant([5, 6, 5], tf.int64), "genre": tf.constant([1, 2, 3])})
  flush = recorded.graphs[built:]
  assert [kind for kind, _ in flush] == ["retrieves", "loads"]
  ops = {
    kind: [op for op in graph.get_operations() if "TPUEmbedding" in op.type]
    for kind, graph in flush
  }
  assert sorted(op.type for op in ops["retrieves"]) == ["RetrieveTPUEmbeddingAdagradParameters"] * 2
  assert sorted(op.type for op in ops["loads"]) == ["LoadTPUEmbeddingAdagradParameters"] * 2
  loaded = {
    op.get_attr("table_name").decode(): sum(4 * i.shape.num_elements() for i in op.inputs)
    for op in ops["loads"]
  }
  assert loaded == {"movies": 2 * CAPACITY * DIM * 4, "genres": 2 * 5 * 3 * 4}
  assert [len(op.outputs) for op in ops["retrieves"]] == [2, 2]  # table and accumulators


def test_v1_training_remap_between_a_restore_before_build_and_build_is_refused(
  monkeypatch, tmp_path
):
  """A restore into an unbuilt layer writes the tables only as `build` creates them, over any
  row a training remap gave meanwhile: that remap is refused, naming the layer and the remedy,
  and changes nothing. Once built, the remap gives the restored map's rows (as the reference
  map does), reset before any step reads them; every other row keeps the checkpoint's."""
  strategy, _, saved, variables, _ = _rows_1_and_2_waiting(monkeypatch)
  path = tf.train.Checkpoint(layer=saved).write(str(tmp_path / "ckpt"))  # flushes rows 1, 2
  trained = {name: v.numpy().copy() for name, v in variables.items()}
  reference = ReferenceMap(CAPACITY, "lru")
  reference.train([5, 6, 5])
  restored_map = tuple(reference.export())
  want_rows, given = reference.train([101, 102, 5])
  assert given == [3, 4] and trained["parameters"][given].min() >= 100  # trained rows
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(
      _features(),
      optimizer=E.Adagrad(0.3, initial_accumulator_value=ACC),
      managed_ids={"movies": tpu_embedding.ManagedIds(eviction="lru", reset_every_steps=5)},
    )
    tf.train.Checkpoint(layer=layer).restore(path)
    with pytest.raises(ValueError, match=rf"layer {layer.name!r} before its tables.*Build the"):
      layer.remap({"movie": tf.constant([101, 102, 5], tf.int64)})
    export = tuple(t.numpy().tolist() for t in layer.managed_ids["movies"].export())
    assert export == restored_map  # nothing changed
    layer.build({"movie": tf.TensorShape([BATCH])})
    rows = layer.remap({"movie": tf.constant([101, 102, 5], tf.int64)})["movie"]
    assert rows.numpy().tolist() == [0, 0, 1]  # the given rows wait for their reset
    layer.flush()
    rows = layer.remap({"movie": tf.constant([101, 102, 5], tf.int64)}, training=False)
  assert rows["movie"].numpy().tolist() == want_rows
  keys, rows, counts = (t.numpy().tolist() for t in layer.managed_ids["movies"].export())
  assert (keys, rows, counts) == tuple(reference.export())
  got = layer.variables_by_table["movies"]
  want_table, want_slot = trained["parameters"].copy(), trained["accumulators"].copy()
  want_table[given], want_slot[given] = INIT[given], ACC
  np.testing.assert_array_equal(got["parameters"].numpy(), want_table)
  np.testing.assert_array_equal(got["accumulators"].numpy(), want_slot)
