"""Tests of the TPUEmbedding layer on the CPU path: activations, training, Keras integration and
errors.

Expected values come from NumPy computations on tables with known constant initial values, or
from the hand-worked examples of the semantics spec.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding
from tpu_embedding import hardware

E = tf.tpu.experimental.embedding
# Set in a child process that runs one test of this file on its own.


def row_id_table(rows: int, dim: int) -> np.ndarray:
  """W[r, c] = r * dim + c: every entry distinct, so a wrong row is always visible."""
  return np.arange(rows * dim, dtype=np.float32).reshape(rows, dim)


def table(rows=5, dim=2, combiner="mean", name=None, optimizer=None, values=None):
  values = row_id_table(rows, dim) if values is None else values
  return E.TableConfig(
    vocabulary_size=rows,
    dim=dim,
    combiner=combiner,
    name=name,
    optimizer=optimizer,
    initializer=tf.constant_initializer(values),
  )


def np_combine(values, bags, combiner, weights=None):
  """NumPy reference of a combiner over bags of ids (weights used as given; zero sum -> 0)."""
  out = []
  for i, ids in enumerate(bags):
    w = np.ones(len(ids)) if weights is None else np.asarray(weights[i], np.float64)
    rows = values[np.asarray(ids, int)] if ids else np.zeros((0, values.shape[1]))
    total = (w[:, None] * rows).sum(axis=0) if ids else np.zeros(values.shape[1])
    base = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w**2).sum())}[combiner]
    out.append(total / base if combiner == "sum" or base != 0 else np.zeros(values.shape[1]))
  return np.stack(out)


def sparse(bags, values=None, dtype=tf.int64, width=None):
  indices = [[i, j] for i, bag in enumerate(bags) for j in range(len(bag))]
  flat = [x for bag in bags for x in bag] if values is None else [x for v in values for x in v]
  width = width or max(len(b) for b in bags)
  return tf.SparseTensor(
    tf.constant(indices, tf.int64).numpy().reshape(-1, 2),
    tf.constant(flat, dtype if values is None else tf.float32),
    [len(bags), width],
  )


BAGS = [[1, 3], [], [4, 4, 0], [2]]
WEIGHTS = [[2.0, 0.5], [], [1.0, -0.5, 3.0], [0.0]]  # a negative weight and a zero-sum bag


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("kind", ["sparse", "ragged"])
@pytest.mark.parametrize("weighted", [False, True])
def test_multi_hot_activations_match_numpy(combiner, kind, weighted):
  t = table(combiner=combiner)
  layer = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table=t)}, "sgd")
  if kind == "sparse":
    ids = sparse(BAGS)
    weights = sparse(BAGS, WEIGHTS) if weighted else None
  else:
    ids = tf.ragged.constant(BAGS, dtype=tf.int64)
    weights = tf.ragged.constant(WEIGHTS, dtype=tf.float32) if weighted else None
  out = layer({"f": ids}, weights={"f": weights} if weighted else None)["f"]
  expected = np_combine(row_id_table(5, 2), BAGS, combiner, WEIGHTS if weighted else None)
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_spec_worked_combiner_example():
  """SPEC §3.2: W[1]=[2,3], W[3]=[6,7]; ids [1,3] weights [2,0.5] -> sqrtn
  [3.3954988, 4.6081772]."""
  values = np.array([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]], np.float32)
  expected = {"sum": [7.0, 9.5], "mean": [2.8, 3.8], "sqrtn": [3.3954988, 4.6081772]}
  for combiner, activation in expected.items():
    layer = tpu_embedding.TPUEmbedding(
      E.FeatureConfig(table=table(combiner=combiner, values=values)), "sgd"
    )
    out = layer(tf.ragged.constant([[1, 3]]), weights=tf.ragged.constant([[2.0, 0.5]]))
    np.testing.assert_allclose(out.numpy()[0], activation, rtol=1e-6)


def test_non_positive_weights_same_rule_for_sparse_and_ragged():
  t = table(combiner="mean")
  layer = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table=t)}, "sgd")
  bags, weights = [[1, 2], [3, 4]], [[-1.0, 3.0], [2.0, -2.0]]
  from_sparse = layer({"f": sparse(bags)}, {"f": sparse(bags, weights)})["f"].numpy()
  from_ragged = layer({"f": tf.ragged.constant(bags)}, {"f": tf.ragged.constant(weights)})["f"]
  np.testing.assert_array_equal(from_sparse, from_ragged.numpy())
  # mean with weight sum 2: (-W[1] + 3 W[2]) / 2; weight sum 0: zero activation
  w = row_id_table(5, 2)
  np.testing.assert_allclose(from_sparse[0], (-w[1] + 3 * w[2]) / 2)
  np.testing.assert_array_equal(from_sparse[1], [0.0, 0.0])


@pytest.mark.parametrize(
  "shape,expected_shape",
  [([4], [4, 3]), ([4, 1], [4, 3]), ([4, 2], [4, 2, 3]), ([2, 2, 1], [2, 2, 3])],
)
def test_dense_ids_give_tpu_shapes(shape, expected_shape):
  t = table(rows=8, dim=3)
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=t), "sgd")
  ids = np.arange(int(np.prod(shape))).reshape(shape) % 8
  out = layer(tf.constant(ids, tf.int32))
  assert out.shape == tuple(expected_shape)
  np.testing.assert_array_equal(out.numpy().reshape(-1, 3), row_id_table(8, 3)[ids.reshape(-1)])


def test_sequence_features_spec_example():
  """SPEC §3.5: W[r] = [2r, 2r+1], L = 3; sparse keeps column positions, ragged left-aligns."""
  values = np.array([[2 * r, 2 * r + 1] for r in range(5)], np.float32)
  t = table(values=values, combiner="sum")
  layer = tpu_embedding.TPUEmbedding(
    {
      "s": E.FeatureConfig(table=t, max_sequence_length=3),
      "r": E.FeatureConfig(table=t, max_sequence_length=3),
    },
    "sgd",
  )
  sp = tf.SparseTensor(
    [[0, 0], [0, 2], [1, 0], [1, 3]], tf.constant([1, 3, 4, 2], tf.int64), [2, 4]
  )
  out = layer({"s": sp, "r": tf.ragged.constant([[1, 3, 2, 4], [4]], tf.int64)})
  np.testing.assert_array_equal(
    out["s"].numpy(), [[[2, 3], [0, 0], [6, 7]], [[8, 9], [0, 0], [0, 0]]]
  )
  np.testing.assert_array_equal(
    out["r"].numpy(), [[[2, 3], [6, 7], [4, 5]], [[8, 9], [0, 0], [0, 0]]]
  )


def test_ragged_output_shape_makes_a_sequence_or_reshapes():
  values = np.array([[2 * r, 2 * r + 1] for r in range(5)], np.float32)
  t = table(values=values, combiner="mean")
  ids = tf.ragged.constant([[1, 3, 2, 4], [4]], tf.int64)
  seq = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=t, output_shape=[2, 3]), "sgd")
  np.testing.assert_array_equal(
    seq(ids).numpy(), [[[2, 3], [6, 7], [4, 5]], [[8, 9], [0, 0], [0, 0]]]
  )
  pooled = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=t, output_shape=[2]), "sgd")
  np.testing.assert_array_equal(pooled(ids).numpy(), [[5, 6], [8, 9]])


def test_nested_config_shared_table_and_user_configs_untouched():
  shared = table(rows=6, dim=2, combiner="sum")
  other = table(rows=3, dim=4, combiner="sum")
  config = {
    "a": [E.FeatureConfig(table=shared), {"b": E.FeatureConfig(table=other)}],
    "c": (E.FeatureConfig(table=shared),),
  }
  layer = tpu_embedding.TPUEmbedding(config, E.Adagrad(0.1))
  ids = {"a": [tf.constant([5, 0]), {"b": tf.constant([2, 1])}], "c": (tf.constant([1, 1]),)}
  out = layer(ids)
  np.testing.assert_array_equal(out["a"][0].numpy(), row_id_table(6, 2)[[5, 0]])
  np.testing.assert_array_equal(out["a"][1]["b"].numpy(), row_id_table(3, 4)[[2, 1]])
  np.testing.assert_array_equal(out["c"][0].numpy(), row_id_table(6, 2)[[1, 1]])
  assert shared.name is None and shared.optimizer is None  # never mutated
  assert set(layer.embedding_tables) == {shared, other}
  assert layer.embedding_tables[shared].shape == (6, 2)


def test_default_table_names_follow_first_use():
  first, second = table(name="video"), table()
  layer = tpu_embedding.TPUEmbedding(
    {"a": E.FeatureConfig(table=first), "b": E.FeatureConfig(table=second)}, "sgd"
  )
  layer({"a": tf.constant([1]), "b": tf.constant([1])})
  assert sorted(layer.variables_by_table) == ["table_1", "video"]


# ---------------------------------------------------------------------------------------------
# Training


def _train_step(model_fn, optimizer):
  @tf.function
  def step(ids):
    with tf.GradientTape() as tape:
      loss = model_fn(ids)
    variables = model_fn.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  return step


class Dot(tf_keras.Model):
  """loss = sum over features of <activation, upstream>: activation gradients are `upstream`."""

  def __init__(self, layer, upstream):
    super().__init__()
    self.embedding = layer
    self.upstream = upstream

  def call(self, ids):
    out = self.embedding(ids)
    return sum(tf.reduce_sum(out[k] * self.upstream[k]) for k in sorted(out))


def test_spec_duplicate_ids_example_sgd_and_adagrad():
  """SPEC §2.1: mean combiner, sample 0 ids [1,1] grad [1,0], sample 1 ids [1] grad [0,1]."""
  values = np.array([[0, 0], [2, 3], [0, 0]], np.float32)
  for optimizer, expected in [(E.SGD(0.1), [1.9, 2.9]), (E.Adagrad(0.1), [1.9046537, 2.9046537])]:
    t = table(rows=3, values=values, combiner="mean")
    layer = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table=t)}, optimizer)
    model = Dot(layer, {"f": tf.constant([[1.0, 0.0], [0.0, 1.0]])})
    step = _train_step(model, tf_keras.optimizers.SGD(0.1))
    step({"f": tf.ragged.constant([[1, 1], [1]], tf.int64)})
    np.testing.assert_allclose(layer.embedding_tables[t].numpy()[1], expected, rtol=1e-6)
    np.testing.assert_array_equal(layer.embedding_tables[t].numpy()[[0, 2]], values[[0, 2]])


def test_two_adagrad_steps_match_numpy_and_only_touched_rows_move():
  rng = np.random.default_rng(0)
  values = rng.normal(size=(6, 3)).astype(np.float32)
  t = table(rows=6, dim=3, values=values, combiner="sum")
  layer = tpu_embedding.TPUEmbedding(
    {"f": E.FeatureConfig(table=t)}, E.Adagrad(0.5, initial_accumulator_value=0.2)
  )
  upstream = rng.normal(size=(3, 3)).astype(np.float32)
  model = Dot(layer, {"f": tf.constant(upstream)})
  step = _train_step(model, tf_keras.optimizers.SGD(0.1))
  bags = [[0, 2], [2], [5, 0, 0]]
  w, acc = values.astype(np.float64), np.full((6, 3), 0.2)
  for _ in range(2):
    step({"f": tf.ragged.constant(bags, tf.int64)})
    g = np.zeros_like(w)
    for bag, up in zip(bags, upstream):
      for i in bag:
        g[i] += up
    touched = sorted({i for bag in bags for i in bag})
    acc[touched] += g[touched] ** 2
    w[touched] -= 0.5 * g[touched] / np.sqrt(acc[touched])
  np.testing.assert_allclose(layer.embedding_tables[t].numpy(), w, rtol=1e-5, atol=1e-6)
  slots = layer.variables_by_table["table_0"]
  np.testing.assert_allclose(slots["accumulators"].numpy(), acc, rtol=1e-5)


def test_per_table_optimizer_overrides_layer_optimizer():
  a = table(rows=3, dim=1, combiner="sum", optimizer=E.SGD(1.0), values=np.zeros((3, 1)))
  b = table(rows=3, dim=1, combiner="sum", values=np.zeros((3, 1)))
  layer = tpu_embedding.TPUEmbedding(
    {"a": E.FeatureConfig(table=a), "b": E.FeatureConfig(table=b)}, E.SGD(0.25)
  )
  model = Dot(layer, {"a": tf.ones([1, 1]), "b": tf.ones([1, 1])})
  _train_step(model, tf_keras.optimizers.SGD(0.1))({"a": tf.constant([1]), "b": tf.constant([1])})
  assert layer.embedding_tables[a].numpy()[1, 0] == -1.0
  assert layer.embedding_tables[b].numpy()[1, 0] == -0.25


def test_training_without_any_optimizer_is_refused_but_serving_works():
  t = table(rows=3, dim=1, combiner="sum")
  layer = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table=t, name="f")}, optimizer=None)
  assert layer({"f": tf.constant([2])})["f"].numpy()[0, 0] == 2.0
  assert list(layer.variables_by_table["table_0"]) == ["parameters"]
  model = Dot(layer, {"f": tf.ones([1, 1])})
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"Table \\*'table_0\\*' has no optimizer"
  ):
    _train_step(model, tf_keras.optimizers.SGD(0.1))({"f": tf.constant([1])})
  with pytest.raises(ValueError, match="Table 'table_0' has no optimizer"):  # eagerly
    with tf.GradientTape() as tape:
      loss = model({"f": tf.constant([1])})
    tape.gradient(loss, model.trainable_variables)


def _mirrored_vs_default(optimizer_fn, pipelining=False):
  """Trains the same global batches under the default strategy and 2-replica Mirrored.

  Bags are ragged (rows padded with -1 are dropped), so the two replicas of a step hold
  different numbers of ids.
  """
  rng = np.random.default_rng(1)
  values = rng.normal(size=(7, 2)).astype(np.float32)
  batches = [rng.integers(0, 7, size=(4, 3)) for _ in range(3)]
  for batch in batches:
    batch[0, 1:] = -1  # replica 0 gets 4 ids, replica 1 gets 6
  tables = []
  for strategy in [
    tf.distribute.get_strategy(),
    # Not TF's default collective all-reduce: its CPU collectives are keyed per process and
    # their keys restart with each strategy, so one of another shape from an earlier test's
    # strategy aborts this one (tensorflow/tensorflow#62790: "Shape mismatch in the collective
    # instance 100").
    tf.distribute.MirroredStrategy(
      ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    ),
  ]:
    with strategy.scope():
      t = table(rows=7, dim=2, values=values, combiner="sum")
      layer = tpu_embedding.TPUEmbedding(
        {"f": E.FeatureConfig(table=t)},
        optimizer_fn(),
        pipeline_execution_with_tensor_core=pipelining,
      )
      dense = tf_keras.layers.Dense(1, kernel_initializer="ones")
      keras_opt = tf_keras.optimizers.SGD(0.01)

    def replica_step(ids):
      with tf.GradientTape() as tape:
        out = dense(layer({"f": tf.RaggedTensor.from_tensor(ids, padding=-1)})["f"])
        loss = tf.reduce_sum(out * out) / 4.0  # global mean: / global batch
      variables = layer.trainable_variables + dense.trainable_variables
      keras_opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    dataset = strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices(np.concatenate(batches)).batch(4)
    )

    @tf.function
    def run(ids):
      strategy.run(replica_step, args=(ids,))

    for ids in dataset:
      run(ids)
    layer.flush()
    tables.append(np.array(layer.embedding_tables[t].numpy()))
  return values, tables


@pytest.mark.parametrize(
  "optimizer_fn",
  [
    lambda: E.Adagrad(0.1),
    lambda: E.Adam(0.01),
    # creates its learning-rate variable on first read, which must not be in a replica step
    lambda: tf_keras.optimizers.legacy.Adagrad(0.1),
  ],
)
def test_mirrored_two_replicas_equal_default_strategy(optimizer_fn):
  values, (single, mirrored) = _mirrored_vs_default(optimizer_fn)
  assert not np.array_equal(single, values)  # it trained
  np.testing.assert_array_equal(mirrored, single)


def test_mirrored_layer_called_outside_any_strategy_is_allowed_for_serving():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table()), "sgd")
    layer.build(None)
  np.testing.assert_array_equal(layer(tf.constant([3])).numpy(), row_id_table(5, 2)[[3]])


# ---------------------------------------------------------------------------------------------
# Keras integration


def _fit_expected_sgd(values, ids, labels, lr):
  """One full-batch SGD step of mean squared error on pred = sum(W[id]) (dense weights frozen)."""
  pred = values[ids].sum(axis=1)
  dpred = 2 * (pred - labels) / len(ids)
  w = values.astype(np.float64).copy()
  for i, d in zip(ids, dpred):
    w[i] -= lr * d
  return w


def test_model_fit_functional_and_subclassed():
  values = row_id_table(4, 2) / 10
  ids = np.array([0, 1, 1, 3])
  labels = np.array([1.0, 0.0, 2.0, -1.0], np.float32)
  expected = _fit_expected_sgd(values, ids, labels, 0.5)
  for style in ["functional", "subclassed"]:
    t = table(rows=4, dim=2, values=values)
    layer = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table=t)}, E.SGD(0.5))
    if style == "functional":
      inputs = {"f": tf_keras.Input(shape=(), dtype=tf.int32, name="f")}
      outputs = tf.reduce_sum(layer(inputs)["f"], axis=1)
      model = tf_keras.Model(inputs, outputs)
    else:

      class Ranker(tf_keras.Model):
        def __init__(self):
          super().__init__()
          self.embedding = layer

        def call(self, inputs):
          return tf.reduce_sum(self.embedding(inputs)["f"], axis=1)

      model = Ranker()
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit({"f": ids.astype(np.int32)}, labels, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    np.testing.assert_allclose(layer.embedding_tables[t].numpy(), expected, rtol=1e-6)


def test_functional_model_with_sparse_and_ragged_inputs_has_static_shapes():
  t = table(rows=5, dim=3, combiner="sum")
  layer = tpu_embedding.TPUEmbedding(
    {"s": E.FeatureConfig(table=t), "r": E.FeatureConfig(table=t)}, "adagrad"
  )
  inputs = {
    "s": tf_keras.Input(batch_size=4, shape=(), sparse=True, dtype=tf.int32),
    "r": tf_keras.Input(batch_size=4, shape=(None,), ragged=True, dtype=tf.int32),
  }
  out = layer(inputs)
  assert out["s"].shape.as_list() == [4, 3] and out["r"].shape.as_list() == [4, 3]


# ---------------------------------------------------------------------------------------------
# Bad input


def _layer(**table_kwargs):
  t = table(rows=5, dim=2, name="videos", **table_kwargs)
  return tpu_embedding.TPUEmbedding(
    {"watched": E.FeatureConfig(table=t), "liked": E.FeatureConfig(table=t)}, "sgd"
  )


@pytest.mark.parametrize("bad", [5, -1])
def test_out_of_range_ids_name_feature_table_and_size(bad):
  layer = _layer()
  # Graph-mode assertion text escapes quotes, hence the optional backslashes.
  pattern = r"Feature \\*'watched\\*' \(table \\*'videos\\*', vocabulary_size=5\).*\[0, 5\)"
  with pytest.raises(ValueError, match=pattern):
    layer({"watched": tf.constant([1, bad]), "liked": tf.constant([0, 0])})
  with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
    tf.function(layer)({"watched": tf.ragged.constant([[1, bad]]), "liked": tf.constant([0])})


def test_one_check_per_step_still_names_the_feature_at_fault():
  layer = _layer()  # in a compiled step all features are checked at once
  with pytest.raises(tf.errors.InvalidArgumentError) as error:
    tf.function(layer)({"watched": tf.constant([1, 4]), "liked": tf.constant([0, 7, 2])})
  message = str(error.value)
  assert re.search(r"Feature \\*'liked\\*' \(table \\*'videos\\*'", message), message
  assert "[Offending ids:] [7]" in message
  assert not re.search(r"Feature \\*'watched", message)


def test_an_out_of_range_id_on_the_second_mirrored_replica_raises_the_layers_error():
  """The refusal a user catches names feature, table and id, not another replica's cancelled
  transfer (`CancelledError: RecvAsync is cancelled`), and the step writes nothing."""
  strategy = tf.distribute.MirroredStrategy(
    ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
  )
  with strategy.scope():
    layer = _layer()
    dense = tf_keras.layers.Dense(1, kernel_initializer="ones")
    optimizer = tf_keras.optimizers.SGD(0.1)

  def replica_step(ids):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(dense(layer({"watched": ids, "liked": tf.zeros_like(ids)})["watched"]))
    variables = layer.trainable_variables + dense.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

  ids = strategy.experimental_distribute_values_from_function(
    lambda context: tf.constant([[1, 2], [3, 9]][context.replica_id_in_sync_group])
  )
  pattern = (
    r"Feature \\*'watched\\*' \(table \\*'videos\\*', vocabulary_size=5\): every id must "
    r"be in \[0, 5\)\.\] \[Offending ids:\] \[9\]"
  )
  with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
    tf.function(lambda ids: strategy.run(replica_step, args=(ids,)))(ids)
  (videos,) = layer.embedding_tables.values()
  np.testing.assert_array_equal(videos.numpy(), row_id_table(5, 2))
  np.testing.assert_array_equal(dense.kernel.numpy(), np.ones((2, 1)))


def test_range_check_traces_one_assert_whatever_the_number_of_features():
  """The check's failure branch is traced into every step: it must not grow with the features
  (first-step latency of a 26-feature DLRM)."""
  t = table(rows=5, dim=2, name="videos")
  features = {f"f{i}": E.FeatureConfig(table=t) for i in range(6)}
  layer = tpu_embedding.TPUEmbedding(features, "sgd")
  graph = (
    tf.function(layer)
    .get_concrete_function({name: tf.TensorSpec([None], tf.int64) for name in features})
    .graph.as_graph_def()
  )
  nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
  assert sum(n.op == "Assert" for n in nodes) == 1


@pytest.mark.parametrize("ids,dtype", [([1.0, 2.0], "float32"), (["a", "b"], "string")])
def test_non_integer_ids_are_refused(ids, dtype):
  with pytest.raises(
    TypeError, match=f"Feature 'watched': ids must be of an integer dtype.*{dtype}"
  ):
    _layer()({"watched": tf.constant(ids), "liked": tf.constant([0, 0])})


def test_structure_mismatch_shows_expected_and_received_keys():
  with pytest.raises(
    ValueError,
    match=r"expected keys: \['liked', 'watched'\]\n.*"
    r"received keys: \['clicked', 'watched'\]",
  ):
    _layer()({"watched": tf.constant([1]), "clicked": tf.constant([0])})


def test_weights_structure_and_kind_are_checked():
  layer = _layer()
  ids = {"watched": tf.ragged.constant([[1, 2]]), "liked": tf.ragged.constant([[0]])}
  with pytest.raises(ValueError, match="structure of weights does not match"):
    layer(ids, weights={"watched": tf.ragged.constant([[1.0, 1.0]])})
  # as many weights, under a misspelt key or as a list: never paired by position
  for misplaced in (
    {"watched": tf.ragged.constant([[1.0, 1.0]]), "likes": None},
    [None, tf.ragged.constant([[1.0, 1.0]])],
  ):
    with pytest.raises(ValueError, match="under the same keys"):
      layer(ids, weights=misplaced)
  with pytest.raises(
    ValueError,
    match="Feature 'liked': its ids are a RaggedTensor, so its "
    "weights must be a RaggedTensor.*SparseTensor",
  ):
    layer(ids, weights={"watched": None, "liked": sparse([[0]], [[1.0]])})


def test_weights_on_dense_input_are_refused():
  with pytest.raises(ValueError, match="Feature 'watched': weights were given for a dense"):
    _layer()(
      {"watched": tf.constant([1]), "liked": tf.constant([0])},
      weights={"watched": tf.constant([1.0]), "liked": None},
    )


def test_unknown_combiner_and_duplicate_table_names():
  with pytest.raises(
    ValueError, match="Table 'videos' has combiner 'max'; expected one of sum, mean, sqrtn"
  ):
    t = table(name="videos")
    t.combiner = "max"
    tpu_embedding.TPUEmbedding(E.FeatureConfig(table=t), "sgd")
  with pytest.raises(ValueError, match="Two different TableConfig objects are both named 'x'"):
    tpu_embedding.TPUEmbedding(
      {"a": E.FeatureConfig(table=table(name="x")), "b": E.FeatureConfig(table=table(name="x"))},
      "sgd",
    )


@pytest.mark.parametrize(
  "initializer,error,message",
  [
    (
      tf.keras.initializers.Zeros,
      TypeError,
      "Table 'videos': initializer is the class Zeros; pass an instance, e.g. Zeros()",
    ),
    (
      tf.constant_initializer(np.zeros([3, 2])),
      ValueError,
      r"Embedding variable 'videos': its initializer failed for shape \[5, 2\]",
    ),
    (
      lambda shape, dtype=None: tf.zeros(shape, tf.int32),
      ValueError,
      r"Embedding variable 'videos': its initializer gave a int32 tensor of shape \[5, 2\]; "
      r"expected float32 \[5, 2\]",
    ),
  ],
)
def test_a_bad_initializer_is_refused_naming_the_table(initializer, error, message):
  t = E.TableConfig(5, 2, name="videos", initializer=initializer)
  with pytest.raises(error, match=message):
    tpu_embedding.TPUEmbedding(E.FeatureConfig(table=t), "sgd")(tf.constant([1]))


def test_two_strategy_objects_of_one_kind_are_named_as_two():
  with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
    layer = _layer()
  with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
    with pytest.raises(
      RuntimeError,
      match="created under MirroredStrategy but is called under another MirroredStrategy object",
    ):
      layer({"watched": tf.constant([1]), "liked": tf.constant([0])})


def test_path_is_cpu_off_tpu_whatever_the_override():
  layer = tpu_embedding.TPUEmbedding(
    E.FeatureConfig(table=table()), "sgd", embedding_feature=hardware.EmbeddingFeature.V1
  )
  assert layer.execution_path is hardware.ExecutionPath.CPU
  with pytest.warns(DeprecationWarning, match="TPUEmbedding.path is deprecated; use .*execution"):
    assert layer.path is hardware.ExecutionPath.CPU


def test_the_engine_is_checkpointed_under_the_tfrs_name_only():
  """tf-recommenders' checkpoints name the tables `<layer>/_tpu_embedding/<table>`: the engine
  (held at `engine`) is that one child, and no other name leads to it."""
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table(name="t")), "adagrad")
  children = tf.train.TrackableView(layer).children(layer)
  assert [name for name, child in children.items() if child is layer.engine] == ["_tpu_embedding"]


def test_tables_exist_before_the_first_call_and_can_be_replaced():
  t = table(rows=3, dim=2, name="videos")
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=t), "adagrad")
  np.testing.assert_array_equal(layer.embedding_tables[t].numpy(), row_id_table(3, 2))
  assert sorted(layer.variables_by_table["videos"]) == ["accumulators", "parameters"]
  replacement = tf.Variable(np.full((3, 2), 7.0, np.float32))
  layer.update_embedding_table(t, replacement)
  np.testing.assert_array_equal(layer(tf.constant([2])).numpy(), [[7.0, 7.0]])
  with pytest.raises(ValueError, match="Table 'other' is not one of this layer's tables"):
    layer.update_embedding_table(table(name="other"), replacement)
  with pytest.raises(ValueError, match="Table 'other' is not one of this layer's tables"):
    layer.update_embedding_table("other", replacement)
  with pytest.raises(TypeError, match="Expected one of this layer's TableConfigs .*, got int"):
    layer.update_embedding_table(3, replacement)
  by_name = tf.Variable(np.full((3, 2), 5.0, np.float32))
  layer.update_embedding_table("videos", by_name)
  np.testing.assert_array_equal(layer(tf.constant([2])).numpy(), [[5.0, 5.0]])


@pytest.mark.parametrize("table_updates", ["engine", "keras"])
def test_a_replaced_table_is_trained_and_checkpointed(tmp_path, table_updates):
  t = table(rows=3, dim=2, name="videos", combiner="sum")
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=t), "sgd", table_updates=table_updates)
  layer(tf.constant([0]))
  replacement = tf.Variable(np.full((3, 2), 7.0, np.float32))
  layer.update_embedding_table(t, replacement)
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(layer(tf.constant([1])))
  grads = tape.gradient(loss, layer.trainable_variables)
  tf_keras.optimizers.SGD(0.5).apply_gradients(zip(grads, layer.trainable_variables))
  # d(loss)/d(row 1) = 1: the engine's SGD steps by its own learning rate (0.01), Keras by 0.5.
  trained = np.full((3, 2), 7.0, np.float32)
  trained[1] -= 0.01 if table_updates == "engine" else 0.5
  np.testing.assert_allclose(replacement.numpy(), trained)
  path = tf.train.Checkpoint(layer=layer).save(str(tmp_path / "ckpt"))
  fresh = tpu_embedding.TPUEmbedding(
    E.FeatureConfig(table=table(rows=3, dim=2, name="videos")), "sgd", table_updates=table_updates
  )
  fresh(tf.constant([0]))
  tf.train.Checkpoint(layer=fresh).restore(path).assert_consumed()
  np.testing.assert_allclose(fresh.variables_by_table["videos"]["parameters"].numpy(), trained)


@pytest.mark.parametrize("bad", ["shape", "dtype", "tensor"])
def test_a_replacement_that_is_not_a_table_like_variable_is_refused(bad):
  t = table(rows=3, dim=2, name="videos")
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=t), "sgd")
  replacement = {
    "shape": tf.Variable(tf.zeros([4, 2])),
    "dtype": tf.Variable(tf.zeros([3, 2], tf.float64)),
    "tensor": tf.zeros([3, 2]),
  }[bad]
  with pytest.raises(
    ValueError,
    match=r"Table 'videos': update_embedding_table needs a "
    r"tf.Variable of shape \[3, 2\] and dtype float32",
  ):
    layer.update_embedding_table(t, replacement)
  np.testing.assert_array_equal(layer.embedding_tables[t].numpy(), row_id_table(3, 2))


@pytest.mark.parametrize("file_name", ["model", "model.keras"])
def test_load_model_is_refused_with_the_way_to_save_and_restore(tmp_path, file_name):
  """A reloaded model would silently stop training its tables: refused, naming the remedy."""
  inputs = tf_keras.Input(shape=(1,), dtype=tf.int64)
  layer = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table(name="videos"))}, "sgd")
  model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(layer({"f": inputs})["f"]))
  model.compile(tf_keras.optimizers.SGD(0.1), loss="mse")
  model.fit(np.array([[1], [2]]), np.array([[1.0], [0.0]]), verbose=0)
  path = str(tmp_path / file_name)
  model.save(path)
  with pytest.raises(
    ValueError,
    match=r"cannot be rebuilt by tf_keras.models.load_model.*"
    r"tf.train.Checkpoint\(model=model\).restore\(path\)",
  ):
    tf_keras.models.load_model(path)


def test_serving_only_layer_saves_with_plain_saved_model(tmp_path):
  t = table(rows=4, dim=2)
  layer = tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table=t)}, optimizer=None)
  module = tf.Module()
  module.layer = layer
  module.serve = tf.function(
    lambda ids: layer({"f": ids})["f"], input_signature=[tf.TensorSpec([None], tf.int32)]
  )
  tf.saved_model.save(module, str(tmp_path / "model"))
  loaded = tf.saved_model.load(str(tmp_path / "model"))
  np.testing.assert_array_equal(
    loaded.serve(tf.constant([3, 1])).numpy(), row_id_table(4, 2)[[3, 1]]
  )


ADAM_WARNING_SCRIPT = """
import sys
import tensorflow as tf, tf_keras
import tpu_embedding
E = tf.tpu.experimental.embedding
config = {"f": E.FeatureConfig(E.TableConfig(4, 2, name="t"))}
def mark(text):
  print(text, file=sys.stderr, flush=True)
