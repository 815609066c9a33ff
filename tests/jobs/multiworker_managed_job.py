"""The managed-ids part of a multi-worker test process (`tests/jobs/multiworker_job.py` runs it
under its strategy): every worker remaps each global batch with its own copy of the map (outside
strategy.run), trains its half; writes the table and the rows of every key seen. Then
(`train_raw_keys`) each worker calls the layer with its half of the raw keys inside
strategy.run; writes the table, its slot and the map's export.
"""

import functools
from typing import Any

import numpy as np
import tensorflow as tf

import tpu_embedding

E = tf.tpu.experimental.embedding
GLOBAL_BATCH = 8


def shared(strategy: tf.distribute.Strategy, value: tf.Tensor) -> Any:
  """`value` (the global batch) cut into each replica's share, in replica order."""
  replicas = strategy.num_replicas_in_sync
  return strategy.experimental_distribute_values_from_function(
    lambda context: tf.split(value, replicas)[context.replica_id_in_sync_group]
  )


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

  share = functools.partial(shared, strategy)

  for keys, upstream in zip(batches, upstreams):
    rows = layer.remap({"f": tf.constant(keys)})["f"]  # the global batch, on every worker
    run(share(rows), share(tf.constant(upstream)))
  probe = layer.managed_ids["t"].lookup(tf.constant(universe)).numpy()
  np.save(out_path, np.concatenate([layer.embedding_tables[table].numpy().ravel(), probe]))


def train_raw_keys(strategy: tf.distribute.Strategy, out_path: str) -> None:
  """Two features of one managed table, raw keys in each replica: the keys of all workers meet
  in one map step per global batch, the same on every worker."""
  rng = np.random.default_rng(8)
  universe = rng.integers(-(2**62), 2**62, size=12)
  batches = [
    {f: universe[rng.integers(0, 12, size=GLOBAL_BATCH)] for f in ("a", "b", "c")} for _ in range(6)
  ]
  for features in batches:  # feature c: string keys (the empty one too), of another table
    features["c"] = np.array([str(k)[: int(k) % 5].encode() for k in features["c"]])
  upstreams = [rng.normal(size=(GLOBAL_BATCH, 2)).astype("f4") for _ in range(6)]
  with strategy.scope():
    table = E.TableConfig(7, 2, initializer=tf.constant_initializer(0.3), name="t")
    strings = E.TableConfig(5, 2, initializer=tf.constant_initializer(0.1), name="s")
    layer = tpu_embedding.TPUEmbedding(
      {
        "a": E.FeatureConfig(table, name="a"),
        "b": E.FeatureConfig(table, name="b"),
        "c": E.FeatureConfig(strings, name="c"),
      },
      E.Adagrad(0.2),
      managed_ids={
        "t": tpu_embedding.ManagedIds(eviction="lfu"),
        "s": tpu_embedding.ManagedIds(key_dtype=tf.string, eviction="lru"),
      },
    )

  def replica_step(features, upstream):
    with tf.GradientTape() as tape:
      out = layer(features)
      loss = tf.reduce_sum((out["a"] - out["b"] + out["c"]) * upstream)
    tape.gradient(loss, layer.trainable_variables)

  @tf.function
  def run(features, upstream):
    strategy.run(replica_step, args=(features, upstream))

  share = functools.partial(shared, strategy)

  for features, upstream in zip(batches, upstreams):
    run({f: share(tf.constant(k)) for f, k in features.items()}, share(tf.constant(upstream)))
  parts = []
  for name in ("t", "s"):
    keys, rows, counts = layer.managed_ids[name].export()
    variables = layer.variables_by_table[name]
    parts += [variables[s].numpy().ravel() for s in ("parameters", "accumulators")]
    parts += [t.numpy().astype(np.float64) for t in (keys, rows, counts)]
  np.save(out_path, np.concatenate(parts))
