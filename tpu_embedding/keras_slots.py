"""The slots a Keras optimizer keeps for one model variable, found by the names Keras gives them.

On TPU V0 the Keras optimizer the model applies trains the tables, so that optimizer, not the
layer, holds their slots; managed ids must reset a row of each of them when the row changes key.
Each Keras family names a slot after its variable, as its own docstring states: tf-keras legacy
answers `get_slot(variable, name)`; tf-keras names it `"{slot}/{variable.name}"` (under the name
scope of the function that built it); Keras 3 names it `"{variable.name}_{slot}"` with the '/'
and ':' of the variable's name as '_'. `slot_names` here are the tf-keras names
(`optimizer_specs.OptimizerSpec.keras_slots`); Keras 3 renames two of Adam's.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import tensorflow as tf

from tpu_embedding import optimizer_specs, tf_internals

# Keras 3's names for the tf-keras slot names that differ.
_KERAS3_NAMES = {"m": "momentum", "v": "velocity"}


def slots_of(optimizer: Any, variable: tf.Variable, slot_names: Iterable[str]) -> dict:
  """{tf-keras slot name: slot variable} for those of `slot_names` that `optimizer` has created
  for `variable` (none before its first update, or its `build`, created them)."""
  names = list(slot_names)
  if hasattr(optimizer, "get_slot_names"):  # tf-keras legacy: a public lookup
    created = set(optimizer.get_slot_names())
    found = {}
    for name in names:
      if name in created:
        try:
          found[name] = optimizer.get_slot(variable, name)
        except KeyError:  # slots not created for this variable yet
          pass
    return found
  if is_keras3(optimizer):
    prefix = variable.name.replace("/", "_").replace(":", "_")
    wanted = {f"{prefix}_{_KERAS3_NAMES.get(name, name)}": name for name in names}
  else:
    wanted = {f"{name}/{variable.name}": name for name in names}
  found = {}
  # tf-keras gathers the slots of a sharded variable's blocks into one ShardedVariable; each
  # block's own slot is named after the block.
  for candidate in (block for each in optimizer.variables for block in _blocks(each)):
    scoped = candidate.name
    name = next((n for w, n in wanted.items() if scoped == w or scoped.endswith("/" + w)), None)
    if name is None or candidate.shape != variable.shape:
      continue
    if name in found:
      raise ValueError(
        f"The Keras optimizer {type(optimizer).__name__} holds two {name!r} slots named "
        f"{candidate.name!r} (two variables named {variable.name!r}), so the slot of this "
        "layer's table cannot be told apart: give the tables distinct names."
      )
    found[name] = candidate
  return found


def create_slots(optimizer: Any, tables: Mapping[Any, tf.Variable]) -> None:
  """Creates the slots a tf-keras legacy `optimizer` keeps for each table ({mid-level
  TableConfig: its variable}), with the initial values of the table's mid-level optimizer, as
  tf-recommenders does when its layer is built: so `get_slot` finds them at once, and a
  checkpoint restored before the build fills them then. Other Keras optimizers create theirs
  at their own `build` (the first step)."""
  if not (hasattr(optimizer, "add_slot") and hasattr(optimizer, "get_slot_names")):
    return
  for table, variable in tables.items():
    names = optimizer_specs.slot_names(table.optimizer) if table.optimizer else ()
    initializers = optimizer_specs.slot_initializers(table.optimizer) if names else ()
    for name, initializer in zip(names, initializers):
      keras_name = optimizer_specs.keras_slot_name(table.optimizer, name)
      if keras_name:
        optimizer.add_slot(variable, keras_name, initializer)


def is_keras3(optimizer: Any) -> bool:
  """Whether `optimizer` is a Keras 3 optimizer (its class defined in the `keras` package)."""
  return type(optimizer).__module__.split(".")[0] == "keras"


def _blocks(variable: Any) -> list:
  """The row blocks of a sharded variable; any other variable is its only block."""
  if isinstance(variable, tf_internals.ShardedVariable):
    return list(variable.variables)
  return [variable]
