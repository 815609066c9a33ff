"""The managed-ids part of a multi-worker test process (`tests/jobs/multiworker_job.py` runs it
under its
strategy): every worker remaps each global batch with its own copy of the map (outside
strategy.run), trains its half; writes the table and the rows of every key seen.
"""

import numpy as np
import tensorflow as tf

import tpu_embedding

E = tf.tpu.experimental.embedding
GLOBAL_BATCH = 8


def train(strategy: tf.distribute.Strategy, out_path: str) -> None:
  rng = np.random.default_rng(4)
  universe = rng.integers(-(2**62), 2**62, size=10)
  batches = [universe[rng.integers(0, 10, size=GLOBAL_BATCH)] for _ in range(6)]
  upstreams = [rng.normal(size=(GLOBAL_BATCH, 2)).astype("f4") for _ in range(6)]
  with strategy.scope():
    table = E.TableConfig(6, 2, initializer=tf.constant_initializer(0.3), name="t")
    layer = tpu_embedding.TPUEmbedding(
      {"f": E.FeatureConfig(table, name="f")},
      E.Adagrad(0.2),
      managed_ids={"t": tpu_embedding.ManagedIds(eviction="lru")},
    )

  def replica_step(rows, upstream):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer({"f": rows}, remapped=True)["f"] * upstream)
    tape.gradient(loss, layer.trainable_variables)

  @tf.function
  def run(rows, upstream):
    strategy.run(replica_step, args=(rows, upstream))

  replicas = strategy.num_replicas_in_sync

  def share(value):
    return strategy.experimental_distribute_values_from_function(
      lambda context: tf.split(value, replicas)[context.replica_id_in_sync_group]
    )

  for keys, upstream in zip(batches, upstreams):
    rows = layer.remap({"f": tf.constant(keys)})["f"]  # the global batch, on every worker
    run(share(rows), share(tf.constant(upstream)))
  probe = layer.managed_ids["t"].lookup(tf.constant(universe)).numpy()
  np.save(out_path, np.concatenate([layer.embedding_tables[table].numpy().ravel(), probe]))
