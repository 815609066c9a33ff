"""Tests for tpu_embedding.PartialTPUEmbedding: small tables replicated, large ones sharded.

Expected activations and updates are computed here with NumPy from the tables' known initial
values, never read back from the code under test. The TPU tests at the end are wiring tests: no
TPU is available, so the hardware seam is patched and TensorFlow's mid-level class is replaced
by a recording fake; they check what is handed to whom, not TPU execution.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding
from tpu_embedding import hardware
from tpu_embedding.partial import PartialTPUEmbedding, ReplicatedTable

import tpu_harness

emb = tf.tpu.experimental.embedding


def values(vocab, dim, offset=0.0):
  """A table whose row r is offset + [r*dim, ..., r*dim + dim - 1] / 10 (exact in float32)."""
  return (offset + np.arange(vocab * dim, dtype=np.float32).reshape(vocab, dim) / 8).astype(
    np.float32
  )


def table(vocab, dim, name=None, combiner="mean", optimizer=None, offset=0.0):
  return emb.TableConfig(
    vocab,
    dim,
    initializer=tf.constant_initializer(values(vocab, dim, offset)),
    combiner=combiner,
    name=name,
    optimizer=optimizer,
  )


# ---------------------------------------------------------------------------------------------
# The tf-recommenders cases: vocabularies 5, 20, 8, 9, 15 with dims 2, 4, 6, 8, 10.

VOCABS = [5, 20, 8, 9, 15]
DIMS = [2, 4, 6, 8, 10]
SCALAR_IDS = {"0": 4, "1": 10, "2": 6, "3": 8, "4": 0}


def upstream_config():
  return {
    str(i): emb.FeatureConfig(table(v, d, name=f"table_{i}"))
    for i, (v, d) in enumerate(zip(VOCABS, DIMS))
  }


def check_scalar_lookup(layer):
  output = layer(SCALAR_IDS)
  assert sorted(output) == sorted(SCALAR_IDS)
  for key, ids in SCALAR_IDS.items():
    i = int(key)
    assert output[key].shape == (DIMS[i],)
    np.testing.assert_array_equal(output[key].numpy(), values(VOCABS[i], DIMS[i])[ids])


def test_threshold_10_shards_the_two_tables_above_it():
  layer = PartialTPUEmbedding(
    upstream_config(), tf_keras.optimizers.legacy.Adam(), size_threshold=10
  )
  sharded = layer.tpu_embedding.embedding_tables
  assert sorted((t.name, t.vocabulary_size, t.dim) for t in sharded) == [
    ("table_1", 20, 4),
    ("table_4", 15, 10),
  ]
  replicated = layer.keras_embedding_layers
  assert sorted(replicated) == ["0", "2", "3"]
  assert [(replicated[k].input_dim, replicated[k].output_dim) for k in ("0", "2", "3")] == [
    (5, 2),
    (8, 6),
    (9, 8),
  ]
  assert all(isinstance(r, ReplicatedTable) for r in replicated.values())
  check_scalar_lookup(layer)


def test_threshold_none_replicates_every_table():
  layer = PartialTPUEmbedding(
    upstream_config(), tf_keras.optimizers.legacy.Adam(), size_threshold=None
  )
  assert layer.tpu_embedding is None
  assert len(layer.keras_embedding_layers) == 5
  check_scalar_lookup(layer)


@pytest.mark.parametrize("pipelining", [False, True])
def test_threshold_0_shards_every_table(pipelining):
  layer = PartialTPUEmbedding(
    upstream_config(),
    tf_keras.optimizers.legacy.Adam(),
    pipeline_execution_with_tensor_core=pipelining,
    size_threshold=0,
  )
  assert len(layer.tpu_embedding.embedding_tables) == 5
  assert layer.keras_embedding_layers == {}
  check_scalar_lookup(layer)


def test_threshold_must_be_a_non_negative_int_or_none():
  for bad in (-1, 2.5, True, "10"):
    with pytest.raises(ValueError, match="size_threshold"):
      PartialTPUEmbedding(upstream_config(), "sgd", size_threshold=bad)


def test_exported_from_the_package():
  assert tpu_embedding.PartialTPUEmbedding is PartialTPUEmbedding
  assert "PartialTPUEmbedding" in tpu_embedding.__all__


# ---------------------------------------------------------------------------------------------
# Nested configs, shared tables, sequence features, weights


def test_a_flat_dict_of_outputs_lists_replicated_features_first_as_tfrs_does():
  """tfrs's `PartialTPUEmbedding.call` fills its output with the Keras-embedding (replicated)
  features, then the TPU (sharded) ones; `outputs.values()` must give the same columns."""
  layer = PartialTPUEmbedding(upstream_config(), "sgd", size_threshold=10)  # 1 and 4 sharded
  features = {key: tf.constant([SCALAR_IDS[key]]) for key in ["4", "1", "0", "3", "2"]}
  out = layer(features)
  assert list(out) == ["0", "3", "2", "4", "1"]  # replicated in input order, then sharded
  for key, ids in features.items():
    i = int(key)
    np.testing.assert_array_equal(out[key].numpy(), values(VOCABS[i], DIMS[i])[ids.numpy()])


def test_nested_config_keeps_its_structure_and_shared_tables_stay_together():
  big = table(30, 2, name="big")  # 30 > 10: sharded, shared by two features
  small = table(4, 3, name="small")  # replicated
  seq = table(6, 2, name="seq")  # replicated sequence feature
  config = {
    "user": {"id": emb.FeatureConfig(big), "country": emb.FeatureConfig(small)},
    "items": [emb.FeatureConfig(big), emb.FeatureConfig(seq, max_sequence_length=3)],
  }
  layer = PartialTPUEmbedding(config, "sgd", size_threshold=10)
  assert (layer.side("big"), layer.side(small), layer.side("seq")) == (
    "sharded",
    "replicated",
    "replicated",
  )
  placement = layer.placement()
  assert placement["big"].features == ("items/0", "user/id")

  features = {
    "user": {"id": tf.constant([29, 3]), "country": tf.constant([[1], [2]])},
    "items": [tf.constant([0, 29]), tf.ragged.constant([[5, 1, 2, 4], [3]], dtype=tf.int64)],
  }
  out = layer(features)
  assert isinstance(out, dict) and isinstance(out["items"], list)
  assert sorted(out) == ["items", "user"] and sorted(out["user"]) == ["country", "id"]
  vb, vs, vq = values(30, 2), values(4, 3), values(6, 2)
  np.testing.assert_array_equal(out["user"]["id"].numpy(), vb[[29, 3]])
  np.testing.assert_array_equal(out["user"]["country"].numpy(), vs[[1, 2]])
  np.testing.assert_array_equal(out["items"][0].numpy(), vb[[0, 29]])
  expected_seq = np.zeros([2, 3, 2], np.float32)  # truncated to 3 positions, missing are zero
  expected_seq[0] = vq[[5, 1, 2]]
  expected_seq[1, 0] = vq[3]
  np.testing.assert_array_equal(out["items"][1].numpy(), expected_seq)


def weighted_rows(table_values, ids_per_row, weights_per_row, combiner):
  out = []
  for ids, ws in zip(ids_per_row, weights_per_row):
    ws = np.asarray(ws, np.float64)
    total = (table_values[ids].astype(np.float64) * ws[:, None]).sum(0)
    scale = {"sum": 1.0, "mean": 1 / ws.sum(), "sqrtn": 1 / math.sqrt((ws**2).sum())}[combiner]
    out.append(total * scale)
  return np.array(out, np.float32)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_ragged_and_sparse_inputs_with_weights_on_replicated_tables(combiner):
  small = table(7, 2, name="small", combiner=combiner)
  config = {"r": emb.FeatureConfig(small), "s": emb.FeatureConfig(small)}
  layer = PartialTPUEmbedding(config, emb.SGD(learning_rate=0.5), size_threshold=None)
  ids = [[1, 3, 3], [6]]
  ws = [[2.0, 0.5, 1.0], [0.25]]
  ragged = tf.ragged.constant(ids, dtype=tf.int64)
  ragged_w = tf.ragged.constant(ws, dtype=tf.float32)
  sparse = tf.sparse.SparseTensor([[0, 0], [0, 1], [0, 2], [1, 0]], [1, 3, 3, 6], [2, 4])
  sparse_w = tf.sparse.SparseTensor(sparse.indices, [2.0, 0.5, 1.0, 0.25], [2, 4])
  upstream = np.array([[1.0, -1.0], [0.5, 2.0]], np.float32)
  with tf.GradientTape() as tape:
    out = layer({"r": ragged, "s": sparse}, weights={"r": ragged_w, "s": sparse_w})
    loss = tf.reduce_sum(out["r"] * upstream) + tf.reduce_sum(out["s"] * upstream)
  tape.gradient(loss, layer.trainable_variables)

  w0 = values(7, 2)
  expected = weighted_rows(w0, ids, ws, combiner)
  np.testing.assert_allclose(out["r"].numpy(), expected, rtol=1e-6)
  np.testing.assert_allclose(out["s"].numpy(), expected, rtol=1e-6)
  # Both features share the table: each occurrence adds gain x upstream, twice (r and s), then
  # one SGD step with learning rate 0.5 on the touched rows only.
  grad = np.zeros_like(w0, np.float64)
  for row, (row_ids, row_ws) in enumerate(zip(ids, ws)):
    row_ws = np.asarray(row_ws)
    scale = {"sum": 1.0, "mean": 1 / row_ws.sum(), "sqrtn": 1 / math.sqrt((row_ws**2).sum())}[
      combiner
    ]
    for i, w in zip(row_ids, row_ws):
      grad[i] += 2 * scale * w * upstream[row]
  np.testing.assert_allclose(layer.embedding_tables[small].numpy(), w0 - 0.5 * grad, rtol=1e-6)


def test_replicated_tables_are_not_trained_by_the_dense_optimizer():
  layer = PartialTPUEmbedding(
    {"a": emb.FeatureConfig(table(4, 2, name="a"))}, "adagrad", size_threshold=None
  )
  layer({"a": tf.constant([1])})
  (trap,) = layer.trainable_variables  # only the gradient trap; the table is not trainable
  assert trap.name.endswith("partial_embedding_helper_dummy:0")


# ---------------------------------------------------------------------------------------------
# Parity with TPUEmbedding


def parity_config(own_optimizer):
  shared = table(6, 3, name="shared", combiner="sum")
  config = {
    "r": emb.FeatureConfig(shared),
    "s": emb.FeatureConfig(shared),
    "q": emb.FeatureConfig(table(7, 2, name="q", combiner="sqrtn", optimizer=own_optimizer)),
    "seq": emb.FeatureConfig(table(5, 2, name="seq"), max_sequence_length=3),
    "shaped": emb.FeatureConfig(table(8, 2, name="shaped"), output_shape=[2, 3]),
    "big": {
      "d": emb.FeatureConfig(table(40, 4, name="big", offset=1.0)),
      "w": emb.FeatureConfig(table(50, 2, name="big_w", combiner="sqrtn")),
    },
  }
  return config


def parity_batches():
  batches = []
  for step in range(2):
    r = tf.ragged.constant([[1, 3, 3], [5 - step]], dtype=tf.int64)
    s = tf.sparse.SparseTensor([[0, 0], [1, 0], [1, 2]], [2, 1 + step, 4], [2, 3])
    q = tf.ragged.constant([[0, 6], [2, 2, 1]], dtype=tf.int64)
    seq = tf.ragged.constant([[4, 0, 1, 2], [3 - step]], dtype=tf.int64)
    shaped = tf.ragged.constant([[7, 1], [0, 2, 3, 5]], dtype=tf.int64)
    d = tf.constant([[39], [step]])
    w = tf.sparse.SparseTensor([[0, 1], [1, 0], [1, 1]], [49, 7, 7 + step], [2, 2])
    weights = {
      "r": tf.ragged.constant([[0.5, 2.0, 1.0], [3.0]]),
      "s": tf.sparse.SparseTensor(s.indices, [1.5, 0.25, 2.0], s.dense_shape),
      "q": tf.ragged.constant([[1.0, 2.0], [0.5, 0.5, 4.0]]),
      "seq": None,
      "shaped": None,
      "big": {"d": None, "w": tf.sparse.SparseTensor(w.indices, [2.0, 1.0, 3.0], [2, 2])},
    }
    features = {"r": r, "s": s, "q": q, "seq": seq, "shaped": shaped, "big": {"d": d, "w": w}}
    batches.append((features, weights))
  return batches


def train_step(layer, features, weights):
  with tf.GradientTape() as tape:
    out = layer(features, weights=weights)
    flat = tf.nest.flatten(out)
    loss = sum(
      tf.reduce_sum(
        o * (i + 1.0) * tf.reshape(tf.cast(tf.range(tf.size(o)), tf.float32), tf.shape(o))
      )
      / 16.0
      for i, o in enumerate(flat)
    )
  tape.gradient(loss, layer.trainable_variables)
  return [o.numpy() for o in flat]


def slots_by_table(variables):
  return {(t, k): v.numpy() for t, vs in variables.items() for k, v in vs.items()}


@pytest.mark.parametrize(
  "make_optimizer",
  [lambda: emb.SGD(learning_rate=0.25), lambda: emb.Adagrad(learning_rate=0.25)],
  ids=["sgd", "adagrad"],
)
@pytest.mark.parametrize("threshold", [10, None, 0])
def test_parity_with_tpu_embedding_after_two_steps(make_optimizer, threshold):
  partial = PartialTPUEmbedding(
    parity_config(emb.SGD(learning_rate=0.125)), make_optimizer(), size_threshold=threshold
  )
  reference = tpu_embedding.TPUEmbedding(
    parity_config(emb.SGD(learning_rate=0.125)), make_optimizer()
  )
  if threshold == 10:
    assert {t: partial.side(t) for t in ("shared", "q", "seq", "shaped", "big", "big_w")} == {
      "shared": "replicated",
      "q": "replicated",
      "seq": "replicated",
      "shaped": "replicated",
      "big": "sharded",
      "big_w": "sharded",
    }
  for features, weights in parity_batches():
    got = train_step(partial, features, weights)
    want = train_step(reference, features, weights)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)
  partial_state = slots_by_table(partial.variables_by_table)
  reference_state = slots_by_table(reference.variables_by_table)
  assert sorted(partial_state) == sorted(reference_state)
  for key, value in reference_state.items():
    np.testing.assert_array_equal(partial_state[key], value, err_msg=str(key))
  # The tables did move: the first step's gradient reached every table.
  for user_table, variable in partial.embedding_tables.items():
    assert not np.array_equal(
      variable.numpy(),
      values(user_table.vocabulary_size, user_table.dim, 1.0 if user_table.name == "big" else 0.0),
    ), user_table.name


# ---------------------------------------------------------------------------------------------
# Placement report


def test_placement_reports_sides_and_bytes():
  config = {
    "a": emb.FeatureConfig(table(5, 2, name="a")),  # Adam: m, v slots
    "b": emb.FeatureConfig(table(20, 4, name="b", optimizer=emb.SGD(0.1))),  # no slots
    "c": emb.FeatureConfig(table(15, 10, name="c", optimizer=emb.Adagrad(0.1))),  # one slot
  }
  layer = PartialTPUEmbedding(config, emb.Adam(0.1), size_threshold=10)
  report = layer.placement(num_replicas=4)
  by_name = {t.table: t for t in report.tables}
  # a: replicated, 5 rows x 2 x 4 B x (table + 2 slots) = 120 B, whole on each device.
  assert (by_name["a"].side, by_name["a"].slots) == ("replicated", ("momenta", "velocities"))
  assert (by_name["a"].bytes, by_name["a"].bytes_per_device) == (120, 120)
  # b: sharded, 20 x 4 x 4 B = 320 B; ceil(20 / 4) = 5 rows per device = 80 B.
  assert (by_name["b"].side, by_name["b"].bytes, by_name["b"].bytes_per_device) == (
    "sharded",
    320,
    80,
  )
  # c: sharded, 15 x 10 x 4 B x 2 = 1200 B; ceil(15 / 4) = 4 rows x 80 B = 320 B.
  assert (by_name["c"].bytes, by_name["c"].bytes_per_device) == (1200, 320)
  assert report.bytes_per_device("replicated") == 120
  assert report.bytes_per_device("sharded") == 400
  assert report.bytes_per_device() == 520
  text = str(report)
  assert "4 replica(s)" in text and "momenta,velocities" in text
  assert "replicated 120 B + sharded 400 B = 520 B" in text
  # One replica: a sharded table is whole on its one device.
  assert layer.placement()["c"].bytes_per_device == 1200
  with pytest.raises(ValueError, match="num_replicas"):
    layer.placement(0)


# ---------------------------------------------------------------------------------------------
# Checkpoints across thresholds


def ckpt_config(a_rows=5, with_c=True, offset=0.0):
  config = {
    "a": emb.FeatureConfig(table(a_rows, 2, name="a", offset=offset)),
    "b": emb.FeatureConfig(table(20, 3, name="b", offset=offset)),
  }
  if with_c:
    config["c"] = emb.FeatureConfig(table(12, 2, offset=offset))  # unnamed: "table_2"
  return config


def ckpt_features():
  return {"a": tf.constant([1, 4]), "b": tf.constant([19, 2]), "c": tf.constant([11, 11])}


def trained_layer(threshold, optimizer):
  layer = PartialTPUEmbedding(ckpt_config(), optimizer, size_threshold=threshold)
  with tf.GradientTape() as tape:
    out = layer(ckpt_features())
    loss = sum(tf.reduce_sum(o * o) for o in tf.nest.flatten(out))
  tape.gradient(loss, layer.trainable_variables)
  return layer


@pytest.mark.parametrize("pipelining", [False, True])
def test_checkpoint_written_with_threshold_0_restores_under_none_and_10(tmp_path, pipelining):
  saved = trained_layer(0, emb.Adagrad(0.5)) if not pipelining else None
  if pipelining:
    saved = PartialTPUEmbedding(
      ckpt_config(), emb.Adagrad(0.5), size_threshold=0, pipeline_execution_with_tensor_core=True
    )
    with tf.GradientTape() as tape:
      loss = sum(tf.reduce_sum(o * o) for o in tf.nest.flatten(saved(ckpt_features())))
    tape.gradient(loss, saved.trainable_variables)  # held back until the save flushes it
  path = tf.train.Checkpoint(embedding=saved).save(str(tmp_path / "ckpt"))
  keys = {name for name, _ in tf.train.list_variables(path)}
  for name in ("a", "b", "table_2"):
    assert f"embedding/_tpu_embedding/{name}/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert f"embedding/_tpu_embedding/{name}.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE" in keys
  expected = slots_by_table(saved.variables_by_table)
  assert not np.array_equal(expected[("a", "accumulators")], np.full([5, 2], 0.1, np.float32))

  for threshold in (None, 10):
    restored = PartialTPUEmbedding(ckpt_config(), emb.Adagrad(0.5), size_threshold=threshold)
    tf.train.Checkpoint(embedding=restored).restore(path).assert_consumed()
    got = slots_by_table(restored.variables_by_table)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
      np.testing.assert_array_equal(got[key], value, err_msg=f"{threshold} {key}")


def test_checkpoint_restores_back_and_interoperates_with_tpu_embedding(tmp_path):
  saved = trained_layer(10, emb.Adagrad(0.5))
  path = tf.train.Checkpoint(embedding=saved).save(str(tmp_path / "partial"))
  expected = slots_by_table(saved.variables_by_table)
  # Into every table sharded...
  restored = PartialTPUEmbedding(ckpt_config(), emb.Adagrad(0.5), size_threshold=0)
  tf.train.Checkpoint(embedding=restored).restore(path).assert_consumed()
  for key, value in slots_by_table(restored.variables_by_table).items():
    np.testing.assert_array_equal(value, expected[key], err_msg=str(key))
  # ...and into a plain TPUEmbedding, which uses the same names.
  plain = tpu_embedding.TPUEmbedding(ckpt_config(), emb.Adagrad(0.5))
  plain(ckpt_features())
  tf.train.Checkpoint(embedding=plain).restore(path).assert_existing_objects_matched()
  for key, value in slots_by_table(plain.variables_by_table).items():
    np.testing.assert_array_equal(value, expected[key], err_msg=str(key))


def assert_refused_and_unchanged(path, layer, *messages):
  before = slots_by_table(layer.variables_by_table)
  with pytest.raises(ValueError) as error:
    tf.train.Checkpoint(embedding=layer).restore(path)
  assert "into this PartialTPUEmbedding layer" in str(error.value)
  for message in messages:
    assert message in str(error.value)
  after = slots_by_table(layer.variables_by_table)
  assert sorted(after) == sorted(before)
  for key, value in before.items():
    np.testing.assert_array_equal(after[key], value, err_msg=str(key))


def test_restore_of_a_small_table_of_another_shape_is_refused_and_changes_nothing(tmp_path):
  """Threshold 10: `a` replicated, `b` and `table_2` sharded; TF alone would assign `b` before
  failing on `a`."""
  saved = PartialTPUEmbedding(
    ckpt_config(a_rows=5, offset=1.0), emb.Adagrad(0.5), size_threshold=10
  )
  path = tf.train.Checkpoint(embedding=saved).save(str(tmp_path / "five_rows"))
  layer = PartialTPUEmbedding(ckpt_config(a_rows=6), emb.Adagrad(0.5), size_threshold=10)
  assert_refused_and_unchanged(
    path, layer, "table 'a' has shape [6, 2] in this layer but [5, 2] in the checkpoint"
  )
  np.testing.assert_array_equal(layer.variables_by_table["b"]["parameters"].numpy(), values(20, 3))


def test_restore_of_a_checkpoint_missing_a_table_is_refused_by_name(tmp_path):
  saved = PartialTPUEmbedding(
    ckpt_config(with_c=False, offset=1.0), emb.Adagrad(0.5), size_threshold=10
  )
  path = tf.train.Checkpoint(embedding=saved).save(str(tmp_path / "no_c"))
  layer = PartialTPUEmbedding(ckpt_config(), emb.Adagrad(0.5), size_threshold=10)
  assert_refused_and_unchanged(
    path,
    layer,
    "table 'table_2' (shape [12, 2] in this layer) is missing from the checkpoint",
    "slot 'table_2/accumulators' of table 'table_2'",
  )


# ---------------------------------------------------------------------------------------------
# table_updates="keras": tf-recommenders' behaviour, replicated side included


@pytest.mark.parametrize("threshold", [None, 10, 0])  # all replicated, both sides, all sharded
def test_keras_mode_tables_are_trainable_variables_with_keras_slots(threshold):
  small = table(8, 4, name="small")  # shared by two features: one variable
  large = table(30, 2, name="large", offset=1.0)
  config = {
    "a": emb.FeatureConfig(small),
    "b": emb.FeatureConfig(small),
    "c": emb.FeatureConfig(large),
  }
  optimizer = tf_keras.optimizers.legacy.Adagrad(0.5, initial_accumulator_value=0.1)
  layer = PartialTPUEmbedding(config, optimizer, size_threshold=threshold, table_updates="keras")
  ids = {"a": [0, 3], "b": [3, 7], "c": [29, 29]}
  with tf.GradientTape() as tape:
    out = layer({k: tf.constant(v) for k, v in ids.items()})
    loss = sum(tf.reduce_sum(o * o) for o in out.values())
  variables = layer.trainable_variables
  assert sorted(tuple(v.shape) for v in variables) == [(8, 4), (30, 2)]
  optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

  start = {"small": values(8, 4), "large": values(30, 2, 1.0)}
  grads = {name: np.zeros_like(value) for name, value in start.items()}
  for feature, rows in ids.items():
    name = "large" if feature == "c" else "small"
    for row in rows:
      grads[name][row] += 2 * start[name][row]  # d sum(o * o) / d o
  tables = layer.variables_by_table
  for name, value in start.items():
    accumulator = 0.1 + grads[name] ** 2  # Keras (legacy) Adagrad, untouched rows included
    variable = tables[name]["parameters"]
    assert list(tables[name]) == ["parameters"]  # no engine slots...
    np.testing.assert_allclose(
      optimizer.get_slot(variable, "accumulator").numpy(), accumulator, rtol=1e-6
    )  # ...the Keras optimizer's
    np.testing.assert_allclose(
      variable.numpy(), value - 0.5 * grads[name] / (np.sqrt(accumulator) + 1e-7), rtol=1e-6
    )


# ---------------------------------------------------------------------------------------------
# TPU V1: TF's real TPUEmbedding under tpu_harness.StandInTPUStrategy (runtime stubbed, steps
# traced, nothing runs on a TPU)


@pytest.fixture
def tpu_v1(monkeypatch):
  return tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1)


def _traced_step(layer):
  @tf.function
  def step(features):
    with tf.GradientTape() as tape:
      out = layer(features)
      loss = sum(tf.reduce_sum(o * o) for o in tf.nest.flatten(out))
    return tape.gradient(loss, layer.trainable_variables)

  return step.get_concrete_function(
    tf.nest.map_structure(tf.TensorSpec.from_tensor, ckpt_features())
  ).graph


def test_on_tpu_v1_only_large_tables_go_to_the_embedding_engine(tpu_v1):
  strategy, recorded = tpu_v1
  with strategy.scope():
    layer = PartialTPUEmbedding(ckpt_config(), emb.SGD(learning_rate=0.5), size_threshold=10)
    graph = _traced_step(layer)
  assert layer.tpu_embedding.execution_path is hardware.ExecutionPath.TPU_V1
  (proto,) = recorded.config_protos
  assert [(t.name, t.vocabulary_size) for t in proto.table_descriptor] == [
    ("b", 20),
    ("table_2", 12),
  ]
  assert [f.table_id for f in proto.feature_descriptor] == [0, 1]
  ops = [op.type for op in graph.get_operations()]
  assert ops.count("EnqueueTPUEmbeddingArbitraryTensorBatch") == 1
  assert ops.count("RecvTPUEmbeddingActivations") == 1
  assert ops.count("SendTPUEmbeddingGradients") == 1
  # Failure 2: the sharded side's tables are readable under the TPU strategy.
  tables = {t.name: v for t, v in layer.embedding_tables.items()}
  np.testing.assert_array_equal(tables["b"].numpy(), values(20, 3))
  sharded = {t.name: v for t, v in layer.tpu_embedding.embedding_tables.items()}
  np.testing.assert_array_equal(sharded["b"].numpy(), values(20, 3))


def test_on_tpu_v1_embedding_tables_copies_the_sharded_tables_back_from_the_tpu_first(tpu_v1):
  """As TPUEmbedding.embedding_tables does: the host copies are stale between saves."""
  strategy, recorded = tpu_v1
  with strategy.scope():
    layer = PartialTPUEmbedding(ckpt_config(), emb.SGD(learning_rate=0.5), size_threshold=10)
    _traced_step(layer)
  retrieves = recorded.retrieves
  tables = {t.name: v for t, v in layer.embedding_tables.items()}
  assert recorded.retrieves == retrieves + 1  # one retrieve of the sharded side, before reading
  assert len(tables) == 3  # "a", "b" and the unnamed table (name None in the user's config)
  np.testing.assert_array_equal(tables["a"].numpy(), values(5, 2))  # replicated: no TPU copy
  np.testing.assert_array_equal(tables["b"].numpy(), values(20, 3))


def test_on_tpu_v1_checkpoint_keeps_the_mid_level_object(tpu_v1):
  """TF's TPU save/restore callbacks hang on the mid-level object, so it stays in the
  checkpoint graph, while every table also has its side-free name."""
  strategy, _ = tpu_v1
  with strategy.scope():
    layer = PartialTPUEmbedding(ckpt_config(), emb.SGD(learning_rate=0.5), size_threshold=10)
    _traced_step(layer)
  children = tf.train.TrackableView(layer).children(layer)
  assert "_sharded_embedding" in children
  tables = children["_tpu_embedding"]
  names = set(tf.train.TrackableView(tables).children(tables))
  assert names == {"a", "b", "table_2", "_tpu_embedding"}  # the last: tfrs's names, aliases


def test_batch_size_reaches_the_tpu_build(tpu_v1):
  strategy, recorded = tpu_v1
  with strategy.scope():
    layer = PartialTPUEmbedding(ckpt_config(), emb.SGD(0.5), batch_size=3, size_threshold=10)
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):  # TF checks the batch of 2
      _traced_step(layer)
  (proto,) = recorded.config_protos
  assert [list(f.input_shape) for f in proto.feature_descriptor] == [[3], [3]]


# ---------------------------------------------------------------------------------------------
# TPU V2 (SparseCore): TF's real TPUEmbeddingV2 under tpu_harness.StandInTPUStrategy (runtime
# stubbed, steps traced, nothing runs on a TPU)


def sparse_core_config():
  """`ckpt_config`'s shapes, with what SparseCore needs: an initializer for any (padded) shape,
  and every feature's output shape (a batch of 4, one row per SparseCore)."""
  offsets = {"a": 0.0, "b": 10000.0, "c": 20000.0}
  shapes = {"a": (5, 2), "b": (20, 3), "c": (12, 2)}
  return {
    key: emb.FeatureConfig(
      emb.TableConfig(*shapes[key], name=key, initializer=tpu_harness.pattern(offset)),
      output_shape=[4],
    )
    for key, offset in offsets.items()
  }


