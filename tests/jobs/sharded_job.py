"""Tables row-sharded over ps tasks: the coordinator side of `tests/engine/test_sharded.py`.

Run as `python tests/jobs/sharded_job.py PHASE CLUSTER_JSON DIR`, where CLUSTER_JSON is the cluster
spec
of processes already running (`LocalCluster`) and DIR is shared between the phases. The phases
`train`, `hammer` and `worker_fault` share one strategy, so one process runs them in turn
(`two_shards PID`); each other phase connects its own: a process's coordinator cannot run
functions on the cluster again once it has connected a second strategy.

* `train`: tables sharded in 2 (FixedShardsPartitioner) over the ps tasks, `STEPS` steps
  scheduled on the workers by a `ClusterCoordinator`; writes the tables and slots
  (`sharded.npz`), the same steps run in this process without any strategy (`reference.npz`),
  what the worker step's graph does where (`placement.npz`) and a checkpoint (`ckpt_2`).
* `whole`: the same steps with tables not sharded (`whole.npz`, `whole_devices.json`).
* `worker_fault PID`: the `train` steps, with worker process PID SIGKILLed after the first
  `MORE` (`worker_fault.npz`).
* `ps_fault PID`: `MORE` steps, checkpoint `ckpt_ps`, ps process PID SIGKILLed, the other
  steps scheduled: the error they raise (`ps_fault.json`).
* `resume`: restores `ckpt_ps` and runs the steps after it (`resumed.npz`).
* `hammer`: both workers update every row of one table at once (`hammer.npy`).
* `restore`: tables sharded in 3 restore `ckpt_2` (`restored_3.npz`), train `MORE` steps
  (`trained_3.npz`) and write `ckpt_3`; an unsharded layer restores `ckpt_3`
  (`unsharded.npz`), is exported for serving (`exported.npz`: the export's tables), trains
  `MORE` steps (`unsharded_trained.npz`) and writes `ckpt_1`, which a 3-shard layer restores
  (`back.npz`).

Steps run in an order nobody chooses, concurrently, on two workers. Every batch holds each id
at most once and the loss is linear in the activations, so each row receives the same gradient
every time a step touches it: the final tables depend on how many steps touched each row, not
on their order, for every optimizer; a lost update changes them.
"""

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding  # noqa: E402
from tpu_embedding import serving  # noqa: E402

E = tf.tpu.experimental.embedding
VOCABULARY = 7  # two shards of 4 and 3 rows, three of 3, 2 and 2
# ids per step (unique within a step), cycled; every table sees the same ids.
BATCHES = [[0, 3, 4, 6], [1, 4, 5], [0, 2, 6], [3, 4, 5, 6]]
STEPS = 24
MORE = 4
HAMMER_ROWS = 50_000
HAMMER_STEPS = 30
OPTIMIZERS = {
  "sgd": lambda: E.SGD(0.5),
  "adagrad": lambda: E.Adagrad(0.5, initial_accumulator_value=1.0),
  "adam": lambda: E.Adam(0.1, lazy_adam=True),
  "ftrl": lambda: E.FTRL(0.1, l1_regularization_strength=0.01),
  "momentum": lambda: E.AdagradMomentum(0.1, momentum=0.9),
}
LOSS_WEIGHTS = {"sgd": 1.0, "adagrad": 2.0, "adam": 1.0, "ftrl": -1.0, "momentum": 0.5}


def make_layer() -> tpu_embedding.TPUEmbedding:
  features = {}
  for name, optimizer in OPTIMIZERS.items():
    table = E.TableConfig(
      vocabulary_size=VOCABULARY,
      dim=2,
      combiner="sum",
      name=name,
      optimizer=optimizer(),
      initializer=tf.constant_initializer(np.arange(VOCABULARY * 2) / 8.0),
    )
    features[name] = E.FeatureConfig(table=table)
  layer = tpu_embedding.TPUEmbedding(features)
  layer.variables_by_table  # creates the tables (under the caller's strategy)
  return layer


def step_fn(layer):
  def step(ids):
    with tf.GradientTape() as tape:
      out = layer({name: ids for name in OPTIMIZERS})
      loss = tf.add_n([w * tf.reduce_sum(out[n]) for n, w in LOSS_WEIGHTS.items()])
    tape.gradient(loss, layer.trainable_variables)

  return step


