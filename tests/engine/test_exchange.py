"""Cross-replica sums of both engine paths, under MirroredStrategy with 2 logical CPUs.

TensorFlow compiles no collective for CPU devices under XLA ("Collectives are not yet implemented
for CPU devices when compiling with XLA"), so the replica steps here are plain `tf.function`s
calling the static path directly; on TPU and on GPUs the same all-reduce is compiled by XLA.
The graph path's gather across workers (padded bags) runs for real in test_multiworker.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import optimizer_specs
from tpu_embedding.engine import exchange, inputs, lookup, static_path, updates
from tpu_embedding.engine.engine import EmbeddingEngine
from tpu_embedding.engine.state import TableState

import reference

E = tf.tpu.experimental.embedding


@pytest.fixture(name="strategy")
def _strategy():
  # Reduction through one device: CPU collectives keep per-process keys that a second strategy
  # of the same devices would reuse with other shapes.
  return tf.distribute.MirroredStrategy(
    ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
  )


def test_every_replica_receives_the_sum_and_one_replica_its_own_value(strategy):
  def per_replica():
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return exchange.cross_replica_sum(tf.cast(replica + 1, tf.float32) * tf.ones([2]))

  summed = tf.function(lambda: strategy.run(per_replica))()
  for value in strategy.experimental_local_results(summed):
    np.testing.assert_array_equal(value.numpy(), [3.0, 3.0])
  np.testing.assert_array_equal(exchange.cross_replica_sum(tf.ones([2])).numpy(), [1.0, 1.0])
  assert exchange.replicas_to_sum() == 1


# Each replica's bags of one feature and their activation gradients; the global batch is both.
BAGS = [[[0, 3, 3], [5]], [[3], [1, 1, 0]]]
UPSTREAM = [
  np.array([[1.0, -2.0], [0.5, 0.25]], np.float32),
  np.array([[-1.0, 3.0], [2.0, -0.5]], np.float32),
]


@pytest.mark.parametrize(
  "optimizer",
  [E.Adagrad(0.3), E.Adam(0.3, lazy_adam=True), E.Adam(0.3, lazy_adam=False)],
  ids=["adagrad", "lazy_adam", "adam"],
)
def test_two_replicas_train_each_copy_as_one_device_trains_the_global_batch(strategy, optimizer):
  values = np.linspace(-1, 1, 8 * 2, dtype=np.float32).reshape(8, 2)
  table = E.TableConfig(8, 2, name="t", combiner="sum", initializer=tf.constant_initializer(values))
  config = config_lib.prepare({"f": E.FeatureConfig(table)}, optimizer)
  with strategy.scope():
    engine = EmbeddingEngine(config)
    engine.build()
  variables = engine.variables_by_table["t"]
  rule = updates.rule_for(optimizer)
  state = TableState.of(variables, rule.slot_names)

  def replica_step(ids, upstream):
    step = inputs.Step.prepare(config, {"f": ids})
    forward = lookup.look_up(step, engine.parameters, static_path.look_up_table)
    static_path.apply_gradients(
      forward.upstream_by_table([upstream]),
      lambda _: rule,
      lambda _: state,
      lambda table: optimizer_specs.learning_rate_tensor(table.optimizer),
    )

  per_replica = strategy.experimental_distribute_values_from_function(
    lambda context: (
      tf.ragged.constant(BAGS[context.replica_id_in_sync_group], tf.int64),
      tf.constant(UPSTREAM[context.replica_id_in_sync_group]),
    )
  )
  train = tf.function(lambda inputs: strategy.run(replica_step, args=inputs))
  params = reference.params_from_optimizer(optimizer)
  w, slots = values.astype(np.float64), reference.initial_slots(params, values.shape)
  global_bags = [(b, None) for bags in BAGS for b in bags]
  for _ in range(3):
    train(per_replica)
    row_ids, grads = reference.assemble_gradients(global_bags, np.concatenate(UPSTREAM), "sum")
    w, slots = reference.apply_step(w, slots, row_ids, grads, 0.3, params)
  for name, expected in [("parameters", w), *slots.items()]:
    for copy in variables[name].values:  # every replica's copy, not only the first
      np.testing.assert_allclose(copy.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_replica_step_updates_each_table_once_with_the_global_batch_summed_in_order(strategy):
  """Two features on table "a" (two bags per replica) and one on table "b"."""
  a, b = E.TableConfig(8, 2, name="a", combiner="sum"), E.TableConfig(4, 2, name="b")
  features = {"f1": E.FeatureConfig(a), "f2": E.FeatureConfig(a), "g": E.FeatureConfig(b)}
  config = config_lib.prepare(features, E.SGD(0.1))
  ids = {  # per replica: f1, f2, g (one sample each)
    "f1": [[[5, 1]], [[1]]],
    "f2": [[[2]], [[5, 5]]],
    "g": [[[3]], [[0]]],
  }
  upstream = {
    "f1": [[[1.0, 2.0]], [[3.0, 4.0]]],
    "f2": [[[0.5, 0.5]], [[-1.0, 2.0]]],
    "g": [[[7.0, 8.0]], [[9.0, 10.0]]],
  }
  recorded, seen_in_replica = [], []

  def replica_step(features, gradients):
    seen_in_replica.append(exchange.in_replica())
    step = inputs.Step.prepare(config, features)
    forward = lookup.look_up(
      step, lambda t: tf.zeros([t.vocabulary_size, t.dim]), lookup.deduplicated
    )
    per_table = forward.upstream_by_table([gradients[k] for k in sorted(gradients)])
    exchange.gather_and_update(
      per_table, lambda tables: recorded.extend((t.name, i, g) for t, i, g in tables)
    )

  per_replica = strategy.experimental_distribute_values_from_function(
    lambda context: (
      {
        k: tf.ragged.constant(v[context.replica_id_in_sync_group], tf.int64) for k, v in ids.items()
      },
      {k: tf.constant(v[context.replica_id_in_sync_group]) for k, v in upstream.items()},
    )
  )

  @tf.function
  def train(inputs):
    recorded.clear()
    strategy.run(replica_step, args=inputs)
    return {name: (i, g) for name, i, g in recorded}

  got = train(per_replica)
  assert len(recorded) == 2 and all(seen_in_replica) and not exchange.in_replica()
  # The global batch, each feature's bags replica by replica: "a" sees f1 (5, 1 | 1), then f2
  # (2 | 5, 5); each occurrence carries its sample's activation gradient (combiner sum).
  np.testing.assert_array_equal(got["a"][0].numpy(), [5, 1, 2])
  np.testing.assert_allclose(
    got["a"][1].numpy(), [[1 - 1 - 1, 2 + 2 + 2], [1 + 3, 2 + 4], [0.5, 0.5]]
  )
  np.testing.assert_array_equal(got["b"][0].numpy(), [3, 0])
  np.testing.assert_allclose(got["b"][1].numpy(), [[7, 8], [9, 10]])
