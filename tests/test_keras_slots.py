"""`keras_slots.slots_of` on real optimizers of the three Keras families: each slot it finds is
the one the optimizer updates for that variable (checked against Adam's first step by hand)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tpu_embedding
from tpu_embedding import keras_slots

E = tf.tpu.experimental.embedding

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


def _keras_trained_layer():
  optimizer = tf_keras.optimizers.legacy.Adagrad(0.5, initial_accumulator_value=0.2)
  table = E.TableConfig(6, 2, initializer=tf.constant_initializer(0.5), name="t")
  layer = tpu_embedding.TPUEmbedding(
    {"f": E.FeatureConfig(table)}, optimizer, table_updates="keras"
  )
  return layer, optimizer


def test_keras_trained_slots_exist_at_build_and_take_a_restore_made_before_it(tmp_path):
  """As tf-recommenders: the layer's build creates the legacy optimizer's slots, so a restore
  issued before the build fills them and `get_slot` finds them before any step."""
  layer, optimizer = _keras_trained_layer()
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(layer({"f": tf.constant([1, 2, 2])})["f"])
  variables = layer.trainable_variables
  optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
  path = tf.train.Checkpoint(layer=layer, optimizer=optimizer).save(str(tmp_path / "ckpt"))
  restored, fresh = _keras_trained_layer()
  tf.train.Checkpoint(layer=restored, optimizer=fresh).restore(path)
  restored({"f": tf.constant([0])}, training=False)  # builds; nothing trained
  table = restored.variables_by_table["t"]["parameters"]
  expected = np.full([6, 2], 0.2)
  expected[1] += 1.0  # one id: gradient 1
  expected[2] += 4.0  # two ids: gradient 2
  np.testing.assert_allclose(fresh.get_slot(table, "accumulator").numpy(), expected)
  unbuilt, untouched = _keras_trained_layer()
  unbuilt({"f": tf.constant([0])}, training=False)
  parameters = unbuilt.variables_by_table["t"]["parameters"]
  np.testing.assert_allclose(untouched.get_slot(parameters, "accumulator"), np.full([6, 2], 0.2))
