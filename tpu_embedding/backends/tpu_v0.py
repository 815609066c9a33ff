"""The TPU path without an embedding accelerator (V0): replicated tables, Keras-trained."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding import config as config_lib
from tpu_embedding import hardware
from tpu_embedding.backends import conversion
from tpu_embedding.backends.base import Backend


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
    super().__init__(config, user_optimizer)
    converted = conversion.for_tpu_v0(config, user_optimizer)
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
