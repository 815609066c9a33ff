"""`keras_slots.slots_of` on real optimizers of the three Keras families: each slot it finds is
the one the optimizer updates for that variable (checked against Adam's first step by hand)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tpu_embedding import keras_slots

FAMILIES = {
  "legacy": tf_keras.optimizers.legacy.Adam,
  "tf_keras": tf_keras.optimizers.Adam,
  "keras3": keras.optimizers.Adam,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_slots_of_finds_each_variables_own_slots(family):
  optimizer = FAMILIES[family](0.1, beta_1=0.9, beta_2=0.99)
  first = tf.Variable(tf.zeros([3, 2]), name="first")
  second = tf.Variable(tf.zeros([3, 2]), name="second")
  assert keras_slots.slots_of(optimizer, first, ["m", "v"]) == {}  # none created yet
  gradients = {
    "first": np.full([3, 2], 2.0, np.float32),
    "second": np.full([3, 2], -3.0, np.float32),
  }

  @tf.function
  def step():  # built under the function's name scope, as in a train step
    optimizer.apply_gradients([(gradients["first"], first), (gradients["second"], second)])

  step()
  for variable in (first, second):
    g = gradients[variable.name.split(":")[0]]
    slots = keras_slots.slots_of(optimizer, variable, ["m", "v"])
    assert sorted(slots) == ["m", "v"]
    np.testing.assert_allclose(slots["m"].numpy(), 0.1 * g, rtol=1e-6)  # (1 - beta_1) g
    np.testing.assert_allclose(slots["v"].numpy(), 0.01 * g * g, rtol=1e-6)  # (1 - beta_2) g^2
