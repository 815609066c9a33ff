"""ParameterServerStrategy for real: one ps and two worker servers on 127.0.0.1, in this process.

Run as `python tests/jobs/parameter_server_job.py OUT.npz`. The coordinator (this process) schedules
`len(BATCHES)` training steps on the workers through a `ClusterCoordinator`; the tables live on
the ps task and every step updates them with the engine. Workers run steps asynchronously, in
an order nobody chooses, so the test uses updates whose result does not depend on that order:
SGD with a loss linear in the activations (every step subtracts a fixed, exactly representable
amount) and Adagrad's accumulators (every step adds squares of small integers). Each update
holds the variables' locks throughout, so no worker's update is lost to another's.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding  # noqa: E402

# Run as a script from tests/jobs: its helpers are in tests/support, which reads examples/ from
# the repository's root.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(TESTS, "support"), os.path.dirname(TESTS)]
import loopback  # noqa: E402

E = tf.tpu.experimental.embedding
# Each step looks up one batch per feature; the loss weights feature "a" by 1 and "b" by 2.
BATCHES = [([0, 2, 2], [1, 4]), ([2, 3, 0], [4, 4]), ([5, 5, 5], [0, 1]), ([0, 1, 2], [3, 3])]


def _in_process_cluster(num_workers: int) -> tf.distribute.cluster_resolver.ClusterResolver:
  ports = loopback.free_ports(num_workers + 1)
  spec = tf.train.ClusterSpec(
    {"worker": [f"127.0.0.1:{p}" for p in ports[:num_workers]], "ps": [f"127.0.0.1:{ports[-1]}"]}
  )
  config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=num_workers + 1)
  for index in range(num_workers):
    tf.distribute.Server(spec, job_name="worker", task_index=index, config=config, protocol="grpc")
  tf.distribute.Server(spec, job_name="ps", task_index=0, protocol="grpc")
  return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")


def main(out_path: str) -> None:
  strategy = tf.distribute.ParameterServerStrategy(_in_process_cluster(num_workers=2))
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  with strategy.scope():
    sgd_table = E.TableConfig(
      vocabulary_size=6,
      dim=2,
      combiner="sum",
      name="sgd",
      optimizer=E.SGD(0.5),
      initializer=tf.zeros_initializer(),
    )
    adagrad_table = E.TableConfig(
      vocabulary_size=5,
      dim=2,
      combiner="sum",
      name="adagrad",
      optimizer=E.Adagrad(0.5, initial_accumulator_value=1.0),
      initializer=tf.constant_initializer(np.arange(10).reshape(5, 2)),
    )
    layer = tpu_embedding.TPUEmbedding(
      {"a": E.FeatureConfig(table=sgd_table), "b": E.FeatureConfig(table=adagrad_table)}, E.SGD(0.5)
    )

  @tf.function
  def worker_step(ids_a, ids_b):
    def replica_step(ids_a, ids_b):
      with tf.GradientTape() as tape:
        out = layer({"a": ids_a, "b": ids_b})
        loss = tf.reduce_sum(out["a"]) + 2.0 * tf.reduce_sum(out["b"])
      tape.gradient(loss, layer.trainable_variables)

    strategy.run(replica_step, args=(ids_a, ids_b))

  for ids_a, ids_b in BATCHES:
    coordinator.schedule(
      worker_step, args=(tf.constant(ids_a, tf.int64), tf.constant(ids_b, tf.int64))
    )
  coordinator.join()
  spec = tf.TensorSpec([None], tf.int64)
  graph = worker_step.get_concrete_function(spec, spec).graph
  op_types = {op.type for op in graph.get_operations()}
  op_types |= {node.op for fn in graph.as_graph_def().library.function for node in fn.node_def}
  variables = layer.variables_by_table
  np.savez(
    out_path,
    sgd=variables["sgd"]["parameters"].numpy(),
    adagrad=variables["adagrad"]["parameters"].numpy(),
    accumulators=variables["adagrad"]["accumulators"].numpy(),
    placement=np.array([variables["sgd"]["parameters"].device]),
    op_types=np.array(sorted(op_types)),
  )


if __name__ == "__main__":
  main(sys.argv[1])
