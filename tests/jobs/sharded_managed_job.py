"""Managed ids under ParameterServerStrategy: the coordinator side of
`tests/managed_ids/test_sharded.py`.

Run as `python tests/jobs/sharded_managed_job.py PHASE CLUSTER_JSON DIR` against a running
`LocalCluster`;
the table is cut into 2 row blocks (`FixedShardsPartitioner(2)`) and its map split with them.
Two processes run the phases: `two_ps_cluster` (2 ps, 2 workers) runs `concurrent`,
`sequential` and `keras_trained` under one strategy, writes `SEQUENTIAL_DONE` after
`sequential`, and runs `two_ps` once a line on its stdin says `one_ps` (1 ps, 1 worker, its own
process, run meanwhile) has written `ckpt_one_ps`; then `second_cluster`, last.

* `concurrent`: `STEPS` steps scheduled at once on both workers; consecutive batches share half
  their keys, so the two workers keep meeting the same new keys at the same time. Writes the map's
  export and every shard's, the rows of all keys and the table (`concurrent.npz`).
* `sequential`: `SEQUENCE` steps run one at a time (each joined before the next), with eviction
  and min_count 2; writes the map, every shard's export and the table (`sequential.npz`), then a
  checkpoint (`ckpt`); a new layer restores it (`restored.npz`); a layer
  without managed ids' checkpoint is refused, and so is `ckpt` by a layer without strategy (one
  whole map) (`refused.json`); the restored layer is exported for serving (`export/`). Then
  the same steps again on a new layer through `layer.remap` on the coordinator, the steps taking
  rows (`remapped.npz`).
* `one_ps` (a cluster of 1 ps, 1 worker): restores `ckpt` (written under 2 ps), both blocks and
  map shards now on the one ps (`restored_one_ps.npz`); trains `MORE` steps (`continued.npz`)
  and writes `ckpt_one_ps`.
* `two_ps` (2 ps again): a new layer restores `ckpt_one_ps` (`restored_two_ps.npz`); a layer whose
  partitioner cuts the table into 3 blocks (its map in 3 shards, `three_blocks.npz`) is refused
  it, nothing changed (`refused_3.json`).
* `keras_trained` (2 ps): a table trained by a tf-keras Adagrad (`table_updates="keras"`):
  `KERAS_STEPS` steps on the workers fill both shards; the table and the accumulator blocks,
  the map and their devices are written before (`keras_before.npz`) and after
  (`keras_after.npz`) one training remap on the coordinator that gives rows to new keys.
  A Keras 3 optimizer in its place is refused at construction, before any variable is created
  (`keras3_refused.json`).
* `second_cluster`: see its docstring; last in the `two_ps_cluster` process.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding  # noqa: E402
from tpu_embedding import serving  # noqa: E402

E = tf.tpu.experimental.embedding
# concurrent: batch i holds UNIVERSE[HALF * i : HALF * (i + 2)]
STEPS, HALF = 40, 100
CONCURRENT_CAPACITY = 2 * HALF * (STEPS + 1) + 1  # room for every key in either shard
# sequential
SEQUENCE, SEQUENCE_BATCH, SEQUENCE_KEYS, MORE = 12, 16, 40, 6
SEQUENCE_CAPACITY = 13  # 12 rows for keys: 6 per shard
SEQUENCE_SPEC = dict(eviction="lfu", min_count=2, lfu_half_life_steps=4)
INITIAL = 0.25
SEQUENTIAL_DONE = "sequential.done"  # the marker file of `two_ps_cluster`: `ckpt` is written
# keras_trained: tf-keras Adagrad's learning rate and initial accumulator value
KERAS_STEPS, KERAS_LEARNING_RATE, KERAS_ACCUMULATOR = 4, 0.5, 0.1


def universe() -> np.ndarray:
  """Distinct int64 keys, negative and beyond 2**31 included."""
  keys = np.random.default_rng(28).integers(-(2**62), 2**62, size=HALF * (STEPS + 1))
  assert len(set(keys.tolist())) == keys.size
  return keys


def concurrent_batch(i: int) -> np.ndarray:
  return universe()[HALF * i : HALF * (i + 2)]


def sequence_batches() -> list[np.ndarray]:
  """`SEQUENCE` batches, then the `MORE` ones the `one_ps` phase trains after its restore."""
  rng = np.random.default_rng(7)
  keys = rng.integers(-(2**40), 2**40, size=SEQUENCE_KEYS)
  return [keys[rng.zipf(1.5, size=SEQUENCE_BATCH) % SEQUENCE_KEYS] for _ in range(SEQUENCE + MORE)]


def strategy_of(cluster: dict, blocks: int = 2) -> tf.distribute.ParameterServerStrategy:
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(cluster), rpc_layer="grpc"
  )
  return tf.distribute.ParameterServerStrategy(
    resolver,
    variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(blocks),
  )


def make_layer(capacity: int, **spec) -> tpu_embedding.TPUEmbedding:
  table = E.TableConfig(
    capacity, 2, initializer=tf.constant_initializer(INITIAL), combiner="sum", name="t"
  )
  layer = tpu_embedding.TPUEmbedding(
    {"f": E.FeatureConfig(table, name="f")},
    E.SGD(0.5),
    managed_ids={"t": tpu_embedding.ManagedIds(**spec)},
  )
  layer.variables_by_table  # creates the table (under the caller's strategy)
  return layer


def worker_step(strategy, layer, remapped=False):
  def step(keys):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer({"f": keys}, remapped=remapped)["f"])  # an occurrence: -0.5
    tape.gradient(loss, layer.trainable_variables)

  @tf.function
  def run(keys):
    strategy.run(step, args=(keys,))

  return run


def state(layer) -> dict:
  id_map = layer.managed_ids["t"]
  keys, rows, counts = id_map.export()
  out = {"keys": keys.numpy(), "rows": rows.numpy(), "counts": counts.numpy()}
  for k, shard in enumerate(id_map.shards):
    for name, value in zip(("keys", "rows", "counts"), shard.export()):
      out[f"shard{k}/{name}"] = value.numpy()
  table = layer.variables_by_table["t"]["parameters"]
  out["table"] = table.numpy()
  out["size"] = id_map.size().numpy()
  # Where each shard's state lives, beside the table block whose rows it gives.
  out["devices"] = np.array([v.device for v in table.variables])
  for k, shard in enumerate(id_map.shards):
    out[f"shard{k}/capacity"] = np.array(shard.capacity)
    held = [shard.keys, shard.counts, shard.last_seen, shard.step]
    out[f"shard{k}/devices"] = np.array(
      [v.device for v in held] + [shard.rows_of_keys.resource_handle.device, id_map.devices[k]]
    )
  return out


def train(strategy, layer, batches):
  """Each batch's step on a worker, one at a time."""
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  run = worker_step(strategy, layer)
  for keys in batches:
    coordinator.schedule(run, args=(tf.constant(keys),))
    coordinator.join()