if sys.argv[1] == "TPUEmbedding":
  tpu_embedding.TPUEmbedding(config, tf_keras.optimizers.Adam(1.0), table_updates="keras")
  mark("MARK keras mode")
  tpu_embedding.TPUEmbedding(config, E.Adam(1.0))
  mark("MARK mid-level Adam")
  tpu_embedding.TPUEmbedding(config, tf_keras.optimizers.Adam(1.0))
  tpu_embedding.TPUEmbedding(config, tf_keras.optimizers.legacy.Adam(1.0))
elif sys.argv[1] == "PartialTPUEmbedding, two sides":
  # DLRM-like: small tables replicated, large ones sharded; every table is named at once.
  two_sides = {
    "big": E.FeatureConfig(E.TableConfig(100, 2, name="big")),
    "f": E.FeatureConfig(E.TableConfig(4, 2, name="t")),
    "large": E.FeatureConfig(E.TableConfig(200, 2, name="large")),
  }
  mark("MARK keras mode")
  mark("MARK mid-level Adam")
  tpu_embedding.PartialTPUEmbedding(two_sides, tf_keras.optimizers.Adam(1.0), size_threshold=50)
  tpu_embedding.PartialTPUEmbedding(two_sides, tf_keras.optimizers.Adam(1.0), size_threshold=50)
