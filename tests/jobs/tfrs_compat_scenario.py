"""tf-recommenders' own layer test scenario, runnable with either layer; used by test_tfrs_compat.

Run as `TF_USE_LEGACY_KERAS=1 python tests/jobs/tfrs_compat_scenario.py OUT.json`. tf-recommenders
needs `tf.keras` to be Keras 2, which TensorFlow decides when it is first imported, so this runs
in its own process. The scenario is written as code for tf-recommenders is written (`tf.keras`,
`tf.keras.optimizers.legacy`, `strategy.run` in a `tf.function`); the only thing that changes
between the two runs is where `TPUEmbedding` is imported from.

For every (optimizer, training, sparse) with our layer, and for SGD/Adagrad training with
tf-recommenders' layer, it records the loss and the activations
of two consecutive steps into OUT.json; the test compares them with values computed by hand.
"""

import itertools
import json
import os
import sys
import time

if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
  sys.exit("run with TF_USE_LEGACY_KERAS=1 (tf-recommenders needs tf.keras to be Keras 2)")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

KEYS = ["watched", "favorited", "friends"]
BATCH = 4
# The ids of tf-recommenders' test, one bag per row.
IDS = {
  "watched": ([0, 0, 1, 0, 1, 1], [1, 2, 2, 1], 2),
  "favorited": ([0, 1, 1, 0, 0, 1], [2, 1, 1, 2], 2),
  "friends": ([3, 0, 1, 2, 3, 0, 1, 2], [1, 3, 1, 3], 3),
}
DENSE = [10.7, 11.4, 10.7, 11.4]


def layer_class(implementation):
  if implementation == "tpu_embedding":
    from tpu_embedding import TPUEmbedding  # the only change a tf-recommenders user makes
  else:
    from tensorflow_recommenders.layers.embedding import TPUEmbedding
  return TPUEmbedding


def feature_config():
  initializer = tf.constant_initializer(np.array(list(range(8)), dtype=np.float64))
  video = tf.tpu.experimental.embedding.TableConfig(
    vocabulary_size=2, dim=4, initializer=initializer, combiner="sum", name="video_table"
  )
  user = tf.tpu.experimental.embedding.TableConfig(
    vocabulary_size=4, dim=2, initializer=initializer, combiner="mean", name="user_table"
  )
  return {
    "watched": tf.tpu.experimental.embedding.FeatureConfig(table=video, name="watched"),
    "favorited": tf.tpu.experimental.embedding.FeatureConfig(table=video, name="favorited"),
    "friends": tf.tpu.experimental.embedding.FeatureConfig(table=user, name="friends"),
  }


def create_optimizer(name):
  if name == "sgd":
    return tf.keras.optimizers.legacy.SGD(learning_rate=0.1)
  if name == "adagrad":
    return tf.keras.optimizers.legacy.Adagrad(learning_rate=0.1, initial_accumulator_value=10)
  if name == "adam":
    return tf.keras.optimizers.legacy.Adam(
      learning_rate=0.1, beta_1=0.9, beta_2=0.999, epsilon=1e-08
    )
  raise ValueError(name)


def create_model(embedding_class, optimizer_name, sparse):
  strategy = tf.distribute.get_strategy()
  with strategy.scope():
    optimizer = create_optimizer(optimizer_name)
    embedding_layer = embedding_class(feature_config=feature_config(), optimizer=optimizer)
    input_args = {
      "batch_size": BATCH,
      "shape": (),
      "sparse" if sparse else "ragged": True,
      "dtype": tf.int32,
    }
    embedding_inputs = {key: tf.keras.Input(**input_args, name=key) for key in KEYS}
    activations = embedding_layer(embedding_inputs)
    dense_input = tf.keras.Input(shape=())
    inputs = {"dense": dense_input}
    inputs.update(embedding_inputs)
    model = tf.keras.Model(inputs=inputs, outputs=(activations, dense_input))
  return model, strategy, optimizer


def create_dataset(sparse):
  features = {}
  for key, (values, lengths, width) in IDS.items():
    if sparse:
      indices = [[row, i] for row, n in enumerate(lengths) for i in range(n)]
      features[key] = tf.SparseTensor(
        indices=indices, values=tf.constant(values, dtype=tf.int32), dense_shape=[BATCH, width]
      )
    else:
      features[key] = tf.RaggedTensor.from_row_lengths(
        row_lengths=lengths, values=tf.constant(values, dtype=tf.int32)
      )
  features["dense"] = tf.constant(DENSE, dtype=tf.float32)
  return tf.data.Dataset.from_tensors(features).repeat()


def total_loss_tensor(activations):
  losses = [
    tf.reduce_mean(tf.reduce_sum(tf.math.squared_difference(activations[key], 0), 1))
    for key in activations
  ]
  return tf.expand_dims(sum(losses), 0)


def run_scenario(embedding_class, optimizer_name, training, sparse, steps=2):
  model, strategy, optimizer = create_model(embedding_class, optimizer_name, sparse)
  dist = strategy.experimental_distribute_dataset(
    create_dataset(sparse), options=tf.distribute.InputOptions(experimental_fetch_to_device=False)
  )
  dist_iter = iter(dist)

  @tf.function
  def test_fn():

    def step(features):
      if not training:
        activations, _ = model(features)
        total_loss = total_loss_tensor(activations)
      else:
        with tf.GradientTape() as tape:
          activations, _ = model(features)
          total_loss = total_loss_tensor(activations)
          loss_per_replica = total_loss / strategy.num_replicas_in_sync
        gradients = tape.gradient(loss_per_replica, model.trainable_variables)
        optimizer.apply_gradients(list(zip(gradients, model.trainable_variables)))
      return [total_loss] + [activations[key] for key in KEYS]

    return strategy.run(step, args=(next(dist_iter),))

  results = []
  for _ in range(steps):
    out = test_fn()
    assert len(out) == 4, out  # upstream's only check: the loss and three activations
    results.append(
      {
        "loss": out[0].numpy().tolist(),
        **{key: value.numpy().tolist() for key, value in zip(KEYS, out[1:])},
      }
    )
  return results


def main(out_path):
  assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
  report = {"keras": tf.keras.__name__, "scenarios": []}
  for implementation in ("tpu_embedding", "tfrs"):
    embedding_class = layer_class(implementation)
    for optimizer_name, training, sparse in itertools.product(
      ["sgd", "adagrad", "adam"], [True, False], [True, False]
    ):
      if implementation == "tfrs" and (not training or optimizer_name == "adam"):
        # tf-recommenders is the reference: its lookups do not depend on the optimizer or on
        # training, and its Adam (Keras, bias-corrected) is not the TPU's, so nothing to compare.
        continue
      entry = {
        "implementation": implementation,
        "optimizer": optimizer_name,
        "training": training,
        "sparse": sparse,
      }
      start = time.perf_counter()
      try:
        entry["steps"] = run_scenario(embedding_class, optimizer_name, training, sparse)
      except Exception as e:  # reported per scenario, so one failure does not hide the others
        entry["error"] = f"{type(e).__name__}: {e}"
      entry["seconds"] = time.perf_counter() - start
      report["scenarios"].append(entry)
  with open(out_path, "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(sys.argv[1])
