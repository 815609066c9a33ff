"""Tests of the Keras 3 `TPUEmbedding` (TensorFlow backend) on the CPU path.

The layer shares its logic with the tf-keras layer, so these tests check what Keras 3 adds:
functional and subclassed models, `fit`/`evaluate`/`predict`, custom loops under the default
and Mirrored strategies, checkpoints interchangeable with the tf-keras layer's (real files,
both ways), and export for serving. Expected values come from NumPy.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import serving, tf_versions

# Skipped where the Keras is older than the layers need (TF 2.15's Keras 2; refusal tested in
# tests/test_tf_versions.py).
pytest.importorskip("tpu_embedding.keras", exc_type=tf_versions.UnsupportedKeras)
from tpu_embedding.keras import TPUEmbedding  # noqa: E402

E = tf.tpu.experimental.embedding
VALUES = np.arange(8, dtype=np.float32).reshape(4, 2) / 10
IDS = np.array([0, 1, 1, 3], np.int32)
LABELS = np.array([1.0, 0.0, 2.0, -1.0], np.float32)


def make_table(optimizer=None, rows=4, dim=2, name="t", values=VALUES):
  return E.TableConfig(
    vocabulary_size=rows,
    dim=dim,
    name=name,
    optimizer=optimizer,
    initializer=tf.constant_initializer(values),
  )


def row_gradients(w, ids, labels):
  """d(mean squared error)/dW of pred = sum(W[id]) over a batch, in float64."""
  pred = w[ids].sum(axis=1)
  g = np.zeros(w.shape)
  np.add.at(g, ids, (2 * (pred - labels) / len(ids))[:, None])
  return g


def sgd_step(values, ids, labels, lr):
  return values - lr * row_gradients(values.astype(np.float64), ids, labels)


def adagrad_steps(values, batches, lr, initial=0.1):
  """Adagrad on the same loss, batch after batch (TPU Adagrad: no epsilon, touched rows only)."""
  w, acc = values.astype(np.float64).copy(), np.full(values.shape, initial)
  for ids, labels in batches:
    g = row_gradients(w, ids, labels)
    rows = np.unique(ids)
    acc[rows] += g[rows] ** 2
    w[rows] -= lr * g[rows] / np.sqrt(acc[rows])
  return w, acc


class SumModel(keras.Model):
  """pred = sum over the embedding dimension: the dense side has no weights."""

  def __init__(self, layer):
    super().__init__()
    self.embedding = layer

  def call(self, inputs):
    return keras.ops.sum(self.embedding(inputs)["f"], axis=1)


def build_model(style, layer):
  if style == "subclassed":
    return SumModel(layer)
  inputs = {"f": keras.Input(shape=(), dtype="int32", name="f")}
  return keras.Model(inputs, keras.ops.sum(layer(inputs)["f"], axis=1))


@pytest.mark.parametrize("style", ["functional", "subclassed"])
def test_fit_trains_tables_with_their_own_optimizer(style):
  t = make_table()
  layer = TPUEmbedding({"f": E.FeatureConfig(table=t)}, E.SGD(0.5))
  model = build_model(style, layer)
  model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse", jit_compile=False)
  model.fit({"f": IDS}, LABELS, batch_size=4, epochs=1, verbose=0)
  np.testing.assert_allclose(
    layer.embedding_tables[t].numpy(), sgd_step(VALUES, IDS, LABELS, 0.5), rtol=1e-6
  )
  # Only the gradient trap is a Keras trainable weight: the model's Adam never sees the tables.
  assert [w.path.split("/")[-1] for w in model.trainable_weights] == ["tpu_embedding_helper_dummy"]


def test_fit_evaluate_predict_with_keras_optimizer_for_tables():
  t = make_table()
  layer = TPUEmbedding({"f": E.FeatureConfig(table=t)}, keras.optimizers.Adagrad(0.2))
  model = build_model("functional", layer)
  model.compile(optimizer="sgd", loss="mse", jit_compile=False)
  halves = [(IDS[:2], LABELS[:2]), (IDS[2:], LABELS[2:])]
  model.fit({"f": IDS}, LABELS, batch_size=2, epochs=1, shuffle=False, verbose=0)
  expected, accumulators = adagrad_steps(VALUES, halves, 0.2)
  np.testing.assert_allclose(layer.embedding_tables[t].numpy(), expected, rtol=1e-5)
  np.testing.assert_allclose(
    layer.variables_by_table["t"]["accumulators"].numpy(), accumulators, rtol=1e-5
  )
  predictions = model.predict({"f": IDS}, verbose=0)
  np.testing.assert_allclose(predictions, expected[IDS].sum(axis=1), rtol=1e-5)
  loss = model.evaluate({"f": IDS}, LABELS, verbose=0)
  np.testing.assert_allclose(loss, np.mean((expected[IDS].sum(axis=1) - LABELS) ** 2), rtol=1e-5)
  # evaluate and predict do not train
  np.testing.assert_allclose(layer.embedding_tables[t].numpy(), expected, rtol=1e-5)


def test_fit_with_jit_compile():
  t = make_table()
  layer = TPUEmbedding({"f": E.FeatureConfig(table=t)}, E.SGD(0.5))
  model = build_model("functional", layer)
  model.compile(optimizer="sgd", loss="mse", jit_compile=True)
  model.fit({"f": IDS}, LABELS, batch_size=4, epochs=1, verbose=0)
  np.testing.assert_allclose(
    layer.embedding_tables[t].numpy(), sgd_step(VALUES, IDS, LABELS, 0.5), rtol=1e-6
  )


def _custom_loop_tables(strategy):
  """Adagrad tables after two global batches of 4 trained in a custom loop under `strategy`."""
  with strategy.scope():
    t = make_table()
    layer = TPUEmbedding({"f": E.FeatureConfig(table=t)}, E.Adagrad(0.2))
    model = SumModel(layer)
    optimizer = keras.optimizers.SGD(0.1)

  def replica_step(ids, labels):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum((model({"f": ids}) - labels) ** 2) / 4.0  # mean over the global batch
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

  @tf.function
  def step(ids, labels):
    strategy.run(replica_step, args=(ids, labels))

  ids = np.concatenate([IDS, IDS[::-1]])
  labels = np.concatenate([LABELS, LABELS])
  dataset = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((ids, labels)).batch(4)
  )
  for batch_ids, batch_labels in dataset:
    step(batch_ids, batch_labels)
  expected, _ = adagrad_steps(VALUES, [(IDS, LABELS), (IDS[::-1], LABELS)], 0.2)
  return layer.embedding_tables[t].numpy(), expected


@pytest.mark.parametrize("mirrored", [False, True])
def test_custom_loop_under_default_and_mirrored_strategy(mirrored):
  # Not TF's default collective all-reduce: its keys restart with each strategy, so collectives
  # of other shapes here would clash with those of a later test's strategy in this process.
  strategy = (
    tf.distribute.MirroredStrategy(
      ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    if mirrored
    else tf.distribute.get_strategy()
  )
  tables, expected = _custom_loop_tables(strategy)
  np.testing.assert_allclose(tables, expected, rtol=1e-5)


def test_fit_under_mirrored_strategy_trains_on_the_global_batch():
  strategy = tf.distribute.MirroredStrategy(  # no collectives: see the custom loop test above
    ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
  )
  with strategy.scope():
    t = make_table()
    layer = TPUEmbedding({"f": E.FeatureConfig(table=t)}, E.Adagrad(0.2))
    inputs = {"f": keras.Input(shape=(), dtype="int32", name="f")}
    # Predictions of shape [batch, 1]: Keras scales a per-sample loss for the replicas, but not
    # the scalar that "mse" makes of [batch]-shaped predictions and labels.
    model = keras.Model(inputs, keras.ops.sum(layer(inputs)["f"], axis=1, keepdims=True))
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
  dataset = tf.data.Dataset.from_tensor_slices(({"f": IDS}, LABELS[:, None])).batch(4)
  model.fit(dataset, epochs=2, shuffle=False, verbose=0)
  expected, _ = adagrad_steps(VALUES, [(IDS, LABELS)] * 2, 0.2)
  np.testing.assert_allclose(layer.embedding_tables[t].numpy(), expected, rtol=1e-5)


def test_keras_rs_configs_train_like_the_mid_level_ones():
  keras_rs = pytest.importorskip("keras_rs")
  table = keras_rs.layers.TableConfig(
    name="t",
    vocabulary_size=4,
    embedding_dim=2,
    initializer=keras.initializers.Constant(VALUES),
    optimizer=keras.optimizers.SGD(0.5),
  )
  feature = keras_rs.layers.FeatureConfig(
    name="f", table=table, input_shape=(4,), output_shape=(4, 2)
  )
  layer = TPUEmbedding({"f": feature})
  model = build_model("subclassed", layer)
  model.compile(optimizer="sgd", loss="mse", jit_compile=False)
  model.fit({"f": IDS}, LABELS, batch_size=4, epochs=1, verbose=0)
  (variable,) = layer.embedding_tables.values()
  np.testing.assert_allclose(variable.numpy(), sgd_step(VALUES, IDS, LABELS, 0.5), rtol=1e-6)


def test_table_updates_by_the_model_optimizer_are_refused():
  with pytest.raises(ValueError, match="trained by the model's optimizer.*table_updates='keras'"):
    TPUEmbedding({"f": E.FeatureConfig(table=make_table())}, "sgd", table_updates="keras")


def test_check_finite_refuses_a_nan_gradient_and_survives_the_config_round_trip():
  """check_finite reaches the engine from the Keras 3 layer, and from its rebuilt copy."""
  original = TPUEmbedding({"f": E.FeatureConfig(table=make_table())}, E.SGD(0.5), check_finite=True)
  assert original.get_config()["check_finite"] is True
  layer = TPUEmbedding.from_config(original.get_config())
  model = SumModel(layer)
  model({"f": IDS})  # builds the tables
  (table,) = layer.embedding_tables.values()
  before = table.numpy()
  with pytest.raises(tf.errors.InvalidArgumentError, match="table 't'.*non-finite"):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model({"f": IDS}) * float("nan"))
    keras.optimizers.SGD(0.1).apply_gradients(
      zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    )
  np.testing.assert_array_equal(table.numpy(), before)


# ---------------------------------------------------------------------------------------------
# Checkpoints: the same keys as the tf-keras layer, restored both ways from real files


def _trained_layer(flavour):
  """A layer of `flavour` ("keras" or "tf_keras") after two Adagrad steps, and its table."""
  import tf_keras

  import tpu_embedding

  t = make_table(E.Adagrad(0.2))
  cls = TPUEmbedding if flavour == "keras" else tpu_embedding.TPUEmbedding
  layer = cls({"f": E.FeatureConfig(table=t)})
  optimizer = (keras if flavour == "keras" else tf_keras).optimizers.SGD(0.1)
  for ids, labels in [(IDS, LABELS), (IDS[::-1], LABELS)]:
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((tf.reduce_sum(layer({"f": ids})["f"], axis=1) - labels) ** 2)
    optimizer.apply_gradients(
      zip(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)
    )
  return layer, t


def _fresh_layer(flavour):
  import tpu_embedding

  cls = TPUEmbedding if flavour == "keras" else tpu_embedding.TPUEmbedding
  return cls({"f": E.FeatureConfig(table=make_table(E.Adagrad(0.2), values=np.zeros((4, 2))))})


@pytest.mark.parametrize("writer,reader", [("tf_keras", "keras"), ("keras", "tf_keras")])
def test_checkpoints_restore_across_keras_flavours(writer, reader, tmp_path):
  layer, _ = _trained_layer(writer)
  expected, _ = adagrad_steps(VALUES, [(IDS, LABELS), (IDS[::-1], LABELS)], 0.2)
  np.testing.assert_allclose(
    layer.variables_by_table["t"]["parameters"].numpy(), expected, rtol=1e-5
  )
  path = tf.train.Checkpoint(model=tf.train.Checkpoint(embedding=layer)).save(
    str(tmp_path / "ckpt")
  )
  assert {k for k, _ in tf.train.list_variables(path) if k.startswith("model/")} == {
    "model/embedding/_tpu_embedding/t/.ATTRIBUTES/VARIABLE_VALUE",
    "model/embedding/_tpu_embedding/t.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE",
  }

  restored = _fresh_layer(reader)
  status = tf.train.Checkpoint(model=tf.train.Checkpoint(embedding=restored)).restore(path)
  restored({"f": IDS})  # builds the layer: the tables take the checkpoint's values
  status.assert_existing_objects_matched()
  for name in ["parameters", "accumulators"]:
    np.testing.assert_array_equal(
      restored.variables_by_table["t"][name].numpy(), layer.variables_by_table["t"][name].numpy()
    )


def test_export_for_serving_reads_the_trained_tables(tmp_path):
  layer, t = _trained_layer("keras")
  model = SumModel(layer)

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
  def serve(ids):
    return model({"f": ids})

  serving.export_for_serving(model, str(tmp_path / "export"), signatures=serve)
  loaded = tf.saved_model.load(str(tmp_path / "export"))
  table = layer.embedding_tables[t].numpy()
  np.testing.assert_allclose(
    loaded.signatures["serving_default"](ids=tf.constant(IDS))["output_0"].numpy(),
    table[IDS].sum(axis=1),
    rtol=1e-6,
  )


# ---------------------------------------------------------------------------------------------
# .keras files


def test_keras_file_round_trip_keeps_tables_slots_and_training(tmp_path):
  t = make_table(keras.optimizers.Adam(0.05, beta_1=0.8))
  layer = TPUEmbedding({"f": E.FeatureConfig(table=t)})
  model = build_model("functional", layer)
  model.compile(optimizer="sgd", loss="mse", jit_compile=False)
  model.fit({"f": IDS}, LABELS, batch_size=4, epochs=1, verbose=0)
  model.save(str(tmp_path / "model.keras"))

  loaded = keras.models.load_model(str(tmp_path / "model.keras"))
  (loaded_layer,) = [layer for layer in loaded.layers if isinstance(layer, TPUEmbedding)]
  for name in ["parameters", "momenta", "velocities"]:
    np.testing.assert_array_equal(
      loaded_layer.variables_by_table["t"][name].numpy(),
      layer.variables_by_table["t"][name].numpy(),
    )
  (saved_table,) = loaded_layer.get_config()["feature_config"]["tables"]
  assert saved_table["optimizer"]["class"] == "Adam"
  assert saved_table["optimizer"]["config"]["beta_1"] == pytest.approx(0.8)
  assert saved_table["optimizer"]["config"]["learning_rate"] == pytest.approx(0.05)
  # Both go on training the same way.
  for m in (model, loaded):
    m.fit({"f": IDS}, LABELS, batch_size=4, epochs=1, verbose=0)
  np.testing.assert_allclose(
    loaded_layer.variables_by_table["t"]["parameters"].numpy(),
    layer.variables_by_table["t"]["parameters"].numpy(),
    rtol=1e-6,
  )


def test_keras_file_with_a_table_of_another_shape_is_refused(tmp_path):
  layer = TPUEmbedding({"f": E.FeatureConfig(table=make_table(E.SGD(0.1)))})
  store = {"table:t": np.zeros((5, 2), np.float32)}
  before = layer.variables_by_table["t"]["parameters"].numpy()
  with pytest.raises(ValueError, match=r"'table:t' has shape \[5, 2\].*\[4, 2\]"):
    layer.load_own_variables(store)
  np.testing.assert_array_equal(layer.variables_by_table["t"]["parameters"].numpy(), before)


def test_export_for_serving_lowers_the_keras_layers_tables(tmp_path):
  layer, t = _trained_layer("keras")
  model = SumModel(layer)

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
  def serve(ids):
    return model({"f": ids})

  path = str(tmp_path / "export")
  serving.export_for_serving(model, path, signatures=serve, table_dtype="int8")
  loaded = tf.saved_model.load(path)
  table = layer.embedding_tables[t].numpy()
  decoded = loaded.embedding_tables[t.name]().numpy()
  codes = loaded.embedding_tables[t.name].stored()["codes"].numpy()
  # int8 rows of two distinct values: the smaller is code 0 (the bias), the larger 255.
  np.testing.assert_array_equal(np.sort(codes, axis=1), [[0, 255]] * len(table))
  step = (table.max(axis=1) - table.min(axis=1)) / 255
  assert np.all(np.abs(decoded - table) <= step[:, None] / 2 + 1e-7)
  np.testing.assert_allclose(
    loaded.signatures["serving_default"](ids=tf.constant(IDS))["output_0"].numpy(),
    decoded[IDS].sum(axis=1),
    rtol=1e-6,
  )
