"""Writes tests/data/string_key_maps/: files of a string-key managed map as tpu_embedding wrote
them before such maps held fingerprints (keys stored as strings): a tf.train.Checkpoint, a
`.weights.h5` and a `.keras` file, and `state.json` (the map's exported strings, rows, counts,
step, and its table). Run once with that release's package on PYTHONPATH (it was main at
a8de19d): `PYTHONPATH=<old tree> python tests/jobs/write_string_key_files.py <folder>`.
"""

import json
import os
import sys

import tensorflow as tf
import tf_keras

import tpu_embedding

E = tf.tpu.experimental.embedding
# Trained in this order; "" and an embedded NUL included. With capacity 5 (4 keys' rows) and
# min_count 2, some keys wait as candidates and some rows are taken over.
STREAM = [
  [b"apple", b"pear", b"apple", b"", b"fig"],
  [b"pear", b"fig", b"k\x00y", b"k\x00y", b""],
  [b"plum", b"plum", b"apple", b"kiwi"],
]


def model():
  table = E.TableConfig(5, 2, initializer=tf.constant_initializer(0.5), name="movies")
  layer = tpu_embedding.TPUEmbedding(
    {"movie": E.FeatureConfig(table, name="movie")},
    optimizer=E.SGD(0.5),
    managed_ids={"movies": tpu_embedding.ManagedIds(key_dtype=tf.string, min_count=2)},
  )
  ids = tf_keras.Input((None,), dtype="string", name="movie")
  return tf_keras.Model({"movie": ids}, layer({"movie": ids})["movie"]), layer


def main(folder):
  keras_model, layer = model()
  for keys in STREAM:
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(keras_model({"movie": tf.constant([keys])}, training=True))
    tape.gradient(loss, keras_model.trainable_variables)
  tf.train.Checkpoint(layer=layer).save(os.path.join(folder, "ckpt"))  # ckpt-1
  keras_model.save_weights(os.path.join(folder, "w.weights.h5"))
  keras_model.save(os.path.join(folder, "m.keras"))
  keys, rows, counts = (t.numpy().tolist() for t in layer.managed_ids["movies"].export())
  state = {
    "keys": [k.decode("latin-1") for k in keys],
    "rows": rows,
    "counts": counts,
    "step": int(layer.managed_ids["movies"].step),
    "candidates": sorted(
      [k.decode("latin-1"), int(c)]
      for k, c in zip(
        *(t.numpy().tolist() for t in layer.managed_ids["movies"].candidates.export())
      )
    ),
    "table": layer.variables_by_table["movies"]["parameters"].numpy().tolist(),
  }
  with open(os.path.join(folder, "state.json"), "w") as f:
    json.dump(state, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