def state(layer) -> dict:
  return {
    f"{table}/{name}": np.asarray(v.numpy())
    for table, variables in layer.variables_by_table.items()
    for name, v in variables.items()
  }


def batch(step: int) -> tf.Tensor:
  return tf.constant(BATCHES[step % len(BATCHES)], tf.int64)


def run_local(layer, steps, first=0):
  step = tf.function(step_fn(layer))
  for i in range(first, first + steps):
    step(batch(i))


def sharded_strategy(cluster, shards):
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(cluster), rpc_layer="grpc"
  )
  return tf.distribute.ParameterServerStrategy(
    resolver,
    variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(shards),
  )


def run_sharded(strategy, layer, steps, first=0):
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  step = step_fn(layer)

  @tf.function
  def worker_step(ids):
    strategy.run(step, args=(ids,))

  for i in range(first, first + steps):
    coordinator.schedule(worker_step, args=(batch(i),))
  coordinator.join()
  return worker_step


def placement(worker_step) -> dict:
  """(op type, device) of every op of the worker step that reads or writes a variable."""
  graph = worker_step.get_concrete_function(tf.TensorSpec([None], tf.int64)).graph
  nodes = [(n.op, n.device) for n in graph.as_graph_def().node]
  for function in graph.as_graph_def().library.function:
    nodes += [(n.op, n.device) for n in function.node_def]
  kept = [
    (op, device)
    for op, device in nodes
    if op.startswith("Resource") or op in ("ReadVariableOp", "MutexLock")
  ]
  return {"ops": np.array([op for op, _ in kept]), "devices": np.array([d for _, d in kept])}


def shard_counts(layer) -> list:
  return [
    len(v.variables) for variables in layer.variables_by_table.values() for v in variables.values()
  ]


def train(strategy, out):
  with strategy.scope():
    layer = make_layer()
  worker_step = run_sharded(strategy, layer, STEPS)
  assert set(shard_counts(layer)) == {2}, shard_counts(layer)
  np.savez(os.path.join(out, "sharded.npz"), **state(layer))
  np.savez(os.path.join(out, "placement.npz"), **placement(worker_step))
  tf.train.Checkpoint(layer=layer).write(os.path.join(out, "ckpt_2"))
  reference = make_layer()
  run_local(reference, STEPS)
  np.savez(os.path.join(out, "reference.npz"), **state(reference))


def restore(cluster, out):
  strategy = sharded_strategy(cluster, 3)
  with strategy.scope():
    layer = make_layer()
  tf.train.Checkpoint(layer=layer).read(os.path.join(out, "ckpt_2")).assert_consumed()
  assert set(shard_counts(layer)) == {3}, shard_counts(layer)
  np.savez(os.path.join(out, "restored_3.npz"), **state(layer))
  run_sharded(strategy, layer, MORE, first=STEPS)
  np.savez(os.path.join(out, "trained_3.npz"), **state(layer))
  tf.train.Checkpoint(layer=layer).write(os.path.join(out, "ckpt_3"))

  unsharded = make_layer()
  tf.train.Checkpoint(layer=unsharded).read(os.path.join(out, "ckpt_3")).assert_consumed()
  np.savez(os.path.join(out, "unsharded.npz"), **state(unsharded))
  model = tf.Module()
  model.layer = unsharded
  serve = tf.function(
    lambda ids: unsharded({name: ids for name in OPTIMIZERS}),
    input_signature=[tf.TensorSpec([None], tf.int64)],
  )
  exported = tf.saved_model.load(
    serving.export_for_serving(model, os.path.join(out, "export"), serve)
  )
  np.savez(
    os.path.join(out, "exported.npz"),
    **{name: exported.embedding_tables[name].numpy() for name in OPTIMIZERS},
  )
  run_local(unsharded, MORE, first=STEPS + MORE)
  np.savez(os.path.join(out, "unsharded_trained.npz"), **state(unsharded))
  tf.train.Checkpoint(layer=unsharded).write(os.path.join(out, "ckpt_1"))

  with strategy.scope():
    back = make_layer()
  tf.train.Checkpoint(layer=back).read(os.path.join(out, "ckpt_1")).assert_consumed()
  assert set(shard_counts(back)) == {3}, shard_counts(back)
  np.savez(os.path.join(out, "back.npz"), **state(back))