else:
  tpu_embedding.PartialTPUEmbedding(config, tf_keras.optimizers.Adam(1.0), table_updates="keras")
  mark("MARK keras mode")
  tpu_embedding.PartialTPUEmbedding(config, tf_keras.optimizers.Adam(1.0))
  tpu_embedding.PartialTPUEmbedding(config, tf_keras.optimizers.Adam(1.0))
mark("MARK end")
"""


@pytest.mark.integration  # starts a process
@pytest.mark.parametrize(
  "layer,tables",
  [
    ("TPUEmbedding", ["t"]),
    ("PartialTPUEmbedding", ["t"]),
    ("PartialTPUEmbedding, two sides", ["big", "t", "large"]),
  ],
)
def test_keras_adam_without_bias_correction_is_logged_once(layer, tables):
  """Only where the engine trains the tables (not table_updates="keras", not a mid-level Adam),
  once per layer naming all its tables (both sides of a PartialTPUEmbedding), not again for a
  layer with the same tables."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
    [sys.executable, "-c", ADAM_WARNING_SCRIPT, layer],
    env=dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="3"),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = [
    line for line in result.stderr.splitlines() if "MARK" in line or "no bias correction" in line
  ]
  warning = [line for line in lines if "no bias correction" in line]
  assert len(warning) == 1, lines
  assert f"tables {tables} are trained by the TPU embedding engine's Adam" in warning[0]
  assert "sqrt(1 - beta_2**t) / (1 - beta_1**t)" in warning[0]
  assert lines.index(warning[0]) == len(lines) - 2  # after every MARK but the end


