"""A small tf-keras model around each tf-keras embedding layer, built the same way by the test
(tests/test_weight_files.py) and by the fresh process that reloads the files it saved.

`main` builds the model anew for each file, loads the file with `model.load_weights` and writes
every table and slot before and after, and the model's predictions, to an .npz file.
"""

import numpy as np
import tensorflow as tf
import tf_keras

import tpu_embedding

E = tf.tpu.experimental.embedding
IDS = {
  "a": (np.arange(16, dtype=np.int32) % 20).reshape(16, 1),
  "b": (np.arange(16, dtype=np.int32) * 3 % 50).reshape(16, 1),
}
LABELS = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(16, 1)
# Raw keys for the "managed" kind, whose table "large" gives rows to keys (managed_ids).
KEYS = IDS["b"].astype(np.int64) * 1000 + 7


def _features():
  small = E.TableConfig(20, 3, name="small")
  large = E.TableConfig(50, 2, name="large")
  return {"a": E.FeatureConfig(small, name="a"), "b": E.FeatureConfig(large, name="b")}


LAYERS = {
  "TPUEmbedding": lambda: tpu_embedding.TPUEmbedding(_features(), E.Adagrad(0.5)),
  "pipelined": lambda: tpu_embedding.TPUEmbedding(
    _features(), E.Adagrad(0.5), pipeline_execution_with_tensor_core=True
  ),
  # "small" replicated, "large" sharded (on its TPUEmbedding sublayer).
  "PartialTPUEmbedding": lambda: tpu_embedding.PartialTPUEmbedding(
    _features(), E.Adagrad(0.5), size_threshold=30
  ),
  "managed": lambda: tpu_embedding.TPUEmbedding(
    _features(), E.Adagrad(0.5), managed_ids={"large": tpu_embedding.ManagedIds()}
  ),
}


def ids(kind):
  """The model's inputs: ids, or for "managed" raw keys of feature "b"."""
  return dict(IDS, b=KEYS) if kind == "managed" else IDS


def build(kind):
  """(model, embedding layer): a functional model, compiled."""
  inputs = {
    key: tf_keras.Input((1,), dtype=value.dtype.name, name=key) for key, value in ids(kind).items()
  }
  layer = LAYERS[kind]()
  out = layer(inputs)
  joined = tf_keras.layers.Concatenate()([out["a"], out["b"]])
  # A fixed kernel: the gradients, and so how far the slots move, the same in every run.
  dense = tf_keras.layers.Dense(1, kernel_initializer="ones")
  model = tf_keras.Model(inputs, dense(joined))
  model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss="mse")
  return model, layer


def state(layer):
  """{"<table>/<parameters or slot>": values} of every table and slot, and for a managed table
  "<table>/rows of keys": the rows its map gives the scenario's keys."""
  values = {
    f"{table}/{slot}": variable.numpy()
    for table, variables in layer.variables_by_table.items()
    for slot, variable in variables.items()
  }
  for table, id_map in (layer.managed_ids or {}).items():
    values[f"{table}/rows of keys"] = id_map.lookup(KEYS.reshape(-1)).numpy()
  return values


def main(kind, out, paths):
  arrays = {}
  for i, path in enumerate(paths):
    model, layer = build(kind)
    arrays.update({f"{i}:before:{k}": v for k, v in state(layer).items()})
    model.load_weights(path)
    arrays.update({f"{i}:after:{k}": v for k, v in state(layer).items()})
    arrays[f"{i}:prediction"] = model.predict(ids(kind), verbose=0)
  np.savez(out, **arrays)
