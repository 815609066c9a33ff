"""Managed-id resets for tables the Keras optimizer trains (TPU V0; `table_updates="keras"`).

The tables are variables the host writes at once; their slots live in the Keras optimizer the
model applies, which must therefore be the layer's `optimizer` object: a row given to a new key
is reset in the table and in each slot that optimizer holds for it, to the initial values of the
optimizer's mid-level twin (the same values: see `optimizers`). Under parameter servers a
shard of the map resets only its row block: of the table, and of each slot (tf-keras keeps one
per block). Keras 3 optimizers are refused there: they keep one slot for a whole sharded table.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import keras_slots, optimizer_specs
from tpu_embedding.backends.row_writers import ImmediateWriter
from tpu_embedding.engine import sharded
from tpu_embedding.engine.distribution import Distribution
from tpu_embedding.managed_ids import resets


def row_writer_of(backend: Any, optimizer: Any, managed: Mapping[str, Any]) -> ImmediateWriter:
  """The `row_resets.Writer` of `backend`'s managed tables ({table name: ManagedIds}), trained by
  the Keras `optimizer`."""
  if not hasattr(optimizer, "apply_gradients"):  # None, a name, a mid-level optimizer
    raise ValueError(
      f"managed_ids on path {backend.path.name} with tables trained by the Keras optimizer (a "
      "TPU without an embedding engine, or table_updates='keras') needs the Keras optimizer "
      f"object that trains the model as the layer's optimizer= (got {optimizer!r}): the "
      "tables' slots live in that optimizer, and a row given to a new key must be reset there "
      "too. Create the optimizer first, pass it to the layer and apply that same object in the "
      "train step."
    )
  tables = {table.name: table for table in backend.config.tables}

  def targets(table: config_lib.TableConfig, block: Optional[int]) -> dict[str, Any]:
    """{"parameters" or mid-level slot name: the variable holding it}: the table (its row
    `block` under parameter servers), and each slot the Keras optimizer has created for it
    (under its Keras name; Keras keeps one per block of a sharded table)."""
    variable = backend.variables_by_table[table.name]["parameters"]
    if block is not None:
      variable = sharded.shards(variable)[block]
    names = {
      name: optimizer_specs.keras_slot_name(table.optimizer, name)
      for name, _ in config_lib.slot_shapes(table)
    }
    slots = keras_slots.slots_of(optimizer, variable, [k for k in names.values() if k])
    return {"parameters": variable, **{n: slots[k] for n, k in names.items() if k in slots}}

  def write(table, rows, block):
    # All of `rows` lie in `block`: written there, on its ps only.
    values = resets.fresh_rows(table, rows)
    _, rows = sharded.in_block(backend.variables_by_table[table.name]["parameters"], rows, block)
    for name, target in targets(table, block).items():
      _write_rows(target, rows, values[name])

  def check():
    """Finds every slot before the maps change, so that one it cannot tell apart is refused
    with nothing changed."""
    if backend.is_built():
      for name in managed:
        variable = backend.variables_by_table[name]["parameters"]
        blocks = range(len(sharded.shards(variable))) if sharded.is_sharded(variable) else [None]
        for block in blocks:
          targets(tables[name], block)

  chosen = {name: table for name, table in tables.items() if name in managed}
  return ImmediateWriter(chosen, write, tables_exist=backend.is_built, check=check)


def refuse_keras3_under_parameter_servers(
  layer_name: str, optimizer: Any, managed: Iterable[str]
) -> None:
  """Refuses a Keras 3 `optimizer` training the managed tables `managed` (names) of a layer
  created under `ParameterServerStrategy`: Keras 3 does not support that strategy, keeps one
  slot for a whole sharded table rather than one per row block, so a map shard could not reset
  its rows' slots on its own ps task."""
  names = sorted(managed)
  if not names or Distribution.current() is not Distribution.PARAMETER_SERVERS:
    return
  if keras_slots.is_keras3(optimizer):
    raise ValueError(
      f"Layer {layer_name!r}: the managed tables {names} are trained by the Keras 3 optimizer "
      f"{type(optimizer).__name__} (table_updates='keras') under ParameterServerStrategy, "
      "which is not supported: a row given to a new key must be reset in each optimizer slot "
      "block by block on its ps task, and only tf-keras optimizers keep one slot per block. "
      "Use a tf_keras.optimizers (or tf_keras.optimizers.legacy) optimizer, or leave "
      "table_updates at 'engine' with a mid-level optimizer (tf.tpu.experimental.embedding)."
    )


def _write_rows(variable: Any, rows: tf.Tensor, value: tf.Tensor) -> None:
  """Writes `value` into `rows` of a tf.Variable, or of a Keras 3 variable (no scatter)."""
  if isinstance(variable, tf.Variable):
    variable.scatter_update(tf.IndexedSlices(value, rows))
  else:
    variable.assign(
      tf.tensor_scatter_nd_update(tf.convert_to_tensor(variable), rows[:, None], value)
    )
