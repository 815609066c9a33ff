"""What a table's update reads and writes, as named values handed from the engine to the kernels.

A table's variables reach the update code in one shape, `TableState` (the table and its slots in
the optimizer's slot order), whether they are whole variables, one device's copy of mirrored ones
or one shard of sharded ones; pipelining holds a step's update back in a `PendingUpdate`. The
checkpointed form stays the mid-level API's `{"parameters": table, slot name: slot}` dict.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import tensorflow as tf

TableConfig = tf.tpu.experimental.embedding.TableConfig


def per_device(variable: Any) -> list[Any]:
  """The copies of a variable, one per device holding one (itself when not distributed)."""
  if isinstance(variable, tf.distribute.DistributedValues):
    return list(variable.values)
  return [variable]


@dataclasses.dataclass(frozen=True, eq=False)  # variables compare elementwise, not as values
class TableState:
  """A table and its optimizer's slots, the slots ordered as the optimizer names them.

  The variables may be whole (plain, mirrored or sharded) or one part of each (a device's copy,
  a shard): every part of a state is cut the same way (`split`).
  """

  parameters: Any
  slots: tuple[Any, ...] = ()

  @classmethod
  def of(cls, variables: Mapping[str, Any], slot_names: Sequence[str]) -> TableState:
    """The state in one table's mid-level `variables` dict ({"parameters": ..., slot: ...})."""
    return cls(variables["parameters"], tuple(variables[name] for name in slot_names))

  @property
  def variables(self) -> tuple[Any, ...]:
    """The table, then its slots."""
    return (self.parameters, *self.slots)

  def split(self, parts: Callable[[Any], Sequence[Any]]) -> list[TableState]:
    """One state per part, where `parts(variable)` cuts each variable alike (copies, shards)."""
    return [TableState(part[0], tuple(part[1:])) for part in zip(*map(parts, self.variables))]

  def copies(self) -> list[TableState]:
    """One state per device holding a copy of the variables (itself when not distributed)."""
    return self.split(per_device)


@dataclasses.dataclass(frozen=True, eq=False)  # variables compare elementwise, not as values
class PendingUpdate:
  """One step's update of a table, held back until the next step has looked up (SPEC §6).

  Variable-length buffers, so XLA cannot compile what reads or writes them.
  """

  has: tf.Variable
  ids: tf.Variable
  grads: tf.Variable
  learning_rate: tf.Variable

  @classmethod
  def create(cls, table: TableConfig) -> PendingUpdate:
    return cls(
      has=tf.Variable(False, trainable=False, name=f"{table.name}/pending_has"),
      ids=tf.Variable(
        tf.zeros([0], tf.int64),
        shape=tf.TensorShape([None]),
        trainable=False,
        name=f"{table.name}/pending_ids",
      ),
      grads=tf.Variable(
        tf.zeros([0, table.dim]),
        shape=tf.TensorShape([None, table.dim]),
        trainable=False,
        name=f"{table.name}/pending_grads",
      ),
      learning_rate=tf.Variable(0.0, trainable=False, name=f"{table.name}/pending_lr"),
    )

  def copies(self) -> list[PendingUpdate]:
    """One per device holding a copy of the buffers (itself when not distributed)."""
    buffers = [getattr(self, field.name) for field in dataclasses.fields(self)]
    return [PendingUpdate(*copy) for copy in zip(*map(per_device, buffers))]

  def apply(self, update: Callable[[tf.Tensor, tf.Tensor, tf.Tensor], None]) -> None:
    """Calls `update(ids, grads, learning_rate)` on the held update, if any; then holds none."""

    def run(*held):
      update(*held)
      return tf.constant(True)

    self.when_held(run)
    self.has.assign(False)

  def when_held(self, compute: Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """`compute(ids, grads, learning_rate)` (a bool) of the held update if there is one, else
    False; holds it still."""
    return tf.cond(
      self.has.read_value(),
      lambda: compute(
        self.ids.read_value(), self.grads.read_value(), self.learning_rate.read_value()
      ),
      lambda: tf.constant(False),
    )

  def hold(self, ids: tf.Tensor, grads: tf.Tensor, learning_rate: tf.Tensor) -> None:
    self.ids.assign(ids)
    self.grads.assign(grads)
    self.learning_rate.assign(learning_rate)
    self.has.assign(True)