def test_on_sparse_core_large_tables_are_stacked_and_read_back_as_logical_tables(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  features = {
    "a": tf.constant([1, 4, 0, 2]),
    "b": tf.constant([19, 2, 3, 0]),
    "c": tf.constant([11, 11, 1, 5]),
  }
  with strategy.scope():
    layer = PartialTPUEmbedding(sparse_core_config(), emb.Adagrad(0.5), size_threshold=10)
    layer.build(tf.nest.map_structure(lambda ids: ids.shape, features))

    @tf.function
    def step(ids):
      return strategy.run(layer, args=(ids,))

    concrete = step.get_concrete_function(
      tf.nest.map_structure(tf.TensorSpec.from_tensor, features)
    )
  assert layer.tpu_embedding.execution_path is hardware.ExecutionPath.TPU_V2
  assert [layer.side(name) for name in "abc"] == ["replicated", "sharded", "sharded"]
  # TF stacks "b" and "c" (one optimizer) into one variable: one SparseCore lookup for both.
  assert set(layer.tpu_embedding.variables_by_table) == {"b_c"}
  ops = [op.type for op in concrete.graph.get_operations()]
  assert ops.count("XlaSparseDenseMatmulWithStaticBufferSize") == 1
  assert {k: v.shape.as_list() for k, v in concrete.structured_outputs.items()} == {
    "a": [4, 2],
    "b": [4, 3],
    "c": [4, 2],
  }
  tables = {t.name: np.asarray(v) for t, v in layer.embedding_tables.items()}
  np.testing.assert_array_equal(tables["a"], tpu_harness.pattern_table(5, 2, 0.0))
  # TF initialises the padded, dealt stack; each table is read back through its layout.
  stacked = tpu_harness.stacked_by_hand(layer.tpu_embedding.variables_by_table["b_c"]["parameters"])
  layouts = layer.tpu_embedding.engine.embedding_layouts
  for name, offset in {"b": 10000.0, "c": 20000.0}.items():
    np.testing.assert_array_equal(
      tables[name], tpu_harness.logical_by_hand(stacked, layouts[name]), err_msg=name
    )
    vocabulary, dim = layouts[name].unsharded_shape
    assert tables[name].shape == (vocabulary, dim), name
    np.testing.assert_array_equal(tables[name] % 100, np.tile(np.arange(dim), (vocabulary, 1)))
    assert ((tables[name] >= offset) & (tables[name] < offset + 10000)).all(), name


SPARSE_CORE_FEATURES = {
  "a": tf.constant([1, 4, 0, 2]),
  "b": tf.constant([19, 2, 3, 0]),
  "c": tf.constant([11, 11, 1, 5]),
}


def sparse_core_partial(strategy, build):
  with strategy.scope():
    layer = PartialTPUEmbedding(sparse_core_config(), emb.Adagrad(0.5), size_threshold=10)
    if build:
      layer.build(tf.nest.map_structure(lambda ids: ids.shape, SPARSE_CORE_FEATURES))
  return layer


def stacked_state(layer):
  return {
    f"{name}/{slot}": tpu_harness.stacked_by_hand(variable)
    for name, slots in layer.tpu_embedding.variables_by_table.items()
    for slot, variable in slots.items()
  }


@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
def test_on_sparse_core_a_per_table_checkpoint_is_refused_and_changes_nothing(
  monkeypatch, tmp_path, built
):
  """The sharded tables are TF's stacked variables: a per-table (CPU/V1) checkpoint's sharded
  tables would silently stay unrestored, built or not."""
  cpu = sparse_core_partial(tf.distribute.get_strategy(), build=True)
  for variable in cpu.embedding_tables.values():
    variable.assign(variable * 2.0 + 7.0)
  path = tf.train.Checkpoint(layer=cpu).write(str(tmp_path / "cpu"))
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  layer = sparse_core_partial(strategy, build=built)
  before = stacked_state(layer) if built else {}
  with pytest.raises(ValueError, match=r"(?s)\['b', 'c'\].*TPU_V2.*per table.*Nothing"):
    tf.train.Checkpoint(layer=layer).read(path)
  with strategy.scope():
    layer.build(tf.nest.map_structure(lambda ids: ids.shape, SPARSE_CORE_FEATURES))
  replicated = {t.name: np.asarray(v) for t, v in layer.embedding_tables.items()}["a"]
  np.testing.assert_array_equal(replicated, tpu_harness.pattern_table(5, 2, 0.0))
  after = stacked_state(layer)
  assert sorted(after) == ["b_c/accumulators", "b_c/parameters"]
  for key, value in (before or after).items():
    np.testing.assert_array_equal(after[key], value, err_msg=key)
  if not built:  # as a fresh layer: TF's initializer, not the checkpoint's values
    want = sparse_core_partial(strategy, build=True)
    for key, value in stacked_state(want).items():
      np.testing.assert_array_equal(after[key], value, err_msg=key)


def test_a_sparse_core_checkpoint_is_refused_off_sparse_core_and_changes_nothing(
  monkeypatch, tmp_path
):
  """Its sharded tables are stacked under stacked names: a CPU layer would keep its own."""
  cpu = sparse_core_partial(tf.distribute.get_strategy(), build=True)
  before = {t.name: np.asarray(v).copy() for t, v in cpu.embedding_tables.items()}
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  saved = sparse_core_partial(strategy, build=True)
  tpu_harness.fill_shards(saved.tpu_embedding.variables_by_table["b_c"].values(), seed=5)
  saved.keras_embedding_layers["a"].embeddings.assign(tpu_harness.pattern_table(5, 2, 50.0))
  path = tf.train.Checkpoint(layer=saved).write(str(tmp_path / "sc"))
  with pytest.raises(ValueError, match=r"(?s)\['b', 'c'\] stacked by SparseCore.*Nothing"):
    tf.train.Checkpoint(layer=cpu).read(path)
  for table, value in cpu.embedding_tables.items():
    np.testing.assert_array_equal(np.asarray(value), before[table.name], err_msg=table.name)


def test_on_sparse_core_its_own_checkpoint_restores(monkeypatch, tmp_path):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V2)
  saved = sparse_core_partial(strategy, build=True)
  tpu_harness.fill_shards(saved.tpu_embedding.variables_by_table["b_c"].values(), seed=3)
  saved.keras_embedding_layers["a"].embeddings.assign(tpu_harness.pattern_table(5, 2, 50.0))
  path = tf.train.Checkpoint(layer=saved).write(str(tmp_path / "sc"))
  layer = sparse_core_partial(strategy, build=True)
  tf.train.Checkpoint(layer=layer).read(path).assert_existing_objects_matched()
  want = {t.name: np.asarray(v) for t, v in saved.embedding_tables.items()}
  for table, value in layer.embedding_tables.items():
    np.testing.assert_array_equal(np.asarray(value), want[table.name], err_msg=table.name)


