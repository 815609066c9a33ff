"""Tests of `tpu_embedding.engine.variables`: a table and its slots created from their
initializers, under the mid-level API's names, on both ways of filling a variable (the plain
constructor below 16 MiB, an in-function assignment above); bad initializers refused by name."""

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding.engine import variables

E = tf.tpu.experimental.embedding
ROWS = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def table(initializer=tf.constant_initializer(ROWS), vocabulary_size=3, dim=2, **optimizer):
  adagrad = E.Adagrad(0.1, initial_accumulator_value=0.25, **optimizer)
  return E.TableConfig(vocabulary_size, dim, name="t", initializer=initializer, optimizer=adagrad)


def test_a_table_holds_its_initializers_values_under_its_name():
  parameters = variables.new_table(table(), trainable=True, check_finite=False)
  np.testing.assert_array_equal(parameters.numpy(), ROWS)
  assert (parameters.name, parameters.trainable) == ("t:0", True)


def test_a_table_of_more_than_16_mib_is_filled_with_the_same_values():
  # 4097 x 1024 float32: 16 MiB + 4 KiB.
  big = table(tf.constant_initializer(0.5), vocabulary_size=4097, dim=1024)
  parameters = variables.new_table(big, trainable=False, check_finite=True)
  assert parameters.shape == (4097, 1024) and not parameters.trainable
  assert parameters.name == "t:0"
  assert np.all(parameters.numpy() == 0.5)


def test_slots_hold_the_optimizers_initial_values_under_table_slash_slot():
  parameters = variables.new_table(table(), trainable=True, check_finite=False)
  slots = variables.new_slots(table(), parameters, on_parameter_servers=False, check_finite=False)
  assert list(slots) == ["accumulators"]
  np.testing.assert_array_equal(slots["accumulators"].numpy(), np.full([3, 2], 0.25))
  assert (slots["accumulators"].name, slots["accumulators"].trainable) == (
    "t/accumulators:0",
    False,
  )


def test_the_optimizers_own_slot_creation_function_makes_the_slots():
  calls = []

  def create(parameters, names, initializers):
    calls.append((parameters, list(names), len(initializers)))
    return {"accumulators": tf.Variable(tf.fill([3, 2], 7.0))}

  config = table(slot_variable_creation_fn=create)
  assert variables.slot_creator(config) is create
  parameters = variables.new_table(config, trainable=True, check_finite=False)
  slots = variables.new_slots(config, parameters, on_parameter_servers=False, check_finite=False)
  assert calls == [(parameters, ["accumulators"], 1)]
  np.testing.assert_array_equal(slots["accumulators"].numpy(), np.full([3, 2], 7.0))


def test_an_initializer_of_the_wrong_shape_is_refused_by_variable_name():
  wrong = table(lambda shape, dtype: tf.zeros([2], dtype))
  with pytest.raises(
    ValueError,
    match=r"Embedding variable 't': its initializer gave a float32 tensor of shape \[2\]; "
    r"expected float32 \[3, 2\]\.",
  ):
    variables.new_table(wrong, trainable=True, check_finite=False)


def test_a_non_finite_initial_value_is_refused_only_with_check_finite():
  nan = table(tf.constant_initializer(np.nan))
  with pytest.raises(tf.errors.InvalidArgumentError, match="Embedding variable 't'.*non-finite"):
    variables.new_table(nan, trainable=True, check_finite=True)
  assert np.isnan(variables.new_table(nan, trainable=True, check_finite=False).numpy()).all()
