"""`.keras` files for the Keras 3 layers: their config as JSON and their tables by name.

Keras 3 saves a layer as `get_config()` plus the arrays `save_own_variables` puts in a store.
The layers' tables and slots live in the engine, not in Keras variables, so they are stored
under `table:<table>` and `table:<table>:<slot>`, checked before anything is assigned
(`tpu_embedding.weight_files`, shared with the tf-keras layers).

The configuration is saved as the layer uses it: every table with its resolved mid-level
optimizer. Saved as values: a learning rate that is a callable or follows a Keras optimizer is
saved at its current value. A table's initializer is kept when it is a Keras initializer;
any other gives the default one to a layer rebuilt from config alone (`load_model` then
assigns the saved values anyway). The hardware arguments (`embedding_feature`,
`sparse_core_embedding_config`) are not saved: the machine that loads the file decides.
Managed-ids maps: their settings are saved in the config (`ManagedIds.to_config`, by table
name), their keys, rows and counts with the tables.
"""

from __future__ import annotations

from typing import Any, Mapping

import keras
import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import optimizer_specs, weight_files
from tpu_embedding.managed_ids import ManagedIds

E = tf.tpu.experimental.embedding
_FEATURE_KEY = "tpu_embedding_feature"


# ---------------------------------------------------------------------------------------------
# The layers' side


class KerasFileMixin(weight_files.TablesInKerasFiles):
  """`get_config`/`from_config` and the tables' store for a Keras 3 embedding layer.

  The layer sets `_arguments` (its constructor arguments other than the feature config and
  the Keras ones) and says which tables it saves itself in `_own_tables`.
  """

  _arguments: dict

  def get_config(self) -> dict:
    config = super().get_config()
    config.update(feature_config=serialize_feature_config(self._config), **self._arguments)
    if self.managed_ids:  # the maps' settings; their keys, rows and counts are stored as weights
      config["managed_ids"] = serialize_managed_ids(self.managed_ids)
    return config

  @classmethod
  def from_config(cls, config: dict) -> Any:
    config = dict(config)
    if config.get("managed_ids") is not None:
      config["managed_ids"] = deserialize_managed_ids(config["managed_ids"])
    return cls(deserialize_feature_config(config.pop("feature_config")), **config)

  @property
  def non_trainable_weights(self) -> list:
    """Keras's list, then every table, slot and managed-ids map variable as a `TableVariable`.

    The tables are trained by their own optimizers, never by the model's, so to Keras they
    are non-trainable weights. Listing them here (and not as tracked variables, which `.keras`
    files and checkpoints already hold under their own names) is what makes legacy HDF5 files
    (`model.save("m.h5")`, `load_weights("m.h5")`), which store a layer's
    `trainable_weights + non_trainable_weights` by position, hold and restore them (on TPU
    V1/V2 as the pieces TF splits each table into, `weight_files.TablesInKerasFiles`). Reading
    it changes nothing: that format holds what `flush` applies only after a `flush`. Every
    variable is numeric (a string-key map holds fingerprints), as h5py needs.
    """
    stored = weight_files.stored_variables(
      self.table_weights(self.variables_by_table), self.managed_ids or {}
    )
    views = [TableVariable(v, key.replace(":", "_").replace("/", "_")) for key, v in stored.items()]
    return super().non_trainable_weights + views


class TableVariable(keras.Variable):
  """A Keras variable over one of the engine's `tf.Variable`s: the same storage, not a copy,
  so Keras code that reads and assigns Keras variables reads and assigns the table itself."""

  def __init__(self, variable: tf.Variable, name: str):
    self._engine_variable = variable
    super().__init__(
      initializer="zeros",  # never run: the engine's variable is adopted instead
      shape=tuple(variable.shape.as_list()),
      dtype=variable.dtype.name,
      trainable=False,
      name=name,
    )

  def _initialize_with_initializer(self, initializer: Any) -> None:
    self._initialize(self._engine_variable)


# ---------------------------------------------------------------------------------------------
# Configuration


def serialize_managed_ids(maps: Mapping[str, Any]) -> dict:
  """{table name: its `ManagedIds` settings as JSON-able values} of a layer's maps."""
  return {table: id_map.spec.to_config() for table, id_map in maps.items()}


def deserialize_managed_ids(serialized: Mapping[str, Any]) -> dict:
  """The `managed_ids` argument `serialize_managed_ids` describes (tables by name)."""
  return {table: ManagedIds.from_config(spec) for table, spec in serialized.items()}


def serialize_feature_config(config: config_lib.EmbeddingConfig) -> dict:
  """The prepared configuration as JSON-able values: tables by name, the nest of features."""
  tables = [_serialize_table(t) for t in config.tables]
  features = tf.nest.map_structure(_serialize_feature, config.feature_config)
  return {"tables": tables, "features": features}


def deserialize_feature_config(serialized: Mapping[str, Any]) -> Any:
  """The nest of mid-level `FeatureConfig`s `serialize_feature_config` describes."""
  tables = {t["name"]: _deserialize_table(t) for t in serialized["tables"]}

  def feature(leaf):
    return E.FeatureConfig(
      table=tables[leaf["table"]],
      max_sequence_length=leaf["max_sequence_length"],
      output_shape=leaf["output_shape"],
      name=leaf["name"],
    )

  def rebuild(node):  # JSON holds dicts and lists only: tuples come back as lists
    if isinstance(node, Mapping) and _FEATURE_KEY in node:
      return feature(node)
    if isinstance(node, Mapping):
      return {key: rebuild(value) for key, value in node.items()}
    return [rebuild(value) for value in node]

  return rebuild(serialized["features"])


def _serialize_feature(feature: E.FeatureConfig) -> dict:
  shape = feature.output_shape
  return {
    _FEATURE_KEY: True,
    "table": feature.table.name,
    "name": feature.name,
    "max_sequence_length": feature.max_sequence_length,
    "output_shape": None if shape.rank is None else shape.as_list(),
  }


def _serialize_table(table: E.TableConfig) -> dict:
  initializer = table.initializer
  keep = isinstance(initializer, keras.initializers.Initializer)
  return {
    "name": table.name,
    "vocabulary_size": table.vocabulary_size,
    "dim": table.dim,
    "combiner": table.combiner,
    "initializer": keras.initializers.serialize(initializer) if keep else None,
    "optimizer": optimizer_specs.serialize(table.optimizer, table.name),
  }


def _deserialize_table(table: Mapping[str, Any]) -> E.TableConfig:
  initializer = table["initializer"]
  return E.TableConfig(
    vocabulary_size=table["vocabulary_size"],
    dim=table["dim"],
    combiner=table["combiner"],
    name=table["name"],
    optimizer=optimizer_specs.deserialize(table["optimizer"]),
    initializer=None if initializer is None else keras.initializers.deserialize(initializer),
  )