# ---------------------------------------------------------------------------------------------
# Keras fit, and replicated tables as a strategy's replicated variables


def test_keras_fit_trains_both_sides():
  config = {
    "a": emb.FeatureConfig(table(5, 2, name="a")),
    "b": emb.FeatureConfig(table(20, 2, name="b")),
  }
  inputs = {k: tf_keras.Input(shape=(), dtype=tf.int64, name=k) for k in config}
  layer = PartialTPUEmbedding(config, emb.SGD(0.1), size_threshold=10)
  out = layer(inputs)
  model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(tf.concat([out["a"], out["b"]], 1)))
  model.compile("sgd", "mse")
  model.fit(
    {"a": np.array([1, 2, 3, 4]), "b": np.array([5, 6, 7, 19])},
    np.ones([4, 1]),
    epochs=1,
    verbose=0,
  )
  for user_table, variable in layer.embedding_tables.items():
    before = values(user_table.vocabulary_size, 2)
    assert not np.array_equal(variable.numpy(), before), user_table.name
    np.testing.assert_array_equal(variable.numpy()[0], before[0])  # row 0 never looked up


def test_under_mirrored_strategy_replicated_tables_are_mirrored_and_sum_the_global_batch():
  config = lambda: {
    "a": emb.FeatureConfig(table(5, 2, name="a", combiner="sum")),
    "b": emb.FeatureConfig(table(20, 2, name="b")),
  }
  features = {"a": tf.constant([1, 1, 3, 4]), "b": tf.constant([5, 6, 5, 19])}
  single = PartialTPUEmbedding(config(), emb.Adagrad(0.5), size_threshold=10)
  with tf.GradientTape() as tape:
    loss = sum(tf.reduce_sum(o * o) for o in tf.nest.flatten(single(features)))
  tape.gradient(loss, single.trainable_variables)

  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    mirrored = PartialTPUEmbedding(config(), emb.Adagrad(0.5), size_threshold=10)
  assert isinstance(
    mirrored.keras_embedding_layers["a"].embeddings, tf.distribute.DistributedValues
  )
  dataset = tf.data.Dataset.from_tensor_slices(features).batch(4)
  batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

  @tf.function
  def step(batch):
    def replica_step(x):
      with tf.GradientTape() as tape:
        loss = sum(tf.reduce_sum(o * o) for o in tf.nest.flatten(mirrored(x)))
      tape.gradient(loss, mirrored.trainable_variables)

    strategy.run(replica_step, args=(batch,))

  step(batch)
  want = slots_by_table(single.variables_by_table)
  got = slots_by_table(mirrored.variables_by_table)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=str(key))


