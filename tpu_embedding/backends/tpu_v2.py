"""The SparseCore path (V2): TF's `TPUEmbeddingV2`, trained through the gradient trap."""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware, sparse_core, tf_internals
from tpu_embedding.backends import conversion, row_writers
from tpu_embedding.backends.base import Backend
from tpu_embedding.managed_ids import resets, row_resets


class TpuV2Backend(Backend):
  """SparseCore: one call does enqueue+dequeue; gradients go back with the preserved state."""

  path = hardware.ExecutionPath.TPU_V2
  table_updates = "engine"

  def __init__(
    self,
    config: config_lib.EmbeddingConfig,
    pipelining: bool = False,
    sparse_core_embedding_config=None,
  ):
    if tf_internals.SPARSE_CORE_CHECKPOINTS is None:
      raise RuntimeError(
        f"The SparseCore path (TPUEmbeddingV2) needs TensorFlow 2.17 or later; this is "
        f"TensorFlow {tf.__version__}, which has no SparseCore checkpoint adapter, so this "
        "layer's tables could not be restored from a checkpoint safely. Use TensorFlow 2.17 to "
        "2.21 on a SparseCore TPU (docs/compatibility.md)."
      )
    super().__init__(config)
    converted = conversion.for_tpu_v2(config)
    self._engine = tf.tpu.experimental.embedding.TPUEmbeddingV2(
      converted.feature_config, converted.optimizer, pipelining, sparse_core_embedding_config
    )

  def create_tables(self, per_replica_input_shapes):
    self._engine.build()

  @property
  def embedding_tables(self) -> dict:
    """{TableConfig: tensor}: each table's logical value, whether stacked or alone.

    TPUEmbeddingV2 keys its variables by stacked table name, and even a table stacked alone is
    padded, row-dealt and rotated over the SparseCores; these are read-only copies of the
    tables as configured (write through a checkpoint restore, not through these).
    """
    return sparse_core.logical_tables(
      self._engine.embedding_tables, self._engine.embedding_layouts, self.config.tables
    )

  @property
  def variables_by_table(self) -> dict[str, dict[str, tf.Variable]]:
    """{stacked table name: {"parameters"/slot: variable}}: SparseCore keeps them by stack."""
    return self._engine.variables

  def row_writer(self, managed: Mapping[str, Any]) -> row_resets.Writer:
    """SparseCore tables are variables in TPU memory the host writes between steps: each reset
    is written at once, into the table's rows of its stacked, dealt and rotated variables."""
    return row_writers.ImmediateWriter(
      self._tables_named(managed), self._write_logical_rows, tables_exist=self.is_built
    )

  def _write_logical_rows(self, table, rows, block) -> None:
    del block  # no row blocks: tables are in TPU memory
    layout = self._engine.embedding_layouts[table.name]
    variables = self._engine.variables[layout.stacked_table_name]
    sparse_core.write_logical_rows(variables, layout, rows, resets.fresh_rows(table, rows))

  def needs_relayout(self, path: str) -> bool:
    return sparse_core.needs_relayout(path, self._engine)

  def lookup(self, features, weights, trap):
    preserved = []

    def forward():
      activations, state = self._engine(features, weights)
      preserved.append(state)
      return activations

    return self.trapped(
      trap,
      forward,
      lambda gradients: self._engine.apply_gradients(gradients, preserved_outputs=preserved[-1]),
    )