# ---------------------------------------------------------------------------------------------
# XLA: tf-keras `compile(jit_compile=True)` + `fit` (the static-shape engine path)


def test_keras_fit_with_jit_compile_trains_dense_ragged_and_sparse_inputs_like_the_reference():
  """loss = mean over samples of <activations, y>, so each activation's gradient is y / B."""
  import reference

  values = row_id_table(6, 2) / 10
  optimizer = E.Adam(0.1, lazy_adam=True)
  shared = table(6, 2, combiner="sum", name="t", values=values)
  layer = tpu_embedding.TPUEmbedding({k: E.FeatureConfig(shared) for k in "drs"}, optimizer)
  inputs = {
    "d": tf_keras.Input(shape=(1,), dtype=tf.int64),
    "r": tf_keras.Input(shape=(None,), dtype=tf.int64, ragged=True),
    "s": tf_keras.Input(shape=(2,), dtype=tf.int64, sparse=True),
  }
  out = layer(inputs)
  model = tf_keras.Model(inputs, tf.concat([out["d"], out["r"], out["s"]], axis=1))
  model.compile(
    tf_keras.optimizers.SGD(0.0), loss=lambda y, a: tf.reduce_sum(y * a, axis=-1), jit_compile=True
  )
  dense, ragged, sparse = [[1], [5]], [[0, 2, 2], [4]], [[3], [0, 1]]
  x = {
    "d": tf.constant(dense, tf.int64),
    "r": tf.ragged.constant(ragged, tf.int64),
    "s": tf.sparse.SparseTensor([[0, 0], [1, 0], [1, 1]], tf.constant([3, 0, 1], tf.int64), [2, 2]),
  }
  y = np.array([[1.0, -2.0, 0.5, 1.5, -1.0, 2.0], [3.0, 1.0, -0.5, 2.0, 1.0, -1.0]], np.float32)
  model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(2), epochs=1, verbose=0)

  params = reference.params_from_optimizer(optimizer)
  w, slots = values.astype(np.float64), reference.initial_slots(params, values.shape)
  bags = [(ids, None) for ids in [*dense, *ragged, *sparse]]
  upstream = np.concatenate([y[:, 0:2], y[:, 2:4], y[:, 4:6]]) / 2  # d, r, s; mean over B = 2
  for _ in range(2):
    row_ids, grads = reference.assemble_gradients(bags, upstream, "sum")
    w, slots = reference.apply_step(w, slots, row_ids, grads, 0.1, params)
  variables = layer.variables_by_table["t"]
  np.testing.assert_allclose(variables["parameters"].numpy(), w, rtol=1e-5, atol=1e-6)
  for name, value in slots.items():
    np.testing.assert_allclose(variables[name].numpy(), value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "make", [tpu_embedding.TPUEmbedding, tpu_embedding.PartialTPUEmbedding], ids=["full", "partial"]
)
@pytest.mark.parametrize("how", ["copy.deepcopy", "copy.copy", "pickle"])
def test_copying_a_layer_is_refused_naming_checkpoints(make, how):
  import copy
  import pickle

  values = row_id_table(5, 2)
  layer = make({"f": E.FeatureConfig(table(values=values, name="t"))}, E.SGD(0.1))
  layer({"f": tf.constant([1, 2])})
  copier = {"copy.deepcopy": copy.deepcopy, "copy.copy": copy.copy, "pickle": pickle.dumps}[how]
  with pytest.raises(
    TypeError,
    match=rf"cannot be copied with {re.escape(how)}: .*tf\.train\.Checkpoint\(model=model\)"
    r"\.save\(path\).*Nothing was copied",
  ):
    copier(layer)
  np.testing.assert_array_equal(layer.variables_by_table["t"]["parameters"].numpy(), values)
