"""Keras's weight files hold every table, slot and managed-ids map of the embedding layers.

Both Keras flavours save a layer in their own formats (`.keras`, `.weights.h5`) as whatever its
`save_own_variables` puts in a store, and then walk only its Keras children (layers,
optimizers): the engine holding the tables is a `tf.Module`, so by default the tables would be
left out without a word, and a reload would keep freshly initialised tables.
`TablesInKerasFiles` stores them under `table:<table>` and `table:<table>:<slot>`
(`checkpoint_names.keras_file_key`), each managed-ids map's variables under
`managed:<table>:<i>`, and checks all of them before assigning any.

The legacy HDF5 format (`save_weights("w.h5")`, `model.save("m.h5")`) calls no method of the
layer before it writes: it stores the layer's Keras weights by position, as they are, and after a
load calls the layer's `finalize_state`. Keras lists the CPU/GPU engine's variables and the maps'
variables itself, but not TF's TPU tables, which are split over hosts (V1) or devices
(SparseCore): `table_weights` gives their pieces, plain variables Keras can read and assign (in
Keras's own formats too, under `<key>/<piece>`). Reading a weight list changes nothing, so that
format holds what `flush` has not applied yet (pipelining, row resets still waiting, V1's tables
in TPU memory) only once the user has called `flush`; Keras's own formats call it themselves.
`finalize_state` loads V1's tables back into the TPU and rebuilds each map's hash table (no
variable) from the map's variables just assigned. Every variable is numeric (a string-key map
holds its strings' int64 fingerprints), so every format holds every map.

This module imports no Keras: the tf-keras layers and the Keras 3 ones
(`tpu_embedding.keras.saving`) share it.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from tpu_embedding import checkpoint_names, hardware, tf_mid_level
from tpu_embedding.managed_ids.spec import fingerprint

# Paths whose tables TF's TPU classes hold, where Keras lists none of them itself.
IN_TPU_MEMORY = (hardware.ExecutionPath.TPU_V1, hardware.ExecutionPath.TPU_V2)


class TablesInKerasFiles:
  """What Keras's files hold of an embedding layer: its tables, slots and managed-ids maps.

  `save_own_variables` / `load_own_variables` (Keras's own formats) store them by name;
  `table_weights` lists them for Keras's weight lists (legacy HDF5, by position), and
  `finalize_state` completes a load. The layer's `_own_tables()` says which tables it stores
  itself (a side served by a Keras sublayer is stored by that sublayer). The gradient trap is
  not stored: it only carries gradients and is always zero.
  """

  def save_own_variables(self, store: Any) -> None:
    self.flush()  # a file holds the tables with every pipelined update and row reset applied
    stored = stored_variables(self.table_weights(self._own_tables()), self.managed_ids or {})
    save_variables(store, stored)

  def load_own_variables(self, store: Any) -> None:
    self.flush()  # an update held back would otherwise land on the loaded tables
    maps = self.managed_ids or {}
    stored = stored_variables(self.table_weights(self._own_tables()), maps)
    load_variables(store, stored, self.name, fingerprint_keys(maps))
    self.finalize_state()

  def table_weights(self, variables_by_table: Mapping[str, Mapping[str, Any]]) -> dict:
    """{name: plain variable} of these tables and slots, in order, for Keras's weight lists
    (`tf_mid_level.plain_variables`; the name is the table's `keras_file_key`, `/<piece>` added
    where TF splits it). V1's pieces are host copies of the TPU's memory: current after `flush`."""
    weights = {}
    for table, variables in variables_by_table.items():
      for slot, variable in variables.items():
        key = checkpoint_names.keras_file_key(table, slot)
        pieces = tf_mid_level.plain_variables(variable)
        if len(pieces) == 1 and pieces[0] is variable:
          weights[key] = variable
        else:
          weights.update({f"{key}/{i}": piece for i, piece in enumerate(pieces)})
    return weights

  def finalize_state(self) -> None:
    """Keras calls this once it has assigned the layer's weights (legacy HDF5 `load_weights`,
    `set_weights`): tables in V1's TPU memory are loaded from the host copies just assigned, and
    each managed-ids map finds its keys again in the variables just assigned."""
    for engine in self._engines_in_tpu_memory():
      tf_mid_level.load_into_tpu(engine)
    for id_map in (self.managed_ids or {}).values():
      id_map.reindex()

  def _engines_in_tpu_memory(self) -> list[tf.Module]:
    """TF's built V1 objects behind this layer (its own, or its sharded side's)."""
    layers = [self, getattr(self, "tpu_embedding", None)]  # tpu_embedding: a Partial's side
    return [
      layer.engine
      for layer in layers
      if getattr(layer, "execution_path", None) is hardware.ExecutionPath.TPU_V1 and layer.built
    ]


def stored_variables(tables: Mapping[str, tf.Variable], maps: Mapping[str, Any]) -> dict:
  """{key in a Keras file's store: variable}: `tables` (`TablesInKerasFiles.table_weights`), and
  every variable of each managed-ids map (`maps`, {table name: map}) under
  `managed:<table>:<i>`, in the map's own order (`tf.Module.variables`; a string-key map's keys
  with `FINGERPRINTS` added)."""
  stored = dict(tables)
  for table, id_map in maps.items():
    stored.update({_map_key(table, i, v, id_map): v for i, v in enumerate(id_map.variables)})
  return stored


def fingerprint_keys(maps: Mapping[str, Any]) -> frozenset[str]:
  """The keys (`stored_variables`') of the string-key maps' keys variables (their int64
  vectors), which older files stored as strings under the key without `FINGERPRINTS`."""
  return frozenset(key for key in stored_variables({}, maps) if key.endswith(FINGERPRINTS))


# A string-key map's keys variable holds fingerprints, int64 as an int64-key map's keys: its key
# ends with this, so that neither kind of map loads the other's keys from a file.
FINGERPRINTS = ":fingerprints"


def _map_key(table: str, position: int, variable: tf.Variable, id_map: Any) -> str:
  key = f"managed:{table}:{position}"
  fingerprints = id_map.key_dtype == tf.string and variable.dtype == tf.int64
  return key + FINGERPRINTS if fingerprints and variable.shape.rank == 1 else key


# Files from before string-key maps held fingerprints stored their keys as two arrays: the
# strings' bytes one after the other under the variable's key, each string's length under the key
# with this suffix. Loading such a file converts them (`_fingerprints_of_strings`).
STRING_LENGTHS = ":lengths"


def save_variables(store: Any, stored: Mapping[str, tf.Variable]) -> None:
  for key, variable in stored.items():
    store[key] = variable.numpy()


def load_variables(
  store: Any,
  stored: Mapping[str, tf.Variable],
  layer: str,
  fingerprinted: frozenset[str] = frozenset(),
) -> None:
  """Assigns every variable of `stored` from `store`, after checking that all are there and fit;
  `fingerprinted` (`fingerprint_keys`): keys whose strings an older file holds are converted."""
  values = []
  names = store.keys()  # the view, not a list: an HDF5 store's finds a piece `<key>/<i>` by path
  for key, variable in stored.items():
    source = key
    if key in fingerprinted and key not in names:
      source = key[: -len(FINGERPRINTS)]  # a file from before fingerprints: strings there
      if source in names and source + STRING_LENGTHS not in names:
        raise ValueError(
          f"Layer {layer!r}: {source!r} holds an int64-key map's keys in the Keras file, but "
          "the layer's map there takes string keys: it was saved from another layer. Nothing "
          "was changed in this layer."
        )
    if source not in names:
      raise ValueError(
        f"Layer {layer!r}: the Keras file holds no {key!r} (it holds {sorted(names)}): "
        "it was saved from another layer, or on another path (a TPU's tables are stored as "
        "the pieces TensorFlow splits them into). Nothing was changed in this layer."
      )
    strings = source + STRING_LENGTHS in names
    if strings and key not in fingerprinted:
      raise ValueError(
        f"Layer {layer!r}: {key!r} holds a string-key map's keys in the Keras file, but the "
        "layer's map there takes int64 keys: it was saved from another layer. Nothing was "
        "changed in this layer."
      )
    shape_key = source + STRING_LENGTHS if strings else source
    value = np.asarray(store[shape_key])
    if list(value.shape) != variable.shape.as_list():
      raise ValueError(
        f"Layer {layer!r}: {shape_key!r} has shape {list(value.shape)} in the Keras file; the "
        f"layer expects {variable.shape.as_list()}. Nothing was changed in this layer."
      )
    if strings:
      value = _fingerprints_of_strings(
        np.asarray(store[source]), value, f"Layer {layer!r}: {source!r}"
      )
    values.append((variable, value))
  for variable, value in values:
    variable.assign(value)


def _fingerprints_of_strings(data: np.ndarray, lengths: np.ndarray, what: str) -> np.ndarray:
  """The fingerprints (what a string-key map now holds) of the keys an older file stored as
  their bytes `data` and their `lengths`."""
  if data.dtype != np.uint8 or data.ndim != 1 or lengths.min(initial=0) < 0:
    raise ValueError(f"{what} is not a list of strings in the Keras file. Nothing was changed.")
  if int(lengths.sum()) != data.size:
    raise ValueError(
      f"{what} holds {data.size} bytes in the Keras file, but its lengths add up to "
      f"{int(lengths.sum())}. Nothing was changed in this layer."
    )
  ends = np.cumsum(lengths.ravel())
  raw = data.tobytes()
  strings = [raw[end - n : end] for end, n in zip(ends.tolist(), lengths.ravel().tolist())]
  return fingerprint(np.array(strings, dtype=object).reshape(lengths.shape)).numpy()