def test_sharding_on_a_tpu_without_embedding_hardware_is_refused(monkeypatch):
  strategy, _ = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.UNSUPPORTED)
  with strategy.scope():
    with pytest.raises(ValueError, match=r"(?s)\['b', 'c'\].*size_threshold=None"):
      PartialTPUEmbedding(ckpt_config(), "sgd", size_threshold=10)
    replicated = PartialTPUEmbedding(ckpt_config(), "sgd", size_threshold=None)
  assert replicated.tpu_embedding is None


# ---------------------------------------------------------------------------------------------
# XLA: both sides train under jit_compile (the static-shape engine path), as on a TPU step


def _expected_tables(optimizer, bags_by_table, upstream_by_table, steps):
  """Reference tables and slots after `steps` identical steps, per table name."""
  import reference

  params = reference.params_from_optimizer(optimizer)
  expected = {}
  for name, (vocab, dim, combiner) in {"a": (5, 2, "sum"), "b": (20, 2, "mean")}.items():
    w, slots = values(vocab, dim).astype(np.float64), reference.initial_slots(params, (vocab, dim))
    for _ in range(steps):
      row_ids, grads = reference.assemble_gradients(
        [(ids, None) for ids in bags_by_table[name]], upstream_by_table[name], combiner
      )
      w, slots = reference.apply_step(w, slots, row_ids, grads, optimizer.learning_rate, params)
    expected[name] = {"parameters": w, **slots}
  return expected


