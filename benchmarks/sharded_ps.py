"""Tables sharded over parameter servers: examples/s and bytes on the wire per step.

Every configuration runs a fresh local cluster (`LocalCluster`: ps and 2 worker processes on
127.0.0.1) with this process as coordinator (the whole benchmark reruns itself in a private network,
which only loopback reaches, where one can be made), and times `--steps` steps of the DLRM-shaped
model's embedding part (`--tables` tables of `--rows` x 16, batch `--batch`, one id per table and
example, Adagrad, loss = sum of the activations) scheduled on the workers:

  sharded N ps   the engine, tables row-sharded over N ps tasks (FixedShardsPartitioner(N))
  unsharded      the engine, no partitioner: each table whole on one ps task
  keras          a Keras-initialised table as a ShardedVariable over 2 ps tasks, looked up by
                 TF's own path (`tf.nn.embedding_lookup` dispatches to the shards), SGD
                 applied shard by shard with `scatter_sub`

With `--managed`, instead, two configurations on 2 ps tasks (tables row-sharded in 2):

  managed        every table manages its ids (`ManagedIds()`, LFU): the steps feed raw int64
                 keys, Zipf-like over `--distinct` values, which the map (split with the
                 table's row blocks, one shard per ps) turns into rows inside the step
  pre-mapped     the same model fed row ids directly (uniform over the rows)

Both warm up until every map is full (so the timed steps admit and evict), then time `--steps`.

Bytes per step are what crossed the loopback interface during the timed steps (the kernel's
`lo` counters in /proc/net/dev, all processes together, gRPC framing included) divided by the
steps. Beside them: the loopback's own bandwidth, one TCP stream moving 256 MiB.

Usage: python -m benchmarks.sharded_ps [--quick] [--managed [managed|pre-mapped]] [--rows 100000]
  [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tpu_embedding  # noqa: E402
from examples import private_network  # noqa: E402
from examples.local_cluster import LocalCluster  # noqa: E402

E = tf.tpu.experimental.embedding
DIM = 16


def loopback_bytes() -> int:
  """Bytes received so far on the loopback interface (Linux)."""
  with open("/proc/net/dev") as f:
    for line in f:
      name, _, counters = line.partition(":")
      if name.strip() == "lo":
        return int(counters.split()[0])
  raise RuntimeError("no loopback interface in /proc/net/dev")


def loopback_bandwidth(total: int = 256 << 20) -> float:
  """GB/s of one TCP stream over 127.0.0.1."""
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  chunk = bytes(1 << 20)

  def send():
    with socket.create_connection(server.getsockname()) as s:
      for _ in range(total // len(chunk)):
        s.sendall(chunk)

  sender = threading.Thread(target=send)
  start = time.perf_counter()
  sender.start()
  connection, _ = server.accept()
  received = 0
  while received < total:
    received += len(connection.recv(1 << 20))
  sender.join()
  elapsed = time.perf_counter() - start
  connection.close()
  server.close()
  return total / elapsed / 1e9


def _engine_step(strategy, args, managed: bool = False):
  features = {
    f"f{i}": E.FeatureConfig(
      table=E.TableConfig(vocabulary_size=args.rows, dim=DIM, combiner="sum", name=f"t{i}")
    )
    for i in range(args.tables)
  }
  managed_ids = (
    {f"t{i}": tpu_embedding.ManagedIds() for i in range(args.tables)} if managed else None
  )
  with strategy.scope():
    layer = tpu_embedding.TPUEmbedding(features, E.Adagrad(0.05), managed_ids=managed_ids)
    layer.variables_by_table

  def step(ids):
    with tf.GradientTape() as tape:
      out = layer({f"f{i}": ids[i] for i in range(args.tables)})
      loss = tf.add_n([tf.reduce_sum(v) for v in out.values()])
    tape.gradient(loss, layer.trainable_variables)

  return step


def _keras_step(strategy, args):
  # tf_keras's Embedding layer itself fails on a ShardedVariable in TF 2.21 ("'ShardedVariable'
  # object has no attribute 'handle'"), so its table is used through `tf.nn.embedding_lookup`,
  # which TF dispatches to its ShardedVariable path; SGD applied shard by shard.
  with strategy.scope():
    tables = [
      tf.Variable(tf_keras.initializers.RandomUniform()([args.rows, DIM]))
      for _ in range(args.tables)
    ]

  def step(ids):
    with tf.GradientTape() as tape:
      loss = tf.add_n(
        [tf.reduce_sum(tf.nn.embedding_lookup(table, ids[i])) for i, table in enumerate(tables)]
      )
    shards = [shard for table in tables for shard in table.variables]
    for shard, grad in zip(shards, tape.gradient(loss, shards)):
      shard.scatter_sub(tf.IndexedSlices(0.05 * grad.values, grad.indices))

  return step


def zipf_keys(shape, seed, distinct: int) -> tf.Tensor:
  """Raw int64 keys: ranks log-uniform over [1, distinct) (a Zipf law of exponent 1), spread
  over the int64 range by an odd multiplier (distinct ranks stay distinct keys)."""
  u = tf.random.stateless_uniform(shape, tf.stack([seed, seed]), dtype=tf.float64)
  ranks = tf.cast(tf.exp(u * tf.math.log(tf.constant(float(distinct), tf.float64))), tf.int64)
  return ranks * 2_654_435_761


def measure(kind: str, num_ps: int, args) -> tuple[float, float]:
  """(examples/s, loopback bytes per step) of one configuration, in a fresh cluster."""
  with LocalCluster(num_ps=num_ps, num_workers=2, allow_exposed=True) as cluster:
    partitioner = (
      None
      if kind == "unsharded"
      else tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps)
    )
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(cluster.spec), rpc_layer="grpc"
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    if kind == "keras":
      replica_step = _keras_step(strategy, args)
    else:
      replica_step = _engine_step(strategy, args, managed=kind == "managed")

    @tf.function
    def worker_step(seed):
      if kind == "managed":
        ids = zipf_keys([args.tables, args.batch], seed, args.distinct)
      else:
        ids = tf.random.stateless_uniform(
          [args.tables, args.batch], tf.stack([seed, seed]), maxval=args.rows, dtype=tf.int64
        )
      strategy.run(replica_step, args=(ids,))

    # Managed: enough batches to fill every map first (each brings at most `batch` new keys).
    warmups = 4 + (args.rows // args.batch + 1 if kind in ("managed", "pre-mapped") else 0)
    for warmup in range(warmups):
      coordinator.schedule(worker_step, args=(tf.constant(warmup, tf.int64),))
    coordinator.join()
    before, start = loopback_bytes(), time.perf_counter()
    for step in range(args.steps):
      coordinator.schedule(worker_step, args=(tf.constant(100 + step, tf.int64),))
    coordinator.join()
    elapsed, sent = time.perf_counter() - start, loopback_bytes() - before
  return args.steps * args.batch / elapsed, sent / args.steps


def rerun_in_private_network(argv) -> None:
  """Runs this benchmark again inside a network of its own, where its tasks and this
  coordinator reach each other and nothing else reaches them; returns where none can be made
  (the clusters then say what they expose)."""
  try:
    network = private_network.PrivateNetwork()
  except private_network.Unavailable:
    return
  with network:
    command = [sys.executable, "-m", "benchmarks.sharded_ps", *argv]
    sys.exit(subprocess.run(network.command(command)).returncode)


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  if not private_network.only_loopback():
    rerun_in_private_network(argv)
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer steps, ps counts 1 and 2")
  parser.add_argument("--rows", type=int, default=100_000)
  parser.add_argument("--tables", type=int, default=3)
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument(
    "--managed",
    nargs="?",
    const="both",
    choices=("both", "managed", "pre-mapped"),
    help="managed vs pre-mapped on 2 ps (one of them: a process of its own per configuration, "
    "since a second cluster in one process may miss functions the first one registered)",
  )
  parser.add_argument("--distinct", type=int, default=10**8, help="distinct keys (--managed)")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps = min(args.steps, 10)
  table_bytes = args.rows * DIM * 4
  print(
    f"{args.tables} tables of {args.rows} x {DIM} ({table_bytes / 1e6:.1f} MB each), "
    f"batch {args.batch}, 2 workers, {args.steps} timed steps\n"
  )
  print(
    "| configuration | examples/s | ms per step (cluster) | bytes per step on loopback "
    "| x one table |"
  )
  print("|---|---:|---:|---:|---:|")
  if args.managed:
    kinds = ("pre-mapped", "managed") if args.managed == "both" else (args.managed,)
    configs = [(kind, 2) for kind in kinds]
  else:
    configs = [("keras", 2), ("unsharded", 2)]
    configs += [("sharded", n) for n in ((1, 2) if args.quick else (1, 2, 4))]
  for kind, num_ps in configs:
    rate, sent = measure(kind, num_ps, args)
    print(
      f"| {kind} {num_ps} ps | {rate:,.0f} | {1e3 * args.batch / rate:.1f} "
      f"| {sent / 1e3:,.0f} kB | {sent / table_bytes:.3f} |",
      flush=True,
    )
  print(f"\nloopback, one TCP stream: {loopback_bandwidth():.2f} GB/s")


if __name__ == "__main__":
  main()