def refusal(layer, path) -> dict:
  """The message of reading `path` into `layer`, and whether the layer is unchanged."""
  before = state(layer)
  try:
    tf.train.Checkpoint(layer=layer).read(path)
    message = "restored"
  except ValueError as e:
    message = str(e)
  after = state(layer)
  return {"message": message, "unchanged": all(np.array_equal(before[k], after[k]) for k in before)}


def concurrent(strategy, out):
  with strategy.scope():
    layer = make_layer(CONCURRENT_CAPACITY, eviction="lru", lfu_half_life_steps=10_000)
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  run = worker_step(strategy, layer)
  for i in range(STEPS):
    coordinator.schedule(run, args=(tf.constant(concurrent_batch(i)),))
  coordinator.join()
  result = state(layer)
  result["lookup"] = layer.managed_ids["t"].lookup(tf.constant(universe())).numpy()
  np.savez(os.path.join(out, "concurrent.npz"), **result)


def sequential(strategy, out):
  with strategy.scope():
    layer = make_layer(SEQUENCE_CAPACITY, **SEQUENCE_SPEC)
  train(strategy, layer, sequence_batches()[:SEQUENCE])
  np.savez(os.path.join(out, "sequential.npz"), **state(layer))
  tf.train.Checkpoint(layer=layer).write(os.path.join(out, "ckpt"))

  with strategy.scope():
    restored = make_layer(SEQUENCE_CAPACITY, **SEQUENCE_SPEC)
  tf.train.Checkpoint(layer=restored).read(os.path.join(out, "ckpt")).assert_consumed()
  np.savez(os.path.join(out, "restored.npz"), **state(restored))

  with strategy.scope():
    plain = tpu_embedding.TPUEmbedding(
      {"f": E.FeatureConfig(E.TableConfig(SEQUENCE_CAPACITY, 2, name="t"), name="f")}, E.SGD(0.5)
    )
    plain.variables_by_table
  tf.train.Checkpoint(layer=plain).write(os.path.join(out, "plain"))
  plain_refusal = refusal(restored, os.path.join(out, "plain"))
  whole = make_layer(SEQUENCE_CAPACITY, **SEQUENCE_SPEC)  # no strategy: one whole map
  try:
    tf.train.Checkpoint(layer=whole).read(os.path.join(out, "ckpt"))
    whole_message = "restored"
  except ValueError as e:
    whole_message = str(e)
  whole_unchanged = int(whole.managed_ids["t"].size()) == 0
  with open(os.path.join(out, "refused.json"), "w") as f:
    json.dump(
      {
        "message": plain_refusal["message"],
        "unchanged": plain_refusal["unchanged"],
        "whole_message": whole_message,
        "whole_unchanged": whole_unchanged,
      },
      f,
    )

  model = tf.Module()
  model.layer = restored
  serve = tf.function(
    lambda keys: restored({"f": keys}, training=False),
    input_signature=[tf.TensorSpec([None], tf.int64)],
  )
  serving.export_for_serving(model, os.path.join(out, "export"), serve)

  with strategy.scope():
    remapping = make_layer(SEQUENCE_CAPACITY, **SEQUENCE_SPEC)
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  run = worker_step(strategy, remapping, remapped=True)
  for keys in sequence_batches()[:SEQUENCE]:
    rows = remapping.remap({"f": tf.constant(keys)})["f"]  # on the coordinator, eagerly
    coordinator.schedule(run, args=(rows,))
    coordinator.join()
  np.savez(os.path.join(out, "remapped.npz"), **state(remapping))


