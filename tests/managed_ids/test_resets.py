"""Tests of `tpu_embedding.managed_ids.resets`: which initializers the reset kernel draws, with
which parameters and seeds (the draws themselves: tests/engine/test_native.py)."""

import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tpu_embedding.managed_ids import resets

E = tf.tpu.experimental.embedding
Draw = resets.Draw


def _table(initializer, optimizer=None):
  return E.TableConfig(10, 4, initializer=initializer, optimizer=optimizer, name="movies")


@pytest.mark.parametrize(
  "initializer, expected",
  [
    (None, Draw("truncated_normal", 0.0, 0.5)),  # TableConfig's default: stddev 1/sqrt(dim)
    (tf.initializers.TruncatedNormal(0.5, 0.25), Draw("truncated_normal", 0.5, 0.25)),
    (tf.compat.v1.random_normal_initializer(0.1, 0.3), Draw("normal", 0.1, 0.3)),
    (tf_keras.initializers.RandomUniform(-1.0, 2.0), Draw("uniform", -1.0, 2.0)),
    (keras.initializers.TruncatedNormal(0.0, 0.05), Draw("truncated_normal", 0.0, 0.05)),
    (tf.zeros_initializer(), Draw("constant", 0.0)),
    (tf.constant_initializer(0.75), Draw("constant", 0.75)),
    (tf.constant_initializer(np.float32(0.5)), Draw("constant", 0.5)),
    (
      tf.compat.v1.random_uniform_initializer(0.0, 1.0, seed=np.int64(3)),
      Draw("uniform", 0.0, 1.0),
    ),
  ],
)
def test_draws_translate_the_initializers_and_slots_the_kernel_knows(initializer, expected):
  draws = resets.draws(_table(initializer, E.Adagrad(0.1, initial_accumulator_value=0.2)))
  assert draws.by_variable == {"parameters": expected, "accumulators": Draw("constant", 0.2)}
  adam = resets.draws(_table(initializer, E.Adam(0.1)))
  assert adam.by_variable == {
    "parameters": expected,
    "momenta": Draw("constant", 0.0),
    "velocities": Draw("constant", 0.0),
  }


@pytest.mark.parametrize(
  "initializer",
  [
    tf.initializers.GlorotUniform(),  # fan-scaled: its rows depend on the table's shape
    tf.constant_initializer([[1.0] * 4] * 10),  # a whole table of values
    lambda shape, dtype=None: tf.ones(shape, dtype),  # a callable of the user's
    keras.initializers.TruncatedNormal(seed=keras.random.SeedGenerator(3)),  # not an int seed
    tf.initializers.RandomNormal(mean=tf.constant(0.5)),  # a tensor parameter
  ],
)
def test_draws_leave_other_initializers_to_tf_ops(initializer):
  assert resets.draws(_table(initializer)) is None


def test_seeds_are_tf_random_ops_seeds():
  tf.random.set_seed(None)  # whatever an earlier test left
  unseeded = _table(tf.initializers.TruncatedNormal(0.0, 1.0))
  seeded = _table(tf.initializers.TruncatedNormal(0.0, 1.0, seed=3))
  assert resets.draws(unseeded).seeds == (0, 0)  # no seed anywhere: random
  assert resets.draws(seeded).seeds == tf.compat.v1.get_seed(3)
  try:
    tf.random.set_seed(11)
    fixed = tf.compat.v1.get_seed(zlib.crc32(b"movies"))  # per table, the same at every call
    assert fixed[0] == 11
    assert resets.draws(unseeded).seeds == fixed == resets.draws(unseeded).seeds
    assert resets.draws(seeded).seeds == (11, 3)
  finally:
    tf.random.set_seed(None)


def test_fresh_rows_give_each_variable_its_own_stream_under_a_global_seed():
  """An unseeded table and slot initializer under a global seed: in one trace, two ops of the
  same kind and seeds would draw the same values; each variable has its own seed."""
  same = tf.initializers.TruncatedNormal(0.0, 1.0)
  custom = E.CustomOptimizer(
    lambda g, t, s, lr, h: t, learning_rate=0.1, slot_names=["a"], slot_initializers=[same]
  )
  table = E.TableConfig(10, 4, initializer=same, optimizer=custom, name="movies")
  try:
    tf.random.set_seed(5)
    values = tf.function(lambda: resets.fresh_rows(table, tf.constant([1, 2, 3])))()
  finally:
    tf.random.set_seed(None)
  assert not np.any(values["parameters"].numpy() == values["a"].numpy())


def test_looking_at_the_global_seed_takes_no_op_seed():
  """Under a global seed TF numbers the op seeds of unseeded ops; reading the seeds a reset
  needs must not shift those of the user's next ops."""
  try:
    tf.random.set_seed(3)
    expected = tf.compat.v1.get_seed(None)
    tf.random.set_seed(3)
    resets.draws(_table(tf.initializers.TruncatedNormal(0.0, 1.0)))
    assert tf.compat.v1.get_seed(None) == expected
  finally:
    tf.random.set_seed(None)
