"""`tpu_embedding.keras.DistributedEmbedding`: keras-rs's layer, every table trained by its own
optimizer. keras-rs's own tests run against it in
tests/keras/test_keras_rs_distributed_embedding.py;
these check the values, what differs from keras-rs, and every refusal."""

import keras
import keras_rs
import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import hardware
from tpu_embedding.keras import DistributedEmbedding, TPUEmbedding, config_conversion

import reference
import tpu_harness

BATCH, DIM, VOCABULARY, LR = 3, 4, 6, 0.5
IDS = np.array([[1, 2], [3, 3], [0, 4]], np.int32)
WEIGHTS = np.array([[1.0, 2.0], [0.5, 1.5], [2.0, -1.0]], np.float32)


def rs_config(combiner="sum", placement="auto", optimizer=None, name="movies"):
  table = keras_rs.layers.TableConfig(
    name=name,
    vocabulary_size=VOCABULARY,
    embedding_dim=DIM,
    combiner=combiner,
    placement=placement,
    optimizer=optimizer or keras.optimizers.SGD(learning_rate=LR),
    initializer=keras.initializers.RandomUniform(seed=1),
  )
  return {
    "movie": keras_rs.layers.FeatureConfig(
      name="movie", table=table, input_shape=(BATCH, 2), output_shape=(BATCH, DIM)
    )
  }


def table_of(layer, name="movies"):
  return layer.get_embedding_tables()[name].numpy()


def expected_activations(table, combiner, ids=IDS, weights=WEIGHTS):
  return np.stack([reference.combine_bag(table, i, w, combiner) for i, w in zip(ids, weights)])


def expected_sgd_step(table, upstream, combiner, ids=IDS, weights=WEIGHTS):
  rows, grads = reference.assemble_gradients(list(zip(ids, weights)), upstream, combiner)
  new = np.array(table, np.float64)
  new[rows] -= LR * grads
  return new