def restore(strategy, out, checkpoint: str, name: str):
  """A new layer under `strategy` with `checkpoint` restored; its state in `name`."""
  with strategy.scope():
    layer = make_layer(SEQUENCE_CAPACITY, **SEQUENCE_SPEC)
  tf.train.Checkpoint(layer=layer).read(os.path.join(out, checkpoint)).assert_consumed()
  np.savez(os.path.join(out, name), **state(layer))
  return layer


def one_ps(cluster, out):
  strategy = strategy_of(cluster)
  layer = restore(strategy, out, "ckpt", "restored_one_ps.npz")
  train(strategy, layer, sequence_batches()[SEQUENCE:])
  np.savez(os.path.join(out, "continued.npz"), **state(layer))
  tf.train.Checkpoint(layer=layer).write(os.path.join(out, "ckpt_one_ps"))


def two_ps(strategy, cluster, out):
  """Last in its process: the strategy cutting the table into 3 blocks runs no function on the
  workers."""
  restore(strategy, out, "ckpt_one_ps", "restored_two_ps.npz")
  with strategy_of(cluster, blocks=3).scope():
    cut_in_3 = make_layer(SEQUENCE_CAPACITY, **SEQUENCE_SPEC)
  np.savez(os.path.join(out, "three_blocks.npz"), **state(cut_in_3))
  with open(os.path.join(out, "refused_3.json"), "w") as f:
    json.dump(refusal(cut_in_3, os.path.join(out, "ckpt_one_ps")), f)


def keras_batches() -> list[np.ndarray]:
  """`KERAS_STEPS` training batches over 30 keys (more than both shards' 12 rows), then the 6
  new keys of the remap."""
  keys = np.random.default_rng(11).integers(-(2**50), 2**50, size=60)
  return [keys[i * 8 : i * 8 + 12] for i in range(KERAS_STEPS - 1)] + [keys[:30], keys[30:36]]


