"""The TPU embedding engine path (V1): TF's `TPUEmbedding`, trained through the gradient trap."""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Optional

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware, tf_mid_level
from tpu_embedding.backends import conversion, row_writers
from tpu_embedding.backends.base import Backend


class TpuV1Backend(Backend):
  """TPU embedding engine: enqueue on the host, dequeue in the step, gradients via the trap."""

  path = hardware.ExecutionPath.TPU_V1
  table_updates = "engine"

  def __init__(
    self,
    config: config_lib.EmbeddingConfig,
    pipelining: bool = False,
    batch_size: Optional[int] = None,
  ):
    super().__init__(config)
    self._batch_size = batch_size
    self._pipelining = bool(pipelining)
    converted = conversion.for_tpu_v1(config)
    self._engine = tf.tpu.experimental.embedding.TPUEmbedding(
      converted.feature_config, converted.optimizer, pipelining
    )
    self._call_ids = itertools.count(1)

  @property
  def embedding_tables(self) -> dict:
    """{TableConfig: variable}, refreshed from TPU memory first.

    TF's class answers only while a checkpoint is written (its host copies are stale in
    between), so the tables are retrieved as a save would, eagerly even inside a trace.
    """
    with tf.init_scope():
      tf_mid_level.retrieve_from_tpu(self._engine)
    variables = self.variables_by_table
    return {table: variables[table.name]["parameters"] for table in self.config.tables}

  def flush(self) -> None:
    """Copies the tables and slots from TPU memory into their host variables, so that what
    export reads is current (TF's own checkpoint saver does the same before a save)."""
    tf_mid_level.retrieve_from_tpu(self._engine)

  def row_writer(self, managed: Mapping[str, Any]) -> row_writers.DeferredWriter:
    """TPU memory takes whole tables only: resets wait for a flush (copy out, reset in the host
    copies, load back) every `reset_every_steps`; their keys read row 0 until then."""
    tables = self._tables_named(managed)
    return row_writers.DeferredWriter(
      {name: (tables[name], spec.reset_every_steps) for name, spec in managed.items()},
      self._write_fresh,
      copies=(self.flush, lambda: tf_mid_level.load_into_tpu(self._engine)),
      tables_exist=self.is_built,
      pipelining=self._pipelining,
      path_name=self.path.name,
    )

  def create_tables(self, per_replica_input_shapes):
    if self._batch_size is None:
      self._engine.build(per_replica_input_shapes=per_replica_input_shapes)
    else:
      self._engine.build(per_replica_batch_size=self._batch_size)

  def lookup(self, features, weights, trap):
    conversion.refuse_wide_dense_ids(self.config, features)
    # A name pairs this call's enqueue, dequeue and apply_gradients within one traced step.
    name = str(next(self._call_ids))
    self._engine.enqueue(features, weights, training=True, name=name)
    return self.trapped(
      trap,
      lambda: self._engine.dequeue(name=name),
      lambda gradients: self._engine.apply_gradients(gradients, name=name),
    )
