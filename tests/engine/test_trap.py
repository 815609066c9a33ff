"""The gradient trap (`engine.trap`) under grappler: a step's table update sees the kernel that
the same step's optimizer then updates.

With a loss linear in the activations (`reduce_sum(dense(layer(ids)))`) their gradient is a
read of the dense kernel times a constant, so the table's update, inside the trap's backward,
reads that kernel; the kernel's own update must wait for that read. Grappler used to cut that
order when the trap's zero gradient depended on the table's update, or was a constant
(docs/engine.md, "The gradient trap and grappler"); which of the two then ran first
depended on the trace, so the values are checked over fresh traces.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.python.eager import context

import tpu_embedding
from benchmarks.trap_race import (
  KERNEL_LAYER,
  expected_row_and_kernel,
  linear_step,
  trained_row_and_kernel,
)

E = tf.tpu.experimental.embedding
# Fresh traces: each met the race about 1 time in 3 before the fix; `python -m
# benchmarks.trap_race 100` runs a hundred.
TRIALS = 10


def one_step(kind: str) -> None:
  """Trains the tables and a kernel for one step: a custom step, with the layer called inside it
  or inside an inner `tf.function`, or Keras `fit`'s step."""
  if kind != "fit":
    step = linear_step(tf_keras.optimizers.SGD(0.5), inner_function=kind == "inner function")[3]
    step(tf.constant([1]))
    return
  table = E.TableConfig(3, 2, initializer=tf.zeros_initializer(), name="t")
  ids = tf_keras.Input(shape=(), dtype=tf.int32)
  layer = tpu_embedding.TPUEmbedding(E.FeatureConfig(table=table), E.SGD(0.5))
  dense = tf_keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name=KERNEL_LAYER)
  model = tf_keras.Model(ids, dense(layer(ids)))
  model.compile(tf_keras.optimizers.SGD(0.5), loss=lambda labels, outputs: tf.reduce_sum(outputs))
  model.train_on_batch(tf.constant([1]), tf.constant([[0.0]]))


def runtime_graphs(run) -> list:
  """The graphs (GraphDef) that TF's runtime executed for `run()`'s functions, after grappler."""
  context.context().enable_run_metadata()
  context.context().enable_graph_collection()
  try:
    run()
    metadata = context.context().export_run_metadata()
  finally:
    context.context().disable_graph_collection()
    context.context().disable_run_metadata()
  return [graph.post_optimization_graph for graph in metadata.function_graphs]


def kernel_reads_and_updates(graph) -> tuple[list[str], list[str], dict]:
  """(the kernel's reads, the other ops taking the kernel's variable, {node: its consumers})."""
  nodes = {node.name: node for node in graph.node}
  variables = {
    node.input[0]
    for node in graph.node
    if node.op == "ReadVariableOp" and f"/{KERNEL_LAYER}/" in f"/{node.name}"
  }
  reads, updates = [], []
  for node in graph.node:
    if node.input and node.input[0] in variables:
      (reads if node.op == "ReadVariableOp" else updates).append(node.name)
  consumers = {name: [] for name in nodes}
  for node in graph.node:
    for name in node.input:
      consumers[name.lstrip("^").split(":")[0]].append(node.name)
  return reads, updates, consumers


def runs_after(first: str, consumers: dict) -> set[str]:
  """Every node that depends on `first` (through data or control edges)."""
  after, pending = set(), [first]
  while pending:
    for name in consumers[pending.pop()]:
      if name not in after:
        after.add(name)
        pending.append(name)
  return after


@pytest.mark.parametrize("kind", ["step", "fit", "inner function"])
def test_the_kernels_update_waits_for_the_read_that_feeds_the_tables_update(kind):
  graphs = runtime_graphs(lambda: one_step(kind))
  (graph,) = [g for g in graphs if kernel_reads_and_updates(g)[1]]
  reads, updates, consumers = kernel_reads_and_updates(graph)
  assert reads and updates
  for read in reads:
    assert set(updates) <= runs_after(read, consumers), (read, updates)


def test_the_table_is_updated_with_the_kernel_before_the_steps_update():
  # The last trial compiles the step with XLA, which must train the same.
  row, kernel = expected_row_and_kernel()
  np.testing.assert_allclose(row, [-1.25, -1.25])  # row 1 -= 1.0 * ones, then 0.25 * ones
  np.testing.assert_allclose(kernel, [1.25, 1.25])  # kernel -= 1.0 * zeros, then 0.25 * (-1, -1)
  for trial in range(TRIALS + 1):
    got_row, got_kernel = trained_row_and_kernel(jit_compile=trial == TRIALS)
    np.testing.assert_allclose(got_row, row)
    np.testing.assert_allclose(got_kernel, kernel)