def keras_state(layer, optimizer) -> dict:
  """The map, the table and the accumulator's blocks, and where each block lives."""
  keys, rows, _ = layer.managed_ids["t"].export()
  table = layer.variables_by_table["t"]["parameters"]
  slots = [
    v
    for each in optimizer.variables
    for v in getattr(each, "variables", [each])
    if "accumulator" in v.name and v.shape.rank == 2
  ]
  return {
    "keys": keys.numpy(),
    "rows": rows.numpy(),
    "table": table.numpy(),
    "accumulator": np.concatenate([v.numpy() for v in slots]),
    "table_devices": np.array([v.device for v in table.variables]),
    "slot_devices": np.array([v.device for v in slots]),
    "shard_devices": np.array(layer.managed_ids["t"].devices),
  }


def keras_trained(strategy, out):
  import keras  # noqa: PLC0415 (Keras 3, only for its refusal)
  import tf_keras  # noqa: PLC0415

  def layer_with(optimizer):
    table = E.TableConfig(
      SEQUENCE_CAPACITY, 2, initializer=tf.constant_initializer(INITIAL), combiner="sum", name="t"
    )
    layer = tpu_embedding.TPUEmbedding(
      {"f": E.FeatureConfig(table, name="f")},
      optimizer,
      table_updates="keras",
      managed_ids={"t": tpu_embedding.ManagedIds(eviction="lru")},
      name="tpu_embedding",  # the default name, though the phases before made layers
    )
    layer.build(None)
    return layer

  created = []  # every variable the refused layer creates (none: refused before its tables)

  def record(next_creator, **kwargs):
    created.append(next_creator(**kwargs))
    return created[-1]

  with strategy.scope():
    keras3 = keras.optimizers.Adagrad(KERAS_LEARNING_RATE, KERAS_ACCUMULATOR)
    try:
      with tf.variable_creator_scope(record):
        layer_with(keras3)
      message = "built"
    except ValueError as e:
      message = str(e)
    optimizer = tf_keras.optimizers.Adagrad(KERAS_LEARNING_RATE, KERAS_ACCUMULATOR)
    layer = layer_with(optimizer)
    optimizer.build(layer.trainable_variables)
  with open(os.path.join(out, "keras3_refused.json"), "w") as f:
    json.dump({"message": message, "created": [v.name for v in created]}, f)

  def step(keys):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(layer({"f": keys})["f"])
    variables = layer.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

  @tf.function
  def run(keys):
    strategy.run(step, args=(keys,))

  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  *steps, new_keys = keras_batches()
  for keys in steps:
    coordinator.schedule(run, args=(tf.constant(keys),))
    coordinator.join()
  np.savez(os.path.join(out, "keras_before.npz"), **keras_state(layer, optimizer))
  layer.remap({"f": tf.constant(new_keys)})  # a training remap: rows given, and reset
  np.savez(os.path.join(out, "keras_after.npz"), **keras_state(layer, optimizer))


def second_cluster(cluster, out):
  """A layer under a strategy of another cluster, made in the process that trained the first
  (`second_cluster.npz`): ps 0 and worker 0 alone, a cluster of their own to TF (its tasks
  get new contexts, knowing no function the first cluster's steps made)."""
  strategy = strategy_of({"worker": cluster["worker"][:1], "ps": cluster["ps"][:1]}, blocks=1)
  with strategy.scope():
    layer = make_layer(SEQUENCE_CAPACITY, eviction="lru")
  train(strategy, layer, keras_batches()[:1])
  keys, rows, _ = layer.managed_ids["t"].export()
  table = layer.variables_by_table["t"]["parameters"].numpy()
  np.savez(
    os.path.join(out, "second_cluster.npz"), keys=keys.numpy(), rows=rows.numpy(), table=table
  )


def two_ps_cluster(cluster, out):
  """Every phase of the 2-ps cluster, under one strategy (see the module docstring)."""
  strategy = strategy_of(cluster)
  concurrent(strategy, out)
  sequential(strategy, out)
  with open(os.path.join(out, SEQUENTIAL_DONE), "w"):
    pass
  keras_trained(strategy, out)
  if not sys.stdin.readline():  # the test went away before `one_ps` was done
    sys.exit("no word that ckpt_one_ps is written")
  two_ps(strategy, cluster, out)
  second_cluster(cluster, out)  # last: connecting another cluster replaces this one


if __name__ == "__main__":
  phases = {"two_ps_cluster": two_ps_cluster, "one_ps": one_ps}
  phases[sys.argv[1]](json.loads(sys.argv[2]), *sys.argv[3:])