def whole(cluster, out):
  """Without a partitioner: each table whole on one ps task, its slots beside it."""
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(cluster), rpc_layer="grpc"
  )
  strategy = tf.distribute.ParameterServerStrategy(resolver)
  with strategy.scope():
    layer = make_layer()
  run_sharded(strategy, layer, STEPS)
  devices = {
    f"{t}/{n}": v.device for t, vs in layer.variables_by_table.items() for n, v in vs.items()
  }
  np.savez(os.path.join(out, "whole.npz"), **state(layer))
  with open(os.path.join(out, "whole_devices.json"), "w") as f:
    json.dump(devices, f)


def worker_fault(strategy, out, pid):
  """SGD steps; after the first `MORE`, worker process `pid` is SIGKILLed and the rest run."""
  with strategy.scope():
    layer = make_layer()
  run_sharded(strategy, layer, MORE)
  os.kill(int(pid), signal.SIGKILL)
  run_sharded(strategy, layer, STEPS - MORE, first=MORE)
  np.savez(os.path.join(out, "worker_fault.npz"), **state(layer))
  sys.stdout.flush()
  os._exit(0)  # the coordinator would keep waiting for the dead worker to come back


def ps_fault(cluster, out, pid):
  """`MORE` steps and a checkpoint; then ps process `pid` is SIGKILLed and steps go on,
  which must fail: writes the error's type and message (`ps_fault.json`)."""
  strategy = sharded_strategy(cluster, 2)
  with strategy.scope():
    layer = make_layer()
  run_sharded(strategy, layer, MORE)
  tf.train.Checkpoint(layer=layer).write(os.path.join(out, "ckpt_ps"))
  os.kill(int(pid), signal.SIGKILL)
  try:
    run_sharded(strategy, layer, STEPS - MORE, first=MORE)
    error = None
  except Exception as e:
    error = {"type": type(e).__name__, "message": str(e)[:2000]}
  with open(os.path.join(out, "ps_fault.json"), "w") as f:
    json.dump(error, f)
  sys.stdout.flush()
  os._exit(0)


def resume(cluster, out):
  """A new coordinator restores `ckpt_ps` and runs the steps after it (`resumed.npz`)."""
  strategy = sharded_strategy(cluster, 2)
  with strategy.scope():
    layer = make_layer()
  tf.train.Checkpoint(layer=layer).read(os.path.join(out, "ckpt_ps")).assert_consumed()
  run_sharded(strategy, layer, STEPS - MORE, first=MORE)
  np.savez(os.path.join(out, "resumed.npz"), **state(layer))


def hammer(strategy, out):
  """Both workers update every row of one wide SGD table at once, `HAMMER_STEPS` times."""
  with strategy.scope():
    table = E.TableConfig(
      vocabulary_size=HAMMER_ROWS,
      dim=8,
      combiner="sum",
      name="rows",
      optimizer=E.SGD(0.5),
      initializer=tf.zeros_initializer(),
    )
    layer = tpu_embedding.TPUEmbedding({"rows": E.FeatureConfig(table=table)})
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

  @tf.function
  def worker_step():
    def step():
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer({"rows": tf.range(HAMMER_ROWS, dtype=tf.int64)})["rows"])
      tape.gradient(loss, layer.trainable_variables)

    strategy.run(step)

  for _ in range(HAMMER_STEPS):
    coordinator.schedule(worker_step)
  coordinator.join()
  np.save(os.path.join(out, "hammer.npy"), layer.variables_by_table["rows"]["parameters"].numpy())


def two_shards(cluster, out, worker_pid):
  """`train`, `hammer`, then `worker_fault` (which ends the process), under one strategy."""
  strategy = sharded_strategy(cluster, 2)
  train(strategy, out)
  hammer(strategy, out)
  worker_fault(strategy, out, worker_pid)


if __name__ == "__main__":
  {
    "two_shards": two_shards,
    "restore": restore,
    "whole": whole,
    "ps_fault": ps_fault,
    "resume": resume,
  }[sys.argv[1]](json.loads(sys.argv[2]), *sys.argv[3:])
