"""tpu_embedding.engine.distribution: the engine's distribution, decided when it is created."""

import tensorflow as tf

from tpu_embedding.engine.distribution import Distribution


def test_no_strategy_is_local():
  assert Distribution.current() is Distribution.LOCAL


def test_a_mirrored_strategy_replicates():
  with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
    assert Distribution.current() is Distribution.REPLICATED
  with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
    assert Distribution.current() is Distribution.REPLICATED
