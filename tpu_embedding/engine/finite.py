"""The opt-in check (`TPUEmbedding(check_finite=True)`) that stops NaN/Inf before a table.

By default the engine does what the TPU does: a non-finite gradient, weight or learning rate
silently poisons the rows it touches, and the damage shows steps later. With the check on, the
first non-finite value on its way to a table raises an error naming the feature (or table) and
what held it, before anything is written: the engine runs every table's `check_update` before
its first write of any table, so a step that fails writes nothing. What the update itself would
produce is checked too (an Adagrad accumulator overflowing to inf from a finite 1e25 gradient
would freeze its row forever), by computing the new rows once without writing them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Iterator, Optional, Sequence

import tensorflow as tf

from tpu_embedding.engine import inputs, sharded, updates
from tpu_embedding.engine.state import TableState

_REMEDY = "(check_finite=True stops it here; this step wrote nothing to any table)"


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


@dataclasses.dataclass
class Joined:
  """Whether a joint step (`JointStep`) runs an engine's checks for it, before its gradient
  functions: they then skip their own, so that each check runs once."""

  guarded: bool = False


def guard_gradients(
  activations: Sequence[tf.Tensor], bags: Sequence[inputs.Bags], joined: Joined
) -> list[tf.Tensor]:
  """The activations, unchanged, whose gradients are checked on their way back to the tables
  (unless a joint step checked them first)."""
  return [_checked_gradient(a, bag, joined) for a, bag in zip(activations, bags)]


def _checked_gradient(activation: tf.Tensor, bag: inputs.Bags, joined: Joined) -> tf.Tensor:
  def grad(upstream):
    return upstream if joined.guarded else checked_activation_gradient(upstream, bag)

  @tf.custom_gradient
  def identity(x):
    return tf.identity(x), grad

  return identity(activation)


def checked_activation_gradient(upstream: tf.Tensor | None, bag: inputs.Bags) -> tf.Tensor | None:
  """The gradient of a bag's activations, checked (None stays None: no gradient reached it)."""
  if upstream is None:
    return None
  return tf.debugging.check_numerics(
    upstream,
    f"Feature {bag.feature.name!r} (table {bag.feature.table.name!r}): the gradient of "
    f"its activations holds a non-finite value {_REMEDY}",
  )


def check_learning_rate(learning_rate: tf.Tensor, table_name: str) -> tf.Tensor:
  return tf.debugging.check_numerics(
    learning_rate, f"Table {table_name!r}: its learning rate is not finite {_REMEDY}"
  )


def check_update(
  table_name: str,
  rule: updates.UpdateRule,
  state: TableState,
  row_ids: tf.Tensor,
  grads: tf.Tensor,
  learning_rate: tf.Tensor,
  table_rows: tf.Tensor | None = None,
) -> tf.Tensor:
  """True once one table's update (`updates.apply_sparse_update`'s arguments, `state` one copy
  of the table) would read and write only finite values; an error naming the table otherwise.

  Computes the rows and slot rows the update would write with the same float32 operations as
  every engine path, without writing them.
  """
  learning_rate = tf.cast(learning_rate, tf.float32)  # checked where it was read
  grads = check_row_gradients(grads, table_name)
  if table_rows is None:
    table_rows = sharded.gather(state.parameters, row_ids)
  slot_rows = tuple(sharded.gather(slot, row_ids) for slot in state.slots)
  clipped = updates.clip_gradient(rule.optimizer, grads)
  new_table, new_slots = updates.update_rows(rule, table_rows, slot_rows, clipped, learning_rate)
  checked = [_checked_rows(new_table, table_name, "rows")]
  for name, values in zip(rule.slot_names, new_slots):
    checked.append(_checked_rows(values, table_name, f"{name!r} slot"))
  if rule.updates_every_row:  # untouched rows take a zero-gradient step too
    checked.append(
      tf.debugging.Assert(
        updates.zero_gradient_step_is_finite(rule, state.parameters, state.slots, learning_rate),
        [
          f"Table {table_name!r}: the zero-gradient step of its untouched rows would write a "
          f"non-finite value {_REMEDY}"
        ],
      )
    )
  with tf.control_dependencies(checked):
    return tf.constant(True)


def check_row_gradients(grads: tf.Tensor, table_name: str) -> tf.Tensor:
  """The step's gradients of a table's touched rows (summed over the step), checked."""
  return tf.debugging.check_numerics(
    tf.cast(grads, tf.float32),
    f"Table {table_name!r}: the gradient summed over one of its rows is not finite {_REMEDY}",
  )


def _checked_rows(values: tf.Tensor, table_name: str, what: str) -> tf.Tensor:
  return tf.debugging.check_numerics(
    values,
    f"Table {table_name!r}: this step's update would write a non-finite value to its {what} "
    f"{_REMEDY}",
  )


# ---------------------------------------------------------------------------------------------
# One step over several engines (PartialTPUEmbedding's two sides)

CheckOf = Callable[[list], list]  # an engine's activations' upstream gradients -> its checks


class JointStep:
  """The trained lookups of several engines in one layer call, whose checks must all run
  before any of them writes: each engine checks and writes in its own gradient function, which
  TF calls one engine after the other, so one engine could write before another refuses.
  `guard` puts all their checks on the gradients' way back, before either gradient function."""

  def __init__(self) -> None:
    self._lookups: list[tuple[list[tf.Tensor], CheckOf, Joined]] = []

  def add(self, activations: list[tf.Tensor], check: CheckOf, joined: Joined) -> None:
    self._lookups.append((list(activations), check, joined))

  def guard(self, outputs: dict) -> dict:
    """`outputs` ({key: activation}), the activations of the lookups added replaced by ones
    whose gradient, before it reaches any engine, passes every engine's checks. With one
    engine there is nothing to join: its own checks run before its writes."""
    if len(self._lookups) < 2:
      return outputs
    registered = [a for activations, _, _ in self._lookups for a in activations]
    keys = {id(a): key for key, a in outputs.items()}
    missing = [a for a in registered if id(a) not in keys]
    if missing:  # a layer between the engine and these outputs replaced its activations
      raise RuntimeError("check_finite: an engine's activations are not among the outputs.")

    @tf.custom_gradient
    def checked(*activations):
      def grad(*upstream):
        checks, position = [], 0
        for lookup_activations, check, _ in self._lookups:
          count = len(lookup_activations)
          checks.extend(check(list(upstream[position : position + count])))
          position += count
        with tf.control_dependencies(checks):
          return [g if g is None else tf.identity(g) for g in upstream]

      return [tf.identity(a) for a in activations], grad

    guarded = dict(zip([keys[id(a)] for a in registered], checked(*registered)))
    for _, _, joined in self._lookups:
      joined.guarded = True
    return {key: guarded.get(key, value) for key, value in outputs.items()}


_open = threading.local()


@contextlib.contextmanager
def joint_step() -> Iterator[JointStep]:
  """While open, engines that train with `check_finite` add their lookups to the step."""
  outer = getattr(_open, "step", None)
  _open.step = JointStep()
  try:
    yield _open.step
  finally:
    _open.step = outer


def join(activations: list[tf.Tensor], check: CheckOf, joined: Joined) -> None:
  """Adds an engine's trained lookup to the joint step open on this thread, if any; `joined`
  says, once its gradient is taken, whether that step ran the checks."""
  step: Optional[JointStep] = getattr(_open, "step", None)
  if step is not None:
    step.add(activations, check, joined)