def _check_tables(layer, expected):
  variables = layer.variables_by_table
  for name, want in expected.items():
    for key, value in want.items():
      np.testing.assert_allclose(
        variables[name][key].numpy(), value, rtol=1e-5, atol=1e-6, err_msg=f"{name}/{key}"
      )


@pytest.mark.parametrize(
  "optimizer",
  [emb.FTRL(0.5, l2_regularization_strength=0.1), emb.Adam(0.5, lazy_adam=False)],
  ids=["ftrl", "adam"],
)
def test_a_jit_compiled_custom_step_trains_both_sides_like_the_reference(optimizer):
  config = {
    "a": emb.FeatureConfig(table(5, 2, name="a", combiner="sum")),  # replicated
    "b": emb.FeatureConfig(table(20, 2, name="b")),
  }  # sharded
  layer = PartialTPUEmbedding(config, optimizer, size_threshold=10)
  bags = {"a": [[1], [4]], "b": [[5, 5, 19], [0]]}
  upstream = {
    "a": np.array([[1.0, -1.0], [0.5, 2.0]], np.float32),
    "b": np.array([[-2.0, 1.0], [1.0, 0.25]], np.float32),
  }

  @tf.function(jit_compile=True)
  def step(features):
    with tf.GradientTape() as tape:
      out = layer(features)
      loss = sum(tf.reduce_sum(out[k] * upstream[k]) for k in out)
    tape.gradient(loss, layer.trainable_variables)

  for _ in range(2):
    step({"a": tf.constant(bags["a"]), "b": tf.ragged.constant(bags["b"])})
  _check_tables(layer, _expected_tables(optimizer, bags, upstream, 2))


