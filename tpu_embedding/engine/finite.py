"""The opt-in check (`TPUEmbedding(check_finite=True)`) that stops NaN/Inf before a table.

By default the engine does what the TPU does: a non-finite gradient, weight or learning rate
silently poisons the rows it touches, and the damage shows steps later. With the check on, the
first non-finite value on its way to a table raises an error naming the feature (or table) and
what held it, before anything is written.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

from tpu_embedding.engine import inputs

_REMEDY = "(check_finite=True stops it here; nothing was written to the table)"


def check_weights(step: inputs.Step) -> inputs.Step:
  """`step`, each weighted bag's gains (weight x combiner scale) checked on their way to a
  lookup."""
  return inputs.Step([_checked_gains(bag) for bag in step.bags])


def _checked_gains(bag: inputs.Bags) -> inputs.Bags:
  if bag.gains is None:
    return bag
  gains = tf.debugging.check_numerics(
    bag.gains,
    f"Feature {bag.feature.name!r} (table {bag.feature.table.name!r}): its "
    f"weights hold a non-finite value, or their sum overflows {_REMEDY}",
  )
  return dataclasses.replace(bag, gains=gains)


def guard_gradients(
  activations: Sequence[tf.Tensor], bags: Sequence[inputs.Bags]
) -> list[tf.Tensor]:
  """The activations, unchanged, whose gradients are checked on their way back to the tables."""
  return [_checked_gradient(a, bag) for a, bag in zip(activations, bags)]


def _checked_gradient(activation: tf.Tensor, bag: inputs.Bags) -> tf.Tensor:
  message = (
    f"Feature {bag.feature.name!r} (table {bag.feature.table.name!r}): the gradient of "
    f"its activations holds a non-finite value {_REMEDY}"
  )

  @tf.custom_gradient
  def identity(x):
    return tf.identity(x), lambda upstream: tf.debugging.check_numerics(upstream, message)

  return identity(activation)


def check_learning_rate(learning_rate: tf.Tensor, table_name: str) -> tf.Tensor:
  return tf.debugging.check_numerics(
    learning_rate, f"Table {table_name!r}: its learning rate is not finite {_REMEDY}"
  )
