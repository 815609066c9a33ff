"""What both Keras flavours of `TPUEmbedding` share: everything but the Keras base class.

`tpu_embedding.layer.TPUEmbedding` (tf-keras) and `tpu_embedding.keras.TPUEmbedding` (Keras 3)
are this mixin over their own `Layer`, so configuration, hardware dispatch, the backend, the
gradient trap and the checkpoint keys are the same objects and code for both. This module
imports no Keras, so neither flavour pulls in the other.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from tpu_embedding import backends
from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding.engine import lookup

TableConfig = tf.tpu.experimental.embedding.TableConfig

TRAP_NAME = "tpu_embedding_helper_dummy"


class TPUEmbeddingCore:
  """The layer behaviour, mixed in before a Keras `Layer` class (see the two flavours)."""

  def __init__(self, feature_config: Any, optimizer: Any = None,
               pipeline_execution_with_tensor_core: bool = False,
               batch_size: Optional[int] = None,
               embedding_feature: Optional[hardware.EmbeddingFeature] = None,
               sparse_core_embedding_config: Any = None,
               table_updates: str = "engine", **kwargs):
    super().__init__(**kwargs)
    self._config = config_lib.prepare(feature_config, optimizer)
    self._strategy = tf.distribute.get_strategy()
    self._backend = backends.create(
        hardware.choose_path(self._strategy, embedding_feature), self._config,
        pipelining=pipeline_execution_with_tensor_core, batch_size=batch_size,
        sparse_core_embedding_config=sparse_core_embedding_config, table_updates=table_updates)
    self._tpu_embedding = self._backend.mid_level  # the checkpoint key tf-recommenders uses
    self.batch_size = batch_size

  @property
  def execution_path(self) -> hardware.Path:
    """The execution path chosen at construction."""
    return self._backend.path

  def build(self, input_shape: Any) -> None:
    self._check_strategy()  # refuse before creating anything under the wrong strategy
    self._backend.build(input_shape)
    if self._backend.needs_trap:
      setattr(self, TRAP_NAME, self.add_weight(
          name=TRAP_NAME, shape=(1,), initializer="zeros", trainable=True, dtype=tf.float32))
    else:
      # Replicated or Keras-managed tables must be trainable variables of the model.
      self._keras_trained_tables = self._backend.trainable_tables
    super().build(input_shape)

  def call(self, features: Any, weights: Any = None, serving_config: Any = None) -> Any:
    return self._lookup(features, weights, serving_config)

  # No tensor-dependent Python control flow below: converting it would only slow tracing (~10x).
  @tf.autograph.experimental.do_not_convert
  def _lookup(self, features: Any, weights: Any, serving_config: Any) -> Any:
    if serving_config is not None:
      return self._serving_lookup(features, weights, serving_config)
    self._check_strategy()
    trap = getattr(self, TRAP_NAME, None)
    return self._backend.lookup(features, weights, trap)

  def _serving_lookup(self, features: Any, weights: Any, serving_config: Any) -> Any:
    """A CPU lookup through `serving_config`, reading this layer's current tables."""
    config = config_lib.for_serving(serving_config, self._config)
    tables = self._backend.embedding_tables
    step = lookup.Step.prepare(config, features, weights, subset=True)
    return tf.nest.pack_sequence_as(features, step.activations(lambda table: tables[table]))

  def _check_strategy(self) -> None:
    current = tf.distribute.get_strategy()
    if current is self._strategy:
      return
    on_tpu = self.execution_path is not hardware.Path.CPU
    if on_tpu or hardware.is_tpu_strategy(current) or tf.distribute.has_strategy():
      raise RuntimeError(
          f"This TPUEmbedding layer was created under {hardware.strategy_name(self._strategy)} "
          f"but is called under {hardware.strategy_name(current)}. Create the layer (the model) "
          "under the strategy you call it with, e.g. inside strategy.scope(), and call it in "
          "strategy.run.")

  def flush(self) -> None:
    """Applies updates held back by pipelining (also done before every checkpoint save)."""
    self._backend.flush()

  def update_embedding_table(self, table: TableConfig, embedding_table: tf.Variable) -> None:
    """Replaces the variable behind `table` (e.g. with one restored elsewhere)."""
    self.variables_by_table[self._clone_of(table).name]["parameters"] = embedding_table

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{table name: {"parameters": table, slot name: slot}} on every path."""
    return self._backend.variables_by_table

  @property
  def embedding_tables(self) -> dict[TableConfig, tf.Variable]:
    """The table variables, keyed by the user's own TableConfig objects."""
    tables = self._backend.embedding_tables
    return {self._config.user_tables[clone]: tables[clone] for clone in self._config.tables
            if clone in tables}

  def _clone_of(self, table: TableConfig) -> TableConfig:
    for clone, user in self._config.user_tables.items():
      if user is table or clone is table:
        return clone
    for clone in self._config.tables:
      if clone.name == table.name:
        return clone
    raise ValueError(f"Table {table.name!r} is not one of this layer's tables "
                     f"({[t.name for t in self._config.tables]}).")

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    if save_type == "checkpoint" and tf.executing_eagerly():
      self.flush()  # a checkpoint holds the tables with every update applied
    children = super()._trackable_children(save_type, **kwargs)
    children.pop(TRAP_NAME, None)
    children.pop("_keras_trained_tables", None)
    return children
