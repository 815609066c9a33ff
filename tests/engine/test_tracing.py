"""What the first training step traces: how often, and how big a graph (counts, never time).

The first step of a model holding these layers costs mostly Python tracing, which grows with
the times our code is traced (and whether AutoGraph converts it first) and with the ops built
per feature. These tests pin both for fixed configs, so that a change that slows the first step
shows up without timing anything (`benchmarks/first_steps.py` measures the time itself).
"""

import contextlib
import sys
import threading
from typing import Callable

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.python.eager import context

import tpu_embedding
from tpu_embedding.engine import backward, exchange, inputs, lookup

E = tf.tpu.experimental.embedding
BATCH = 4
THRESHOLD = 50  # even features' tables (100 rows) are sharded, odd ones (10 rows) replicated

LAYERS = {
  "tpu": lambda config: tpu_embedding.TPUEmbedding(config, E.Adagrad(0.1)),
  "partial": lambda config: tpu_embedding.PartialTPUEmbedding(
    config, E.Adagrad(0.1), size_threshold=THRESHOLD
  ),
}


def features(count: int, output_shape: bool = False) -> dict:
  """`count` one-id features, each with its own table; `output_shape`: each configured with
  the batch's (as TF Model Garden's ranking task configures them)."""
  return {
    f"f{i}": E.FeatureConfig(
      E.TableConfig(10 if i % 2 else 100, 4, name=f"t{i}", combiner="sum"),
      name=f"f{i}",
      output_shape=[BATCH] if output_shape else None,
    )
    for i in range(count)
  }


def model_over(
  layer_kind: str, count: int, output_shape: bool = False
) -> tuple[tf_keras.Model, dict]:
  """(a compiled functional model over the layer, one batch of its ids)."""
  config = features(count, output_shape)
  layer = LAYERS[layer_kind](config)
  ids = {name: tf_keras.Input(shape=(), dtype=tf.int64, name=name) for name in config}
  joined = tf_keras.layers.Concatenate()(list(layer(ids).values()))
  model = tf_keras.Model(ids, tf_keras.layers.Dense(1)(joined))
  model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.1), loss="mse")
  batch = {name: tf.constant(np.arange(BATCH) % 10, tf.int64) for name in config}
  return model, batch


def entries(code, run: Callable[[], None]) -> int:
  """How many times `run()` enters the Python code object `code` (a function converted by
  AutoGraph runs converted code instead, so it is not counted)."""
  return entries_of((code,), run)[0]


def entries_of(codes: tuple, run: Callable[[], None]) -> list[int]:
  """`entries` of each code object, in one run."""
  count = [0] * len(codes)

  def profile(frame, event, arg):
    if event == "call" and frame.f_code in codes:
      count[codes.index(frame.f_code)] += 1

  sys.setprofile(profile)
  threading.setprofile(profile)  # a strategy's replica steps run in threads of their own
  try:
    run()
  finally:
    sys.setprofile(None)
    threading.setprofile(None)
  return count


@pytest.mark.parametrize("layer_kind,sides", [("tpu", 1), ("partial", 2)])
def test_fit_traces_its_step_twice_and_our_code_once_per_side_and_trace(layer_kind, sides):
  model, batch = model_over(layer_kind, 4)
  labels = tf.ones([BATCH, 1])
  # Two batches: the second step must reuse the first one's trace.
  x = {name: tf.concat([ids, ids], 0) for name, ids in batch.items()}
  prepared = entries(
    inputs.Step.prepare.__func__.__code__,
    lambda: model.fit(x, tf.concat([labels, labels], 0), batch_size=BATCH, verbose=0),
  )
  # Keras traces its step once creating variables, once more without; nothing retraces.
  assert model.train_function.experimental_get_tracing_count() == 2
  # Our inputs are prepared once per side of the layer in each trace, by our code as written:
  # AutoGraph converting it (and all it calls) cost more than the trace itself.
  assert prepared == 2 * sides


