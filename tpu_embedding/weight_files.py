"""Keras's own weight files (`.keras`, `.weights.h5`) hold every table and slot, by name.

Both Keras flavours save a layer in these formats as whatever its `save_own_variables` puts in
a store, and then walk only its Keras children (layers, optimizers): the engine holding the
tables is a `tf.Module`, so by default the tables would be left out without a word, and a reload
would keep freshly initialised tables. `TablesInKerasFiles` stores them under
`table:<table>` and `table:<table>:<slot>` (`checkpoint_names.keras_file_key`) and checks all of
them before assigning any. This module imports no Keras: the tf-keras layers and the Keras 3
ones (`tpu_embedding.keras.saving`) share it.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from tpu_embedding import checkpoint_names, hardware

_IN_ENGINE_MEMORY = (hardware.ExecutionPath.TPU_V1, hardware.ExecutionPath.TPU_V2)


class TablesInKerasFiles:
  """`save_own_variables` / `load_own_variables` of an embedding layer: its tables by name.

  The layer's `_own_tables()` says which tables it stores itself (a side served by a Keras
  sublayer is stored by that sublayer). The gradient trap is not stored: it only carries
  gradients and is always zero. Managed ids (key -> row maps) and tables in a TPU embedding
  engine's memory are refused by name: such a file would silently lack them.
  """

  def save_own_variables(self, store: Any) -> None:
    self._refuse_keras_file()
    self.flush()  # a file holds the tables with every pipelined update applied
    save_tables(store, self._own_tables())

  def load_own_variables(self, store: Any) -> None:
    self._refuse_keras_file()
    self.flush()  # an update held back would otherwise land on the loaded tables
    load_tables(store, self._own_tables(), self.name)

  def _refuse_keras_file(self) -> None:
    if self.managed_ids:
      why = "has managed_ids, whose key -> row maps no Keras file (.keras, .weights.h5) holds"
    elif getattr(self, "execution_path", None) in _IN_ENGINE_MEMORY:
      why = (
        f"keeps its tables in the TPU embedding engine's memory (path {self.execution_path.name}),"
        " which a Keras file (.keras, .weights.h5) cannot read or load"
      )
    else:
      return
    raise ValueError(
      f"{type(self).__name__} layer {self.name!r} {why}. Save and restore it with "
      "tf.train.Checkpoint (or save_weights/load_weights to a path without .h5 or .keras), "
      "which holds every table, slot and map; export it for serving with tf.saved_model.save or "
      "tpu_embedding.serving.export_for_serving."
    )


def save_tables(store: Any, variables_by_table: Mapping[str, Mapping[str, tf.Variable]]) -> None:
  for table, variables in variables_by_table.items():
    for slot, variable in variables.items():
      store[checkpoint_names.keras_file_key(table, slot)] = variable.numpy()


def load_tables(
  store: Any, variables_by_table: Mapping[str, Mapping[str, tf.Variable]], layer: str
) -> None:
  """Assigns every table and slot from `store`, after checking that all are there and fit."""
  values = {}
  for table, variables in variables_by_table.items():
    for slot, variable in variables.items():
      key = checkpoint_names.keras_file_key(table, slot)
      if key not in store.keys():
        raise ValueError(
          f"Layer {layer!r}: the Keras file holds no {slot!r} for table "
          f"{table!r} (looked for {key!r}; it holds {sorted(store.keys())}). Nothing was "
          "changed in this layer."
        )
      value = np.asarray(store[key])
      if list(value.shape) != variable.shape.as_list():
        raise ValueError(
          f"Layer {layer!r}: table {table!r} {slot!r} has shape "
          f"{list(value.shape)} in the Keras file; the layer expects "
          f"{variable.shape.as_list()}. Nothing was changed in this layer."
        )
      values[key] = (variable, value)
  for variable, value in values.values():
    variable.assign(value)
