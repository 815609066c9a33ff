"""Fresh values for rows given to new keys: what a newly created table and its slots hold."""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import optimizer_specs

TableConfig = tf.tpu.experimental.embedding.TableConfig

# Initializers whose every element is drawn independently of the shape asked for: a fresh draw
# for just the reset rows has the distribution a fresh table's rows have. Others (fan-scaled,
# user callables, full-table constants) are evaluated at the full shape and the rows gathered.
_ROW_INDEPENDENT = frozenset({"RandomNormal", "RandomUniform", "TruncatedNormal", "Zeros", "Ones"})


def fresh_rows(table: TableConfig, rows: tf.Tensor) -> dict[str, tf.Tensor]:
  """{"parameters": [len(rows), dim], slot name: its [len(rows), ...]}: what a fresh table and
  its optimizer slots hold at `rows` (where each path writes them is its own business)."""
  values = {"parameters": _fresh(table.initializer, rows, [table.vocabulary_size, table.dim])}
  if table.optimizer is not None:
    initializers = optimizer_specs.slot_initializers(table.optimizer)
    for (name, shape), initializer in zip(config_lib.slot_shapes(table), initializers):
      values[name] = _fresh(initializer, rows, shape)
  return values


def _fresh(initializer: Callable, rows: tf.Tensor, full_shape: list[int]) -> tf.Tensor:
  shape = tf.concat([tf.shape(rows, tf.int64), tf.constant(full_shape[1:], tf.int64)], 0)
  value = _scalar_constant(initializer)
  if value is not None:
    return tf.fill(shape, tf.constant(value, tf.float32))
  if type(initializer).__name__ in _ROW_INDEPENDENT:
    return initializer(shape=shape, dtype=tf.float32)
  return tf.gather(initializer(shape=full_shape, dtype=tf.float32), rows)


def _scalar_constant(initializer: Callable) -> Any:
  """The value of a constant initializer of one value (zeros, ones, Constant(scalar))."""
  name = type(initializer).__name__
  if name == "Zeros":
    return 0.0
  if name == "Ones":
    return 1.0
  if name == "Constant":
    value = initializer.get_config().get("value")
    if isinstance(value, (int, float)):
      return float(value)
  return None