def train_step_graph(layer_kind: str, count: int, output_shape: bool = False) -> list:
  """The nodes of a custom training step's graph, the functions it calls included."""
  model, batch = model_over(layer_kind, count, output_shape)
  optimizer = tf_keras.optimizers.legacy.SGD(0.1)
  model(batch)  # creates the dense variables outside the step

  @tf.function
  def step(batch):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(batch))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  graph = step.get_concrete_function(batch).graph.as_graph_def()
  return list(graph.node) + [n for f in graph.library.function for n in f.node_def]


def train_step_nodes(layer_kind: str, count: int) -> tuple[int, int]:
  """(nodes, Assert nodes) of a custom training step's graph, the functions it calls included."""
  nodes = train_step_graph(layer_kind, count)
  return len(nodes), sum(n.op == "Assert" for n in nodes)


# Measured on TF 2.21 (TPUEmbedding 4 features: 289 nodes, 8: 405; PartialTPUEmbedding 4: 286,
# 8: 388; the range check's failure branch as a function of its own added 2-3). Before the cuts:
# 36 nodes per feature on either layer, two range checks on Partial's.
@pytest.mark.parametrize(
  "layer_kind,most_per_feature,most_at_4", [("tpu", 29, 289), ("partial", 25.5, 286)]
)
def test_training_step_graph_size_per_feature(layer_kind, most_per_feature, most_at_4):
  nodes_4, asserts_4 = train_step_nodes(layer_kind, 4)
  nodes_8, asserts_8 = train_step_nodes(layer_kind, 8)
  assert (nodes_8 - nodes_4) / 4 <= most_per_feature
  assert nodes_4 <= most_at_4
  # The id-range check is one function, built once however many features, whichever side of
  # PartialTPUEmbedding calls it (both sides hold 2 or 4 features here).
  assert asserts_4 == asserts_8 == 1


# TF Model Garden's ranking trainer (tf-models-official 2.20), against which these were found
# (`python -m benchmarks model_garden`): its task gives every feature an output_shape of the
# batch's, trains under a MirroredStrategy (one device off TPU) with AutoGraph on (`fit` and its
# Orbit loop), and the tables' Keras optimizer follows a learning-rate schedule. Its first 100
# steps took 1.6-2.5x tfrs's: a `tf.cond` per feature checking the output_shape, the schedule
# called once per table, and the whole update converted by AutoGraph through the strategy's
# merge. Each pinned below by a count.


@pytest.mark.parametrize("layer_kind", ["tpu", "partial"])
def test_an_output_shape_the_trace_knows_holds_builds_no_check(layer_kind):
  with_shape = train_step_graph(layer_kind, 4, output_shape=True)
  without = [n.op for n in train_step_graph(layer_kind, 4)]
  # The check is decided while tracing (the batch's shape is static): no `tf.cond` with its
  # asserts per feature (9 Asserts here before); per feature only the configured shape and the
  # count as constants, and the comparison the trace evaluated (unused: pruned before running).
  assert sum(n.op == "Assert" for n in with_shape) == 1  # the range check's, as without
  assert len(with_shape) - len(without) <= 3 * 4


class CountedSchedule(tf_keras.optimizers.schedules.LearningRateSchedule):
  """A constant rate that counts the calls (each one builds its ops into the step)."""

  def __init__(self):
    self.calls = 0

  def __call__(self, step):
    self.calls += 1
    return tf.constant(0.1)

  def get_config(self) -> dict:
    return {}


