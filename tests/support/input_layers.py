"""The one-feature layer the engine's input tests share: feature 'f' on table 't' of 10 rows,
whose row r is [2r, 2r + 1], and a training step on it."""

import numpy as np
import tensorflow as tf

import tpu_embedding

E = tf.tpu.experimental.embedding
DIM = 2
VALUES = np.arange(10 * DIM, dtype=np.float32).reshape(10, DIM)  # W[r] = [2r, 2r + 1]


def layer(combiner="sum", **feature_kwargs):
  table = E.TableConfig(
    10, DIM, name="t", combiner=combiner, initializer=tf.constant_initializer(VALUES)
  )
  return tpu_embedding.TPUEmbedding({"f": E.FeatureConfig(table, **feature_kwargs)}, "sgd")


def train_step(model, features, signature=None):
  """One training step, eager or in a tf.function traced with `signature`; returns its output."""

  def step(features):
    with tf.GradientTape() as tape:
      out = model(features)
      loss = sum(tf.reduce_sum(x) for x in tf.nest.flatten(out))
    tape.gradient(loss, model.trainable_variables)
    return out

  if signature is None:
    return step(features)
  return tf.function(step, input_signature=[signature])(features)


def weights_cases():
  """Per kind, ids of feature 'f' and weights laid out differently from them."""
  ids_sp = tf.SparseTensor([[0, 0], [0, 1], [1, 0]], tf.constant([1, 3, 4], tf.int64), [2, 2])
  shifted = tf.SparseTensor([[0, 0], [1, 0], [1, 1]], [2.0, 3.0, 5.0], [2, 2])
  ids_rt = tf.ragged.constant([[1, 3], [4]], tf.int64)
  regrouped = tf.ragged.constant([[2.0], [3.0, 5.0]])
  return {"sparse": (ids_sp, shifted), "ragged": (ids_rt, regrouped)}
