"""Tests of the Keras 3 `PartialTPUEmbedding` on the CPU path: both sides train the same as the
tf-keras layer, in `model.fit`, and checkpoints restore into a tf-keras `TPUEmbedding`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.keras import PartialTPUEmbedding

E = tf.tpu.experimental.embedding
IDS = {"small": np.array([0, 1, 1, 2], np.int32), "large": np.array([5, 5, 0, 7], np.int32)}
LABELS = np.array([1.0, 0.0, 2.0, -1.0], np.float32)


def tables():
  small = E.TableConfig(3, 2, name="small", initializer=tf.constant_initializer(0.5))
  large = E.TableConfig(8, 2, name="large", initializer=tf.constant_initializer(-0.25))
  return small, large


def expected_sgd(lr):
  """One SGD step of mean squared error on pred = sum of both activations, per table."""
  small = np.full((3, 2), 0.5)
  large = np.full((8, 2), -0.25)
  pred = small[IDS["small"]].sum(1) + large[IDS["large"]].sum(1)
  dpred = 2 * (pred - LABELS) / len(LABELS)
  for table, ids in [(small, IDS["small"]), (large, IDS["large"])]:
    update = np.zeros_like(table)
    for i, d in zip(ids, dpred):
      update[i] += d
    table -= lr * update
  return small, large


@pytest.mark.parametrize("size_threshold", [5, None])
def test_table_updates_by_the_model_optimizer_are_refused(size_threshold):
  """Keras 3 optimizers only update Keras variables: "keras" would leave the tables untrained,
  even when every table is replicated (no sharded layer there to refuse it)."""
  small, large = tables()
  with pytest.raises(ValueError, match="table_updates='keras'"):
    PartialTPUEmbedding(
      {"small": E.FeatureConfig(small), "large": E.FeatureConfig(large)},
      "sgd",
      size_threshold=size_threshold,
      table_updates="keras",
    )


@pytest.mark.parametrize("size_threshold", [5, None, 0])
def test_fit_trains_both_sides_like_numpy(size_threshold):
  small, large = tables()
  layer = PartialTPUEmbedding(
    {"small": E.FeatureConfig(small), "large": E.FeatureConfig(large)},
    E.SGD(0.5),
    size_threshold=size_threshold,
  )
  assert [layer.side(t) for t in ("small", "large")] == {
    5: ["replicated", "sharded"],
    None: ["replicated"] * 2,
    0: ["sharded"] * 2,
  }[size_threshold]
  inputs = {k: keras.Input(shape=(), dtype="int32", name=k) for k in IDS}
  activations = layer(inputs)
  model = keras.Model(inputs, keras.ops.sum(activations["small"] + activations["large"], axis=1))
  model.compile(optimizer="adam", loss="mse", jit_compile=False)
  model.fit(IDS, LABELS, batch_size=4, epochs=1, verbose=0)
  want_small, want_large = expected_sgd(0.5)
  np.testing.assert_allclose(layer.embedding_tables[small].numpy(), want_small, rtol=1e-6)
  np.testing.assert_allclose(layer.embedding_tables[large].numpy(), want_large, rtol=1e-6)


def test_checkpoint_restores_into_the_tf_keras_layer(tmp_path):
  import tpu_embedding

  small, large = tables()
  config = {"small": E.FeatureConfig(small), "large": E.FeatureConfig(large)}
  layer = PartialTPUEmbedding(config, E.Adagrad(0.5), size_threshold=5)
  with tf.GradientTape() as tape:
    out = layer({k: tf.constant(v) for k, v in IDS.items()})
    loss = tf.reduce_sum(out["small"]) - tf.reduce_sum(out["large"])
  tape.gradient(loss, layer.trainable_variables)  # the trap's gradient trains both sides
  path = tf.train.Checkpoint(embedding=layer).save(str(tmp_path / "ckpt"))

  fresh_small, fresh_large = tables()
  reader = tpu_embedding.TPUEmbedding(
    {"small": E.FeatureConfig(fresh_small), "large": E.FeatureConfig(fresh_large)}, E.Adagrad(0.5)
  )
  reader.build(None)
  tf.train.Checkpoint(embedding=reader).restore(path).assert_existing_objects_matched()
  trained = {t.name: v.numpy() for t, v in layer.embedding_tables.items()}
  assert not np.allclose(trained["small"], 0.5) and not np.allclose(trained["large"], -0.25)
  for name, values in trained.items():
    np.testing.assert_array_equal(reader.variables_by_table[name]["parameters"].numpy(), values)


def test_keras_file_round_trip_of_both_sides(tmp_path):
  small, large = tables()
  layer = PartialTPUEmbedding(
    {"small": E.FeatureConfig(small), "large": E.FeatureConfig(large)},
    E.Adagrad(0.5),
    size_threshold=5,
  )
  inputs = {k: keras.Input(shape=(), dtype="int32", name=k) for k in IDS}
  activations = layer(inputs)
  model = keras.Model(inputs, keras.ops.sum(activations["small"] + activations["large"], axis=1))
  model.compile(optimizer="sgd", loss="mse", jit_compile=False)
  model.fit(IDS, LABELS, batch_size=4, epochs=1, verbose=0)
  model.save(str(tmp_path / "partial.keras"))
  loaded = keras.models.load_model(str(tmp_path / "partial.keras"))
  (loaded_layer,) = [layer for layer in loaded.layers if isinstance(layer, PartialTPUEmbedding)]
  assert loaded_layer.side("large") == "sharded" and loaded_layer.side("small") == "replicated"
  trained = {t.name: v.numpy() for t, v in layer.embedding_tables.items()}
  for t, variable in loaded_layer.embedding_tables.items():
    np.testing.assert_array_equal(variable.numpy(), trained[t.name])


def test_custom_loop_under_mirrored_strategy_and_export_for_serving(tmp_path):
  from tpu_embedding import serving

  strategy = tf.distribute.MirroredStrategy(  # no collectives: see test_keras_layer
    ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
  )
  with strategy.scope():
    small, large = tables()
    layer = PartialTPUEmbedding(
      {"small": E.FeatureConfig(small), "large": E.FeatureConfig(large)},
      E.SGD(0.5),
      size_threshold=5,
    )

  def replica_step(ids, labels):
    with tf.GradientTape() as tape:
      out = layer(ids)
      pred = tf.reduce_sum(out["small"] + out["large"], axis=1)
      loss = tf.reduce_sum((pred - labels) ** 2) / 4.0  # mean over the global batch
    tape.gradient(loss, layer.trainable_variables)

  dataset = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((IDS, LABELS)).batch(4)
  )
  for ids, labels in dataset:
    tf.function(lambda ids, labels: strategy.run(replica_step, args=(ids, labels)))(ids, labels)
  want_small, want_large = expected_sgd(0.5)
  np.testing.assert_allclose(layer.embedding_tables[small].numpy(), want_small, rtol=1e-6)
  np.testing.assert_allclose(layer.embedding_tables[large].numpy(), want_large, rtol=1e-6)

  @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)] * 2)
  def serve(small, large):
    out = layer({"small": small, "large": large})
    return tf.reduce_sum(out["small"] + out["large"], axis=1)

  serving.export_for_serving(layer, str(tmp_path / "export"), signatures=serve)
  loaded = tf.saved_model.load(str(tmp_path / "export"))
  got = loaded.signatures["serving_default"](**{k: tf.constant(v) for k, v in IDS.items()})
  np.testing.assert_allclose(
    list(got.values())[0].numpy(),
    want_small[IDS["small"]].sum(1) + want_large[IDS["large"]].sum(1),
    rtol=1e-6,
  )
