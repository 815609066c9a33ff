"""One process of the multi-worker test: trains a fixed set of global batches, writes the table
(`plain.npy`); then, under the same strategy, the managed-ids runs of `multiworker_managed_job`
(`managed_ids.npy`: remapped outside strategy.run; `managed_raw_keys.npy`: raw keys inside it).
A process makes one MultiWorkerMirroredStrategy, so all share it.

Run as `python tests/jobs/multiworker_job.py OUT_DIR` with TF_CONFIG set for
MultiWorkerMirroredStrategy,
or without TF_CONFIG for the single-process reference run on the same global batches.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tpu_embedding  # noqa: E402

import multiworker_managed_job  # noqa: E402  (this script's folder)

E = tf.tpu.experimental.embedding
GLOBAL_BATCH = 8


def strategy_of_this_process() -> tf.distribute.Strategy:
  """MultiWorkerMirroredStrategy with TF_CONFIG set; the default strategy for the reference."""
  if "TF_CONFIG" in os.environ:
    return tf.distribute.MultiWorkerMirroredStrategy()
  return tf.distribute.get_strategy()


def train(strategy: tf.distribute.Strategy, out_path: str) -> None:
  rng = np.random.default_rng(3)
  values = rng.normal(size=(9, 2)).astype(np.float32)
  bags = [rng.integers(0, 9, size=(GLOBAL_BATCH, 3)) for _ in range(3)]
  for batch in bags:
    batch[:2, 1:] = -1  # ragged: the worker holding the first rows gets fewer ids
  with strategy.scope():
    table = E.TableConfig(
      vocabulary_size=9,
      dim=2,
      combiner="sum",
      name="t",
      initializer=tf.constant_initializer(values),
    )
    layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table), E.Adagrad(0.1))
    dense = tf_keras.layers.Dense(1, kernel_initializer="ones")
    optimizer = tf_keras.optimizers.SGD(0.01)

  def replica_step(ids):
    with tf.GradientTape() as tape:
      out = dense(layer(tf.RaggedTensor.from_tensor(ids, padding=-1)))
      loss = tf.reduce_sum(out * out) / GLOBAL_BATCH
    variables = layer.trainable_variables + dense.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

  dataset = tf.data.Dataset.from_tensor_slices(np.concatenate(bags)).batch(GLOBAL_BATCH)
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
  dist = strategy.experimental_distribute_dataset(dataset.with_options(options))

  @tf.function
  def run(ids):
    strategy.run(replica_step, args=(ids,))

  for ids in dist:
    run(ids)
  np.save(out_path, layer.embedding_tables[table].numpy())


def main(out_dir: str) -> None:
  strategy = strategy_of_this_process()
  train(strategy, os.path.join(out_dir, "plain.npy"))
  multiworker_managed_job.train(strategy, os.path.join(out_dir, "managed_ids.npy"))
  multiworker_managed_job.train_raw_keys(strategy, os.path.join(out_dir, "managed_raw_keys.npy"))
  if "TF_CONFIG" in os.environ:
    print(json.dumps({"task": json.loads(os.environ["TF_CONFIG"])["task"]}))


if __name__ == "__main__":
  main(sys.argv[1])