def fit_as_model_garden(devices: list[str]) -> tuple[tf_keras.Model, int, int, CountedSchedule]:
  """TF Model Garden's pattern (above) on a `PartialTPUEmbedding` of 4 features, 2 per side,
  `fit` over two batches: (the model, entries into `gather_and_update`, into
  `TableUpdates.update_tables` as written (not converted), the tables' schedule)."""
  schedule = CountedSchedule()
  # Sums by copying to one device, not collective ops: collective instance keys restart with
  # every strategy in a process, and a later test's strategy met this one's shapes under them.
  reduce = tf.distribute.ReductionToOneDevice()
  strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=reduce)
  config = features(4, output_shape=True)
  with strategy.scope():
    optimizer = tf_keras.optimizers.legacy.SGD(schedule)
    # The step the schedule reads, made before the step (as the trainer's optimizer has it):
    # made lazily in a step of two replicas, that step would fail on TF's variable lifting.
    optimizer.iterations
    layer = tpu_embedding.PartialTPUEmbedding(config, optimizer, size_threshold=THRESHOLD)
    ids = {name: tf_keras.Input(shape=(), dtype=tf.int64, name=name) for name in config}
    joined = tf_keras.layers.Concatenate()(list(layer(ids).values()))
    model = tf_keras.Model(ids, tf_keras.layers.Dense(1)(joined))
    model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.1), loss="mse")
  global_batch = BATCH * len(devices)
  data = tf.data.Dataset.from_tensor_slices(
    ({name: np.arange(2 * global_batch) % 10 for name in config}, np.ones([2 * global_batch, 1]))
  ).batch(global_batch, drop_remainder=True)  # static shapes, as the trainer's batches
  gathered, updated = entries_of(
    (exchange.gather_and_update.__code__, backward.TableUpdates.update_tables.__code__),
    lambda: model.fit(data, verbose=0),
  )
  return model, gathered, updated, schedule


def test_fit_under_a_one_device_strategy_updates_without_a_merge_and_one_rate_per_side():
  model, gathered, updated, schedule = fit_as_model_garden(["CPU:0"])
  assert model.train_function.experimental_get_tracing_count() == 2
  # One replica's gradients are the global batch's: the update runs in the replica step as
  # without a strategy, with no merge (its gathers, second deduplication and sums per table).
  assert gathered == 0
  assert updated == 2 * 2  # each trace, each side
  # The schedule the 2 tables of each side share is called once per side and trace (it was
  # once per table: 8), as the TPU engine calls a learning-rate callable once per step.
  assert schedule.calls == 2 * 2


def test_fit_under_two_replicas_merges_each_step_without_converting_the_update():
  model, gathered, updated, schedule = fit_as_model_garden(["CPU:0", "CPU:1"])
  assert model.train_function.experimental_get_tracing_count() == 2
  assert gathered == 2 * 2 * 2  # each trace, side and replica
  # The merge runs the update as written: AutoGraph, which converts a function `merge_call`
  # is given from converted code, converted it and all it calls (about 3,000 conversions in
  # the trainer), and a converted function's own code is never entered.
  assert updated == 2 * 2
  assert schedule.calls == 2 * 2


def serving_function(
  count: int, for_export: bool = False
) -> tuple[tf.types.experimental.ConcreteFunction, dict]:
  """(a serving function, traced with no tape as a signature, over a `TPUEmbedding` of `count`
  one-id features each with its own table; one request for it). `for_export`: traced as
  `export_for_serving` traces its signatures."""
  config = features(count)
  layer = LAYERS["tpu"](config)
  layer({name: tf.constant([0], tf.int64) for name in config})
  serve = tf.function(layer, autograph=False)
  specs = {name: tf.TensorSpec([None], tf.int64) for name in config}
  with lookup.exporting() if for_export else contextlib.nullcontext():
    traced = serve.get_concrete_function(specs)
  return traced, {n: tf.constant([0, 1], tf.int64) for n in config}


def serving_graph(count: int) -> tf.compat.v1.GraphDef:
  return serving_function(count)[0].graph.as_graph_def()


def executed_graph(count: int, for_export: bool = False) -> list:
  """The nodes of the graph TF's runtime runs for a serving request: after its rewrites, which
  lower every `tf.cond` to Switch/Merge and inline the functions called, branches included."""
  serve, request = serving_function(count, for_export)
  context.enable_run_metadata()
  try:
    serve(request)  # the first call instantiates the function, which records its graphs
    graphs = context.context().export_run_metadata().function_graphs
  finally:
    context.disable_run_metadata()
  return [
    node
    for function in graphs
    for graph in function.partition_graphs
    if any(n.op == "ResourceGather" for n in graph.node)
    for node in graph.node
  ]


