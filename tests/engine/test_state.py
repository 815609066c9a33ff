"""A table's state and held-back update, as the engine hands them to the update code."""

import numpy as np
import tensorflow as tf

from tpu_embedding.engine.state import PendingUpdate, TableState

E = tf.tpu.experimental.embedding


def test_slots_follow_the_given_names_whatever_order_the_dict_has():
  table, momenta, velocities = tf.Variable([[1.0]]), tf.Variable([[2.0]]), tf.Variable([[3.0]])
  variables = {"velocities": velocities, "parameters": table, "momenta": momenta}
  state = TableState.of(variables, ["momenta", "velocities"])
  assert state.parameters is table
  assert state.slots == (momenta, velocities)
  assert state.variables == (table, momenta, velocities)


def test_copies_are_one_state_per_device_of_mirrored_variables():
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    table, accumulators = tf.Variable([[1.0, 2.0]]), tf.Variable([[0.5, 0.5]])
  copies = TableState(table, (accumulators,)).copies()
  assert [c.parameters.device for c in copies] == [v.device for v in table.values]
  for copy, table_copy, slot_copy in zip(copies, table.values, accumulators.values):
    assert copy.parameters is table_copy and copy.slots == (slot_copy,)
  plain = TableState(tf.Variable([[1.0]]))
  assert [c.variables for c in plain.copies()] == [plain.variables]


def test_a_held_update_is_applied_once_then_none_is_held():
  pending = PendingUpdate.create(E.TableConfig(5, 2, name="t"))
  applied = []
  record = lambda ids, grads, lr: applied.append((ids.numpy(), grads.numpy(), lr.numpy()))
  pending.apply(record)
  assert applied == []  # nothing held yet
  pending.hold(tf.constant([3, 1], tf.int64), tf.constant([[1.0, 2.0], [3.0, 4.0]]), 0.5)
  pending.apply(record)
  pending.apply(record)
  assert len(applied) == 1
  ids, grads, lr = applied[0]
  np.testing.assert_array_equal(ids, [3, 1])
  np.testing.assert_array_equal(grads, [[1.0, 2.0], [3.0, 4.0]])
  assert lr == 0.5
  assert [v.name for v in (pending.has, pending.ids, pending.grads, pending.learning_rate)] == [
    "t/pending_has:0",
    "t/pending_ids:0",
    "t/pending_grads:0",
    "t/pending_lr:0",
  ]
