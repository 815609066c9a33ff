"""`PartialTPUEmbedding` for Keras 3 (TensorFlow backend): the tf-keras layer's logic, Keras 3 base.

Everything the layer does is `tpu_embedding.partial_core.PartialTPUEmbeddingCore`; its sharded
tables are served by the Keras 3 `TPUEmbedding`.
"""

from __future__ import annotations

from typing import Any, Optional

import keras

from tpu_embedding.keras import saving, shapes
from tpu_embedding.keras.layer import TPUEmbedding, feature_config_for_keras3
from tpu_embedding.partial_core import PartialTPUEmbeddingCore


@keras.saving.register_keras_serializable(package="tpu_embedding")
class PartialTPUEmbedding(saving.KerasFileMixin, PartialTPUEmbeddingCore, keras.layers.Layer):
  """Replicates small tables and shards large ones (see `tpu_embedding.PartialTPUEmbedding`).

  Args:
    feature_config: any nest of `tf.tpu.experimental.embedding.FeatureConfig` or
      `keras_rs.layers.FeatureConfig`; the output has the same structure.
    optimizer: for tables without their own optimizer, on both sides: a string, a Keras
      optimizer or a `tf.tpu.experimental.embedding` optimizer.
    pipeline_execution_with_tensor_core: passed to the sharded side.
    batch_size: passed to the sharded side (per-replica batch size to build the TPU engine).
    size_threshold: a table with `vocabulary_size > size_threshold` is sharded, any other is
      replicated. 0 shards every table; None replicates every table.
    check_finite: raise an error naming the feature or table at the first NaN/Inf gradient,
      weight or learning rate on its way to a table, before anything is written, as
      `TPUEmbedding`'s: for the replicated tables on every hardware, and for the sharded ones
      off TPU (refused on TPU, whose embedding engine cannot stop at such a value).
    **kwargs: Keras layer arguments (`name`, ...).

  Every table is trained by its own optimizer (`table_updates="engine"`, the only value taken:
  "keras" is refused, since a Keras 3 optimizer only updates Keras variables).
  """

  sharded_layer_class = TPUEmbedding

  def __init__(
    self,
    feature_config: Any,
    optimizer: Any = None,
    pipeline_execution_with_tensor_core: bool = False,
    batch_size: Optional[int] = None,
    size_threshold: Optional[int] = 10_000,
    table_updates: str = "engine",
    check_finite: bool = False,
    **kwargs,
  ):
    if table_updates == "keras":
      raise ValueError(
        "PartialTPUEmbedding for Keras 3: table_updates='keras' would leave the tables to the "
        "model's optimizer, which in Keras 3 only updates Keras variables. Leave table_updates "
        "at 'engine', or use the tf-keras layer tpu_embedding.PartialTPUEmbedding."
      )
    super().__init__(
      feature_config_for_keras3(feature_config),
      optimizer,
      pipeline_execution_with_tensor_core=pipeline_execution_with_tensor_core,
      batch_size=batch_size,
      size_threshold=size_threshold,
      table_updates=table_updates,
      check_finite=check_finite,
      **kwargs,
    )
    self._arguments = dict(
      pipeline_execution_with_tensor_core=pipeline_execution_with_tensor_core,
      batch_size=batch_size,
      size_threshold=size_threshold,
      check_finite=check_finite,
    )

  # As the Keras 3 TPUEmbedding: Keras 3 passes `training` only to a `call` that names it.
  def call(self, features: Any, weights: Any = None, training: Any = None, **kw) -> Any:
    features = shapes.cast_placeholders(features)
    return super().call(features, weights, training=training, **kw)

  def compute_output_spec(self, features: Any, weights: Any = None, **unused: Any) -> Any:
    """The outputs' specs; `training` and `remapped` do not change them."""
    return shapes.output_spec(self._config, features, shapes.mid_level_shape)

  def compute_output_shape(self, input_shape: Any) -> Any:
    return shapes.output_shape(self._config, input_shape, shapes.mid_level_shape)