# Measured on TF 2.21: 26 nodes at 2 features, 44 at 4 (the training forward it replaced: 59 and
# 111, with a tf.unique and a sparse product per table; one constant of the 26 tells the range
# check which features came as uint64). The id-range check's failure branch lives
# in the functions of the graph's library, outside the path a request runs.
def test_serving_graph_gathers_each_feature_once_without_deduplicating():
  graph_2, graph_4 = serving_graph(2), serving_graph(4)
  ops_4 = [n.op for n in graph_4.node]
  assert (len(graph_4.node) - len(graph_2.node)) / 2 <= 9
  assert len(graph_2.node) <= 26
  assert "Unique" not in ops_4 and "GatherV2" not in ops_4
  assert ops_4.count("ResourceGather") == 4


# Measured on TF 2.21: 40 nodes at 2 features, 56 at 4 (inlined, the failure branch made them 91
# and 109: ~50 ops visited as dead on every request, most of the latency above tfrs's plain
# gather). The branch is a function TF never inlines, so a request passes one dead call.
def test_serving_request_runs_without_the_range_checks_failure_branch():
  nodes_2, nodes_4 = executed_graph(2), executed_graph(4)
  assert [n.op for n in nodes_4].count("ResourceGather") == 4
  assert len(nodes_2) <= 40
  assert (len(nodes_4) - len(nodes_2)) / 2 <= 8
  refusal = {"Assert", "AsString", "Where", "ArgMax"}
  assert not refusal & {n.op for n in nodes_2 + nodes_4}


# Measured on TF 2.21: 10 nodes at 2 features, 21 at 4 (traced as elsewhere: 40 and 56). An
# export's request runs the gathers and nothing else of ours: no range check (the CPU gather
# refuses an id outside its table itself; any op of a check cost more than the whole gap to
# tfrs's plain gathers) and no gradient trap (an export saves no custom gradient).
def test_an_exports_request_runs_the_gathers_and_no_range_check_or_trap():
  nodes_2, nodes_4 = executed_graph(2, for_export=True), executed_graph(4, for_export=True)
  ops_4 = [n.op for n in nodes_4]
  assert ops_4.count("ResourceGather") == 4
  assert len(nodes_2) <= 10
  assert (len(nodes_4) - len(nodes_2)) / 2 <= 5.5
  ours = {"Max", "Bitcast", "Switch", "Merge", "Assert", "StatefulPartitionedCall", "IdentityN"}
  assert not ours & {n.op for n in nodes_2 + nodes_4}
  assert "ReadVariableOp" not in ops_4  # the trap's variable


def test_an_exports_gather_names_the_feature_and_table_of_an_id_it_refuses():
  serve, request = serving_function(2, for_export=True)
  request["f1"] = tf.constant([3, 10, -2], tf.int64)  # f1's table t1 has 10 rows
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match=r"(?s)indices\[1\] = 10 is not in \[0, 10\).*feature_f1\.table_t1/",
  ):
    serve(request)


def test_an_export_still_checks_ids_its_gathers_never_see_or_would_misprint():
  """uint64 ids (2**63 and more would print negative) and ids past max_sequence_length keep
  the range check of their own, naming the feature."""
  table = E.TableConfig(10, 4, name="t")
  config = {
    "u": E.FeatureConfig(table, name="u"),
    "s": E.FeatureConfig(table, name="s", max_sequence_length=2),
  }
  layer = tpu_embedding.TPUEmbedding(config, E.Adagrad(0.1))
  serve = tf.function(layer, autograph=False)
  specs = {"u": tf.TensorSpec([None], tf.uint64), "s": tf.TensorSpec([None, 3], tf.int64)}
  layer({"u": tf.constant([0], tf.uint64), "s": tf.constant([[0, 0, 0]], tf.int64)})
  with lookup.exporting():
    traced = serve.get_concrete_function(specs)
  good = tf.constant([[1, 2, 3]], tf.int64)
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"Offending ids:\] \[18446744073709551615\]"
  ):
    traced({"u": tf.constant([2**64 - 1], tf.uint64), "s": good})
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"Feature \\*'s\\*'.*Offending ids:\] \[99\]"
  ):
    traced({"u": tf.constant([1], tf.uint64), "s": tf.constant([[1, 2, 99]], tf.int64)})