def test_keras_fit_with_jit_compile_trains_both_sides_like_the_reference():
  optimizer = emb.Adagrad(0.5)
  config = {
    "a": emb.FeatureConfig(table(5, 2, name="a", combiner="sum")),
    "b": emb.FeatureConfig(table(20, 2, name="b")),
  }
  layer = PartialTPUEmbedding(config, optimizer, size_threshold=10)
  inputs = {
    "a": tf_keras.Input(shape=(), dtype=tf.int64, sparse=True),
    "b": tf_keras.Input(shape=(None,), dtype=tf.int64, ragged=True),
  }
  out = layer(inputs)
  model = tf_keras.Model(inputs, tf.concat([out["a"], out["b"]], axis=1))
  model.compile(
    tf_keras.optimizers.SGD(0.0), loss=lambda y, a: tf.reduce_sum(y * a, axis=-1), jit_compile=True
  )
  bags = {"a": [[1], [4]], "b": [[5, 5, 19], [0]]}
  x = {
    "a": tf.sparse.SparseTensor([[0], [1]], tf.constant([1, 4], tf.int64), [2]),
    "b": tf.ragged.constant(bags["b"], tf.int64),
  }
  y = np.array([[1.0, -1.0, -2.0, 1.0], [0.5, 2.0, 1.0, 0.25]], np.float32)
  model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(2), verbose=0)
  upstream = {"a": y[:, :2] / 2, "b": y[:, 2:] / 2}  # the loss is a mean over 2 samples
  _check_tables(layer, _expected_tables(optimizer, bags, upstream, 2))
