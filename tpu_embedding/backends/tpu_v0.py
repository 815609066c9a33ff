"""The TPU path without an embedding accelerator (V0): replicated tables, Keras-trained."""

from __future__ import annotations

from typing import Any, Mapping

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware, keras_slots, optimizer_specs
from tpu_embedding.backends import conversion
from tpu_embedding.backends.base import Backend
from tpu_embedding.managed_ids import row_resets


class TpuV0Backend(Backend):
  """TPU without an embedding accelerator: replicated tables, trained by the Keras optimizer.

  TF's V0 class only looks rows up; the tables are ordinary trainable variables that the
  optimizer the model applies updates (Keras semantics, as in tf-recommenders). A mid-level
  optimizer, whose TPU update rule V0 cannot give, is therefore refused rather than ignored,
  and no slot variables are created (TF would create them and never update them).
  """

  path = hardware.ExecutionPath.TPU_V0
  table_updates = "keras"

  def __init__(self, config: config_lib.EmbeddingConfig, user_optimizer: Any = None):
    super().__init__(config)
    converted = conversion.for_tpu_v0(config, user_optimizer)
    self._keras_optimizer = user_optimizer
    self._engine = tf.tpu.experimental.embedding.TPUEmbeddingV0(converted.feature_config, None)

  def create_tables(self, per_replica_input_shapes):
    self._engine.build()

  def lookup(self, features, weights, trap):
    activations = self._engine(features, weights)
    return tf.nest.pack_sequence_as(
      self.config.feature_config,
      [
        _as_other_paths_give(feature, ids, out)
        for (feature, ids), out in zip(
          config_lib.match_structure(self.config, features), tf.nest.flatten(activations)
        )
      ],
    )

  @property
  def trainable_tables(self) -> list[tf.Variable]:
    return list(self._engine.embedding_tables.values())

  def row_resets(self, managed: Mapping[str, Any]) -> row_resets.ImmediateResets:
    """Replicated tables are written at once; their slots live in the Keras optimizer the
    model applies, which must therefore be the layer's `optimizer` object: a row's slots are
    reset there too, to the initial values of the optimizer's mid-level twin (the same)."""
    optimizer = self._keras_optimizer
    if optimizer is None or isinstance(optimizer, str):
      raise ValueError(
        f"managed_ids on path {self.path.name} (a TPU without an embedding engine) needs the "
        "Keras optimizer object that trains the model as the layer's optimizer= (got "
        f"{optimizer!r}): the tables' slots live in that optimizer, and a row given to a new "
        "key must be reset there too. Create the optimizer first, pass it to the layer and "
        "apply that same object in the train step."
      )

    tables = {table.name: table for table in self.config.tables}

    def targets(table):
      """{"parameters" or mid-level slot name: the variable holding it}: the table, and each
      slot the Keras optimizer has created for it (under its Keras name)."""
      variable = self.variables_by_table[table.name]["parameters"]
      names = {
        name: optimizer_specs.keras_slot_name(table.optimizer, name)
        for name, _ in config_lib.slot_shapes(table)
      }
      slots = keras_slots.slots_of(optimizer, variable, [k for k in names.values() if k])
      return {"parameters": variable, **{n: slots[k] for n, k in names.items() if k in slots}}

    def write(table, rows, values):
      for name, target in targets(table).items():
        _write_rows(target, rows, values[name])

    def check():
      """Finds every slot before the maps change, so that one it cannot tell apart is refused
      with nothing changed."""
      if self.is_built():
        for name in managed:
          targets(tables[name])

    return row_resets.ImmediateResets(write, built=self.is_built, check=check)


def _write_rows(variable: Any, rows: tf.Tensor, value: tf.Tensor) -> None:
  """Writes `value` into `rows` of a tf.Variable, or of a Keras 3 variable (no scatter)."""
  if isinstance(variable, tf.Variable):
    variable.scatter_update(tf.IndexedSlices(value, rows))
  else:
    variable.assign(
      tf.tensor_scatter_nd_update(tf.convert_to_tensor(variable), rows[:, None], value)
    )


def _as_other_paths_give(feature: config_lib.Feature, ids: Any, out: tf.Tensor) -> tf.Tensor:
  """Two differences of TF's V0 class from every other path, undone: it keeps the trailing 1 of
  dense [B, 1] ids ([B, 1, D], not [B, D]), and it looks the padding of a short ragged or sparse
  sequence up as id 0 (row 0's values, not zeros)."""
  if (
    isinstance(ids, tf.Tensor)
    and ids.shape.rank is not None
    and ids.shape.rank >= 2
    and ids.shape[-1] == 1
  ):
    return tf.squeeze(out, -2)
  length = feature.config.max_sequence_length
  if not length or isinstance(ids, tf.Tensor):
    return out
  if isinstance(ids, tf.RaggedTensor):
    present = tf.sequence_mask(ids.row_lengths(), length)
  else:
    positions = tf.SparseTensor(ids.indices, tf.ones_like(ids.values, tf.bool), ids.dense_shape)
    present = tf.sparse.to_dense(
      tf.sparse.slice(positions, [0, 0], tf.stack([ids.dense_shape[0], length])),
      default_value=False,
    )
    present = tf.pad(present, [[0, 0], [0, length - tf.shape(present)[1]]])
  return out * tf.cast(present, out.dtype)[:, :, None]
