"""The CPU/GPU path: this package's `EmbeddingEngine`, TPU-faithful by default."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware, keras_slots
from tpu_embedding.backends.base import Backend
from tpu_embedding.engine import EmbeddingEngine


class CpuBackend(Backend):
  """Non-TPU strategies: our engine, trained by each table's mid-level optimizer (or by the
  Keras optimizer with `table_updates="keras"`)."""

  path = hardware.ExecutionPath.CPU

  def __init__(
    self,
    config: config_lib.EmbeddingConfig,
    pipelining: bool = False,
    table_updates: str = "engine",
    check_finite: bool = False,
    user_optimizer: Any = None,
  ):
    super().__init__(config, user_optimizer)
    self.table_updates = table_updates
    self._engine = EmbeddingEngine(
      config, pipelining=pipelining, table_updates=table_updates, check_finite=check_finite
    )

  def create_tables(self, per_replica_input_shapes: Any) -> None:
    self._engine.build()
    if self.table_updates == "keras":  # its slots too, as tf-recommenders makes them
      with tf.init_scope():
        keras_slots.create_slots(self._keras_optimizer, self._engine.embedding_tables)

  def lookup(self, features, weights, trap):
    return self._engine.lookup(features, weights, trap)

  @property
  def embedding_tables(self) -> dict:
    return self._engine.embedding_tables

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    return self._engine.variables_by_table

  def replace_table(self, table: config_lib.TableConfig, variable: tf.Variable) -> None:
    self._engine.replace_table(table, variable)

  @property
  def trainable_tables(self) -> list[tf.Variable]:
    return [] if self.table_updates == "engine" else list(self._engine.embedding_tables.values())

  def flush(self) -> None:
    self._engine.flush()