# ---------------------------------------------------------------------------------------------
# Dense [B, L] ids with weights are bags, on the eager, graph and XLA paths


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("placement", ["auto", "default_device"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_dense_weighted_bags_look_up_and_train_with_the_tables_optimizer(
  combiner, placement, jit_compile
):
  layer = DistributedEmbedding(rs_config(combiner, placement))
  before = table_of(layer)
  upstream = np.random.default_rng(0).normal(size=(BATCH, DIM)).astype(np.float32)

  @tf.function(jit_compile=jit_compile)
  def step(ids, weights):
    with tf.GradientTape() as tape:
      out = layer({"movie": ids}, {"movie": weights})["movie"]
      loss = tf.reduce_sum(out * upstream)
    tape.gradient(loss, layer.trainable_variables)  # the table's own SGD applies it
    return out

  out = step(tf.constant(IDS), tf.constant(WEIGHTS))
  np.testing.assert_allclose(out, expected_activations(before, combiner), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    table_of(layer), expected_sgd_step(before, upstream, combiner), rtol=1e-5, atol=1e-6
  )


def test_rank_one_dense_ids_are_one_id_per_row():
  layer = DistributedEmbedding(rs_config("mean"))
  table = table_of(layer)
  out = layer({"movie": tf.constant([2, 5, 0])}, {"movie": tf.constant([3.0, 1.0, 2.0])})
  np.testing.assert_allclose(out["movie"], table[[2, 5, 0]], rtol=1e-6)  # mean of one id


def test_fit_trains_tables_by_their_own_optimizer_not_the_models():
  layer = DistributedEmbedding(rs_config("sum", "default_device"))
  ids = keras.Input((2,), dtype="int32")
  weights = keras.Input((2,))
  model = keras.Model([ids, weights], layer({"movie": ids}, {"movie": weights})["movie"])
  model.compile(optimizer=keras.optimizers.Adam(learning_rate=10.0), loss="mse")
  before = table_of(layer)
  activations = expected_activations(before, "sum")
  model.fit([IDS, WEIGHTS], np.zeros((BATCH, DIM)), batch_size=BATCH, epochs=1, verbose=0)
  upstream = 2 * activations / (BATCH * DIM)  # d(mean squared error)/d(activations)
  np.testing.assert_allclose(
    table_of(layer), expected_sgd_step(before, upstream, "sum"), rtol=1e-5, atol=1e-6
  )


def test_preprocess_gives_what_call_looks_up():
  layer = DistributedEmbedding(rs_config("sqrtn"))
  preprocessed = layer.preprocess({"movie": IDS}, {"movie": WEIGHTS})
  direct = layer({"movie": IDS}, {"movie": WEIGHTS})["movie"]
  np.testing.assert_allclose(layer(preprocessed)["movie"], direct, rtol=1e-6)
  ids = tf.data.Dataset.from_tensors(({"movie": IDS}, {"movie": WEIGHTS})).map(layer.preprocess)
  np.testing.assert_allclose(layer(next(iter(ids)))["movie"], direct, rtol=1e-6)


def test_tables_are_listed_by_name_and_as_sublayers():
  config = rs_config(placement="default_device")
  config["user"] = keras_rs.layers.FeatureConfig(
    name="user",
    table=keras_rs.layers.TableConfig(name="users", vocabulary_size=3, embedding_dim=2),
    input_shape=(BATCH, 1),
    output_shape=(BATCH, 2),
  )
  layer = DistributedEmbedding(config)
  views = {view.name: view for view in layer._flatten_layers(include_self=False)}
  assert {n: (v.input_dim, v.output_dim) for n, v in views.items()} == {
    "movies": (6, 4),
    "users": (3, 2),
  }
  assert views["users"].table is not None
  tables = layer.get_embedding_tables()
  np.testing.assert_array_equal(tables["users"], views["users"].embeddings.numpy())
  assert [v.shape.as_list() for v in layer.trainable_variables] == [[6, 4], [3, 2]]


# ---------------------------------------------------------------------------------------------
# Refusals: each names what is wrong


def test_sparsecore_placement_without_an_embedding_engine_is_refused():
  with pytest.raises(ValueError, match="Table 'movies' has placement='sparsecore'.*CPU"):
    DistributedEmbedding(rs_config(placement="sparsecore"))


def test_update_stats_is_refused_as_keras_rs_refuses_it_on_tensorflow():
  with pytest.raises(ValueError, match="update_stats=True"):
    DistributedEmbedding(rs_config(), update_stats=True)


def test_unknown_placement_of_a_mid_level_table_is_refused():
  table = tf.tpu.experimental.embedding.TableConfig(VOCABULARY, DIM, name="movies")
  with pytest.raises(ValueError, match="Table 'movies': placement='tpu'"):
    DistributedEmbedding(
      {"movie": tf.tpu.experimental.embedding.FeatureConfig(table)}, placements={"movies": "tpu"}
    )


def test_table_stacking_other_than_auto_or_none_is_refused():
  with pytest.raises(ValueError, match=r"table_stacking=\[\['a', 'b'\]\]"):
    config_conversion.sparse_core_config([["a", "b"]])
  assert config_conversion.sparse_core_config(None).disable_table_stacking


@pytest.mark.parametrize("stacking", ["bogus", 123])
def test_bad_table_stacking_is_refused_off_tpu_too(stacking):
  """Off TPU the value is unused, but it is saved in the config: a later TPU run would fail."""
  with pytest.raises(ValueError, match=f"table_stacking={stacking!r}: on TensorFlow only"):
    DistributedEmbedding(rs_config(), table_stacking=stacking)
  assert (
    DistributedEmbedding(rs_config(), table_stacking=None).get_config()["table_stacking"] is None
  )


def test_placements_naming_an_unknown_table_are_refused():
  table = tf.tpu.experimental.embedding.TableConfig(VOCABULARY, DIM, name="movies")
  features = {"movie": tf.tpu.experimental.embedding.FeatureConfig(table)}
  with pytest.raises(ValueError, match=r"names tables \['typo_table'\].*tables are \['movies'\]"):
    DistributedEmbedding(features, placements={"typo_table": "sparsecore"})


@pytest.mark.parametrize(
  "placement,hint",
  [("SparseCore", "lower case: placement='sparsecore'"), ("hbm", "keras-rs placements are")],
)
def test_misspelt_keras_rs_placement_says_what_to_write(placement, hint):
  with pytest.raises(ValueError, match=f"placement='{placement}'.*{hint}") as refused:
    DistributedEmbedding(rs_config(placement=placement))
  assert "use tpu_embedding.keras.DistributedEmbedding" not in str(refused.value)
  with pytest.raises(ValueError, match="default_device.*use tpu_embedding.keras.Distributed"):
    TPUEmbedding(rs_config(placement="default_device"))


def test_weights_beside_preprocessed_inputs_are_refused_not_dropped():
  layer = DistributedEmbedding(rs_config("mean"))
  before = table_of(layer)
  with pytest.raises(ValueError, match=r"pass the weights to preprocess\(inputs, weights\)"):
    layer(layer.preprocess({"movie": IDS}), {"movie": WEIGHTS})
  np.testing.assert_array_equal(table_of(layer), before)
  got = layer(layer.preprocess({"movie": IDS}, {"movie": WEIGHTS}))["movie"]
  np.testing.assert_allclose(got, expected_activations(before, "mean"), rtol=1e-6)


@pytest.mark.parametrize(
  "ids,weights,match",
  [
    (np.zeros((3, 2, 2), np.int32), None, r"Feature 'movie': dense ids must be \[batch\]"),
    (IDS, tf.ragged.constant([[1.0], [1.0], [1.0]]), "'movie'.*weights a RaggedTensor"),
    (IDS, np.ones((3, 3), np.float32), r"'movie': dense weights of shape \(3, 3\)"),
    (IDS.astype(np.float32), None, "'movie': ids must be of an integer dtype, got float32"),
  ],
  ids=["rank3", "ragged_weights", "weight_shape", "float_ids"],
)
def test_bad_dense_inputs_are_refused_naming_the_feature(ids, weights, match):
  layer = DistributedEmbedding(rs_config())
  before = table_of(layer)
  with pytest.raises((ValueError, TypeError), match=match):
    layer({"movie": ids}, None if weights is None else {"movie": weights})
  np.testing.assert_array_equal(table_of(layer), before)


# ---------------------------------------------------------------------------------------------
# Saving


def test_keras_file_keeps_tables_slots_and_placements(tmp_path):
  config = rs_config("mean", "default_device", optimizer=keras.optimizers.Adagrad(0.5))
  ids = keras.Input((2,), dtype="int32")
  layer = DistributedEmbedding(config)
  model = keras.Model(ids, layer({"movie": ids})["movie"])
  model.compile(optimizer="sgd", loss="mse")
  model.fit(IDS, np.ones((BATCH, DIM)), batch_size=BATCH, verbose=0)
  model.save(tmp_path / "m.keras")
  loaded = keras.models.load_model(tmp_path / "m.keras")
  reloaded = loaded.layers[-1]
  assert isinstance(reloaded, DistributedEmbedding)
  assert reloaded.get_config()["placements"] == {"movies": "default_device"}
  saved = layer.variables_by_table["movies"]
  for slot, variable in reloaded.variables_by_table["movies"].items():
    np.testing.assert_array_equal(variable.numpy(), saved[slot].numpy(), err_msg=slot)
  np.testing.assert_allclose(loaded.predict(IDS, verbose=0), model.predict(IDS, verbose=0))


# ---------------------------------------------------------------------------------------------
# TPU V1: TF's real TPUEmbedding under tpu_harness.StandInTPUStrategy (runtime stubbed, the
# step traced, nothing runs on a TPU)


def test_on_tpu_v1_dense_weighted_bags_reach_the_engine_as_bags(monkeypatch):
  strategy, recorded = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1)
  with strategy.scope():
    layer = DistributedEmbedding(rs_config("mean"))

    @tf.function
    def step(ids, weights):
      with tf.GradientTape() as tape:
        out = layer({"movie": ids}, {"movie": weights})["movie"]
        loss = tf.reduce_sum(out)
      return tape.gradient(loss, layer.trainable_variables)

    graph = step.get_concrete_function(
      tf.TensorSpec([BATCH, 2], tf.int32), tf.TensorSpec([BATCH, 2], tf.float32)
    ).graph
  assert layer.tpu_embedding.execution_path is hardware.ExecutionPath.TPU_V1
  (enqueue,) = [op for op in graph.get_operations() if op.type.startswith("EnqueueTPUEmbedding")]
  assert enqueue.type == "EnqueueTPUEmbeddingArbitraryTensorBatch"
  assert enqueue.get_attr("combiners") == [b"mean"]
  # The weights are enqueued as the bag's aggregation weights: 6 values for 6 ids.
  (_, ids, weights) = (enqueue.inputs[i] for i in range(3))
  assert ids.shape.as_list() == [BATCH * 2] and weights.shape.as_list() == [BATCH * 2]
  assert weights.dtype == tf.float32
  (receive,) = [op for op in graph.get_operations() if op.type == "RecvTPUEmbeddingActivations"]
  assert [o.shape.as_list() for o in receive.outputs] == [[BATCH, DIM]]  # one bag a row
  (proto,) = recorded.config_protos
  assert [(t.name, t.vocabulary_size) for t in proto.table_descriptor] == [("movies", VOCABULARY)]


def test_on_tpu_v1_default_device_tables_stay_replicated(monkeypatch):
  strategy, recorded = tpu_harness.tpu_strategy(monkeypatch, hardware.EmbeddingFeature.V1)
  with strategy.scope():
    layer = DistributedEmbedding(rs_config(placement="default_device"))
  assert layer.tpu_embedding is None and not recorded.config_protos
  assert [v.shape.as_list() for v in layer.trainable_variables] == [[VOCABULARY, DIM]]


# ---------------------------------------------------------------------------------------------
# keras-rs's tutorial model: a subclassed model, fitted under a strategy and saved


class TwoTower(keras.Model):
  def __init__(self, embedding_class, config, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding_class(config)
    self.dense = keras.layers.Dense(1)

  def call(self, inputs):
    return self.dense(self.embedding(inputs)["movie"])


@pytest.mark.parametrize("embedding_class", [DistributedEmbedding, TPUEmbedding])
def test_subclassed_model_fits_under_a_strategy_and_saves_without_a_manual_build(
  embedding_class, tmp_path
):
  config = rs_config()
  config["movie"].input_shape = (None, 1)
  config["movie"].output_shape = (None, DIM)
  ids = np.array([[1], [2], [3], [4]], np.int32)
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    model = TwoTower(embedding_class, config)  # Keras builds it on float32 placeholders
    model.compile(optimizer="sgd", loss="mse")
  before = model.embedding.get_embedding_tables() if embedding_class is DistributedEmbedding else 0
  model.fit({"movie": ids}, np.ones((4, 1)), batch_size=4, verbose=0)
  if embedding_class is DistributedEmbedding:
    assert not np.allclose(table_of(model.embedding), before["movies"])
  expected = model.predict({"movie": ids}, verbose=0)
  tf.saved_model.save(model, str(tmp_path))  # traces Keras's float32 serving signature
  serving = tf.saved_model.load(str(tmp_path)).signatures["serving_default"]
  # Keras's signature: the per-replica shape it was built with, float32, as with Keras Embedding.
  (served,) = serving(inputs=tf.constant(ids[:2], tf.float32)).values()
  np.testing.assert_allclose(served, expected[:2], rtol=1e-6)
  with pytest.raises(TypeError, match="'movie': ids must be of an integer dtype, got float32"):
    model({"movie": tf.constant(ids, tf.float32)})  # real float ids stay refused
