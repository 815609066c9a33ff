"""The coordinator's side of `sharded_dlrm`: a DLRM-shaped model whose tables are row-sharded
over parameter servers, trained, checkpointed, restored unsharded and exported for serving.

`run_on_cluster(spec, args)` makes this process the coordinator of a `ParameterServerStrategy`
on the running cluster `spec`, whose `variable_partitioner` shards every embedding table (and
its optimizer slots) by rows over the ps tasks.
"""

from __future__ import annotations

import os
import time

import tensorflow as tf
import tf_keras

import tpu_embedding
from tpu_embedding import serving

E = tf.tpu.experimental.embedding
DIM = 16
DENSE_FEATURES = 13


class DLRM(tf.Module):
  """Dense features through a bottom MLP, concatenated with one embedding per table."""

  def __init__(self, num_tables: int, vocabulary_size: int):
    super().__init__(name="dlrm")
    features = {
      f"cat_{i}": E.FeatureConfig(
        table=E.TableConfig(
          vocabulary_size=vocabulary_size,
          dim=DIM,
          combiner="sum",
          name=f"table_{i}",
        )
      )
      for i in range(num_tables)
    }
    self.embedding = tpu_embedding.TPUEmbedding(features, E.Adagrad(0.05))
    self.bottom = tf_keras.layers.Dense(DIM, activation="relu")
    self.top = tf_keras.Sequential(
      [tf_keras.layers.Dense(32, activation="relu"), tf_keras.layers.Dense(1)]
    )
    # Create every variable now, under the caller's strategy.
    self.embedding.variables_by_table
    self(*synthetic_batch(tf.constant(0, tf.int64), 1, num_tables, vocabulary_size)[:2])

  def __call__(self, dense: tf.Tensor, ids: dict) -> tf.Tensor:
    embedded = self.embedding(ids)
    parts = [self.bottom(dense)] + [embedded[name] for name in sorted(ids)]
    return self.top(tf.concat(parts, axis=1))[:, 0]

  @property
  def dense_variables(self) -> list:
    return self.bottom.trainable_variables + self.top.trainable_variables


def synthetic_batch(step: tf.Tensor, batch: int, num_tables: int, vocabulary_size: int):
  """(dense, ids, labels) of one step; the label depends on the first table's id."""
  seed = tf.stack([step, tf.constant(7, tf.int64)])
  dense = tf.random.stateless_uniform([batch, DENSE_FEATURES], seed)
  ids = {
    f"cat_{i}": tf.random.stateless_uniform(
      [batch], seed + i + 1, maxval=vocabulary_size, dtype=tf.int64
    )
    for i in range(num_tables)
  }
  labels = tf.cast(ids["cat_0"] % 2 == 0, tf.float32)
  return dense, ids, labels


def train(strategy, model: DLRM, args) -> list[float]:
  """Schedules `args.steps` steps on the workers; returns the loss of every step."""
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

  @tf.function
  def worker_step(step):
    def replica_step(step):
      dense, ids, labels = synthetic_batch(step, args.batch, args.tables, args.vocabulary)
      with tf.GradientTape() as tape:
        logits = model(dense, ids)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
      # The tables are updated by the embedding layer's own optimizer as the tape
      # reaches them; the dense layers by plain SGD here.
      grads = tape.gradient(loss, model.dense_variables + model.embedding.trainable_variables)
      for variable, grad in zip(model.dense_variables, grads):
        variable.assign_sub(0.1 * grad)
      return loss

    return strategy.run(replica_step, args=(step,))

  losses = [
    coordinator.schedule(worker_step, args=(tf.constant(step, tf.int64),))
    for step in range(args.steps)
  ]
  coordinator.join()
  return [float(loss.fetch()) for loss in losses]


def export(checkpoint: str, args, export_dir: str) -> str:
  """Restores the sharded checkpoint into an unsharded model and exports it for serving."""
  model = DLRM(args.tables, args.vocabulary)
  tf.train.Checkpoint(model=model).read(checkpoint).assert_existing_objects_matched()
  # Named specs: the serving signature's inputs are `dense`, `cat_0`, `cat_1`, ...
  spec = (
    tf.TensorSpec([None, DENSE_FEATURES], tf.float32, name="dense"),
    {f"cat_{i}": tf.TensorSpec([None], tf.int64, name=f"cat_{i}") for i in range(args.tables)},
  )
  predict = tf.function(lambda dense, ids: tf.sigmoid(model(dense, ids)), input_signature=spec)
  return serving.export_for_serving(model, export_dir, predict, overwrite=True)


def shard_count(table) -> int:
  """A sharded table (a `ShardedVariable`) lists its shards in `variables`; a table the
  partitioner left whole (it fits one shard) is a single variable."""
  return len(getattr(table, "variables", [table]))


def run(strategy, args) -> None:
  with strategy.scope():
    model = DLRM(args.tables, args.vocabulary)
  shards = shard_count(model.embedding.variables_by_table["table_0"]["parameters"])
  print(
    f"{args.tables} tables of {args.vocabulary} x {DIM}, "
    f"each in {shards} shard{'s' if shards > 1 else ''}",
    flush=True,
  )
  start = time.monotonic()
  losses = train(strategy, model, args)
  elapsed = time.monotonic() - start
  print(
    f"{args.steps} steps of {args.batch} examples in {elapsed:.1f} s "
    f"({args.steps * args.batch / elapsed:.0f} examples/s); "
    f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
  )
  checkpoint = tf.train.Checkpoint(model=model).write(os.path.join(args.output_dir, "ckpt"))
  print(f"checkpoint: {checkpoint}")
  print(f"serving export: {export(checkpoint, args, os.path.join(args.output_dir, 'export'))}")


def sharded_strategy(resolver, num_ps: int) -> tf.distribute.ParameterServerStrategy:
  """Variables of 256 KiB and more (the tables and their slots) split by rows over the ps
  tasks, in shards of at least 256 KiB; the small dense layers stay whole."""
  partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=256 << 10, max_shards=num_ps
  )
  return tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)


def run_on_cluster(spec: dict[str, list[str]], args) -> None:
  """Coordinates the running cluster `spec` (its "ps" and "worker" task addresses)."""
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(spec), rpc_layer="grpc"
  )
  run(sharded_strategy(resolver, len(spec["ps"])), args)
