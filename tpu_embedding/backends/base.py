"""What the layer needs from an execution path: the `Backend` interface every path implements."""

from __future__ import annotations

import abc
from typing import Any, Callable, Mapping, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware, tf_mid_level
from tpu_embedding.backends import keras_trained, row_writers
from tpu_embedding.engine import trap as trap_lib
from tpu_embedding.managed_ids import row_resets


class Backend(abc.ABC):
  """One execution path's tables and lookup, as the layer uses them.

  `config` is the layer's prepared configuration, never modified: a path that needs another
  form of it (see `conversion`) hands TF its own converted copy, and keys what it returns by the
  tables of `config`.
  """

  path: hardware.ExecutionPath
  table_updates: str  # one of conversion.TABLE_UPDATES; "engine" needs the gradient trap

  def __init__(self, config: config_lib.EmbeddingConfig, keras_optimizer: Any = None):
    self.config = config
    # The user's optimizer: with table_updates="keras" it trains the tables and holds their slots.
    self._keras_optimizer = keras_optimizer

  _engine: tf.Module  # set by each backend's constructor

  @property
  def engine(self) -> tf.Module:
    """The trackable holding (and on most paths training) the tables: our `EmbeddingEngine`
    off TPU, TF's mid-level `TPUEmbeddingV0`/`TPUEmbedding`/`TPUEmbeddingV2` on TPU."""
    return self._engine

  _built = False

  def build(self, per_replica_input_shapes: Any) -> None:
    """Creates the tables (and slots) once, given the per-replica input shapes (a nest like
    the feature config, or None where the path needs none)."""
    self.create_tables(per_replica_input_shapes)
    self._built = True

  @abc.abstractmethod
  def create_tables(self, per_replica_input_shapes: Any) -> None:
    """What `build` does on this path."""

  def is_built(self) -> bool:
    """Whether `build` has created the tables: rows given to new keys before then need no
    reset, since they will be fresh (and TPU memory does not hold them yet)."""
    return self._built

  @abc.abstractmethod
  def lookup(self, features: Any, weights: Any, trap: Optional[tf.Variable]) -> Any:
    """The activations of one call, with the structure of the feature config.

    `trap` is the layer's gradient-trap variable (see `engine.trap`) where `table_updates` is
    "engine": the gradient reaching the activations then updates the tables. None otherwise.
    """

  def trapped(
    self,
    trap: tf.Variable,
    forward: Callable[[], Any],
    apply_gradients: Callable[[Any], Any],
  ) -> Any:
    """`forward()`'s activations (structured as the feature config) through the gradient trap,
    which hands their gradients, in the same structure, to `apply_gradients` (TF's engines)."""
    activations = trap_lib.trapped(
      trap,
      lambda: tf.nest.flatten(forward()),
      lambda upstream: apply_gradients(
        tf.nest.pack_sequence_as(self.config.feature_config, upstream)
      ),
    )
    return tf.nest.pack_sequence_as(self.config.feature_config, activations)

  @property
  def embedding_tables(self) -> dict:
    """{table of `config`: its variable}."""
    by_name = {table.name: value for table, value in self.engine.embedding_tables.items()}
    return {table: by_name[table.name] for table in self.config.tables}

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{table name: {"parameters": table, slot name: slot}}, the engine's own dict."""
    return tf_mid_level.variables_by_table(self.engine)

  def replace_table(self, table: config_lib.TableConfig, variable: tf.Variable) -> None:
    """Makes `variable` the table everywhere; TF's classes track their variables dict."""
    self.variables_by_table[table.name]["parameters"] = variable

  @property
  def trainable_tables(self) -> list[tf.Variable]:
    """Tables the user's optimizer must see as trainable (replicated, Keras-trained tables)."""
    return []

  def row_writer(self, managed: Mapping[str, Any]) -> row_resets.Writer:
    """How rows given to new keys of the `managed` tables ({table name: ManagedIds}) reach this
    path's memory: by default written at once into `variables_by_table` (created on first use),
    and into the Keras optimizer's slots where it trains the tables (`keras_trained`)."""
    if self.table_updates == "keras":
      return keras_trained.row_writer_of(self, self._keras_optimizer, managed)
    return row_writers.ImmediateWriter(self._tables_named(managed), self._write_fresh)

  def _tables_named(self, names: Any) -> dict[str, config_lib.TableConfig]:
    """{name: TableConfig} of the tables of `config` named in `names`."""
    return {table.name: table for table in self.config.tables if table.name in names}

  def _write_fresh(
    self, table: config_lib.TableConfig, rows: tf.Tensor, block: Optional[int]
  ) -> None:
    row_resets.write_fresh(self.variables_by_table[table.name], table, rows, block)

  def flush(self) -> None:
    """Applies any update the hardware still holds back (pipelining); most paths hold none."""

  def needs_relayout(self, path: str) -> bool:
    """Whether the checkpoint at `path` holds the tables in a layout that TF converts only while
    it creates the variables (SparseCore); every other path restores per table at any time."""
    return False
