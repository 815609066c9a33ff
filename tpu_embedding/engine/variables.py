"""The engine's variables: each table and its slots, created without a second copy in memory.

A table is initialised by its `TableConfig.initializer` (TF's default otherwise), each slot by
its optimizer's slot initializers, or by the optimizer's own `slot_variable_creation_fn`;
tables row-sharded over parameter servers get their slots from `sharded`.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import tensorflow as tf

from tpu_embedding import checkpoint_names, optimizer_specs, tf_internals
from tpu_embedding import config as config_lib
from tpu_embedding.engine import sharded

TableConfig = tf.tpu.experimental.embedding.TableConfig


def new_table(table: TableConfig, trainable: bool, check_finite: bool) -> tf.Variable:
  """The table's variable, under the mid-level API's name (the table's)."""
  initializer = table.initializer or tf.initializers.TruncatedNormal(
    mean=0.0, stddev=1.0 / (table.dim**0.5)
  )
  shape = [table.vocabulary_size, table.dim]
  return _new_variable(initializer, shape, table.name, trainable, check_finite)


def slot_creator(table: TableConfig) -> Optional[Callable]:
  """The table optimizer's own `slot_variable_creation_fn`, if it has one."""
  return getattr(table.optimizer, "slot_variable_creation_fn", None)


def new_slots(
  table: TableConfig, parameters: tf.Variable, on_parameter_servers: bool, check_finite: bool
) -> dict[str, tf.Variable]:
  """{slot name: variable} of the table's optimizer, beside `parameters` (on its ps task, or
  block by block beside a row-sharded table)."""
  shapes = config_lib.slot_shapes(table)
  names = [name for name, _ in shapes]
  initializers = optimizer_specs.slot_initializers(table.optimizer)
  creator = slot_creator(table)
  if creator is not None:
    return dict(creator(parameters, names, initializers))
  if sharded.is_sharded(parameters):
    return sharded.create_slots(table, parameters, names, initializers)
  with sharded.colocated_with(parameters, on_parameter_servers):
    return {
      name: _new_variable(
        initializer, shape, checkpoint_names.variable_key(table.name, name), False, check_finite
      )
      for (name, shape), initializer in zip(shapes, initializers)
    }


_COPY_IS_CHEAP_BYTES = 16 << 20


def _new_variable(
  initializer: Callable, shape: list[int], name: str, trainable: bool, check_finite: bool
) -> tf.Variable:
  """A variable holding `initializer(shape)`, without a second copy of it in memory.

  `tf.Variable(initial_value=...)` keeps the initial tensor alive while copying it into the
  variable, so a 1.3 GB table briefly costs 2.6 GB (more with the initializer's temporaries).
  Off any strategy the value is instead computed and assigned inside one function, where it is
  an intermediate that TF writes straight into the variable's buffer. Strategies create their
  own (e.g. mirrored) variables, so there the plain constructor is used, as it is for tables
  below `_COPY_IS_CHEAP_BYTES`, where the function's tracing would cost more time (at the first
  step, once per table and slot) than the copy costs memory.
  """
  value = functools.partial(_initial_value, initializer, shape, name, check_finite)
  if tf.distribute.has_strategy() or 4 * math.prod(shape) < _COPY_IS_CHEAP_BYTES:
    return tf.Variable(initial_value=value, trainable=trainable, name=name)
  variable = tf_internals.uninitialized_variable(
    shape=shape, dtype=tf.float32, trainable=trainable, name=name
  )
  # One function per variable (in one function for all, TF holds every constant initial value
  # at once). A partial, not a lambda: TF counts traces per code object and would warn that a
  # function meant to run once per variable is "retracing".
  tf.function(functools.partial(_assign, variable, value), autograph=False)()
  return variable


def _initial_value(
  initializer: Callable, shape: list[int], name: str, check_finite: bool
) -> tf.Tensor:
  """`initializer(shape)`, refused by name unless it is a float32 tensor of that shape (and
  finite, with `check_finite`)."""
  try:
    value = tf.convert_to_tensor(initializer(shape=shape, dtype=tf.float32))
  except (TypeError, ValueError) as e:
    raise ValueError(
      f"Embedding variable {name!r}: its initializer failed for shape {shape}, float32: {e}"
    ) from e
  if value.dtype != tf.float32 or value.shape != shape:
    raise ValueError(
      f"Embedding variable {name!r}: its initializer gave a {value.dtype.name} "
      f"tensor of shape {value.shape.as_list()}; expected float32 {shape}."
    )
  if check_finite:
    value = tf.debugging.check_numerics(
      value,
      f"Embedding variable {name!r}: its initializer produced a non-finite value "
      "(check_finite=True refuses it when the variable is created)",
    )
  return value


def _assign(variable: tf.Variable, value: Callable[[], tf.Tensor]) -> None:
  variable.assign(value(), read_value=False)
