"""`PartialTPUEmbedding` for tf-keras: small tables replicated on every device, large ones sharded.

Everything the layer does is `tpu_embedding.partial_core.PartialTPUEmbeddingCore` (sides,
placement report, checkpoint keys), shared with the Keras 3 layer (`tpu_embedding.keras`).
"""

from __future__ import annotations

import tf_keras

from tpu_embedding import weight_files
from tpu_embedding.layer import RebuiltInCodeOnly, TPUEmbedding
from tpu_embedding.partial_core import (  # the public names of this module, defined there
  REPLICATED,
  SHARDED,
  PartialTPUEmbeddingCore,
  Placement,
  ReplicatedTable,
  TablePlacement,
)

__all__ = [
  "PartialTPUEmbedding",
  "Placement",
  "REPLICATED",
  "ReplicatedTable",
  "SHARDED",
  "TablePlacement",
]


@tf_keras.saving.register_keras_serializable(package="tpu_embedding")
class PartialTPUEmbedding(
  RebuiltInCodeOnly,
  weight_files.TablesInKerasFiles,
  PartialTPUEmbeddingCore,
  tf_keras.layers.Layer,
):
  """Replicates small tables and shards large ones; a drop-in for tf-recommenders' class.

  Args:
    feature_config: any nest of `tf.tpu.experimental.embedding.FeatureConfig`; the output has
      the same structure.
    optimizer: for tables without their own `TableConfig.optimizer`, on both sides: a string, a
      Keras optimizer of any family or a `tf.tpu.experimental.embedding` optimizer.
    pipeline_execution_with_tensor_core: passed to the sharded side. Replicated tables are
      TensorCore variables, so their updates are never pipelined (as on TPU).
    batch_size: passed to the sharded side (per-replica batch size to build the TPU engine).
    size_threshold: a table with `vocabulary_size > size_threshold` is sharded, any other is
      replicated. 0 shards every table; None replicates every table.
    table_updates: "engine" (default) trains the replicated tables with their mid-level
      optimizers, as the sharded side; "keras" makes them trainable variables of this layer,
      updated by the Keras optimizer the user applies (tf-recommenders' behaviour), and is
      passed to the sharded side (where it applies off TPU).
    check_finite: raise an error naming the feature or table at the first NaN/Inf gradient,
      weight or learning rate on its way to a table, before anything is written, as
      `TPUEmbedding`'s: for the replicated tables on every hardware, and for the sharded ones
      off TPU (refused on TPU, whose embedding engine cannot stop at such a value).
    **kwargs: Keras layer arguments (`name`, ...).
  """

  sharded_layer_class = TPUEmbedding
