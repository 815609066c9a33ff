"""Writes checkpoints with tf-recommenders 0.7.7's own layers; used by the checkpoint tests.

Run as `TF_USE_LEGACY_KERAS=1 python tests/jobs/tfrs_checkpoint_writer.py OUT_DIR`. tf-recommenders
needs
`tf.keras` to be Keras 2, decided when TensorFlow is first imported, hence a subprocess. For every
(layer, optimizer) in `CASES` it trains a two-table model for two steps with `model.fit`, as a
tf-recommenders user does (the layer and `compile` share one Keras optimizer), and saves
`tf.train.Checkpoint(model=model, optimizer=optimizer)` to OUT_DIR/<layer>-<optimizer>/ckpt (and,
before the first step, to OUT_DIR/<layer>-<optimizer>-untrained/ckpt-1, with `save`). The tests
import this module (without tf-recommenders) to build the same model with this package's layers and
restore those files. `--read CKPT OUT.npz LAYER` goes the other way: it restores a checkpoint
written by this package into tf-recommenders' LAYER and saves what it got.
"""

import os
import sys

import numpy as np
import tensorflow as tf

E = tf.tpu.experimental.embedding
OPTIMIZERS = ("sgd", "adagrad", "adam", "ftrl")
CASES = [("TPUEmbedding", name) for name in OPTIMIZERS] + [
  ("PartialTPUEmbedding", name) for name in ("adagrad", "adam")
]
# PartialTPUEmbedding threshold: "small" (8 rows, shared by two features) is replicated and
# "large" (30 rows) sharded.
SIZE_THRESHOLD = 10
IDS = {"a": [0, 3, 3, 7], "b": [1, 3, 5, 0], "c": [29, 0, 4, 4]}
LABELS = [[1.0], [0.0], [2.0], [1.0]]


def feature_config():
  small = E.TableConfig(8, 4, name="small", initializer=tf.constant_initializer(0.1))
  large = E.TableConfig(30, 2, name="large", initializer=tf.constant_initializer(-0.2))
  return {"a": E.FeatureConfig(small), "b": E.FeatureConfig(small), "c": E.FeatureConfig(large)}


def keras_optimizer(name, optimizers):
  """The same Keras optimizer in either process (`optimizers` is its legacy namespace)."""
  return {
    "sgd": lambda: optimizers.SGD(0.1),
    "adagrad": lambda: optimizers.Adagrad(0.5),
    "adam": lambda: optimizers.Adam(0.1),
    "ftrl": lambda: optimizers.Ftrl(0.3),
  }[name]()


def build_model(layer, optimizer, keras):
  """A ranking model around `layer`, built with the Keras namespace `keras`."""

  class Model(keras.Model):
    def __init__(self):
      super().__init__()
      self.embedding = layer
      self.dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(0.5))

    def call(self, features):
      activations = self.embedding(features)
      return self.dense(tf.concat([activations[k] for k in sorted(activations)], axis=1))

  model = Model()
  model.compile(optimizer, loss="mse")
  return model


def inputs():
  return {k: tf.constant(v, tf.int64) for k, v in IDS.items()}


def main(out_dir):
  from tensorflow_recommenders.experimental.layers.embedding import PartialTPUEmbedding
  from tensorflow_recommenders.layers.embedding import TPUEmbedding

  for layer_name, optimizer_name in CASES:
    tf.keras.utils.set_random_seed(0)
    optimizer = keras_optimizer(optimizer_name, tf.keras.optimizers.legacy)
    if layer_name == "TPUEmbedding":
      layer = TPUEmbedding(feature_config(), optimizer)
    else:
      layer = PartialTPUEmbedding(feature_config(), optimizer, size_threshold=SIZE_THRESHOLD)
    model = build_model(layer, optimizer, tf.keras)
    model(inputs())  # built, not trained: the Keras optimizer has no variable yet
    tf.train.Checkpoint(model=model, optimizer=optimizer).save(  # as `ckpt-1`
      os.path.join(out_dir, f"{layer_name}-{optimizer_name}-untrained", "ckpt")
    )
    data = tf.data.Dataset.from_tensors((inputs(), tf.constant(LABELS))).repeat(2)
    model.fit(data, verbose=0)
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(
      os.path.join(out_dir, f"{layer_name}-{optimizer_name}", "ckpt")
    )


def read(path, out, layer_name):
  """Restores the checkpoint at `path` into tf-recommenders' `layer_name` model (Adagrad) and
  saves, by table, the table and Keras accumulator it ended with (NaN: none) to `out`."""
  from tensorflow_recommenders.experimental.layers.embedding import PartialTPUEmbedding
  from tensorflow_recommenders.layers.embedding import TPUEmbedding

  optimizer = keras_optimizer("adagrad", tf.keras.optimizers.legacy)
  if layer_name == "TPUEmbedding":
    layer = TPUEmbedding(feature_config(), optimizer)
  else:
    layer = PartialTPUEmbedding(feature_config(), optimizer, size_threshold=SIZE_THRESHOLD)
  model = build_model(layer, optimizer, tf.keras)
  model(inputs())
  tf.train.Checkpoint(model=model, optimizer=optimizer).read(path).expect_partial()
  values = {}
  for variable in model.embedding.trainable_variables:  # the tables, told apart by shape
    table = {(8, 4): "small", (30, 2): "large"}[tuple(variable.shape)]
    values[table] = variable.numpy()
    try:
      values[table + "/accumulator"] = optimizer.get_slot(variable, "accumulator").numpy()
    except KeyError:  # a Keras Embedding's slot is made by its first update, if not restored
      values[table + "/accumulator"] = np.full(variable.shape, np.nan, np.float32)
  np.savez(out, **values)


if __name__ == "__main__":
  if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    sys.exit("run with TF_USE_LEGACY_KERAS=1 (tf-recommenders needs tf.keras to be Keras 2)")
  if sys.argv[1] == "--read":
    read(*sys.argv[2:5])
  else:
    main(sys.argv[1])
